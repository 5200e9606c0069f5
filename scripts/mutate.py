"""Mutation testing: does the test suite catch a one-line bug in the code that decides what
training computes?

    python scripts/mutate.py                    # every mutation (~5 min on 2 quiet cores)
    python scripts/mutate.py --list             # what each one does, and its tests
    python scripts/mutate.py --only gae         # one area, or one mutation by its id

Each mutation replaces one exact snippet of one file by a realistic bug (a flipped sign, a
swapped bound, an off-by-one, a dropped term) and runs the tests that should notice. Runs
happen in a temporary copy of the repository's tracked files, never in this checkout: the
copy is put first on PYTHONPATH, so its ``areal_mcore`` is imported rather than the
editable install's. The named tests first run once unmutated and must pass; then each
mutation is CAUGHT (pytest exit code 1: a test failed), SURVIVED (0) or an ERROR (any other
code: collection failed, no tests ran, a timeout). The exit status is 1 unless every
mutation was caught.
"""

from __future__ import annotations

import argparse
import compileall
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# A mutation's tests stop at their first failure (-x); one that hangs is an ERROR, not a wait.
RUN_TIMEOUT_S = 900


@dataclass(frozen=True)
class Mutation:
    id: str
    area: str
    file: str  # relative to the repository root
    old: str  # occurs exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest node ids or files; the cheapest that catch it
    what: str  # the bug, in words


