"""The GPU check (bench/gpu_check.sh runs it under torchrun on one GPU): the default
training path, on the device. Writes one JSON (bench/results/gpu_check.json); every part
records its numbers and an ``ok`` flag, and a failing part does not stop the others.

The run uses configs/boba_1.5b.yaml's actor, PPO and weight-sync settings, with
``actor.layer_spec`` at its default ``auto``. The model is a random Qwen2 shaped like
DeepSeek-R1-Distill-Qwen-1.5B: the machine has no network and no checkpoint.

1. placement: ``bind_local_device`` from LOCAL_RANK. A CPU tensor is all-reduced over the
   NCCL world through ``collectives``. ``Dispatcher.dispatch`` and ``to_train_batch`` run on
   NCCL (world size 1: the shard lands on the GPU), then the allocator's NCCL agreement.
2. layer_spec: what ``auto`` picked (TE when it imports, else the local spec) and the
   reason the actor printed, checked against the attention module it built.
3. sft: two SFT steps on one batch built on the CPU, as ``train_sft`` builds it; the
   second loss must be lower.
4. ppo: the trainer's step (trainer/ppo.py): ``pack_rollout``, recomputed proximal
   logprobs, ``add_advantages``, then ``train_batch`` with ``ppo_loss``, boba's options and
   the entropy. The samples' rollout logprobs are the actor's own.
5. weight_push: the distributed syncer's gather and pack, bucket by bucket, and its
   broadcast over an update group to a receiving process. It joins the way the embedded
   server does (``join_group``, ``receive_flat``). NCCL when a second GPU exists; else gloo
   with the sender's CUDA tensors. The received bytes must equal ``hf_state_dict``'s.
6. speed: bf16 train steps on lognormal lengths; tokens/s and MFU (6N + 6Ld*s FLOPs a token).
7. attention: the local spec's ``CPUCoreAttention`` (THD, one segment attended as 4-D
   [1, H, S, D]) at 8k and 16k tokens. It records the forward+backward peak memory, and
   whether a fused SDPA kernel takes the input. The math fallback's S x S matrix would
   show as 4x the memory at 2x the tokens.
8. numerics: the fp32 actor vs transformers' Qwen2 on the CPU, same weights: logprobs
   within 1e-4, and ``hf_state_dict`` returns the loaded weights bitwise.
9. moe: a small Qwen3-MoE at EP=1 (TE's grouped GEMM under TE). The logprobs must match
   transformers within 1e-4, and one PPO step must train.
10. kernels: the Triton fused logprob (values, gradients) and packed GAE vs the torch
   path, with times and peak memory; bench/logprob_kernels.py's table as well, time allowing.

What only real CUDA does goes through ``Gpu``: the process group's backend, synchronize,
memory statistics, the device's name, and where the weight receiver runs.
tests/test_gpu_check.py runs everything else at tiny sizes on the emulated CUDA device of
tests/_fake_cuda.py, with its own ``Gpu``. The kernels there run through Triton's
interpreter.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import multiprocessing
import os
import time
import traceback
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from areal_mcore import collectives
from areal_mcore.devices import bind_local_device

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "gpu_check.json"
BOBA = ROOT / "configs" / "boba_1.5b.yaml"
MiB = 2**20


class Gpu:
    """What only real CUDA does. tests/test_gpu_check.py replaces it with an emulated one."""

    def init_process_group(self) -> None:
        dist.init_process_group("nccl")

    def describe(self) -> dict:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return {"gpu": props.name, "gpu_memory_GiB": props.total_memory / 2**30, "cuda": torch.version.cuda,
                "visible_gpus": torch.cuda.device_count()}

    def sync(self) -> None:
        torch.cuda.synchronize()

    def reset_peak(self) -> int:
        """Starts a peak measurement; returns the bytes allocated now."""
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def peak(self) -> int:
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    def free(self) -> None:
        torch.cuda.empty_cache()

    def peer_device(self) -> str:
        """Where the weight receiver runs. A second GPU takes NCCL (two ranks on one GPU
        are refused: "Duplicate GPU detected"). Otherwise the receiver shares this GPU, and
        the group is gloo, which stages CUDA tensors through the host."""
        return "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"


@dataclasses.dataclass
class Sizes:
    """Shapes and lengths; the defaults are the GPU run's (the test passes tiny ones)."""

    # DeepSeek-R1-Distill-Qwen-1.5B (boba's base model): its config.json
    hidden: int = 1536
    intermediate: int = 8960
    layers: int = 28
    heads: int = 12
    kv_heads: int = 2
    vocab: int = 151936
    max_len: int = 8192  # speed: the longest sequence
    seqs: int = 64  # speed: sequences a step
    steps: int = 4  # speed: train steps (the first is not timed)
    ppo_steps: int = 2
    attn_tokens: str = "8192,16384"
    moe_hidden: int = 256
    moe_layers: int = 4
    experts: int = 8
    moe_vocab: int = 1024
    kernel_tokens: int = 4096
    gae_seqs: int = 512
    gae_max_len: int = 8000

    def dense(self):
        from transformers import Qwen2Config

        return Qwen2Config(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
                           num_hidden_layers=self.layers, num_attention_heads=self.heads,
                           num_key_value_heads=self.kv_heads, max_position_embeddings=max(self.max_len, 4096),
                           tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-6,
                           use_sliding_window=False)

    def moe(self):
        from transformers import Qwen3MoeConfig

        # Qwen3-30B-A3B's layout, shrunk: top-2 of 8 renormalised, and one dense layer
        # (mlp_only_layers) so the adapter's dense/MoE mix is on the path too.
        return Qwen3MoeConfig(vocab_size=self.moe_vocab, hidden_size=self.moe_hidden,
                              intermediate_size=2 * self.moe_hidden, moe_intermediate_size=self.moe_hidden // 2,
                              num_hidden_layers=self.moe_layers, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=self.moe_hidden // 4, num_experts=self.experts, num_experts_per_tok=2,
                              norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1,
                              max_position_embeddings=4096, tie_word_embeddings=False, rope_theta=10000.0,
                              rms_norm_eps=1e-6, use_sliding_window=False)


