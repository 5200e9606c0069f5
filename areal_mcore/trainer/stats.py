"""What a run reports, written by rank 0 under ``<log_dir>/<experiment>/``:

- ``stats.jsonl``: one row of scalars per step (also the source of the plot);
- ``tensorboard/``: the same scalars as TensorBoard events, plus the evals;
- a one-line console summary per step (under a tqdm bar when ``trainer.progress``);
- ``rollouts/step_N.jsonl`` with ``trainer.dump_to_file``: prompt, response, reward,
  lengths and per-token weight versions of every sample;
- ``trace.json`` with ``trainer.trace``: the step phases as Chrome-trace events;
- ``curves.png`` at the end: training reward/accuracy and held-out accuracy vs step (and
  the tool-call rate of a tool-using episode).
"""

from __future__ import annotations

import contextlib
import json
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from areal_mcore.run_dir import RunDir, append_jsonl, read_jsonl, write_atomic
from areal_mcore.trainer.config import TrainerConfig


class Phases:
    """Wall time per phase of a step (``time/<phase>_s``) and, when tracing, the same
    spans as Chrome "complete" events. The trace is a JSON array written one event per
    line without the closing bracket, which the trace viewers accept, so a run that dies
    keeps every finished span."""

    def __init__(self, trace_path: Path | None = None):
        self.times: dict[str, float] = {}
        self._origin = time.perf_counter()
        self._trace = None
        if trace_path is not None:
            self._trace = open(trace_path, "a")
            if self._trace.tell() == 0:
                self._trace.write("[\n")

    @contextmanager
    def __call__(self, name: str, **args):
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            self.times[name] = self.times.get(name, 0.0) + end - start
            if self._trace is not None:
                event = {"name": name, "ph": "X", "pid": 0, "tid": 0, "ts": round((start - self._origin) * 1e6),
                         "dur": round((end - start) * 1e6), "args": args}
                self._trace.write(json.dumps(event) + ",\n")
                self._trace.flush()

    def take(self) -> dict[str, float]:
        """This step's phase times, then starts the next step from zero."""
        out = {f"time/{k}_s": v for k, v in self.times.items()}
        self.times = {}
        return out

    def close(self) -> None:
        if self._trace is not None:
            self._trace.close()


# Dense bf16 peak of the GPUs we run on (no sparsity); MFU is left out for other devices.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12}


def train_flops(args, seqlens: list[int], *, forward_passes: int = 3) -> float:
    """Matmul FLOPs of ``forward_passes`` (3 = forward + backward) over packed sequences
    of a dense decoder (``model.args.ModelArgs``): 2 FLOPs per weight per token, plus the
    causal attention scores and mix (2 · 2 · L · heads · head_dim · len² / 2 per sequence)."""
    a = args
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    per_layer = a.hidden_size * (q + 2 * kv) + q * a.hidden_size + 3 * a.hidden_size * a.ffn_hidden_size
    weights = a.num_layers * per_layer + a.hidden_size * a.vocab_size  # + the output layer
    tokens = sum(seqlens)
    attention = sum(2 * a.num_layers * q * n * n for n in seqlens)
    return forward_passes * (2 * weights * tokens + attention)


def mfu(flops: float, seconds: float, n_gpus: int) -> float | None:
    """Model FLOPs utilisation; None off the GPUs in PEAK_FLOPS (e.g. on CPU)."""
    if not torch.cuda.is_available() or seconds <= 0:
        return None
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_FLOPS.items() if k in name), None)
    return None if peak is None else flops / seconds / (peak * n_gpus)


def gpu_stats() -> dict[str, float]:
    """Utilisation and memory of this process's GPU through NVML (nvidia-ml-py); empty
    without a GPU or without the library."""
    if not torch.cuda.is_available():
        return {}
    try:
        import pynvml
    except ImportError:
        return {}
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    util = pynvml.nvmlDeviceGetUtilizationRates(handle)
    mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
    return {"gpu/util_pct": float(util.gpu), "gpu/mem_used_gib": mem.used / 2**30,
            "gpu/mem_total_gib": mem.total / 2**30}


