import json
import subprocess
import sys
from pathlib import Path

import pytest

from areal_mcore.weight_sync.projection import GPU_LINK, LinkModel, predict_sync_s, projection_table

ROOT = Path(__file__).parents[1]
GB = 1e9


def test_projection_parts_follow_the_formula():
    link = LinkModel(link_GBps=10, alpha_s=1e-3, rtt_s=1e-2, load_GBps=20, gather_GBps=40, convert_GBps=50)
    p = predict_sync_s(10 * GB, receivers=3, bucket_bytes=5 * GB, tensors=7, flatten=True, tp=2, link=link)
    assert p["wire_s"] == pytest.approx(1.0 + 2 * 3 * 1e-3)  # 2 buckets x 3 hops
    assert p["load_s"] == pytest.approx(0.5) and p["http_s"] == pytest.approx(0.02)
    assert p["prepare_s"] == pytest.approx(5 / 40 + 10 / 50)
    assert p["total_s"] == pytest.approx(p["prepare_s"] / 2 + p["wire_s"] + 0.5 + 0.02 + 0.05)
    per_tensor = predict_sync_s(10 * GB, receivers=3, bucket_bytes=5 * GB, tensors=7, flatten=False,
                                tp=2, link=link)
    assert per_tensor["load_s"] == 0 and per_tensor["wire_s"] == pytest.approx(1.0 + 7 * 3 * 1e-3)


def test_ring_bandwidth_holds_with_receivers_and_tree_halves_it():
    ring = [predict_sync_s(64 * GB, receivers=n, bucket_bytes=GB, tensors=800, flatten=True, tp=8,
                           link=GPU_LINK)["wire_s"] for n in (12, 768)]
    assert ring[0] < ring[1] < ring[0] * 1.3  # latency grows with hops; bandwidth does not fall
    tree = LinkModel(**{**GPU_LINK.__dict__, "algo": "tree"})
    t = predict_sync_s(64 * GB, receivers=768, bucket_bytes=GB, tensors=800, flatten=True, tp=8, link=tree)
    assert t["wire_s"] > 64 / 50 * 2 * 0.99
    rows = projection_table(GPU_LINK)
    assert [(r["model"], r["gpus"]) for r in rows][:3] == [("1.5B", 16), ("1.5B", 128), ("1.5B", 1024)]
    assert all(r["total_s"] > r["wire_s"] > 0 for r in rows)


@pytest.mark.slow
def test_weight_sync_benchmark_runs_on_a_small_model(tmp_path):
    out = tmp_path / "ws.json"
    # Its own process: the benchmark initialises a process group and megatron state.
    r = subprocess.run([sys.executable, "-W", "ignore", "bench/weight_sync.py", "--small",
                        "--buckets", "0.05,1", "--out", str(out)], cwd=ROOT, check=True, timeout=400,
                       capture_output=True, text=True)
    assert "x raw broadcast" in r.stdout and "projection" in r.stdout
    res = json.loads(out.read_text())
    assert len(res["rows"]) == 4 and res["raw_GBps"] > 0
    assert all(row["bytes"] == res["rows"][0]["bytes"] > 0 and row["ratio_to_raw"] > 0 for row in res["rows"])
    b = [row["buckets"] for row in res["rows"]]  # 0.05 MB flat / per tensor, 1 MB flat / per tensor
    assert b[0] == b[1] > b[2] == b[3] >= 1