def boba(overrides: list[str]):
    """configs/boba_1.5b.yaml with groups of 4 (the check's batches are small)."""
    from areal_mcore.config import load_config

    return load_config(BOBA, ["rollout.n_samples=4", "ppo.reward_norm.group_size=4", *overrides])


def build_actor(cfg, hf_config, **actor_overrides):
    from areal_mcore.actor.megatron_actor import MegatronActor

    actor_cfg = dataclasses.replace(cfg.actor, **actor_overrides)
    return MegatronActor(actor_cfg, hf_config, seed=cfg.seed, total_optimizer_steps=100)


def random_samples(n: int, vocab: int, *, prompt: int, response: int, seed: int = 0) -> list:
    """``n`` rollout samples in groups of 4, rewards 0/1 within each group."""
    from areal_mcore.rollout.trajectory import Sample

    rng = np.random.default_rng(seed)
    return [Sample(group=i // 4, prompt_ids=rng.integers(0, vocab, prompt).tolist(),
                   output_ids=rng.integers(0, vocab, response).tolist(), logprobs=(-rng.random(response)).tolist(),
                   versions=[0] * response, reward=float(i % 2), finish_reason="stop", start_version=0)
            for i in range(n)]


def check_placement(device: torch.device, cfg) -> dict:
    from areal_mcore.packing import allocate_micro_batches_synced
    from areal_mcore.trainer.batch import to_train_batch
    from areal_mcore.trainer.dispatch import Dispatcher

    world = dist.group.WORLD
    host = torch.tensor([2.0, 3.0])
    collectives.all_reduce(host, world)  # NCCL has no CPU backend: moved to the GPU and back
    samples = random_samples(8, 1000, prompt=20, response=12)
    d = Dispatcher(dp_rank=0, dp_size=1, mp_group=None, world=world, control=dist.new_group(backend="gloo"))
    shard, _ = d.dispatch(samples, 4)
    batch = to_train_batch(shard, cfg.ppo, dp_group=world)
    bins = allocate_micro_batches_synced(batch.seqlens_padded, 64, group=world)
    out = {"bound_device": str(device), "current_device": torch.cuda.current_device(),
           "host_tensor_after_all_reduce": [host.tolist(), str(host.device)],
           "shard_device": str(shard.tokens.device), "batch_devices": sorted({str(v.device) for v in batch.fields.values()}),
           "micro_batches": len(bins)}
    out["ok"] = (out["current_device"] == int(os.environ.get("LOCAL_RANK", 0)) and out["shard_device"].startswith("cuda")
                 and out["batch_devices"] == [str(shard.tokens.device)] and host.device.type == "cpu"
                 and host.tolist() == [2.0, 3.0])
    return out


