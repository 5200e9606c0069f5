"""The GPU check (run by bench/gpu_check.sh under torchrun, one GPU): what the CPU suite
cannot show. Writes bench/results/gpu_check.json; every part records its numbers and a
pass flag, and a failing part does not stop the others.

1. placement: ``bind_local_device`` from LOCAL_RANK, a CPU tensor all-reduced over the NCCL
   world through ``collectives`` (moved to the GPU and back), ``Dispatcher.dispatch`` and
   ``to_train_batch`` on NCCL (world size 1: the shard lands on the GPU), the allocator's
   NCCL agreement;
2. actor numerics: a ~1B Qwen2 shape (local spec), fp32 logprobs on the GPU vs transformers'
   Qwen2 on the CPU with the same weights, max |diff| <= 1e-4;
3. actor speed: bf16 train steps, tokens/s and MFU (6N + 6Ld·s FLOPs a token);
4. kernels: Triton fused logprob (values, gradients) and packed GAE vs the torch path,
   times and peak memory (bench/kernels.py's table as well).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from areal_mcore import collectives
from areal_mcore.devices import bind_local_device

RESULTS = Path(__file__).resolve().parent / "results" / "gpu_check.json"


def _qwen2_1b(max_len: int):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                       num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=max_len,
                       tie_word_embeddings=True, rope_theta=1e6)


def _actor(hf, dtype: str, mb_tokens: int, steps: int = 1):
    from areal_mcore.actor.config import ActorConfig, MicroBatchSpec, OptimizerConfig
    from areal_mcore.actor.megatron_actor import MegatronActor

    cfg = ActorConfig(mb_spec=MicroBatchSpec(max_tokens_per_mb=mb_tokens), optimizer=OptimizerConfig(lr=1e-5, eps=1e-5),
                      dtype=dtype, layer_spec="local")
    return MegatronActor(cfg, hf, total_optimizer_steps=steps)


def check_placement(device: torch.device) -> dict:
    from areal_mcore.algo.config import NormConfig, PPOConfig
    from areal_mcore.packing import allocate_micro_batches_synced
    from areal_mcore.rollout.controller import Sample
    from areal_mcore.trainer.batch import to_train_batch
    from areal_mcore.trainer.dispatch import Dispatcher

    world = dist.group.WORLD
    host = torch.tensor([2.0, 3.0])
    collectives.all_reduce(host, world)  # NCCL has no CPU backend: moved to the GPU and back
    rng = np.random.default_rng(0)
    samples = [Sample(group=i // 4, prompt_ids=rng.integers(0, 1000, 20).tolist(),
                      output_ids=rng.integers(0, 1000, 12).tolist(), logprobs=(-rng.random(12)).tolist(),
                      versions=[0] * 12, reward=float(i % 2), finish_reason="stop", start_version=0)
               for i in range(8)]
    d = Dispatcher(dp_rank=0, dp_size=1, mp_group=None, world=world, control=dist.new_group(backend="gloo"))
    shard, _ = d.dispatch(samples, 4)
    ppo = PPOConfig(reward_norm=NormConfig(mean_level="group", std_level="group", group_size=4),
                    adv_norm=NormConfig(mean_level="batch", std_level="batch"))
    batch = to_train_batch(shard, ppo, dp_group=world)
    bins = allocate_micro_batches_synced(batch.seqlens_padded, 64, group=world)
    out = {"bound_device": str(device), "current_device": torch.cuda.current_device(),
           "host_tensor_after_all_reduce": [host.tolist(), str(host.device)],
           "shard_device": str(shard.tokens.device), "batch_devices": sorted({str(v.device) for v in batch.fields.values()}),
           "micro_batches": len(bins)}
    out["ok"] = (out["current_device"] == int(os.environ.get("LOCAL_RANK", 0)) and out["shard_device"].startswith("cuda")
                 and out["batch_devices"] == [str(shard.tokens.device)] and host.device.type == "cpu")
    return out


def check_numerics(max_len: int) -> dict:
    from transformers import Qwen2ForCausalLM

    from areal_mcore.packing import pack

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    hf = _qwen2_1b(max_len)
    actor = _actor(hf, "float32", mb_tokens=4096)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, hf.vocab_size, (n,), generator=g) for n in (48, 80)]
    got = actor.compute_logprobs(pack(seqs)).cpu()
    state = actor.hf_state_dict()
    del actor
    torch.cuda.empty_cache()
    ref = Qwen2ForCausalLM(hf).float().eval()
    missing, unexpected = ref.load_state_dict(state, strict=False)
    if set(missing) - {"lm_head.weight"} or unexpected:  # tied: lm_head is the embedding
        raise KeyError(f"HF export does not match Qwen2: missing {missing[:4]}, unexpected {unexpected[:4]}")
    expected = []
    with torch.no_grad():
        for s in seqs:
            logp = ref(s[None]).logits[0].float().log_softmax(-1)
            expected.append(torch.cat([torch.zeros(1), logp[:-1].gather(-1, s[1:, None]).squeeze(1)]))
    err = float((got - torch.cat(expected)).abs().max())
    return {"tokens": sum(len(s) for s in seqs), "max_abs_diff": err, "tolerance": 1e-4, "ok": err <= 1e-4}


def check_speed(steps: int, seqs: int, max_len: int, mb_tokens: int, peak_tflops: float) -> dict:
    from areal_mcore.packing import pack

    def nll(logprobs_T, mb, num_global_tokens, num_global_seqs):
        m = mb.fields["loss_mask"].to(logprobs_T.device)
        return -(logprobs_T * m).sum() / num_global_tokens, {}

    hf = _qwen2_1b(max_len)
    actor = _actor(hf, "bfloat16", mb_tokens=mb_tokens, steps=steps)
    n_params = sum(p.numel() for p in actor.model.module.parameters())
    rng = np.random.default_rng(0)
    times, tokens, lens_all = [], 0, []
    torch.cuda.reset_peak_memory_stats()
    for step in range(steps):
        lens = np.clip(rng.lognormal(np.log(max_len / 6), 1.0, seqs), 64, max_len).astype(int)
        batch = pack([torch.randint(0, hf.vocab_size, (int(n),)) for n in lens],
                     {"loss_mask": [torch.ones(int(n)) for n in lens]})
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        actor.train_batch(batch, nll, n_minibatches=1)
        torch.cuda.synchronize()
        if step:  # the first step pays for allocation and kernel selection
            times.append(time.perf_counter() - t0)
            tokens += int(lens.sum())
            lens_all += lens.tolist()
    tps = tokens / sum(times)
    L, d = hf.num_hidden_layers, hf.hidden_size
    flops_per_token = 6 * n_params + 6 * L * d * float(np.mean(lens_all))
    out = {"params_B": n_params / 1e9, "tokens_per_s": tps, "mfu": tps * flops_per_token / (peak_tflops * 1e12),
           "peak_tflops_assumed": peak_tflops, "peak_mem_GiB": torch.cuda.max_memory_allocated() / 2**30,
           "steps_timed": len(times)}
    del actor
    torch.cuda.empty_cache()
    out["ok"] = tps > 0
    return out


def _timed(fn, repeats=5):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return out, best * 1e3, (torch.cuda.max_memory_allocated() - base) / 2**20


def check_kernels() -> dict:
    from areal_mcore.algo.gae import gae_packed
    from areal_mcore.kernels.logprob import logprob_entropy_torch, logprob_entropy_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    T, V = 4096, 151936
    logits = (torch.randn(T, V, generator=g, device="cuda") * 2).bfloat16().requires_grad_(True)
    targets = torch.randint(0, V, (T,), generator=g, device="cuda")
    w = torch.randn(T, generator=g, device="cuda")
    res = {}
    for name, fn in (("torch", logprob_entropy_torch), ("triton", logprob_entropy_triton)):
        def run(fn=fn):
            logits.grad = None
            logp, ent = fn(logits, targets, vocab_size=V)
            ((logp * w).sum() + ent.sum()).backward()
            return logp.detach(), ent.detach(), logits.grad.float()
        out, ms, mib = _timed(run)
        res[name] = {"out": out, "ms": ms, "peak_MiB": mib}
    t, k = res["torch"]["out"], res["triton"]["out"]
    logprob = {"T": T, "V": V, "logp_max_diff": float((t[0] - k[0]).abs().max()),
               "entropy_max_diff": float((t[1] - k[1]).abs().max()),
               "grad_max_diff": float((t[2] - k[2]).abs().max()),
               **{f"{n}_fwd_bwd_ms": res[n]["ms"] for n in res}, **{f"{n}_peak_MiB": res[n]["peak_MiB"] for n in res}}
    logprob["ok"] = logprob["logp_max_diff"] < 1e-3 and logprob["grad_max_diff"] < 1e-3
    lens = torch.randint(100, 8000, (512,), generator=g, device="cuda")
    cu = torch.zeros(513, dtype=torch.int32, device="cuda")
    cu[1:] = torch.cumsum(lens, 0)
    rewards = torch.randn(512, generator=g, device="cuda")
    mask = torch.rand(int(cu[-1]), generator=g, device="cuda") > 0.2
    gae = {"tokens": int(cu[-1])}
    outs = {}
    for name in ("torch", "triton"):
        (adv, _), ms, mib = _timed(lambda name=name: gae_packed(rewards, cu, gamma=1.0, lam=1.0, loss_mask_T=mask,
                                                                 kernel=name))
        outs[name], gae[f"{name}_ms"], gae[f"{name}_peak_MiB"] = adv, ms, mib
    gae["adv_max_diff"] = float((outs["torch"] - outs["triton"]).abs().max())
    gae["ok"] = gae["adv_max_diff"] < 1e-4
    return {"logprob": logprob, "gae": gae, "ok": logprob["ok"] and gae["ok"]}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--max-len", type=int, default=8192)
    p.add_argument("--mb-tokens", type=int, default=16384)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak (H100/H200 SXM: 989)")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--table-after-s", type=float, default=240.0,
                   help="run bench/kernels.py's table only if the checks took less than this")
    a = p.parse_args()
    started = time.perf_counter()
    device = bind_local_device()  # before NCCL and megatron touch CUDA
    dist.init_process_group("nccl")
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cuda": torch.version.cuda}
    try:
        import megatron.core
        import triton
        report.update(megatron_core=megatron.core.__version__, triton=triton.__version__)
    except Exception as e:  # noqa: BLE001 - recorded, the parts fail on their own
        report["import_error"] = repr(e)
    parts = {"placement": lambda: check_placement(device), "kernels": check_kernels,
             "numerics": lambda: check_numerics(a.max_len),
             "speed": lambda: check_speed(a.steps, a.seqs, a.max_len, a.mb_tokens, a.peak_tflops)}
    for name, fn in parts.items():
        t = time.perf_counter()
        try:
            report[name] = fn()
        except Exception:  # noqa: BLE001 - one part's failure is recorded, the others still run
            report[name] = {"ok": False, "error": traceback.format_exc()[-3000:]}
        report[name]["wall_s"] = time.perf_counter() - t
        print(f"[gpu_check] {name}: {json.dumps(report[name])[:600]}", flush=True)
    if time.perf_counter() - started < a.table_after_s:  # bench/kernels.py's full table, time allowing
        try:
            from bench import kernels as kbench
            report["kernels_table"] = kbench.main(out=Path(a.out).parent / "kernels_gpu.json")
        except Exception:  # noqa: BLE001 - optional extra
            report["kernels_table"] = {"error": traceback.format_exc()[-2000:]}
    report["ok"] = all(report[n].get("ok") for n in parts)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1, default=str))
    print(f"[gpu_check] {'PASS' if report['ok'] else 'FAIL'}; wrote {a.out}", flush=True)
    dist.destroy_process_group()
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
