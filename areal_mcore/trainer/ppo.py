"""The boba RL loop: rollout -> rewards -> advantages -> train -> weight sync.

Every rank runs ``train(cfg)`` (torchrun or the tests' gloo spawner). Global rank 0 owns
the rollout side (``trainer/rollout_side.py``: servers, client, executor, reward pool)
and hands each data-parallel replica its share of the prompt groups; all ranks train and
take part in weight sync.
A run stops early, with a checkpoint, when ``<run>/STOP`` appears or a rank gets SIGUSR2 or
SIGTERM (Slurm's time-limit warning, preemption, scancel); the Slurm launcher requeues it.
``trainer.mode=sync`` samples each batch with the weights it trains; ``async`` keeps
sampling during training (rank 0's event loop runs on its own thread), with samples at
most ``rollout.max_head_offpolicyness`` versions old and the decoupled loss correcting for it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import signal
import threading
import time
import traceback
from datetime import timedelta
from functools import partial

import torch.distributed as dist
from transformers import AutoConfig, AutoTokenizer

from areal_mcore import collectives
from areal_mcore.actor.checkpoint import CheckpointConfig, Checkpointer
from areal_mcore.actor.megatron_actor import MegatronActor
from areal_mcore.algo import (
    loglinear_gap_stats,
    loglinear_proximal_logprobs,
    ppo_actor_loss,
    reduce_ppo_stats,
)
from areal_mcore.algo.config import PPOConfig
from areal_mcore.algo.drift import reduce_rollout_gap, rollout_gap_sums
from areal_mcore.config import ExperimentConfig
from areal_mcore.convert.hf_files import load_hf_state_dict
from areal_mcore.convert.save_hf import save_hf
from areal_mcore.paths import check_run_paths
from areal_mcore.rollout.protocol import RolloutError
from areal_mcore.run_dir import RunDir
from areal_mcore.trainer import stats as S
from areal_mcore.trainer.batch import add_advantages, overlong_stats, pack_rollout
from areal_mcore.trainer.dispatch import Dispatcher
from areal_mcore.trainer.event_loop import LoopThread
from areal_mcore.trainer.rollout_side import RolloutSide
from areal_mcore.weight_sync import weight_syncer
from areal_mcore.weight_sync.syncer import WeightSyncError


def ppo_loss(ppo: PPOConfig, version: int, logprobs_T, mb, num_global_tokens, num_global_seqs, *, entropy_T=None):
    """The actor's loss: clipped PPO against the proximal logprobs (``prox_logp_method``:
    recomputed before training; AReaL's log-linear interpolation with the proximal weights
    at ``version`` = this step's index, our version labels, see
    ``algo.loglinear_proximal_logprobs``; recomputed and measured against that
    interpolation, ``metrics``; or θ's own detached logprobs, ``reuse_train_logp``), with
    the behaviour (rollout) logprobs in the decoupled form when configured, and the loss options of ``ppo`` (aggregation,
    importance-sampling level, behaviour-weight level and mode), the entropy bonus on θ's
    ``entropy_T`` and, with a reference model (field ``ref``), the KL loss term
    (``kl_in: loss``; with ``kl_in: reward`` the KL is in the advantages and only logged
    here); also counts the batch's empty responses."""
    f, method, extra = mb.fields, ppo.prox_logp_method, {}
    if ppo.recomputes_prox:
        prox = f["prox"]
    elif method == "loglinear":
        prox = loglinear_proximal_logprobs(f["behave"], logprobs_T, f["versions"], version)
    else:  # reuse_train_logp: θ's own logprobs, detached; the behaviour weight corrects all
        prox = logprobs_T.detach()
    if method == "metrics":
        approx = loglinear_proximal_logprobs(f["behave"], logprobs_T, f["versions"], version)
        extra = loglinear_gap_stats(prox, approx, f["loss_mask"], f["versions"], version)
    loss, stats = ppo_actor_loss(
        logprobs_T, prox, f["adv"], f["loss_mask"], num_global_tokens=num_global_tokens,
        eps_clip=ppo.eps_clip, eps_clip_high=ppo.eps_clip_high, c_clip=ppo.c_clip,
        behave_logprobs_T=f["behave"] if ppo.use_decoupled_loss else None,
        behav_imp_weight_cap=ppo.behav_imp_weight_cap, cu_seqlens_B1=mb.cu_seqlens_padded,
        num_global_seqs=num_global_seqs, loss_agg_mode=ppo.loss_agg_mode, loss_norm_tokens=ppo.loss_norm_tokens,
        importance_sampling_level=ppo.importance_sampling_level,
        behav_imp_weight_level=ppo.behav_imp_weight_level, behav_imp_weight_mode=ppo.behav_imp_weight_mode,
        entropy_T=entropy_T, entropy_coef=ppo.entropy_coef, ref_logprobs_T=f.get("ref"),
        kl_coef=ppo.kl_coef if ppo.kl_in == "loss" else 0.0, kl_estimator=ppo.kl_estimator,
        seq_group=mb.cp_group)
    return loss, {**stats, **extra, "empty_responses": f["empty_response"].sum()}