def check_layer_spec(actor) -> dict:
    """``auto`` takes TE where it imports (with CUDA), else the local spec, and the actor
    prints why (accel.fallbacks). The attention module it built must say the same."""
    from areal_mcore import accel

    found = accel.detect()
    layer = actor.model.module.decoder.layers[0]
    core = type(layer.self_attention.core_attention).__name__
    out = {"transformer_engine": found.transformer_engine, "apex": found.apex,
           "wgrad_fusion": found.wgrad_fusion, "layer_spec": actor.cfg.layer_spec,
           "reason": accel.fallbacks(found), "core_attention": core,
           "param_device": str(next(actor.model.module.parameters()).device)}
    picked_te = core.startswith("TE")
    out["ok"] = (out["param_device"].startswith("cuda") and picked_te == found.transformer_engine
                 and (picked_te or "TransformerEngine" in (out["reason"] or "")))
    return out


def check_sft(actor, gpu: Gpu, vocab: int) -> dict:
    """Two steps on the same CPU-built batch: the actor moves it, and the loss must drop."""
    from areal_mcore.trainer.sft import sft_batch, sft_loss

    rng = np.random.default_rng(1)
    pairs = [(rng.integers(0, vocab, 24).tolist(), rng.integers(0, vocab, n).tolist()) for n in (40, 17, 63, 8)]
    batch = sft_batch(pairs)
    base = gpu.reset_peak()
    losses = [actor.train_batch(batch, sft_loss)["loss"][0] for _ in range(2)]
    return {"batch_device": str(batch.input_ids.device), "losses": losses,
            "peak_MiB": (gpu.peak() - base) / MiB,
            "ok": batch.input_ids.device.type == "cpu" and all(map(math.isfinite, losses)) and losses[1] < losses[0]}