def _scalar(value) -> float | None:
    """Numbers as they are; per-minibatch lists as their mean; anything else skipped."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
        return sum(value) / len(value)
    return None


class RunLogger:
    """Rank 0's writer of every per-step artefact; the other ranks get a no-op one."""

    def __init__(self, cfg: TrainerConfig, run_dir: Path, *, enabled: bool, start_step: int = 0,
                 experiment: dict | None = None, wandb_run_id: str | None = None):
        """``experiment``: the resolved config (W&B's run config); ``wandb_run_id``: the W&B
        run a resumed run continues (from its checkpoint)."""
        self.cfg, self.run_dir, self.enabled = cfg, run_dir, enabled
        self.writer, self.bar, self.wandb = None, None, None
        if not enabled:
            return
        if cfg.wandb.enabled:
            from areal_mcore.trainer.wandb_log import WandbLogger

            self.wandb = WandbLogger(cfg.wandb, run_dir, experiment_name=run_dir.name, config=experiment or {},
                                     run_id=wandb_run_id, start_step=start_step)
        if start_step:  # a resumed run redoes what a killed one logged after its checkpoint
            _keep_rows(RunDir(run_dir).stats, lambda step: step <= start_step)
            _keep_rows(run_dir / "eval.jsonl", lambda step: step < start_step)
        else:  # a fresh run: an earlier run's rows (its checkpoints gone) are set aside
            for path in (RunDir(run_dir).stats, run_dir / "eval.jsonl"):
                _set_aside(path)
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops events a killed run wrote after its last checkpoint.
            self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start_step + 1)
        if cfg.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.total_steps, initial=start_step, desc="ppo", unit="step",
                            dynamic_ncols=True)

    def step(self, row: dict) -> None:
        if not self.enabled:
            return
        RunDir(self.run_dir).append_stats(row)
        self._scalars(row)
        r = row
        line = (f"[ppo] step {r['step']}/{self.cfg.total_steps} reward {r['rollout/reward_mean']:.3f} "
                f"acc {r['rollout/accuracy']:.3f} len {r['rollout/response_len_mean']:.1f} "
                f"loss {_scalar(r['train/loss']):+.4f} stale {r['rollout/staleness_mean']:.2f} "
                + (f"kept {r['rollout/dynamic_kept_ratio']:.2f} ({r['rollout/dynamic_groups']:.0f} groups) "
                   if "rollout/dynamic_kept_ratio" in r else "")  # rollout.dynamic_sampling
                + (f"calls {r['rollout/tool_call_rate']:.2f} " if "rollout/tool_call_rate" in r else "")
                + (f"sync {r['sync/time_s']:.2f}s " if "sync/time_s" in r else "sync skipped (stopping) ")
                + f"step {r['time/step_s']:.1f}s")
        self.print(line)
        if self.bar is not None:
            self.bar.update(1)

    def eval(self, row: dict) -> None:
        if self.enabled:
            append_jsonl(self.run_dir / "eval.jsonl", row)
            self._scalars(row)

    def _scalars(self, row: dict) -> None:
        scalars = {k: x for k, x in ((k, _scalar(v)) for k, v in row.items()) if k != "step" and x is not None}
        if self.wandb is not None:
            self.wandb.log(row["step"], scalars)
        if self.writer is None:
            return
        try:
            for key, x in scalars.items():
                self.writer.add_scalar(key, x, global_step=row["step"])
            self.writer.flush()
        except OSError as e:  # raised by TensorBoard's writer thread, naming no file
            writer, self.writer = self.writer, None  # broken: close() must not raise it again
            with contextlib.suppress(OSError):
                writer.close()
            where = self.run_dir / "tensorboard"
            raise OSError(e.errno, f"{e.strerror} while writing TensorBoard events in {where}", str(where)) from e

    def print(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def dump_rollouts(self, step: int, samples, decode) -> None:
        """Every sample of the step as one JSON line (``trainer.dump_to_file``)."""
        if not (self.enabled and self.cfg.dump_to_file):
            return
        out = self.run_dir / "rollouts"
        out.mkdir(exist_ok=True)
        with open(out / f"step_{step}.jsonl", "w") as f:
            for s in samples:
                f.write(json.dumps({
                    "step": step, "group": s.group, "prompt": decode(s.prompt_ids),
                    "response": decode(s.output_ids), "reward": s.reward, "finish_reason": s.finish_reason,
                    "prompt_len": len(s.prompt_ids), "response_len": len(s.output_ids),
                    "start_version": s.start_version, "versions": s.versions,
                    # the token ids as generated and appended (a multi-turn trajectory's
                    # tool output among them: version -1), which the text may not round-trip
                    "response_ids": s.output_ids}) + "\n")

    def close(self) -> Path | None:
        """Flushes everything and draws the curves; returns the plot's path."""
        if not self.enabled:
            return None
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()
        try:
            plot = plot_curves(self.run_dir)
        except OSError as e:  # a full disk: the curves are a convenience, stats.jsonl has the rows
            print(f"[ppo] curves.png not drawn: {e}", flush=True)
            plot = None
        if self.wandb is not None:
            if plot is not None:
                self.wandb.image("curves", plot)
            self.wandb.finish()
        return plot


def _set_aside(path: Path) -> None:
    """Renames a non-empty ``path`` to ``<stem>.before-<time><suffix>`` (a fresh run's rows
    appended to an old run's read as steps 1, 2, 1, 2)."""
    if path.is_file() and path.stat().st_size:
        aside = path.with_name(f"{path.stem}.before-{time.strftime('%Y%m%d-%H%M%S')}{path.suffix}")
        path.replace(aside)
        print(f"[ppo] a fresh run (no checkpoint): the earlier {path.name} is now {aside.name}", flush=True)


def _keep_rows(path: Path, keep) -> None:
    """Rewrites ``path`` (atomically) with the rows ``keep`` accepts; a torn last line goes."""
    if path.is_file():
        rows = read_jsonl(path)
        write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows if keep(r["step"])))


