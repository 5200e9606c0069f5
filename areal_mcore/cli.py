"""``areal-mcore``: the command-line entry point."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path


def parse_size(text: str) -> int:
    """'2GB', '500MB', '64KiB' or a byte count -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 2GB, 500MB or 1048576")
    number, unit, suffix = float(m.group(1)), m.group(2).upper(), (m.group(3) or "").lower()
    base = 1024 if suffix == "ib" or not suffix else 1000
    return int(number * base ** " KMGT".index(unit or " "))


def add_convert_parsers(sub) -> None:
    convert = sub.add_parser(
        "convert", help="convert checkpoints between megatron (any TP/PP) and HF",
        description="Convert training checkpoints to HF folders and back.")
    kinds = convert.add_subparsers(dest="direction", required=True)

    out = kinds.add_parser(
        "mcore-to-hf", help="training checkpoint -> HF safetensors folder",
        description="Export a training checkpoint (saved at any TP/PP) as an HF folder: "
                    "config.json, sharded model-*.safetensors + index, generation config and "
                    "tokenizer files. Streams one layer at a time; no GPU needed.")
    out.add_argument("--input", required=True, help="checkpoint folder (step_XXXXXXXX) or a root with 'latest'")
    out.add_argument("--output", required=True, help="HF folder to write")
    out.add_argument("--hf-config", help="HF folder whose config.json must match the checkpoint "
                                         "(default: the config stored in the checkpoint)")
    out.add_argument("--tokenizer", help="folder to copy tokenizer files from (default: the first of --hf-config, "
                                         "the run's tokenizer_path / model_path and the imported HF folder "
                                         "that holds one; none found is refused)")
    out.add_argument("--no-tokenizer", action="store_true", help="export the weights without a tokenizer")
    out.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="cast weights (default: as stored)")
    out.add_argument("--max-shard-size", type=parse_size, default=parse_size("2GB"),
                     help="largest safetensors shard, e.g. 2GB (default), 500MB")
    out.add_argument("--verify", action="store_true",
                     help="reload with transformers and compare logits with the megatron model")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")

    inp = kinds.add_parser(
        "hf-to-mcore", help="HF folder -> step-0 training checkpoint at a TP/PP/EP layout",
        description="Import an HF folder (qwen2, qwen3, qwen3_moe, llama) as a training checkpoint "
                    "at the given TP x PP x EP (written by tp*pp*ep CPU ranks), to start a long run "
                    "from it.")
    inp.add_argument("--input", required=True, help="HF model folder")
    inp.add_argument("--output", required=True, help="checkpoint root to write (gets 'latest')")
    inp.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the run")
    inp.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the run")
    inp.add_argument("--ep", type=int, default=1,
                     help="expert-parallel size of the run (MoE models; the run's actor.parallel.ep)")
    inp.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    inp.add_argument("--vocab-divisible-by", type=int, default=128,
                     help="pad the vocabulary to a multiple of this x TP: the run's actor.vocab_divisible_by "
                          "(default 128, the actor's default; configs/tiny_cpu.yaml uses 8)")


def run_convert(a) -> int:
    from areal_mcore.convert.tools import hf_to_mcore, mcore_to_hf
    from areal_mcore.paths import PathError, check_hf_model, check_writable_dir

    check_writable_dir("--output", a.output)
    if a.direction == "mcore-to-hf":
        if not Path(a.input).is_dir():
            raise PathError(f"--input={a.input}: no such folder; expected a checkpoint folder "
                            "(step_XXXXXXXX) or a checkpoint root with 'latest'")
        if a.hf_config:
            check_hf_model("--hf-config", a.hf_config, weights=False)
    else:
        check_hf_model("--input", a.input)
    if a.direction == "mcore-to-hf":
        index = mcore_to_hf(a.input, a.output, hf_config_dir=a.hf_config, tokenizer_dir=a.tokenizer,
                            dtype=a.dtype, max_shard_bytes=a.max_shard_size, verify=a.verify,
                            progress=not a.no_progress, require_tokenizer=not a.no_tokenizer)
        files = len(set(index["weight_map"].values()))
        print(f"wrote {len(index['weight_map'])} tensors in {files} shard(s) to {a.output}"
              + (" (verified)" if a.verify else ""))
    else:
        path = hf_to_mcore(a.input, a.output, tp=a.tp, pp=a.pp, ep=a.ep, dtype=a.dtype,
                           vocab_divisible_by=a.vocab_divisible_by)
        print(f"wrote {path} (tp={a.tp}, pp={a.pp}, ep={a.ep}, vocab_divisible_by={a.vocab_divisible_by}): "
              f"start a run from it with actor.parallel.tp={a.tp} actor.parallel.pp={a.pp} "
              f"actor.parallel.ep={a.ep} actor.vocab_divisible_by={a.vocab_divisible_by}")
    return 0