def check_ppo(actor, cfg, gpu: Gpu, vocab: int, steps: int) -> dict:
    """trainer/ppo.py's train step on samples whose rollout logprobs are the actor's own
    (a server serving the same weights), so the decoupled loss keeps every token. The
    samples reach the batch through the trainer's dispatcher, as a shard on the device."""
    from areal_mcore.algo import reduce_ppo_stats
    from areal_mcore.packing import pack
    from areal_mcore.trainer.batch import add_advantages, pack_rollout
    from areal_mcore.trainer.dispatch import Dispatcher
    from areal_mcore.trainer.ppo import ppo_loss

    ppo, temperature, g = cfg.ppo, cfg.rollout.temperature, actor.groups
    dispatcher = Dispatcher(dp_rank=g.dp_rank, dp_size=g.dp_size, mp_group=g.mp, world=dist.group.WORLD,
                            control=dist.new_group(backend="gloo"))
    samples = random_samples(8, vocab, prompt=32, response=48, seed=2)
    own = actor.compute_logprobs(pack([torch.tensor(s.prompt_ids + s.output_ids) for s in samples]),
                                 temperature=temperature).cpu()
    at = 0
    for s in samples:
        start = at + len(s.prompt_ids)
        s.logprobs = own[start:start + len(s.output_ids)].tolist()
        at += len(s.prompt_ids) + len(s.output_ids)
    shard, _ = dispatcher.dispatch(samples, cfg.rollout.n_samples)
    base = gpu.reset_peak()
    done = []
    for step in range(steps):
        batch, rewards_B = pack_rollout(shard, ppo, dp_group=g.dp)
        batch.fields["prox"] = actor.compute_logprobs(batch, temperature=temperature)
        f = batch.fields
        gap = float(((f["prox"] - f["behave"]).abs() * f["loss_mask"]).max())  # behave is 0 on prompts
        add_advantages(batch, rewards_B, ppo, dp_group=g.dp)
        stats = actor.train_batch(batch, partial(ppo_loss, ppo, step), ppo.ppo_n_minibatches,
                                  reduce_stats=reduce_ppo_stats, temperature=temperature, step=step + 1,
                                  entropy=True)
        done.append({"loss": stats["loss"], "grad_norm": stats["grad_norm"], "behave_prox_gap": gap})
    after = actor.compute_logprobs(batch, temperature=temperature).cpu()
    moved = float((after - batch.fields["prox"].cpu()).abs().max())
    finite = all(math.isfinite(x) for s in done for x in s["loss"] + s["grad_norm"])
    # The first step's proximal logprobs are the rollout's up to micro-batching: a gap here
    # would be the trainer disagreeing with itself.
    return {"steps": done, "logprob_change": moved, "peak_MiB": (gpu.peak() - base) / MiB,
            "ok": finite and moved > 0 and done[0]["behave_prox_gap"] < 0.1}


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def _receive(port: int, name: str, backend: str, device: str, buckets: list, queue) -> None:
    """The receiving end of a push, in its own process: joins as the embedded server does
    (SGLang's recipe) and takes every flattened bucket; puts {name: sha256} on ``queue``."""
    try:
        from areal_mcore.rollout.embedded.server import join_group
        from areal_mcore.rollout.weights import ReusableBuffer, receive_flat

        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        group = join_group(master_address="127.0.0.1", master_port=port, rank=1, world_size=2,
                           group_name=name, backend=backend, timeout_s=60)
        buffer, got = ReusableBuffer(device), {}
        for names, dtypes, shapes in buckets:
            got.update((n, _digest(t)) for n, t in receive_flat(group, buffer, names, dtypes, shapes))
        dist.destroy_process_group(group)
        queue.put(got)
    except BaseException:  # noqa: BLE001 - reported to the sender, which fails the part
        queue.put(traceback.format_exc())


