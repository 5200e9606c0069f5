"""bench/gpu_check.py's Python part, on the emulated CUDA device (tests/_fake_cuda.py).

The GPU check runs once on a real GPU (bench/gpu_check.sh). Here ``main`` runs in a
process of its own, started as torchrun would start it (LOCAL_RANK, env:// rendezvous), at
tiny sizes. Every part runs on the emulated device:

- the bf16 actor of boba's config with ``layer_spec=auto`` (the local spec here: no TE);
- SFT and PPO steps;
- the weight push to a receiving process;
- the attention;
- the fp32 and MoE actors against transformers;
- the Triton kernels, through Triton's interpreter (conftest sets TRITON_INTERPRET; the
  actor's own logprob and GAE use torch, for speed).

The world group refuses CPU tensors as NCCL does; megatron's own subgroups are plain gloo.
``EmulatedGpu`` stands in for gpu_check's ``Gpu``, i.e. for what only real CUDA does:
- the NCCL group;
- synchronize;
- memory statistics;
- the device's name;
- the receiver's device (the CPU: a spawned process has no emulated device).

The child traces which lines of gpu_check.py run. Every line must run here except those
listed in ``NOT_HERE_FUNCTIONS`` and ``NOT_HERE_LINES``, each with its reason.
Cost: about 20 s in the check's process, plus the start of the test ranks' forkserver
(tests/_dist.py) if no earlier test in the worker started it (~60 s on 2 busy cores).
"""
from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
import time

import pytest
import torch
from _dist import rank_context

from areal_mcore.net import free_port

TINY = ["--hidden", "64", "--intermediate", "96", "--layers", "2", "--heads", "4", "--kv-heads", "2",
        "--vocab", "256", "--max-len", "48", "--seqs", "4", "--steps", "2", "--ppo-steps", "2",
        "--attn-tokens", "32,64", "--moe-hidden", "64", "--moe-layers", "2", "--experts", "4",
        "--moe-vocab", "256", "--kernel-tokens", "16", "--gae-seqs", "4", "--gae-max-len", "40",
        "--set", "actor.mb_spec.max_tokens_per_mb=128",  # several micro-batches
        "--set", "weight_sync.bucket_mb=0.05",  # several buckets (the model is ~0.5 MB in bf16)
        # The actor's fused logprob and GAE on torch: Triton's interpreter is ~1000x slower,
        # and the kernels part runs both kernels through it (against torch) anyway.
        "--set", "actor.logprob_kernel=torch", "--set", "ppo.gae_kernel=torch",
        "--table-after-s", "0"]

# What of gpu_check.py does not run here, and why: functions (all their lines), and lines
# (matched on the start of their text).
NOT_HERE_FUNCTIONS = {
    "Gpu": "real CUDA only: replaced by EmulatedGpu",
    "_receive": "runs in the receiving process, which is not traced",
    "kernels_table": "bench/logprob_kernels.py's table measures CUDA memory: real CUDA only (--table-after-s 0 here)",
}
NOT_HERE_LINES = {
    'report["kernels_table"] = kernels_table(': "its call (--table-after-s 0 here)",
    "except Exception as e:  # noqa: BLE001 - recorded": "megatron and triton import here",
    'report["import_error"] = repr(e)': "the same",
    "except Exception:  # noqa: BLE001 - one part's": "every part passes here (the test asserts it)",
    'report[name] = {"ok": False, "error":': "the same",
    'raise RuntimeError(f"the receiver failed': "the receiver succeeds here",
    "except RuntimeError as e:  # no fused kernel": "the CPU's flash kernel takes the input",
    'row["fused_kernel"], row["fused_error"] = False': "the same",
}


def _emulate_cuda() -> None:
    """This process's torch reports one CUDA device, which FakeCuda emulates.

    megatron-core's CPU shims are applied first, while CUDA is still absent (the RNG tracker,
    synchronize, the optimizers' type-name checks). Their redirection of hard-coded
    ``device="cuda"`` factories to the CPU is taken back, since FakeCuda places those itself,
    on the emulated device; their CPU streams stay."""
    from areal_mcore.model import cpu_shims

    assert cpu_shims.apply_cpu_shims()

    class Streams(cpu_shims._CPUTorch):
        _FACTORIES = ()
    # moe_utils too: maybe_move_tensor_to_cpu records the current stream for a tensor that
    # says is_cuda, as the emulated device's do (megatron/core/transformer/moe/moe_utils.py).
    for name in cpu_shims._HARD_CODED_CUDA + cpu_shims._CUDA_STREAMS + ("megatron.core.transformer.moe.moe_utils",):
        importlib.import_module(name).torch = Streams()
    torch.Tensor.record_stream = lambda self, stream: None  # the caching allocator's: none here
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.set_device = lambda device: None
    # torch.compile'd megatron functions (the MoE router's) run eagerly: dynamo would save
    # the CUDA RNG state it now believes in, and trace through FakeCuda's mode.
    torch._dynamo.config.disable = True


def _trace_lines(path: str, seen: set[int]):
    def local(frame, event, arg):
        if event == "line":
            seen.add(frame.f_lineno)
        return local

    def on_call(frame, event, arg):
        return local if frame.f_code.co_filename == path else None
    return on_call