# eval and filter: their settings are typed config keys (the eval and filter sections, and
# the experiment's model, servers, reward, ...); each flag is a shorthand for one key.
SETTINGS = ("Settings are config keys: the {section} section and the rest of --config, then the flags, "
            "each of which sets the key it names, then key=value overrides (docs/eval.md).")
ALIAS = "alias:"  # argparse dest prefix: the flag sets the config key after it


def _settings_args(p) -> None:
    p.add_argument("--config", help="experiment YAML under configs/ (default: none, the keys' defaults)")
    p.add_argument("overrides", nargs="*", help="a.b.c=value overrides, after the flags")


def _alias(p, flag: str, key: str, what: str, *, kind: str = "value") -> None:
    """``flag X`` sets ``key`` to X: as a list for ``kind="list"`` (X comma-separated), to
    true for ``kind="switch"`` (no X)."""
    extra = {"list": {"type": _csv}, "switch": {"action": "store_const", "const": True}}.get(kind, {})
    p.add_argument(flag, dest=ALIAS + key, metavar=key.rpartition(".")[2].upper(), help=f"{what} (sets {key})",
                   **extra)


def _csv(text: str) -> list[str]:
    """'a.jsonl,b.jsonl' -> ['a.jsonl', 'b.jsonl']."""
    return [t.strip() for t in text.split(",") if t.strip()]


def _load_settings(a):
    """The config of eval and filter: --config (else InferenceConfig's defaults), the flags,
    then the key=value overrides, through the one loader and its errors."""
    from areal_mcore.config import ExperimentConfig, InferenceConfig, load_config

    # JSON values, which YAML reads as written: a path or suffix stays a string ('null', '').
    flags = [f"{dest.removeprefix(ALIAS)}={json.dumps(value)}" for dest, value in vars(a).items()
             if dest.startswith(ALIAS) and value is not None]
    return load_config(a.config, flags + a.overrides, schema=ExperimentConfig if a.config else InferenceConfig)


def add_filter_parsers(sub) -> None:
    filt = sub.add_parser("filter", help="boba's dataset filters (difficulty, prompt length)",
                          description="Filter a boba-format JSONL dataset; kept rows are copied unchanged.")
    kinds = filt.add_subparsers(dest="kind", required=True)
    diff = kinds.add_parser(
        "difficulty", help="drop problems the base model solves in all k of k samples",
        description="Sample k responses per problem from the model (servers launched as eval launches "
                    "them) or from running servers, or take precomputed ones; score them with the boba "
                    "reward and drop the problems solved every time (boba: k = 8 from the base model). "
                    "Sampling is resumable: finished problems are kept in OUT.samples.jsonl and a rerun "
                    "samples only the others. " + SETTINGS.format(section="filter"),
        epilog="example: areal-mcore filter difficulty --model runs/tiny-cpu/sft_model --data "
               "runs/tiny-cpu/assets/train.jsonl --k 8 --max-new-tokens 24 --out train.filtered.jsonl")
    length = kinds.add_parser("length", help="drop problems whose prompt is too long",
                              description="Drop problems whose chat-templated prompt exceeds "
                                          "filter.max_prompt_tokens. " + SETTINGS.format(section="filter"))
    for p in (diff, length):
        _settings_args(p)
        _alias(p, "--data", "dataset.path", "boba-format JSONL to filter")
        _alias(p, "--out", "filter.out", "JSONL of the kept rows")
        _alias(p, "--tokenizer", "tokenizer_path", "tokenizer folder (default: the model's)")
        _alias(p, "--skip-bad-rows", "dataset.skip_bad_rows", "skip and count malformed rows", kind="switch")
    source = diff.add_mutually_exclusive_group()
    _alias(source, "--samples", "filter.samples", 'precomputed JSONL, one row per problem in order: '
                                                  '{"completions": [k strings]}')
    _alias(source, "--model", "server.model_path", "HF folder to sample from (servers are launched here)")
    _alias(source, "--server-url", "server.addresses", "comma-separated host:port of running servers", kind="list")
    _alias(diff, "--k", "filter.k", "samples per problem (default 8)")
    _alias(diff, "--workers", "reward.num_workers", "reward worker processes")
    _alias(diff, "--model-kind", "filter.model_kind", "rl, sft or base: sets the sampling as eval does "
                                                      "(default base: temperature 0.6, top_p 0.95)")
    _alias(diff, "--temperature", "filter.temperature", "instead of the model kind's")
    _alias(diff, "--top-p", "filter.top_p", "instead of the model kind's")
    _alias(diff, "--max-new-tokens", "filter.max_new_tokens", "response budget (default: rollout.max_new_tokens, "
                                                              "else boba's 27648)")
    _alias(diff, "--context-length", "server.context_length", "of the servers launched here")
    _alias(diff, "--dtype", "server.dtype", "weights of the servers launched here")
    _alias(diff, "--chunk", "filter.chunk", "problems in flight between two appends to OUT.samples.jsonl")
    _alias(length, "--max-prompt-tokens", "filter.max_prompt_tokens",
           "longest prompt kept, in tokens (default: trainer.max_prompt_tokens, else 1024)")