def check_weight_push(actor, cfg, gpu: Gpu) -> dict:
    """The distributed syncer's own gather, pack and broadcast of every bucket, against a
    receiving process (no server: its HTTP side runs in tests/test_weight_sync.py)."""
    from areal_mcore.net import free_port
    from areal_mcore.weight_sync import weight_syncer
    from areal_mcore.weight_sync.buckets import DTYPES
    from areal_mcore.weight_sync.syncer import SyncStats
    from areal_mcore.weight_sync.transport import open_group

    syncer = weight_syncer(cfg.weight_sync, actor, ["127.0.0.1:1"])  # its fleet is never started
    plan = syncer.plan()
    metas = [plan.bucket_meta(i) for i in range(len(plan.buckets))]
    buckets = [(names, [plan.dtype] * len(names), shapes) for names, shapes in metas]
    peer = gpu.peer_device()
    backend = "nccl" if peer.startswith("cuda") and torch.device(peer) != actor.device else "gloo"
    port, name = free_port(), "gpu_check_push"
    ctx = multiprocessing.get_context("spawn")  # a fresh process: CUDA does not survive fork
    queue = ctx.Queue()
    receiver = ctx.Process(target=_receive, args=(port, name, backend, peer, buckets, queue), daemon=True)
    receiver.start()
    stats, on_device = SyncStats(), True
    t0 = time.perf_counter()
    syncer._group = open_group("torch", master_address="127.0.0.1", master_port=port, world_size=2,
                               group_name=name, backend=backend, timeout_s=60)
    try:
        for i in range(len(plan.buckets)):
            payload = syncer._gather(plan, i, stats)
            on_device &= all(t.device == actor.device for t in payload)
            syncer._broadcast(payload)
            stats.bytes += sum(t.numel() * t.element_size() for t in payload)
        got = queue.get(timeout=120)
    finally:
        syncer._close_local_group()
        receiver.join(timeout=30)
    seconds = time.perf_counter() - t0
    if isinstance(got, str):
        raise RuntimeError(f"the receiver failed:\n{got}")
    sent = {n: _digest(t.to(DTYPES[plan.dtype])) for n, t in actor.hf_state_dict().items()}
    differ = sorted(n for n in sent if got.get(n) != sent[n])
    return {"backend": backend, "receiver_device": peer, "buckets": len(plan.buckets), "bytes": stats.bytes,
            "seconds": seconds, "GB_per_s": stats.bytes / seconds / 1e9, "payload_on_device": on_device,
            "tensors": len(got), "differ": differ[:8], "missing": sorted(set(sent) - set(got))[:8],
            "ok": on_device and set(got) == set(sent) and not differ}


def check_speed(actor, sizes: Sizes, gpu: Gpu, peak_tflops: float) -> dict:
    from areal_mcore.packing import pack
    from areal_mcore.trainer.sft import sft_loss

    hf = actor.hf_config
    n_params = sum(p.numel() for p in actor.model.module.parameters())
    rng = np.random.default_rng(0)
    times, tokens, lens_all = [], 0, []
    base = gpu.reset_peak()
    for step in range(sizes.steps):
        lens = np.clip(rng.lognormal(np.log(sizes.max_len / 6), 1.0, sizes.seqs), 8, sizes.max_len).astype(int)
        batch = pack([torch.randint(0, hf.vocab_size, (int(n),)) for n in lens],
                     {"loss_mask": [torch.ones(int(n)) for n in lens]})
        gpu.sync()
        t0 = time.perf_counter()
        actor.train_batch(batch, sft_loss, n_minibatches=1)
        gpu.sync()
        if step:  # the first step pays for allocation and kernel selection
            times.append(time.perf_counter() - t0)
            tokens += int(lens.sum())
            lens_all += lens.tolist()
    tps = tokens / sum(times)
    L, d = hf.num_hidden_layers, hf.hidden_size
    flops_per_token = 6 * n_params + 6 * L * d * float(np.mean(lens_all))
    return {"params_B": n_params / 1e9, "tokens_per_s": tps, "mfu": tps * flops_per_token / (peak_tflops * 1e12),
            "peak_tflops_assumed": peak_tflops, "peak_mem_GiB": (gpu.peak() - base) / 2**30,
            "steps_timed": len(times), "ok": tps > 0}