M = Mutation
MUTATIONS = [
    # ---------------------------------------------------------------- PPO loss
    # Asymmetric clipping (DAPO's clip-higher) has two bounds whose names are easy to cross.
    M("ppo_loss.clip_bounds_swapped", "ppo_loss", "areal_mcore/algo/ppo_loss.py",
      "ratio.clamp(1.0 - eps_clip, 1.0 + high)", "ratio.clamp(1.0 - high, 1.0 + eps_clip)",
      ("tests/test_ppo_loss.py::test_asymmetric_clip_uses_eps_clip_high_above_one",),
      "clip range [1 - eps_clip_high, 1 + eps_clip] instead of [1 - eps_clip, 1 + eps_clip_high]"),
    # Dividing by the micro-batch's own token count is the classic gradient-accumulation /
    # data-parallel normalisation bug: every micro-batch then weighs the same, whatever its size.
    M("ppo_loss.local_normaliser", "ppo_loss", "areal_mcore/algo/ppo_loss.py",
      "return token_T.sum() / num_global_tokens", "return token_T.sum() / mask.sum()",
      ("tests/test_ppo_loss.py::test_global_token_count_sets_the_normaliser",),
      "token-mean divides by the micro-batch's loss tokens, not the global count"),
    # The decoupled loss's importance weight is pi_prox / pi_behave; the inverse is one swap away.
    M("ppo_loss.behaviour_weight_inverted", "ppo_loss", "areal_mcore/algo/ppo_loss.py",
      "log_w = prox - behave_logprobs_T.detach().to(dtype)",
      "log_w = behave_logprobs_T.detach().to(dtype) - prox",
      ("tests/test_ppo_loss.py::test_decoupled_loss_weights_by_behaviour_ratio_and_masks_above_cap",),
      "behaviour weight exp(behave - prox) instead of exp(prox - behave)"),

    # ---------------------------------------------------------------- GAE
    # In a packed row the next token's value belongs to the next sequence at a boundary:
    # bootstrapping from it leaks values across sequences.
    M("gae.bootstrap_across_sequences", "gae", "areal_mcore/algo/gae.py",
      "v_next_A = torch.where(last_A, 0.0, torch.roll(v_A, -1)) if n_A else v_A",
      "v_next_A = torch.roll(v_A, -1) if n_A else v_A",
      ("tests/test_gae.py::test_gae_matches_python_reference_on_random_packed_batches",),
      "a sequence's last action bootstraps from the next sequence's first value"),
    # GAE's trace decays by gamma * lambda; with gamma = 1 (boba) lambda alone looks right.
    M("gae.trace_without_gamma", "gae", "areal_mcore/algo/gae.py",
      "c = gamma * lam", "c = lam",
      ("tests/test_gae.py::test_gae_matches_python_reference_on_random_packed_batches",),
      "advantage trace decays by lambda instead of gamma * lambda"),
    # Suffix sums from one prefix cumsum: leaving out the token's own term is an off-by-one.
    M("gae.suffix_sum_without_own_delta", "gae", "areal_mcore/algo/gae.py",
      "adv_A = csum_A[ends_B[seq_A]] - csum_A + delta_A", "adv_A = csum_A[ends_B[seq_A]] - csum_A",
      ("tests/test_gae.py::test_boba_gae_gives_every_response_token_its_sequence_reward",),
      "gamma = lambda = 1 suffix sum leaves out each token's own delta"),

    # ---------------------------------------------------------------- micro-batch allocator
    # A bitset over sums 0..gap needs gap + 1 bits; with gap bits an exact fill is never found.
    M("allocator.subset_sum_off_by_one", "allocator", "areal_mcore/packing/allocator.py",
      "mask = (1 << (gap + 1)) - 1", "mask = (1 << gap) - 1",
      ("tests/test_allocator.py::test_tight_hand_case_reaches_lower_bound",),
      "subset-sum bitset one bit short: a bin is never filled exactly to the cap"),
    # Rounding the micro-batch count to the divisor down instead of up breaks min_mbs.
    M("allocator.round_down", "allocator", "areal_mcore/packing/allocator.py",
      "return -(-x // m) * m", "return x // m * m",
      ("tests/test_allocator.py::test_min_mbs_and_divisor_spread_sequences_evenly",),
      "micro-batch count rounded down to the divisor, below min_mbs"),
    # DP ranks must agree on the count (the largest); the smallest leaves a rank over budget
    # and the ranks' collectives out of step.
    M("allocator.synced_count_min", "allocator", "areal_mcore/packing/allocator.py",
      "op=dist.ReduceOp.MAX)", "op=dist.ReduceOp.MIN)",
      ("tests/test_allocator.py::test_synced_allocator_makes_dp_ranks_agree_on_count",),
      "data-parallel ranks agree on the smallest micro-batch count, not the largest"),

    # ---------------------------------------------------------------- weight sync: names, buckets
    # Under expert parallelism megatron's local expert e of EP rank r is global expert
    # r * n_local + e; the local index sends every EP rank's experts under the same names.
    M("weight_sync.expert_local_index", "weight_sync", "areal_mcore/model/adapter.py",
      "hf_e = None if e is None else ep_rank * n_local + e", "hf_e = e",
      ("tests/test_moe.py::test_moe_weight_sync_plan_at_ep2_names_every_expert_once",),
      "HF expert name from the local expert index instead of the global one"),
    # Pipeline stages number their layers from 0; HF names need the global layer index.
    M("weight_sync.stage_local_layer", "weight_sync", "areal_mcore/model/adapter.py",
      "tuple(h.format(i=i, e=hf_e) for h in p.hf)", "tuple(h.format(i=local, e=hf_e) for h in p.hf)",
      ("tests/test_moe.py::test_moe_weight_sync_plan_sends_every_expert_in_checkpoint_names_and_shapes",),
      "HF layer name from the stage-local layer index instead of the global one"),
    # A unit that fills the budget exactly still fits; ">=" opens one bucket too many.
    M("weight_sync.bucket_full_budget_split", "weight_sync", "areal_mcore/weight_sync/buckets.py",
      "if used + size > budget:", "if used + size >= budget:",
      ("tests/test_weight_sync.py::test_plan_keeps_tensors_whole_and_gives_an_oversized_one_its_own_bucket",),
      "a bucket that would fill the budget exactly is split"),

    # ---------------------------------------------------------------- checkpoint resume
    # The fallback must try the newest checkpoint first, then older ones newest first.
    M("checkpoint.fallback_oldest_first", "checkpoint", "areal_mcore/actor/checkpoint.py",
      "for candidate in [newest, *older]:", "for candidate in [*older, newest]:",
      ("tests/test_checkpoint.py::test_crash_during_save_keeps_previous_checkpoint_and_latest",),
      "resume tries older checkpoints before the one `latest` names"),
    # "the step saved" vs "the step to run next": an off-by-one skips (or repeats) a step.
    M("checkpoint.restored_step_plus_one", "checkpoint", "areal_mcore/actor/checkpoint.py",
      'return ResumeState(path=path, step=trainer["step"],',
      'return ResumeState(path=path, step=trainer["step"] + 1,',
      ("tests/test_checkpoint.py::test_a_flipped_byte_in_a_checkpoint_is_named_and_the_previous_one_is_resumed",),
      "restored step is one past the saved one"),
    # The caller's state (the data position, the rollout counters) rides in ``extra``.
    M("checkpoint.extra_dropped", "checkpoint", "areal_mcore/actor/checkpoint.py",
      '"extra": extra or {}}', '"extra": {}}',
      ("tests/test_checkpoint.py::test_resume_is_bitwise_identical_to_an_uninterrupted_run",),
      "the trainer's extra state (data position) is not saved"),
    # A flipped condition: RNG states restored only when the world size changed, never on a
    # same-size resume (the one where they can be restored exactly).
    M("checkpoint.rng_not_restored", "checkpoint", "areal_mcore/actor/checkpoint.py",
      'if manifest["layout"]["world"] == dist.get_world_size(self.group) and rng.exists():',
      'if manifest["layout"]["world"] != dist.get_world_size(self.group) and rng.exists():',
      ("tests/test_checkpoint.py::test_a_flipped_byte_in_a_checkpoint_is_named_and_the_previous_one_is_resumed",),
      "per-rank RNG states are not restored on a same-size resume"),
    # A run checkpointed at exactly total_steps is finished; ">" takes it for resumable.
    M("run_dir.finished_run_off_by_one", "checkpoint", "areal_mcore/run_dir.py",
      "if step and step >= total_steps and", "if step and step > total_steps and",
      ("tests/test_run_dir.py::test_an_earlier_finished_or_unresumable_run_is_refused_unless_a_flag_says_what_to_do",),
      "a run whose latest checkpoint is its last step is not seen as finished"),

    # ---------------------------------------------------------------- rollout admission
    # The staleness bound admits (ofp + version + 1) batches; one more breaks max_head_offpolicyness.
    M("admission.staleness_bound_plus_one", "admission", "areal_mcore/rollout/admission.py",
      "(self.max_head_offpolicyness + self.version + 1) * self.batch_size",
      "(self.max_head_offpolicyness + self.version + 2) * self.batch_size",
      ("tests/test_dapo.py::test_async_dynamic_sampling_dropped_groups_free_capacity_and_never_count_as_accepted",),
      "async capacity admits one batch more than max_head_offpolicyness allows"),
    # AReaL #1388: a counter reset on resume admits many batches at once.
    M("admission.consumed_reset_on_resume", "admission", "areal_mcore/rollout/admission.py",
      'self.consumed = state["consumed"]', "self.consumed = 0",
      ("tests/test_dapo.py::test_sync_dynamic_sampling_replaces_each_rejected_group_until_the_batch_holds_only_mixed_ones",),
      "the consumed-groups counter restarts at 0 after a resume"),
    # A group exactly max_head_offpolicyness versions old is still allowed; "<=" drops it.
    M("admission.stale_boundary", "admission", "areal_mcore/rollout/admission.py",
      "return start_version < self.version - self.max_head_offpolicyness",
      "return start_version <= self.version - self.max_head_offpolicyness",
      # At max_head_offpolicyness=0 the on-policy groups themselves are dropped.
      ("tests/test_dapo.py::test_async_dynamic_sampling_bound_hands_out_a_short_batch_with_a_warning",),
      "groups exactly max_head_offpolicyness versions old are dropped as stale"),

    # ---------------------------------------------------------------- rollout API key
    # The explicit setting must win over the environment a launcher left behind.
    M("auth.env_over_config", "auth", "areal_mcore/rollout/auth.py",
      "return cfg.api_key or env.get(KEY_ENV) or None", "return env.get(KEY_ENV) or cfg.api_key or None",
      ("tests/test_rollout_launcher.py::test_a_key_is_generated_when_none_is_configured_and_kept_owner_only",),
      "$AREAL_ROLLOUT_API_KEY overrides server.api_key"),
    # The embedded server reads its key from the launcher's variable; another name means no
    # key at all, and a server without a key installs no check: every route is open.
    M("auth.embedded_reads_wrong_env", "auth", "areal_mcore/rollout/embedded/server.py",
      "api_key=os.environ.get(KEY_ENV) or None", 'api_key=os.environ.get("API_KEY") or None',
      ("tests/test_rollout_server.py::test_requests_without_the_generated_api_key_are_refused",),
      "the embedded server reads its key from the wrong variable and serves unauthenticated"),
    # Fail open: a request without an Authorization header falls through to "allowed".
    M("auth.vllm_guard_fails_open", "auth", "plugins/vllm_gloo_transfer/areal_vllm_gloo/guard.py",
      "        return False\n", "        return True\n",
      ("tests/test_rollout_launcher.py::test_our_vllm_guard_keys_every_route_but_health",),
      "the vLLM guard lets a request without an Authorization header through"),

    # ---------------------------------------------------------------- context-parallel layout
    # Load balance comes from pairing chunk r with its mirror 2cp-1-r; cp + r is a plain stripe.
    M("cp.stripe_not_mirror", "cp", "areal_mcore/packing/cp.py",
      "for k in (cp_rank, 2 * cp_size - 1 - cp_rank)", "for k in (cp_rank, cp_size + cp_rank)",
      ("tests/test_context_parallel.py::test_each_rank_holds_one_early_and_one_late_chunk_of_every_sequence",),
      "rank r holds chunks r and cp + r instead of r and 2cp - 1 - r"),
    # A rank's share of a sequence is its two chunks, n / cp tokens, one segment of its layout.
    M("cp.view_one_chunk", "cp", "areal_mcore/packing/cp.py",
      "lens = [n // cp_size for n in batch.seqlens_padded]",
      "lens = [n // (2 * cp_size) for n in batch.seqlens_padded]",
      ("tests/test_context_parallel.py::test_a_ranks_view_holds_the_next_tokens_fields_on_its_own_layout",),
      "a rank's local layout gives each sequence one chunk's length instead of two"),
    # Segments must split into 2*cp equal chunks; checking cp lets odd chunks through.
    M("cp.layout_check_cp", "cp", "areal_mcore/packing/cp.py",
      "if n % (2 * cp_size)]", "if n % cp_size]",
      ("tests/test_context_parallel.py::test_a_segment_that_does_not_split_evenly_is_refused_with_the_padding_to_use",),
      "the layout check accepts segments that are a multiple of cp but not of 2 cp"),
]