# The exit code of a run that stopped early with a checkpoint (a signal, <run>/STOP), to
# be resumed: sysexits.h's EX_TEMPFAIL ("the user is invited to retry"). A finished run
# exits 0, a failed one 1 (2: a config or path error before anything started).
EXIT_STOPPED = 75


class History(list):
    """The per-step stats rows (rank 0's); ``stopped``: the run ended early, checkpointed."""

    stopped: bool = False


class RolloutDriftError(RuntimeError):
    """The servers' logprobs are further from the trainer's than
    ``trainer.max_rollout_logprob_gap``: they do not serve the weights the trainer pushed."""


def train(cfg: ExperimentConfig) -> list[dict]:
    """Runs ``cfg.trainer.total_steps`` PPO steps; returns the per-step stats (rank 0).
    Its paths are checked first, as ``areal-mcore train`` checks them (``load_config`` does not)."""
    check_run_paths(cfg, "train")
    run = PPORun(cfg)
    phase, ppo = run.phases, cfg.ppo
    try:
        run.evaluate(step=run.start_step)
        for step in range(run.start_step, cfg.trainer.total_steps):
            with phase("rollout"):
                got = run.rollout(step)
            if got is None:  # a signal during the rollout: it is abandoned, the last step saved
                run.stopped = True
                run.save_interrupted(step)
                break
            samples, rollout_stats = got
            with phase("advantages"):
                batch, rewards_B = pack_rollout(samples, ppo, dp_group=run.actor.groups.dp)
            temperature = cfg.rollout.temperature  # score what the servers sampled from
            # A signal before the optimizer's first step abandons the step (run.abandon):
            # the forwards stop between micro-batches where they can (compute_logprobs).
            forwards = ppo.recomputes_prox or run.ref_model is not None
            if ppo.recomputes_prox:
                with phase("recompute"):  # π_prox before the update
                    prox = run.actor.compute_logprobs(batch, temperature=temperature, stop=run.signalled)
                if run.abandon(step, "recompute", prox is None):
                    break
                batch.fields["prox"] = prox
                if run.actor.router_disagreement is not None:  # MoE with the rollout's routing
                    rollout_stats = {**rollout_stats, "moe/router_disagreement": run.actor.router_disagreement}
                rollout_stats = {**rollout_stats, **run.check_drift(step, batch)}  # may end the run
            if run.ref_model is not None:
                with phase("reference"):  # the frozen π_ref, at the same temperature
                    ref = run.actor.compute_logprobs(batch, temperature, model=run.ref_model, stop=run.signalled)
                if run.abandon(step, "reference", ref is None):
                    break
                batch.fields["ref"] = ref
            if not forwards and run.abandon(step, "advantages", False):
                break
            with phase("advantages"):  # after the forwards: kl_in=reward's penalty needs them
                add_advantages(batch, rewards_B, ppo, dp_group=run.actor.groups.dp)
            with phase("train"):
                train_stats = run.actor.train_batch(batch, partial(ppo_loss, ppo, step), ppo.ppo_n_minibatches,
                                                    reduce_stats=reduce_ppo_stats, temperature=temperature,
                                                    step=step + 1, entropy=True)
            # <run>/STOP, SIGUSR2 or SIGTERM: the step is checkpointed at once, without its
            # weight sync and eval (a resumed run syncs first, and evaluates a step it skipped).
            stop = run.stop_requested(step + 1)
            sync_stats = {}
            if not stop:
                with phase("sync"):
                    sync_stats = run.sync(version=step + 1)
                with phase("eval"):
                    run.evaluate(step=step + 1)
            run.log(step + 1, batch, rollout_stats, train_stats, sync_stats)
            with phase("save"):  # reported with the next step
                run.maybe_save(step + 1, force=stop)
            run.remember_state()
            if stop:
                run.stopped = True
                break
        run.export_if_missing()
        run.history.stopped = run.stopped
        if run.stopped and run.rank == 0:
            run.files.mark_stopped(run.files.checkpoint_step())
    except BaseException:
        try:
            run.close(barrier=False)  # the other ranks may be gone: no collective
        except Exception as e:  # noqa: BLE001 - the error that ended the run is the one to raise
            print(f"[ppo] rank {run.rank}: stopping after the error below failed too: {type(e).__name__}: {e}",
                  flush=True)
        raise
    run.close()
    return run.history