def check_attention(device: torch.device, sizes: Sizes, gpu: Gpu) -> dict:
    """The local spec's core attention on one packed segment of S tokens (bf16, forward and
    backward). A fused SDPA kernel keeps memory linear in S; the math fallback would hold
    fp32 [Hq, S, S] scores (16 GiB at 16k tokens and 12 heads)."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.transformer_config import TransformerConfig
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from areal_mcore.model.attention import CPUCoreAttention

    hq, hkv, d = sizes.heads, sizes.kv_heads, sizes.hidden // sizes.heads
    config = TransformerConfig(num_layers=1, hidden_size=hq * d, num_attention_heads=hq, num_query_groups=hkv,
                               kv_channels=d, attention_dropout=0.0)
    attention = CPUCoreAttention(config, layer_number=1, attn_mask_type=None, attention_type="self")
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    out = {}
    for S in map(int, sizes.attn_tokens.split(",")):
        q = torch.randn(S, hq, d, device=device, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(S, hkv, d, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        cu = torch.tensor([0, S], dtype=torch.int32, device=device)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=S, max_seqlen_kv=S)
        base = gpu.reset_peak()
        attention(q, k, v, None, packed_seq_params=params).float().square().mean().backward()
        row = {"peak_MiB": (gpu.peak() - base) / MiB, "math_scores_MiB": hq * S * S * 4 / MiB}
        try:  # only fused kernels: raises "No available kernel" when none takes the input
            with sdpa_kernel(fused):
                attention(q, k, v, None, packed_seq_params=params).sum().backward()
            row["fused_kernel"] = True
        except RuntimeError as e:  # no fused kernel: the actor's attention is the math one
            row["fused_kernel"], row["fused_error"] = False, str(e)[:300]
        row["ok"] = row["fused_kernel"] and row["peak_MiB"] < row["math_scores_MiB"] / 4
        out[f"{S}_tokens"] = row
        del q, k, v
    out["ok"] = all(r["ok"] for r in out.values())
    return out


def _hf_model(config, seed: int):
    """A seeded random transformers model in fp32 on the CPU, and its state dict under the
    names of HF checkpoint files (transformers >= 5 keeps MoE experts stacked in memory and
    unstacks them on save: core_model_loading.revert_weight_conversion)."""
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:  # HF inits them to 0 and 1: a mapping
                p.add_(torch.randn_like(p) * 0.1)  # mistake would not show
            if name.endswith("mlp.gate.weight"):
                # Router logits far above rounding, so megatron and HF pick the same experts.
                p.normal_(0.0, 0.3)
    state = {k: v.detach().clone() for k, v in revert_weight_conversion(model, model.state_dict()).items()}
    return model, state


def _hf_logprobs(model, seqs: list[torch.Tensor]) -> torch.Tensor:
    """transformers' logprob of each token given the ones before (0 at a sequence's start)."""
    out = []
    with torch.no_grad():
        for s in seqs:
            logp = model(s[None]).logits[0].float().log_softmax(-1)
            out.append(torch.cat([torch.zeros(1), logp[:-1].gather(-1, s[1:, None]).squeeze(1)]))
    return torch.cat(out)


def _matches_transformers(cfg, hf_config, gpu: Gpu, lengths, **actor_overrides) -> tuple[dict, object]:
    """An fp32 actor loaded with a random transformers model's weights: its packed logprobs
    vs transformers' per sequence on the CPU, and its HF export vs what it loaded."""
    from areal_mcore.packing import pack

    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 means fp32
    try:
        model, state = _hf_model(hf_config, seed=3)
        actor = build_actor(cfg, hf_config, dtype="float32", **actor_overrides)
        actor.load_hf_state_dict(state)
        g = torch.Generator().manual_seed(0)
        seqs = [torch.randint(0, hf_config.vocab_size, (n,), generator=g) for n in lengths]
        got = actor.compute_logprobs(pack(seqs)).cpu()
        exported = actor.hf_state_dict()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    err = float((got - _hf_logprobs(model, seqs)).abs().max())
    same = sorted(state) == sorted(exported) and all(torch.equal(exported[k].cpu(), v) for k, v in state.items())
    out = {"tokens": int(sum(lengths)), "max_abs_diff": err, "tolerance": 1e-4, "export_bitwise": same,
           "ok": err <= 1e-4 and same}
    del model
    return out, actor


def check_numerics(cfg, sizes: Sizes, gpu: Gpu) -> dict:
    out, actor = _matches_transformers(cfg, sizes.dense(), gpu, (48, 80))
    del actor
    gpu.free()
    return out