def run_filter(a) -> int:
    from areal_mcore.eval.config import filter_job
    from areal_mcore.paths import check_filter_paths

    job = filter_job(_load_settings(a))
    check_filter_paths(job, a.kind)  # before any server or worker starts
    f = job.filter
    if a.kind == "length":
        from transformers import AutoTokenizer

        from areal_mcore.data.filters import length_filter

        tok = AutoTokenizer.from_pretrained(job.tokenizer_path, local_files_only=True)
        summary = length_filter(job.dataset, tok, f.out, max_prompt_tokens=f.max_prompt_tokens,
                                suffix=job.dataset.instruction)
    elif f.samples:
        from areal_mcore.data.filters import difficulty_filter
        from areal_mcore.reward.pool import RewardPool

        with RewardPool(job.reward) as pool:
            summary = difficulty_filter(job.dataset, f.samples, f.out, k=f.k, pool=pool)
    else:
        from areal_mcore.eval.difficulty import filter_by_sampling

        summary = filter_by_sampling(job)
    print(json.dumps(summary))
    return 0


def add_train_parsers(sub) -> None:
    for name, what in (("train", "boba PPO: rollout servers, rewards, megatron actor, weight sync"),
                       ("sft", "supervised warm-up of a base model on the dataset's solutions")):
        p = sub.add_parser(name, help=what, description=f"{what}. Launch with torchrun for "
                           "several ranks; a plain call runs one rank.",
                           epilog="example: areal-mcore train --config configs/tiny_cpu.yaml "
                                  "trainer.total_steps=20 actor.optimizer.lr=1e-5")
        p.add_argument("--config", required=True, help="YAML file under configs/")
        p.add_argument("overrides", nargs="*", help="a.b.c=value overrides, applied after the file")
        p.add_argument("--no-plan-check", action="store_true",
                       help="start even when `areal-mcore plan` says the config does not fit in GPU memory")
        if name == "sft":
            p.add_argument("--if-changed", action="store_true",
                           help="keep sft.output_dir's model when its sft.json records this same SFT "
                                "(base model, data, steps, batch, lr, seed); train otherwise")
        if name == "train":  # an earlier run in log_dir/experiment_name: trainer.existing_run
            earlier = p.add_mutually_exclusive_group()
            earlier.add_argument("--resume", action="store_true",
                                 help="go on from the earlier run's checkpoint, or start afresh if it has none "
                                      "(a checkpoint short of total_steps is resumed without it)")
            earlier.add_argument("--overwrite", action="store_true",
                                 help="move the earlier run's files to <run>/before-<time>/ and start afresh")