def check_snippets(mutations: list[Mutation]) -> None:
    for m in mutations:
        count = (REPO / m.file).read_text().count(m.old)
        if count != 1:
            sys.exit(f"mutation {m.id}: its old snippet occurs {count} times in {m.file}, not once:\n{m.old}")


def make_copy() -> Path:
    """The tracked files as they are in the working tree (uncommitted edits included)."""
    copy = Path(tempfile.mkdtemp(prefix="areal-mutate-"))
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True, capture_output=True).stdout
    for name in files.decode().split("\0"):
        src = REPO / name
        if name and os.path.lexists(src):  # a tracked file deleted in the working tree is skipped
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, copy / name, follow_symlinks=False)
    # What `make install` does: bytecode once, not in every process the tests start.
    for folder in ("areal_mcore", "kernels", "tests", "bench", "plugins"):
        compileall.compile_dir(copy / folder, quiet=1)
    # setup.py ships kernels/ as areal_mcore.kernels; without this link the editable install's
    # finder would serve it from this checkout.
    (copy / "areal_mcore" / "kernels").symlink_to("../kernels")
    return copy


def run_pytest(python: str, copy: Path, tests: list[str]) -> tuple[int, str, float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(copy), os.environ.get("PYTHONPATH")])),
               # No bytecode written during the runs: a mutated module's .pyc would be
               # trusted by mtime and size, and a same-size edit within one second is neither.
               PYTHONDONTWRITEBYTECODE="1")
    cmd = [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    t = time.monotonic()
    # A session of its own: a timeout kills the servers and ranks the tests started too.
    proc = subprocess.Popen(cmd, cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return -1, out + f"\n[mutate] timed out after {RUN_TIMEOUT_S} s", time.monotonic() - t
    except BaseException:  # Ctrl-C: its own session is spared the SIGINT, and the copy goes next
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc.returncode, out, time.monotonic() - t


def first_failure(output: str) -> str:
    found = re.search(r"^(?:FAILED|ERROR) (\S+)", output, re.M)
    return found.group(1) if found else "?"


def tail(output: str, lines: int = 25) -> str:
    return "\n".join("    " + line for line in output.rstrip().splitlines()[-lines:])


def mutate(python: str, copy: Path, m: Mutation) -> tuple[str, float, str]:
    path = copy / m.file
    original = path.read_text()
    path.write_text(original.replace(m.old, m.new))
    Path(importlib.util.cache_from_source(str(path))).unlink(missing_ok=True)  # compileall's, of the original
    try:
        rc, out, secs = run_pytest(python, copy, list(m.tests))
    finally:
        path.write_text(original)
    if rc == 1:
        return "CAUGHT", secs, first_failure(out)
    if rc == 0:
        return "SURVIVED", secs, ""
    return "ERROR", secs, f"pytest exit code {rc}:\n{tail(out)}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--list", action="store_true", help="print the mutations and exit")
    p.add_argument("--only", action="append", metavar="AREA_OR_ID",
                   help="run the mutations of this area, or this one mutation (repeatable)")
    p.add_argument("--python", default=str(REPO / ".venv" / "bin" / "python"),
                   help="the interpreter that runs pytest (default: the repository's .venv)")
    a = p.parse_args()
    chosen = [m for m in MUTATIONS if not a.only or m.id in a.only or m.area in a.only]
    if not chosen:
        sys.exit(f"--only {a.only}: no such area or mutation id (see --list)")
    check_snippets(chosen)
    if a.list:
        for m in chosen:
            print(f"{m.id}  [{m.area}]  {m.file}\n    {m.what}\n    " + "\n    ".join(m.tests))
        return 0

    start = time.monotonic()
    copy = make_copy()
    try:
        union = list(dict.fromkeys(t for m in chosen for t in m.tests))
        rc, out, secs = run_pytest(a.python, copy, union)
        if rc != 0:
            print(f"the unmutated tests do not pass (pytest exit code {rc}), so no mutation result would "
                  f"mean anything:\n{tail(out)}", flush=True)
            return 1
        print(f"unmutated: {len(union)} test ids pass ({secs:.0f} s)", flush=True)
        results = []
        for m in chosen:
            result, secs, detail = mutate(a.python, copy, m)
            results.append(result)
            print(f"{m.id:<40} {m.area:<12} {result:<8} {secs:6.1f} s  {detail}", flush=True)
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    counts = {r: results.count(r) for r in ("CAUGHT", "SURVIVED", "ERROR")}
    print(f"{len(results)} mutations: {counts['CAUGHT']} caught, {counts['SURVIVED']} survived, "
          f"{counts['ERROR']} errors ({time.monotonic() - start:.0f} s)")
    return 0 if counts["CAUGHT"] == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