def check_moe(cfg, sizes: Sizes, gpu: Gpu) -> dict:
    """EP=1 on one GPU: megatron's MoE layer (router, token dispatcher, experts) against
    transformers' Qwen3-MoE, then one PPO step."""
    from areal_mcore.actor.config import ParallelConfig

    # Without recompute (boba_1.5b's dense recipe recomputes; the other parts run it): the
    # tests' emulated device (tests/_fake_cuda.py) loses the router weight's placement in
    # megatron's full-recompute forward (router.py, gating, then asks the real
    # torch.cuda.current_device), so this part would check the emulation, not the layer.
    out, actor = _matches_transformers(cfg, sizes.moe(), gpu, (40, 24, 56),
                                       parallel=ParallelConfig(tp=1, pp=1, ep=1), recompute=False)
    mlp = actor.model.module.decoder.layers[0].mlp
    out["experts_module"] = type(mlp.experts).__name__
    out["ppo"] = check_ppo(actor, cfg, gpu, sizes.moe_vocab, steps=1)
    out["ok"] = out["ok"] and out["ppo"]["ok"]
    del actor
    gpu.free()
    return out


def _timed(gpu: Gpu, fn, repeats=5):
    base = gpu.reset_peak()
    best, out = float("inf"), None
    for _ in range(repeats):
        gpu.sync()
        t = time.perf_counter()
        out = fn()
        gpu.sync()
        best = min(best, time.perf_counter() - t)
    return out, best * 1e3, (gpu.peak() - base) / MiB


def check_kernels(device: torch.device, sizes: Sizes, gpu: Gpu) -> dict:
    from areal_mcore.algo.gae import gae_packed
    from areal_mcore.kernels.logprob import logprob_entropy_torch, logprob_entropy_triton

    torch.manual_seed(0)
    T, V = sizes.kernel_tokens, sizes.vocab
    logits = (torch.randn(T, V, device=device) * 2).bfloat16().requires_grad_(True)
    targets = torch.randint(0, V, (T,), device=device)
    w = torch.randn(T, device=device)
    res = {}
    for name, fn in (("torch", logprob_entropy_torch), ("triton", logprob_entropy_triton)):
        def run(fn=fn):
            logits.grad = None
            logp, ent = fn(logits, targets, vocab_size=V)
            ((logp * w).sum() + ent.sum()).backward()
            return logp.detach(), ent.detach(), logits.grad.float()
        out, ms, mib = _timed(gpu, run)
        res[name] = {"out": out, "ms": ms, "peak_MiB": mib}
    t, k = res["torch"]["out"], res["triton"]["out"]
    logprob = {"T": T, "V": V, "logp_max_diff": float((t[0] - k[0]).abs().max()),
               "entropy_max_diff": float((t[1] - k[1]).abs().max()),
               "grad_max_diff": float((t[2] - k[2]).abs().max()), "grad_max": float(t[2].abs().max()),
               **{f"{n}_fwd_bwd_ms": res[n]["ms"] for n in res}, **{f"{n}_peak_MiB": res[n]["peak_MiB"] for n in res}}
    # The gradient is bf16 (the logits'): two roundings apart at most, 2^-7 of its largest entry.
    logprob["ok"] = logprob["logp_max_diff"] < 1e-3 and logprob["grad_max_diff"] <= 2**-7 * logprob["grad_max"]
    n = sizes.gae_seqs
    lens = torch.randint(sizes.gae_max_len // 80 + 1, sizes.gae_max_len, (n,), device=device)
    cu = torch.zeros(n + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(lens, 0)
    rewards = torch.randn(n, device=device)
    mask = torch.rand(int(cu[-1]), device=device) > 0.2
    gae, outs = {"tokens": int(cu[-1])}, {}
    for name in ("torch", "triton"):
        (adv, _), ms, mib = _timed(gpu, lambda name=name: gae_packed(rewards, cu, gamma=1.0, lam=1.0,
                                                                      loss_mask_T=mask, kernel=name))
        outs[name], gae[f"{name}_ms"], gae[f"{name}_peak_MiB"] = adv, ms, mib
    gae["adv_max_diff"] = float((outs["torch"] - outs["triton"]).abs().max())
    gae["ok"] = gae["adv_max_diff"] < 1e-4
    return {"logprob": logprob, "gae": gae, "ok": logprob["ok"] and gae["ok"]}


def kernels_table(out: Path):
    """bench/logprob_kernels.py's full table (fused vs log_softmax, at boba's shapes)."""
    try:
        from bench import logprob_kernels as kbench
        return kbench.main(out=out)
    except Exception:  # noqa: BLE001 - an optional extra
        return {"error": traceback.format_exc()[-2000:]}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f in dataclasses.fields(Sizes):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="an override of configs/boba_1.5b.yaml (areal_mcore.config syntax)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak (H100/H200 SXM: 989)")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--table-after-s", type=float, default=240.0,
                   help="run bench/logprob_kernels.py's table only if the checks took less than this")
    return p.parse_args(argv)


