import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.packed_vs_padded import padded_groups

ROOT = Path(__file__).parents[1]


def test_padded_groups_respect_the_token_budget_counting_padding():
    lens = [5, 30, 10, 10, 40, 2]
    groups = padded_groups(lens, 60)
    assert [i for g in groups for i in g] == list(range(len(lens)))
    assert all(len(g) * max(lens[i] for i in g) <= 60 for g in groups)
    assert groups == [[0, 1], [2, 3], [4], [5]]


@pytest.mark.slow
def test_packed_vs_padded_benchmark_runs_on_a_small_mix(tmp_path):
    out = tmp_path / "r.json"
    # Its own process: the benchmark initialises megatron's global parallel state.
    code = ("from pathlib import Path; from bench.packed_vs_padded import main; "
            f"main(n_seqs=12, max_len=256, cap=512, repeats=1, out=Path({str(out)!r}))")
    subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=ROOT, check=True, timeout=300)
    row = json.loads(out.read_text())
    assert row["padding_fraction"] > 0 and row["speedup"] > 0
    assert row["packed_micro_batches"] <= row["padded_micro_batches"]