def add_plan_parsers(sub) -> None:
    from areal_mcore.plan import GPUS_GB

    p = sub.add_parser(
        "plan", help="will the config fit in GPU memory? per trainer rank and rollout server",
        description="Predict the memory of every trainer rank (weights, main params, grads, optimizer "
                    "shard, activations of the micro-batches in flight, logits, weight-sync buffers, "
                    "margin) and of a rollout server (weights, KV-cache tokens, sequences that fit). "
                    "Exit status 0 when everything fits, 1 when not (with the knobs that would fix it).",
        epilog="example: areal-mcore plan --config configs/boba_32b_ppo.yaml --gpu h100 actor.recompute=false")
    p.add_argument("--config", required=True, help="YAML file under configs/")
    p.add_argument("overrides", nargs="*", help="a.b.c=value overrides, applied after the file")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--gpu-memory-gb", type=float, help="memory per GPU (default: plan.gpu_memory_gb)")
    size.add_argument("--gpu", choices=sorted(GPUS_GB), help="memory per GPU of a known GPU")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def run_plan(a) -> int:
    from areal_mcore.config import load_config
    from areal_mcore.plan import GPUS_GB, format_table, make_plan, to_json

    cfg = load_config(a.config, a.overrides)
    plan = make_plan(cfg, GPUS_GB[a.gpu] if a.gpu else a.gpu_memory_gb)
    print(json.dumps(to_json(plan), indent=1) if a.json else format_table(plan))
    return 0 if plan.fits else 1


def run_verify_checkpoint(a) -> int:
    from areal_mcore.run_dir import verify_checkpoint

    bad = 0
    for path in a.checkpoints:
        if not (Path(path) / "manifest.json").is_file():
            raise FileNotFoundError(f"{path}: no manifest.json (give a checkpoints/step_* folder)")
        problems = verify_checkpoint(Path(path))
        bad += bool(problems)
        print(f"{path}: " + ("OK" if not problems else "DAMAGED\n  " + "\n  ".join(problems)))
    return 1 if bad else 0


def refuse_unplanned(cfg, command: str) -> bool:
    """Prints the plan and returns True when ``cfg`` cannot fit (before anything starts)."""
    from areal_mcore.plan import refusal

    why = refusal(cfg)
    if why:
        print(f"areal-mcore {command}: {why}", file=sys.stderr)
    return why is not None


def _init_distributed() -> None:
    """From torchrun's environment, else a one-rank group on this machine. The rank is
    bound to its GPU (``LOCAL_RANK``) first: NCCL and megatron use the current device."""
    import os

    import torch
    import torch.distributed as dist

    from areal_mcore.devices import bind_local_device
    from areal_mcore.net import free_port, set_nccl_env

    bind_local_device()
    set_nccl_env(os.environ)  # before NCCL reads it
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def run_train(a) -> int:
    from areal_mcore.config import load_config
    from areal_mcore.model.args import check_model_folder
    from areal_mcore.paths import check_run_paths

    overrides = a.overrides + (["plan.check=false"] if a.no_plan_check else [])
    for flag in ("resume", "overwrite"):
        if getattr(a, flag, False):
            overrides.append(f"trainer.existing_run={flag}")
    cfg = load_config(a.config, overrides)  # config errors surface before any process group
    if refuse_unplanned(cfg, a.command):  # ... and a config that cannot fit, before any server
        return 2
    check_run_paths(cfg, a.command)  # and wrong paths, before any rank or server starts
    if a.command == "train":
        from areal_mcore.rollout.servers import check_ports_free

        check_ports_free(cfg.server)  # and a taken server.base_port
        from areal_mcore.run_dir import RunDir

        # ... and a run directory in use or holding a run this one would redo or set aside
        # (rank 0's to check: the others would see its lock between its check and its start).
        why = os.environ.get("RANK", "0") == "0" and RunDir.of(cfg.trainer.log_dir, cfg.experiment_name).start_refusal(
            cfg.trainer.total_steps, cfg.trainer.existing_run)
        if why:
            raise ValueError(why)
    if a.command == "sft":
        from areal_mcore.trainer.sft import sft_is_current

        if a.if_changed and sft_is_current(cfg):
            print(f"sft: {cfg.sft.output_dir} holds this SFT's model already (its sft.json); not retrained")
            return 0
        check_model_folder("sft.base_model", cfg.sft.base_model, cfg.actor.parallel.ep)  # and a model the actor refuses
    else:
        check_model_folder("model_path", cfg.model_path, cfg.actor.parallel.ep, cfg.actor.router_replay)
    _init_distributed()
    if a.command == "sft":
        from areal_mcore.trainer.sft import run_sft

        losses = run_sft(cfg)
        print(f"sft: NLL {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps; "
              f"model written to {cfg.sft.output_dir}")
    else:
        from areal_mcore.trainer.ppo import EXIT_STOPPED, train

        history = train(cfg)
        print(f"train: {len(history)} steps; stats in {cfg.trainer.log_dir}/{cfg.experiment_name}/stats.jsonl")
        if history.stopped:
            print(f"train: stopped early with a checkpoint (exit code {EXIT_STOPPED}); run the same "
                  "command again to resume")
            return EXIT_STOPPED
    return 0


