import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_kernels_benchmark_runs_at_toy_size_and_the_fused_path_saves_memory(tmp_path):
    out = tmp_path / "kernels.json"
    # Its own process: on CPU the benchmark changes glibc's mmap threshold to measure RSS.
    code = ("from pathlib import Path; from bench.logprob_kernels import main; "
            f"main(shapes=[(64, 500), (4096, 4096)], repeats=1, out=Path({str(out)!r}))")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=300)
    rows = json.loads(out.read_text())
    assert {(r["T"], r["mode"], r["method"]) for r in rows} >= {
        (T, mode, method) for T in (64, 4096) for mode in ("forward", "forward+backward")
        for method in ("log_softmax", "fused-torch")}
    assert all(r["seconds"] > 0 and r["max_abs_diff"] < 1e-4 for r in rows)
    # 4096 tokens > one 1024-token chunk: the fused path holds fp32 blocks of a quarter of
    # the rows, the baseline fp32 copies (and gradients) of all of them.
    big = {r["method"]: r for r in rows if r["T"] == 4096 and r["mode"] == "forward+backward"}
    assert big["fused-torch"]["peak_bytes"] < 0.7 * big["log_softmax"]["peak_bytes"]
