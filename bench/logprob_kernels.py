"""Fused logprob + entropy (kernels/logprob.py) vs ``log_softmax`` + gather: peak memory
and time.

Shape legend: T = tokens in a micro-batch, V = vocabulary (one TP rank holding all of it).

Logits are bf16 (the actor's training precision). Each method runs forward only (as in
``compute_logprobs``) and forward + backward of Σ g·logp (as in the PPO loss):
- ``log_softmax``: ``logits.float().log_softmax(-1).gather(...)``, the obvious baseline;
  it materialises fp32 ``[T, V]`` copies (and their gradients);
- ``fused-torch``: the chunked torch path (fp32 ``[1024, V]`` blocks), the CPU default;
- ``fused-triton`` (with CUDA): the Triton kernels, which stream over V.
The fused methods also return the entropy. Peak memory is what a method allocates on top
of the logits (the bf16 gradient included): CUDA's allocator peak on GPU, the process's
peak RSS (VmHWM, reset through /proc/self/clear_refs) on CPU. Ratios are against the
baseline measured in the same run; time is the best of ``repeats``. Shapes whose baseline
would not fit comfortably in free memory are skipped with the reason printed.
Run: ``python bench/logprob_kernels.py`` (about a minute on 2 CPU cores), ``--small`` for a toy
run; writes bench/results/kernels.json.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import re
import time
from pathlib import Path

import torch

from areal_mcore.kernels import use_triton
from areal_mcore.kernels.logprob import logprob_entropy

RESULTS = Path(__file__).parent / "results" / "kernels.json"
QWEN2_VOCAB = 151936
SHAPES = [(4096, 32768), (4096, QWEN2_VOCAB), (16384, 32768), (16384, QWEN2_VOCAB)]
SMALL_SHAPES = [(512, 4096), (2048, 8192)]  # the second spans two 1024-row chunks
# Bytes per logit the baseline allocates beyond the bf16 logits, with headroom over the
# 8 (fp32 copy + log_softmax output) and 12 (+ fp32 gradients, the bf16 one) measured on CPU.
BASELINE_BYTES = {"forward": 10, "forward+backward": 18}
MEMORY_BUDGET = 0.6  # of the free memory


def _baseline(logits_TV, targets_T):
    return logits_TV.float().log_softmax(-1).gather(-1, targets_T[:, None]).squeeze(1)


def _fused(kernel):
    def fn(logits_TV, targets_T):
        return logprob_entropy(logits_TV, targets_T, vocab_size=logits_TV.shape[-1],
                               kernel=kernel)[0]
    return fn


class _Peak:
    """Peak bytes allocated between start() and stop(), beyond what was held at start()."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if not self.cuda:
            # glibc serves blocks under its (adaptive, up to 32 MiB) mmap threshold from a
            # heap that keeps freed memory, so RSS would miss reused temporaries: mmap
            # every block from 64 KiB on, so each allocation shows in RSS and leaves it.
            ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD

    @staticmethod
    def _proc(key: str) -> int:
        with open("/proc/self/status") as f:
            return int(re.search(rf"{key}:\s+(\d+) kB", f.read()).group(1)) * 1024

    def start(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            self.base = self._proc("VmRSS")

    def stop(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return self._proc("VmHWM") - self.base


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info()[0]
    with open("/proc/meminfo") as f:
        return int(re.search(r"MemAvailable:\s+(\d+) kB", f.read()).group(1)) * 1024


def _measure(fn, logits_TV, targets_T, g_T, backward: bool, repeats: int, peak: _Peak):
    best, mem, out = float("inf"), 0, None
    for i in range(repeats + peak.cuda):  # on GPU one untimed first run (Triton compiles)
        x = logits_TV.detach().requires_grad_(backward)
        peak.start()
        t0 = time.perf_counter()
        with torch.set_grad_enabled(backward):
            logp_T = fn(x, targets_T)
            if backward:
                (g_T @ logp_T).backward()
        if peak.cuda:
            torch.cuda.synchronize()
        sec = time.perf_counter() - t0
        out = logp_T.detach()
        del x, logp_T
        if i >= peak.cuda:
            best, mem = min(best, sec), max(mem, peak.stop())
    return best, mem, out


def main(shapes=SHAPES, repeats: int | None = None, out: Path = RESULTS) -> list[dict]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    repeats = repeats or (5 if device.type == "cuda" else 2)
    methods = {"log_softmax": _baseline, "fused-torch": _fused("torch")}
    if use_triton("auto", "logprob_kernel"):
        methods["fused-triton"] = _fused("triton")
    peak = _Peak(device)
    rows = []
    print(f"device: {device}, logits bf16, best of {repeats}")
    print(f"{'T':>6} {'V':>7} {'mode':<17} {'method':<13} {'ms':>9} {'peak MiB':>9} "
          f"{'time/base':>9} {'mem/base':>9} {'max|Δlogp|':>10}")
    for T, V in shapes:
        fits = {}
        for mode in ("forward", "forward+backward"):
            # bf16 logits + what the baseline allocates on top of them
            need, free = T * V * (2 + BASELINE_BYTES[mode]), _free_bytes(device)
            fits[mode] = need <= MEMORY_BUDGET * free
            if not fits[mode]:
                print(f"{T:>6} {V:>7} {mode:<17} skipped: the baseline needs ~{need / 2**30:.1f} GiB "
                      f"with the logits, more than {MEMORY_BUDGET:.0%} of the "
                      f"{free / 2**30:.1f} GiB free")
        if not any(fits.values()):
            continue
        g = torch.Generator(device=device).manual_seed(0)
        logits_TV = torch.empty(T, V, dtype=torch.bfloat16, device=device).normal_(0, 3, generator=g)
        targets_T = torch.randint(0, V, (T,), generator=g, device=device)
        g_T = torch.randn(T, generator=g, device=device)
        for mode, backward in (("forward", False), ("forward+backward", True)):
            if not fits[mode]:
                continue
            base = None
            for name, fn in methods.items():
                sec, mem, logp_T = _measure(fn, logits_TV, targets_T, g_T, backward, repeats, peak)
                base = base or (sec, mem, logp_T)
                row = {"T": T, "V": V, "mode": mode, "method": name, "device": device.type,
                       "seconds": sec, "peak_bytes": mem, "time_ratio": sec / base[0],
                       "memory_ratio": mem / base[1] if base[1] else float("nan"),
                       "max_abs_diff": float((logp_T - base[2]).abs().max())}
                rows.append(row)
                print(f"{T:>6} {V:>7} {mode:<17} {name:<13} {sec * 1e3:>9.1f} {mem / 2**20:>9.0f} "
                      f"{row['time_ratio']:>9.2f} {row['memory_ratio']:>9.3f} "
                      f"{row['max_abs_diff']:>10.1e}")
        del logits_TV
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="toy shapes (seconds)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS)
    a = parser.parse_args()
    main(SMALL_SHAPES if a.small else SHAPES, a.repeats, a.out)