def add_eval_parsers(sub) -> None:
    p = sub.add_parser(
        "eval", help="pass@k over n samples per problem, with boba's eval settings",
        description="Sample n responses per problem from rollout servers (launched here with boba's "
                    "long-context settings, or running ones), score them with the boba reward and "
                    "report pass@1 (averaged over samples) and unbiased pass@k per dataset, as a table "
                    "and as JSON. With --config, its model, servers, reward, eval set, rollout seed and "
                    "budget and prompt limit are the defaults. " + SETTINGS.format(section="eval"),
        epilog="example: areal-mcore eval --config configs/tiny_cpu.yaml --model runs/tiny-cpu/hf/step_300 "
               "--data runs/tiny-cpu/assets/test.jsonl --model-kind rl --n-samples 8 --out eval.json")
    _settings_args(p)
    _alias(p, "--model", "server.model_path", "HF folder to evaluate")
    _alias(p, "--data", "eval.data", "comma-separated JSONL files, one report row each", kind="list")
    _alias(p, "--data-format", "eval.data_format", "row format of --data; mc = multiple choice "
                                                   "{question, choices, answer}")
    _alias(p, "--model-kind", "eval.model_kind", "rl, sft or base: sets the sampling (temperature/top_p "
                                                 "rl 1.0/1.0, sft and base 0.6/0.95)")
    _alias(p, "--n-samples", "eval.n_samples", "samples per problem (default 32)")
    _alias(p, "--k", "eval.ks", "pass@k to report, e.g. 1,8,32 (default: powers of two up to n, and n)",
           kind="list")
    _alias(p, "--max-new-tokens", "eval.max_new_tokens", "response budget (default: rollout.max_new_tokens, "
                                                         "else boba's 27648)")
    _alias(p, "--shuffle-choices", "eval.shuffle_choices", "permute multiple-choice options per problem "
                                                           "(seeded); GPQA's gold is always A", kind="switch")
    _alias(p, "--prompt-suffix", "eval.prompt_suffix", "another instruction after each question than "
                                                       "training's ('' for none)")
    _alias(p, "--think", "eval.think", "auto, always or never: start responses with '<think>\\n' unlike "
                                       "training")
    _alias(p, "--server-url", "server.addresses", "comma-separated host:port of running servers "
                                                  "(nothing is launched)", kind="list")
    _alias(p, "--out", "eval.out", "write the JSON report here")


def run_eval(a) -> int:
    from areal_mcore.eval import evaluate, format_table
    from areal_mcore.eval.config import eval_job
    from areal_mcore.paths import check_eval_paths

    job = eval_job(_load_settings(a))
    check_eval_paths(job)  # before any server starts
    report = evaluate(job)
    print(format_table(report))
    if job.eval.out:
        print(f"report written to {job.eval.out}")
    return 0


def add_launch_parsers(sub) -> None:
    p = sub.add_parser(
        "launch", help="submit a run to Slurm through submitit (requeue, sweeps)",
        description="Submit a run as a submitit Slurm job that runs the in-allocation launcher "
                    "(rollout servers + trainer steps, launch.allocation) and requeues itself on "
                    "time limit or preemption, resuming from its checkpoint.",
        epilog="example: areal-mcore launch --config configs/boba_7b.yaml --nodes 4 --gpus-per-node 8 "
               "--partition gpu --time 72:00:00 --wait launch.allocation=sglang:d16+megatron:d8t2")
    p.add_argument("--config", required=True, help="YAML under configs/")
    p.add_argument("overrides", nargs="*", help="a.b.c=value overrides of the config")
    p.add_argument("--nodes", type=int, required=True, help="nodes of the allocation")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node; 0 for CPU nodes")
    p.add_argument("--partition", help="Slurm partition (default: the cluster's)")
    p.add_argument("--time", default="72:00:00", help="limit of one try, [D-]HH:MM:SS (default 72:00:00)")
    p.add_argument("--folder", default="runs/submitit", help="submitit's logs and pickles")
    p.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2",
                   help="one array task per combination of values (repeatable)")
    p.add_argument("--max-restarts", type=int, default=3, help="requeues on time limit before giving up")
    p.add_argument("--wait", action="store_true", help="print state changes until done, then the results")