class PPORun:
    """The loop's collaborators, built from the config; one per rank. ``rollout_side`` is
    rank 0's (``trainer/rollout_side.py``), None on the other ranks."""

    def __init__(self, cfg: ExperimentConfig):
        for section in ("model_path", "dataset", "rollout", "server", "trainer"):
            if getattr(cfg, section) is None:
                raise ValueError(f"training needs the config section/key {section!r}")
        self.cfg = cfg
        self.rank = dist.get_rank()
        self.rollout_side: RolloutSide | None = None
        self.syncer, self.logger, self.phases, self.hf_dir = None, None, None, None
        self.files = RunDir.of(cfg.trainer.log_dir, cfg.experiment_name)
        self.run_dir = self.files.path
        self.loop = LoopThread()
        self.history = History()
        self._signalled, self._old_handlers, self._lock = False, {}, None
        self.stopped = False  # ended early, checkpointed, by a signal or <run>/STOP (EXIT_STOPPED)
        self._in_rollout, self._resume_state = False, None
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self._setup()
        except BaseException:
            self.close(barrier=False)  # no server outlives a failed start
            raise

    def _setup(self) -> None:
        cfg = self.cfg
        # One trainer per run directory, checked before anything is started or written.
        refusal, t = None, cfg.trainer
        if self.rank == 0:
            # ... and no earlier run here that this one would silently redo or set aside.
            self._lock, refusal = self.files.claim(t.total_steps, t.existing_run)
            if refusal is None and t.existing_run == "overwrite" and (aside := self.files.set_aside()):
                print(f"[ppo] trainer.existing_run=overwrite: the earlier run's files are now in {aside}",
                      flush=True)
        refusal = collectives.broadcast_object(refusal, 0, dist.group.WORLD)
        if refusal:
            raise ValueError(refusal)
        if self.rank == 0:
            self.files.clear_stopped()  # this try's end is what a launcher reads
        self.actor = MegatronActor(cfg.actor, AutoConfig.from_pretrained(cfg.model_path), seed=cfg.seed,
                                   total_optimizer_steps=cfg.trainer.total_steps * cfg.ppo.ppo_n_minibatches)
        self.actor.load_hf_state_dict(load_hf_state_dict(cfg.model_path))
        # The KL's frozen reference policy: parameters only, sharded like the actor.
        self.ref_model = (self.actor.build_frozen_model(load_hf_state_dict(cfg.ppo.ref_model_path or cfg.model_path))
                          if cfg.ppo.uses_reference else None)
        tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path or cfg.model_path)
        # Where the other ranks wait for rank 0 (server start-up, rollouts, evals): gloo, with
        # the config's timeout. On the NCCL world they would be aborted by its 10 min watchdog.
        self.control = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.trainer.wait_timeout_s))
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.rollout_side = RolloutSide(cfg, tokenizer, self.files, self.loop)
        # With the servers' key (rank 0 may have generated it): other ranks send weights too.
        side = self.rollout_side
        addresses, api_key = collectives.broadcast_object(
            (side.addresses, side.api_key) if side is not None else None, 0, self.control)
        self.addresses = addresses
        g = self.actor.groups
        self.dispatcher = Dispatcher(dp_rank=g.dp_rank, dp_size=g.dp_size, mp_group=g.mp, cp_group=g.cp,
                                     world=dist.group.WORLD, control=self.control)
        # Rank 0 shares the rollout client's fleet: a server the sync finds gone gets no
        # more work, and the sync skips those the rollout found stalled.
        fleet = self.rollout_side.client.fleet if self.rollout_side is not None else addresses
        self.syncer = weight_syncer(cfg.weight_sync, self.actor, fleet, api_key=api_key,
                                    backend=cfg.server.backend, root=str(self.run_dir),
                                    stall=(cfg.rollout.stall_after_s, cfg.rollout.stall_probe_s))
        self.loop.run(self.syncer.connect())
        self.checkpointer = Checkpointer(CheckpointConfig(root=str(self.files.checkpoints)), group=dist.group.WORLD)
        resumed = self.checkpointer.load(self.actor)
        self.start_step = resumed.step if resumed else 0
        state = resumed.extra if resumed and self.rank == 0 else {}
        if resumed and self.rank == 0 and resumed.weights_only:  # `convert hf-to-mcore`'s
            print(f"[ppo] starting from the weights of {resumed.path} (step {self.start_step}): it holds no "
                  "trainer state, so the prompt order, rollout state, learning-rate schedule and W&B run "
                  "start afresh", flush=True)
        elif resumed and self.rank == 0:
            self.load_state_dict(state)
            print(f"[ppo] resumed from {resumed.path} at step {self.start_step}", flush=True)
        self.logger = S.RunLogger(t, self.run_dir, enabled=self.rank == 0, start_step=self.start_step,
                                  experiment=dataclasses.asdict(cfg), wandb_run_id=state.get("wandb_run_id"))
        self.phases = S.Phases(self.run_dir / "trace.json" if t.trace and self.rank == 0 else None)
        # Servers may hold anything (another run's weights, a base model): serve the actor's.
        self.sync(version=self.start_step)
        if self.rank == 0:
            self.rollout_side.start_sampling()
        self._last_row_t = time.perf_counter()
        self.remember_state()

    # ---- resumable state (rank 0; the actor's own is the checkpointer's) ------------------
    def state_dict(self) -> dict | None:
        """What a resumed run needs beyond the actor: the prompt order and the executor's
        state, and the W&B run it continues. None on the ranks without a rollout side."""
        if self.rollout_side is None:
            return None
        state = self.rollout_side.state_dict()
        if self.logger.wandb is not None:  # a resumed run continues the same W&B run
            state["wandb_run_id"] = self.logger.wandb.run_id
        return state

    def load_state_dict(self, state: dict) -> None:
        self.rollout_side.load_state_dict(state)  # wandb_run_id is read when the logger starts

    def remember_state(self) -> None:
        """The state at the end of a step: what a checkpoint of that step holds when a
        signal interrupts the next rollout (which draws prompts, so the state moves on)."""
        self._resume_state = self.state_dict()

    def save_interrupted(self, step: int, why: str = "a signal") -> None:
        """Step ``step + 1``'s rollout was abandoned (a signal, or it failed): the actor
        still holds step ``step``'s weights, checkpointed here with the state that step
        ended with (unless it was saved already), so a resumed run redoes the rollout."""
        if self.rank == 0:
            where = why if " during the " in why else f"{why} during the rollout"
            self.logger.print(f"[ppo] {where} of step {step + 1}: abandoned; "
                              f"checkpointing step {step} and exiting")
        if step and self.files.checkpoint_step() != step:
            self.checkpointer.save(self.actor, step=step, weight_version=step, extra=self._resume_state,
                                   config_snapshot=dataclasses.asdict(self.cfg))

    # ---- the step's parts --------------------------------------------------------------
    def rollout(self, step: int):
        """Rank 0 samples (sync) or collects (async) the batch; every rank returns its
        data-parallel replica's share as a ``RolloutShard`` (trainer/dispatch.py)."""
        samples, stats, side, interrupted, error = None, None, self.rollout_side, False, None
        if side is not None:
            try:
                out = self._interruptible(side.rollout)
            except Exception as e:  # noqa: BLE001 - every rollout failure keeps the last step
                out, error = None, str(e) if isinstance(e, RolloutError) else f"{type(e).__name__}: {e}"
                if not isinstance(e, RolloutError):  # not the servers': where in our code, for the report
                    traceback.print_exc()
            if out is None:
                interrupted = True
                side.abort_all()  # the servers stop generating what nobody waits for
            else:
                self.logger.dump_rollouts(step + 1, out.samples, side.decode)
                samples, stats = out.samples, out.stats
                if self.cfg.ppo.overlong_penalty is not None:
                    stats = {**stats, **overlong_stats(samples, self.cfg.ppo.overlong_penalty)}
        # The other ranks wait here for rank 0's rollout (on the gloo control group).
        interrupted, error = collectives.broadcast_object((interrupted, error), 0, self.control)
        if error:  # the last finished step is kept, then the run ends with the reason
            self.save_interrupted(step, why=f"the rollout failed ({error})")
            raise RolloutError(f"step {step + 1}'s rollout failed: {error}; step {step} is checkpointed")
        if interrupted:
            return None
        packer = side.packer if side is not None else None
        shard, moved = self.dispatcher.dispatch(samples, self.cfg.rollout.n_samples, packer)
        stats = collectives.broadcast_object(stats, 0, dist.group.WORLD)  # a few scalars
        if self.rank == 0:
            stats = {**stats, "dispatch/bytes": float(moved.bytes_sent),
                     "dispatch/time_s": moved.pack_s + moved.send_s}
        return shard, stats

    def check_drift(self, step: int, batch) -> dict:
        """``drift/*``: the servers' logprobs against the recomputed proximal ones on the
        same tokens (``algo/drift.py``), the same on every rank. With
        ``trainer.max_rollout_logprob_gap``, a mean |Δ| above it on the tokens sampled by
        the proximal weights' own version (step ``step``'s) ends the run as a failed
        rollout does: step ``step`` (the last finished) is checkpointed, then
        ``RolloutDriftError`` names the step, the servers and the gap."""
        f = batch.fields
        gap = reduce_rollout_gap(rollout_gap_sums(f["behave"], f["prox"], f["loss_mask"], f["versions"], step),
                                 self.actor.groups.dp)
        limit, on_policy = self.cfg.trainer.max_rollout_logprob_gap, gap.get("gap_mean_abs_stale0")
        if limit is not None and on_policy is not None and on_policy > limit:
            self.save_interrupted(step, why="the rollout servers' logprobs drifted from the trainer's")
            raise RolloutDriftError(
                f"step {step + 1}: the rollout servers {self.addresses} sampled {gap['tokens_stale0']:.0f} tokens "
                f"with weight version {step} whose logprobs are a mean |Δ| {on_policy:.4g} from the trainer's "
                f"for the same weights (p99 over all tokens {gap['gap_p99_abs']:.3g}, k3 KL {gap['k3_kl']:.3g}), "
                f"over trainer.max_rollout_logprob_gap={limit}: they do not serve the weights the trainer "
                "pushed (a bad load, dtype or shard; an engine bug); compare their dtype and "
                "weight_sync.dtype with the actor's. "
                + (f"Step {step} is checkpointed" if step else "No step had finished: nothing is checkpointed"))
        return {f"drift/{k}": v for k, v in gap.items()}

    def sync(self, version: int) -> dict:
        """Pushes step ``version``'s weights. A push no server survived (``Syncer.push``
        re-pushes to survivors) ends the run with the step checkpointed: it trained, and a
        resumed run syncs first."""
        stats, error = None, None
        try:
            stats = self.loop.run(self.syncer.push(version))
        except WeightSyncError as e:
            error = str(e)
        # Every rank learns it (the ranks of other replicas take no part in a push).
        error = next(filter(None, collectives.all_gather_object(error, self.control)), None)
        if error:
            saved = bool(version) and self.files.checkpoint_step() != version
            if self.rank == 0:
                self.logger.print(f"[ppo] the weight sync of step {version} failed"
                                  + (f": checkpointing step {version} and exiting" if saved else ""))
            if saved:
                self.checkpointer.save(self.actor, step=version, weight_version=version, extra=self.state_dict(),
                                       config_snapshot=dataclasses.asdict(self.cfg))
            raise RolloutError(error + (f" Step {version} is checkpointed; a resumed run syncs it first."
                                        if version else ""))
        out = {"sync/time_s": stats.total_s, "sync/bytes": float(stats.bytes)}
        if self.rollout_side is not None:
            out["sync/server_versions"] = self.rollout_side.set_version(version)
        return out

    def evaluate(self, step: int) -> None:
        """Accuracy on the held-out problems (rank 0; every ``trainer.eval_freq`` steps,
        before the first and after the last); the other ranks wait for it."""
        freq, last = self.cfg.trainer.eval_freq, step == self.cfg.trainer.total_steps
        if not freq or not (step % freq == 0 or last):
            return
        error = None
        if self.rollout_side is not None:
            try:
                self._evaluate(step)
            except Exception as e:  # the other ranks learn it below, then it is raised
                error = e
        # The other ranks wait out rank 0's eval here, on the gloo control group (with
        # trainer.wait_timeout_s), as they wait out its rollout. Their next collectives
        # are on NCCL groups, whose watchdog aborts a wait after the group's timeout, which
        # a boba eval can outlast: log's pipeline broadcast (30 min: megatron's
        # parallel_state.py::initialize_model_parallel, distributed_timeout_minutes) and
        # maybe_save's WORLD barriers (10 min: torch's constants.py::default_pg_nccl_timeout).
        failed = collectives.broadcast_object(error and f"{type(error).__name__}: {error}", 0, self.control)
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(f"rank 0's eval after step {step} failed ({failed}); see rank 0's log")

    def _evaluate(self, step: int) -> None:
        row = self._interruptible(self.rollout_side.evaluate)
        if row is None:  # no eval_dataset, or a signal abandoned it (a resumed run evaluates)
            if self._signalled:
                self.rollout_side.abort_all()
            return
        row = {"step": step, **row}
        self.logger.eval(row)
        self.logger.print(f"[eval] step {step}: accuracy {row['eval/accuracy']:.3f} over "
                           f"{len(self.rollout_side.eval_prompts)} held-out problems x "
                           f"{self.cfg.rollout.n_samples} samples")

    def stop_requested(self, step: int) -> bool:
        """After step ``step``'s training: whether any rank was signalled or rank 0 sees
        ``<run>/STOP`` (removed once seen, so the requeued run goes on)."""
        flag = self._signalled or (self.rank == 0 and self.files.take_stop())
        flags = collectives.all_gather_object(flag, dist.group.WORLD)
        if any(flags) and self.rank == 0:
            train_s = self.phases.times.get("train", 0.0)
            self.logger.print(f"[ppo] stop requested: checkpointing step {step} (trained in {train_s:.1f} s; "
                              "weight sync and eval skipped) and exiting; a resumed run continues from here")
        return any(flags)

    def signalled(self) -> bool:
        return self._signalled

    def abandon(self, step: int, phase: str, stopped: bool) -> bool:
        """Before step ``step + 1``'s first optimizer step: whether any rank was signalled
        (``stopped``: this one left its ``phase`` early); if so the step is abandoned and
        step ``step`` checkpointed (``save_interrupted``), so the run ends within its save
        time of the signal (Slurm's KillWait: 30 s), not after this step's training."""
        flags = collectives.all_gather_object(self._signalled or stopped, self.control)
        if not any(flags):
            return False
        self.stopped = True
        self.save_interrupted(step, why=f"a signal during the {phase}")
        return True

    def _interruptible(self, fn):
        """Rank 0's ``fn()`` (a rollout or an eval: minutes, on servers), abandoned when a
        signal comes (``_on_signal``): returns None then, or at once if one came before."""
        self._in_rollout = not self._signalled
        try:
            return fn() if self._in_rollout else None
        except concurrent.futures.CancelledError:
            return None
        finally:
            self._in_rollout = False

    def _on_signal(self, signum, frame) -> None:
        """SIGTERM (scancel, preemption: SIGKILL follows after KillWait), SIGUSR2 (the time
        limit) and SIGINT: a rollout or eval in progress is abandoned at once (rank 0) and
        the last finished step checkpointed; in the train phase the step's training
        finishes (its optimizer steps cannot be undone) and is checkpointed without its
        sync and eval. A second Ctrl-C interrupts for good."""
        if signum == signal.SIGINT and self._signalled:
            raise KeyboardInterrupt
        self._signalled = True
        if self._in_rollout:
            self.loop.cancel_current()

    def maybe_save(self, step: int, force: bool = False) -> None:
        """A checkpoint every ``trainer.save_freq`` steps (and when ``force``d), an HF
        export every ``trainer.export_freq``; both after the last step."""
        t, last = self.cfg.trainer, step == self.cfg.trainer.total_steps
        if force or (t.save_freq and (step % t.save_freq == 0 or last)):
            self.checkpointer.save(self.actor, step=step, weight_version=step, extra=self.state_dict(),
                                   config_snapshot=dataclasses.asdict(self.cfg))  # the resolved config
        if last or (t.export_freq and step % t.export_freq == 0):
            self.hf_dir = self.run_dir / "hf" / f"step_{step}"
            save_hf(self.actor, self.hf_dir, tokenizer_dir=self.cfg.tokenizer_path or self.cfg.model_path)

    def export_if_missing(self) -> None:
        """A run resumed at its last step (killed during its final HF export, which
        ``save_hf`` leaves absent, never partial) writes the export it lacks."""
        total = self.cfg.trainer.total_steps
        hf_dir = self.run_dir / "hf" / f"step_{total}"
        if self.start_step == total and not (hf_dir / "config.json").is_file():
            save_hf(self.actor, hf_dir, tokenizer_dir=self.cfg.tokenizer_path or self.cfg.model_path)
        if self.start_step == total:
            self.hf_dir = hf_dir

    def log(self, step: int, batch, rollout_stats: dict, train_stats: dict, sync_stats: dict) -> None:
        g = self.actor.groups
        reduced = train_stats.get("stats")
        if g.pp_size > 1:  # the loss's stats exist on the last stage only
            reduced = collectives.broadcast_object(reduced, g.pp_last_rank, g.pp)
        now = time.perf_counter()
        step_s, self._last_row_t = now - self._last_row_t, now
        times = self.phases.take()
        n = rollout_stats["rollout/n_samples"]
        train_tokens = n * (rollout_stats["rollout/prompt_len_mean"] + rollout_stats["rollout/response_len_mean"])
        # Async generation overlaps the whole step; sync generation is the rollout phase.
        gen_s = step_s if self.cfg.trainer.mode == "async" else times["time/rollout_s"]
        row = {"step": step, **rollout_stats, **sync_stats, **times, "time/step_s": step_s,
               "train/loss": train_stats["loss"], "train/grad_norm": train_stats["grad_norm"],
               "train/lr": train_stats["lr"],
               **{f"train/{k}": float(v) for k, v in (reduced or {}).items()},
               "perf/rollout_tokens_per_s": rollout_stats["rollout/generated_tokens"] / max(gen_s, 1e-9),
               "perf/train_tokens_per_s": train_tokens / max(times["time/train_s"], 1e-9),
               **S.gpu_stats()}
        seqlens = batch.seqlens_padded  # this rank's share; every DP replica trains as much
        busy = times["time/train_s"] + times.get("time/recompute_s", 0.0)
        passes = 3 + (1 if self.cfg.actor.recompute else 0) + ("time/recompute_s" in times)
        util = S.mfu(S.train_flops(self.actor.args, seqlens, forward_passes=passes) * g.dp_size, busy,
                     dist.get_world_size())
        if util is not None:
            row["perf/mfu"] = util
        self.history.append(row)
        self.logger.step(row)

    def close(self, barrier: bool = True) -> None:
        # The syncer first: its update groups are torn down on servers that are still up.
        if self.syncer is not None:
            self.loop.run(self.syncer.close())
        if self.rollout_side is not None:
            self.rollout_side.close()
        self.loop.close()
        if self.phases is not None:
            self.phases.close()
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        try:
            plot = self.logger.close() if self.logger is not None else None
        finally:
            if self._lock is not None:
                self._lock.close()
        if not barrier:
            return
        # On the control group: rank 0 gets here after stopping the servers and closing
        # the logger (W&B's upload), which can outlast the NCCL watchdog (see evaluate).
        collectives.barrier(self.control)
        if plot is not None:
            print(f"[ppo] stats: {self.files.stats}\n"
                  f"[ppo] tensorboard: tensorboard --logdir {self.run_dir / 'tensorboard'}\n"
                  f"[ppo] curves: {plot}\n[ppo] HF model: {self.hf_dir or 'not exported'}", flush=True)