def main(argv: list[str] | None = None, gpu: Gpu | None = None) -> int:
    a = parse(argv)
    gpu = gpu or Gpu()
    sizes = Sizes(**{f.name: getattr(a, f.name) for f in dataclasses.fields(Sizes)})
    started = time.perf_counter()
    device = bind_local_device()  # before NCCL and megatron touch CUDA
    gpu.init_process_group()
    report = {**gpu.describe(), "torch": torch.__version__, "sizes": dataclasses.asdict(sizes), "overrides": a.set}
    try:
        import megatron.core
        import triton
        report.update(megatron_core=megatron.core.__version__, triton=triton.__version__)
    except Exception as e:  # noqa: BLE001 - recorded, the parts fail on their own
        report["import_error"] = repr(e)
    cfg = boba(a.set)
    held = {}

    def actor():  # the bf16 actor of the default path, built once for the parts that train it
        if "actor" not in held:
            held["actor"] = build_actor(cfg, sizes.dense())
        return held["actor"]

    def attention():  # the bf16 actor is done with: its memory would blur the peaks
        held.clear()
        gpu.free()
        return check_attention(device, sizes, gpu)

    parts = {"placement": lambda: check_placement(device, cfg), "layer_spec": lambda: check_layer_spec(actor()),
             "sft": lambda: check_sft(actor(), gpu, sizes.vocab),
             "ppo": lambda: check_ppo(actor(), cfg, gpu, sizes.vocab, sizes.ppo_steps),
             "weight_push": lambda: check_weight_push(actor(), cfg, gpu),
             "speed": lambda: check_speed(actor(), sizes, gpu, a.peak_tflops),
             "attention": attention,
             "numerics": lambda: check_numerics(cfg, sizes, gpu), "moe": lambda: check_moe(cfg, sizes, gpu),
             "kernels": lambda: check_kernels(device, sizes, gpu)}
    for name, fn in parts.items():
        t = time.perf_counter()
        try:
            report[name] = fn()
        except Exception:  # noqa: BLE001 - one part's failure is recorded, the others still run
            report[name] = {"ok": False, "error": traceback.format_exc()[-3000:]}
        report[name]["wall_s"] = time.perf_counter() - t
        print(f"[gpu_check] {name}: {json.dumps(report[name], default=str)[:600]}", flush=True)
    if time.perf_counter() - started < a.table_after_s:  # time allowing
        report["kernels_table"] = kernels_table(Path(a.out).parent / "kernels_gpu.json")
    report["ok"] = all(report[n].get("ok") for n in parts)
    report["wall_s"] = time.perf_counter() - started
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1, default=str))
    print(f"[gpu_check] {'PASS' if report['ok'] else 'FAIL'}; wrote {a.out}", flush=True)
    dist.destroy_process_group()
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