def plot_curves(run_dir: Path) -> Path | None:
    """``curves.png``: per-step training reward and accuracy, held-out accuracy, and the
    tool-call rate of a tool-using episode."""
    rows = RunDir(run_dir).stats_rows()
    evals = read_jsonl(run_dir / "eval.jsonl")
    if not rows and not evals:
        return None
    import matplotlib

    matplotlib.use("Agg")  # no display on cluster nodes
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in rows]
    # boba's reward is 1/0 on the answer, so its mean is the training accuracy.
    acc = [r.get("rollout/accuracy", r["rollout/reward_mean"]) for r in rows]
    ax.plot(steps, acc, lw=0.6, alpha=0.4, color="C0", label="train accuracy (= reward mean)")
    w = 10
    if len(acc) >= w:
        smooth = [sum(acc[i - w + 1:i + 1]) / w for i in range(w - 1, len(acc))]
        ax.plot(steps[w - 1:], smooth, color="C0", label=f"train accuracy, {w}-step mean")
    if evals:
        ax.plot([e["step"] for e in evals], [e["eval/accuracy"] for e in evals], "o-", color="C2",
                label="held-out accuracy")
    calls = [(r["step"], r["rollout/tool_call_rate"]) for r in rows if "rollout/tool_call_rate" in r]
    if calls:  # a multi-turn episode with a tool (rollout/episodes/tool_use.py)
        ax.plot(*zip(*calls), lw=1.0, color="C1", label="tool-call rate (samples with a call)")
    ax.set_xlabel("PPO step")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(run_dir.name)
    path = run_dir / "curves.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def trajectory(rows: list[dict], evals: list[dict] = (), every: int = 25) -> str:
    """A run's course per ``every`` steps, to read an instability from: mean training reward,
    response length and share cut without EOS, entropy, the largest grad norm and
    server-trainer logprob gap (drift), and the held-out evals in the span."""
    held = {e["step"]: e["eval/accuracy"] for e in evals}
    out = [f"held-out at step 0: {held[0]:.3f}"] if 0 in held else []
    out.append("steps | reward | len | no-EOS | entropy | grad max | drift max | held-out")
    for i in range(0, len(rows), every):
        part = rows[i:i + every]

        def mean(key, part=part):
            return sum(r[key] for r in part) / len(part)
        grad = max(max(g) if isinstance(g, list) else g for g in (r["train/grad_norm"] for r in part))
        drift = max(r.get("drift/gap_mean_abs", 0.0) for r in part)
        evals_here = [f"{held[s]:.3f}" for s in range(part[0]["step"], part[-1]["step"] + 1) if s in held]
        out.append(f"{part[0]['step']}-{part[-1]['step']} | {mean('rollout/reward_mean'):.3f} | "
                   f"{mean('rollout/response_len_mean'):.1f} | {mean('rollout/no_eos_ratio'):.3f} | "
                   f"{mean('train/entropy'):.3f} | {grad:.2f} | {drift:.1e} | {' '.join(evals_here)}")
    return "\n".join(out)