def _child(argv: list[str], port: int, lines_out: str) -> None:
    started = time.monotonic()
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist
    from _fake_cuda import FakeCuda, nccl_like

    from bench import gpu_check

    _emulate_cuda()

    class EmulatedGpu(gpu_check.Gpu):
        def init_process_group(self):
            dist.init_process_group("gloo")  # env://, as under torchrun
            self.world_log = nccl_like(setattr, dist.group.WORLD)

        def describe(self):
            return {"gpu": "emulated (tests/_fake_cuda.py)"}

        def sync(self):
            pass

        def reset_peak(self):
            return 0

        def peak(self):
            return 0

        def free(self):
            pass

        def peer_device(self):
            return "cpu"

    seen: set[int] = set()
    tracer = _trace_lines(gpu_check.__file__, seen)
    gpu = EmulatedGpu()
    sys.settrace(tracer)  # gpu_check runs nothing on threads of its own
    try:
        with FakeCuda():
            gpu_check.main(argv, gpu)
    finally:
        sys.settrace(None)
    with open(lines_out, "w") as f:
        json.dump({"lines": sorted(seen), "world_collectives": gpu.world_log,
                   "child_s": time.monotonic() - started}, f)


def _executable_lines(module) -> dict[int, str]:
    """Line -> text of each line of code in the module's functions, outside
    ``NOT_HERE_FUNCTIONS`` (the module's own lines ran at import, before the trace)."""
    source = inspect.getsource(module).splitlines()
    skip = set()
    for obj in map(module.__dict__.get, NOT_HERE_FUNCTIONS):
        lines, start = inspect.getsourcelines(obj)
        skip |= set(range(start, start + len(lines)))
    found: set[int] = set()

    def walk(code):
        if code.co_flags & inspect.CO_NEWLOCALS:  # a function's body, not a class body (run at import)
            # (its first line is the def's, which the trace reports as a call, not a line)
            found.update(line for _, _, line in code.co_lines() if line not in (None, code.co_firstlineno))
        for c in code.co_consts:
            if inspect.iscode(c):
                walk(c)
    for c in compile("\n".join(source), module.__file__, "exec").co_consts:
        if inspect.iscode(c):
            walk(c)
    return {n: source[n - 1].strip() for n in sorted(found - skip) if source[n - 1].strip()}


# multirank: the weight push forms a gloo group of two processes (the check's and its receiver's).
@pytest.mark.multirank
def test_the_gpu_checks_python_part_runs_every_line_on_the_emulated_device(tmp_path):
    from bench import gpu_check

    out, lines_out = tmp_path / "gpu_check.json", tmp_path / "lines.json"
    ctx = rank_context()
    child = ctx.Process(target=_child, args=(TINY + ["--out", str(out)], free_port(), str(lines_out)))
    t0 = time.monotonic()
    child.start()
    child.join(timeout=400)
    if child.exitcode is None:
        child.kill()
    assert child.exitcode == 0, f"the check's process ended with {child.exitcode}"
    report = json.loads(out.read_text())
    failed = {k: v.get("error", v) for k, v in report.items() if isinstance(v, dict) and not v.get("ok", True)}
    assert report["ok"] and not failed, json.dumps(failed, indent=1, default=str)[:6000]
    traced = json.loads(lines_out.read_text())
    print(f"gpu_check on the emulated device: {time.monotonic() - t0:.0f} s, its process {traced['child_s']:.0f} s, "
          f"main {report['wall_s']:.0f} s: "
          + ", ".join(f"{k} {v['wall_s']:.1f} s" for k, v in report.items() if isinstance(v, dict) and "wall_s" in v))

    # What the parts saw: the device was the emulated GPU's throughout.
    assert report["placement"]["shard_device"] == "cuda:0" and report["placement"]["batch_devices"] == ["cuda:0"]
    assert report["placement"]["host_tensor_after_all_reduce"] == [[2.0, 3.0], "cpu"]
    assert report["layer_spec"]["core_attention"] == "CPUCoreAttention"  # no TE here: auto is local
    assert "TransformerEngine" in report["layer_spec"]["reason"]
    push = report["weight_push"]
    assert push["payload_on_device"] and push["backend"] == "gloo" and push["buckets"] > 1
    assert push["tensors"] == 2 * 12 + 3  # a layer's q/k/v weight and bias, o, 2 norms, 3 MLP; embed, norm, head
    assert report["moe"]["experts_module"] == "SequentialMLP"  # the local spec's (TE's: TEGroupedMLP)
    assert len(report["sft"]["losses"]) == 2 and len(report["ppo"]["steps"]) == 2

    assert "all_reduce" in traced["world_collectives"]  # the NCCL-like world saw the placement check's
    missed = {n: text for n, text in _executable_lines(gpu_check).items() if n not in traced["lines"]}
    allowed = {n: text for n, text in missed.items() if any(text.startswith(k) for k in NOT_HERE_LINES)}
    assert missed == allowed, f"lines of bench/gpu_check.py that do not run here: " \
                              f"{ {n: missed[n] for n in sorted(missed.keys() - allowed.keys())} }"
    assert len(allowed) == len(NOT_HERE_LINES), f"NOT_HERE_LINES lists lines that run here (or are gone): {allowed}"