def run_launch(a) -> int:
    from areal_mcore.launcher.submit import SubmitConfig, submit, wait

    jobs = submit(SubmitConfig(config=a.config, overrides=a.overrides, nodes=a.nodes, gpus_per_node=a.gpus_per_node,
                               partition=a.partition, time=a.time, folder=a.folder, sweep=a.sweep,
                               max_restarts=a.max_restarts))
    print("submitted: " + " ".join(j.job_id for j in jobs), flush=True)
    if a.wait:
        for result in wait(jobs):
            print(json.dumps(result))
    return 0


def add_doctor_parsers(sub) -> None:
    from areal_mcore.doctor.config import CHECKS

    p = sub.add_parser(
        "doctor", help="preflight: check the cluster against this run's shape before it starts",
        description="Check GPUs (NVML), the software stack, the fabric (an all-reduce over the trainer's "
                    "ranks), the network between trainer and rollout nodes, the run directory's filesystem, "
                    "Slurm's settings, torchrun variables in the steps' environment and the memory plan. Inside "
                    "a Slurm allocation it runs on every node of it; elsewhere on this machine. Prints a table, "
                    "writes <run>/doctor.json; exit status 1 when a check fails (docs/slurm_admin.md).",
        epilog="example: salloc -N 3 --gpus-per-node=8 areal-mcore doctor --config configs/boba_7b.yaml "
               "launch.allocation=sglang:d8+megatron:d16")
    p.add_argument("--config", required=True, help="YAML file under configs/")
    p.add_argument("overrides", nargs="*", help="a.b.c=value overrides, applied after the file")
    p.add_argument("--checks", type=_csv, help=f"only these, comma-separated: {','.join(CHECKS)} (sets doctor.checks)")
    p.add_argument("--warn-only", action="store_true", help="exit 0 even when a check fails (start anyway)")
    p.add_argument("--local", action="store_true", help="check this machine only, even inside a Slurm job")


def run_doctor(a) -> int:
    import os

    overrides = a.overrides + ([f"doctor.checks={json.dumps(a.checks)}"] if a.checks else [])
    if "SLURM_JOB_ID" in os.environ and not a.local:
        from areal_mcore.launcher.slurm import Launcher

        return Launcher(a.config, overrides).doctor(warn_only=a.warn_only)[0]
    from areal_mcore.config import load_config
    from areal_mcore.doctor.preflight import local, report, run_dir

    cfg = load_config(a.config, overrides)
    return report(run_dir(cfg), local(cfg), warn_only=a.warn_only, config=a.config, where="local")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="areal-mcore", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_convert_parsers(sub)
    add_filter_parsers(sub)
    add_train_parsers(sub)
    add_eval_parsers(sub)
    add_launch_parsers(sub)
    add_plan_parsers(sub)
    add_doctor_parsers(sub)
    verify = sub.add_parser("verify-checkpoint", help="check checkpoint folders against their manifests' hashes",
                            epilog="example: areal-mcore verify-checkpoint runs/tiny-cpu/checkpoints/step_*")
    verify.add_argument("checkpoints", nargs="+", help="checkpoints/step_* folders")
    a = parser.parse_args(argv)
    from areal_mcore.accel import quiet_known_warnings

    quiet_known_warnings()  # before megatron-core is imported; the actor says it in one line
    from areal_mcore.rollout.protocol import RolloutError
    try:
        return {"convert": run_convert, "filter": run_filter, "train": run_train,
                "sft": run_train, "eval": run_eval, "launch": run_launch, "plan": run_plan, "doctor": run_doctor,
                "verify-checkpoint": run_verify_checkpoint}[a.command](a)
    except (ValueError, FileNotFoundError) as e:  # user errors; anything else is a bug: traceback
        print(f"areal-mcore {a.command}: error: {e}", file=sys.stderr)
        return 2
    except RolloutError as e:  # the servers failed (none healthy left): what, not where in our code
        print(f"areal-mcore {a.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
