"""Uneven pipeline split (6 layers over PP=2 as 2 + 4, actor.parallel.first_stage_layers):
training equals PP=1, and the HF export and weight sync carry the right global layers."""

from __future__ import annotations

import pytest
import torch
from _actor_setup import VOCAB, ppo_loss, push_once, seqs, tiny_actor, train_fields
from _dist import run_gloo
from _rollout import embedded_servers, http
from _tiny_model import tiny_qwen2

from areal_mcore.packing import pack

pytestmark = [pytest.mark.multirank, pytest.mark.server]


def _worker(rank, world, pp, first, hf_dir, address):
    from areal_mcore.convert.save_hf import save_hf
    from areal_mcore.weight_sync import weight_syncer
    from areal_mcore.weight_sync.config import WeightSyncConfig

    actor = tiny_actor(pp=pp, cap=24, layers=6, first_stage_layers=first)
    n_local = len(actor.model.module.decoder.layers)
    s = seqs()
    logp = actor.compute_logprobs(pack(s))
    out = actor.train_batch(pack(s, train_fields(s)), ppo_loss, n_minibatches=2)
    save_hf(actor, hf_dir, max_shard_bytes=100_000)
    if address is not None:
        syncer = weight_syncer(WeightSyncConfig(bucket_mb=0.02, dtype="float32", master_address="127.0.0.1",
                                               timeout_s=60), actor, [address])
        push_once(syncer, 3)
    return {"loss": out["loss"], "grad_norm": out["grad_norm"], "logp": logp, "layers": n_local,
            "hf": {k: v.clone() for k, v in actor.hf_state_dict().items()}}


def test_uneven_split_2_plus_4_equals_pp1_and_exports_and_syncs_bitwise(tmp_path):
    from areal_mcore.convert.tools import load_hf_state_dict

    ref = run_gloo(_worker, 1, 1, None, str(tmp_path / "pp1"), None)[0]
    _, _, model = tiny_qwen2(21, vocab=VOCAB, layers=6)  # the server starts from other weights
    model.save_pretrained(tmp_path / "server")
    with embedded_servers(str(tmp_path / "server"), str(tmp_path / "logs"), n=1) as servers:
        results = run_gloo(_worker, 2, 2, 2, str(tmp_path / "pp2"), servers[0].address)
        assert [r["layers"] for r in results] == [2, 4]
        hf = {k: v for r in results for k, v in r["hf"].items()}
        assert set(hf) == set(ref["hf"])
        for r in results:
            assert r["loss"] == pytest.approx(ref["loss"], rel=1e-5)
            assert r["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
            assert (r["logp"] - ref["logp"]).abs().max() <= 1e-5
        for name, want in ref["hf"].items():
            rel = (hf[name] - want).abs().max() / want.abs().max()
            assert rel <= 1e-5, f"{name}: relative difference {rel:.2e}"
        saved = load_hf_state_dict(tmp_path / "pp2")
        assert set(saved) == set(hf) and all(torch.equal(saved[k], hf[k]) for k in hf)
        for name, want in hf.items():  # layer 2 comes from stage 1's local layer 0
            status, rows = http(servers[0].address, "POST", "/get_weights_by_name",
                                {"name": name, "truncate_size": want.shape[0]})
            assert status == 200 and torch.equal(torch.tensor(rows, dtype=torch.float32), want), name
