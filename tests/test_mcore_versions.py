"""The same run under both tested megatron-core versions (0.16.1 and 0.19.x), across venvs.

`make test` runs this file under the 0.19 venv with ``AREAL_MCORE_OTHER_PY`` naming the
main venv's python (0.16.1); each version trains, saves and exports in its own process
(tests/_mcore_run.py), then resumes and exports the other version's checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _tiers import needs
from _tiny_model import tiny_qwen2
from safetensors.torch import load_file

from areal_mcore.convert.hf_files import load_hf_state_dict, safetensors_files
from areal_mcore.model.mcore_compat import parse_version

OTHER_PY = os.environ.get("AREAL_MCORE_OTHER_PY")
RUN = Path(__file__).with_name("_mcore_run.py")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.venv,
    pytest.mark.skipif(not OTHER_PY, reason="AREAL_MCORE_OTHER_PY (another venv's python) is "
                       "unset; `make test` sets it in its megatron-core 0.19 run"),
]


def _run_all(jobs: list[tuple[str, list[str]]]) -> None:
    """Runs the (python, args) jobs of _mcore_run.py side by side; fails with their output."""
    procs = [subprocess.Popen([py, "-W", "ignore", str(RUN), *args], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, cwd=RUN.parents[1])
             for py, args in jobs]
    outputs = [p.communicate(timeout=900)[0] for p in procs]
    for (py, args), p, out in zip(jobs, procs, outputs, strict=True):
        if p.returncode:
            raise AssertionError(f"{py} {' '.join(args)}: exit {p.returncode}\n{out[-4000:]}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"this"|"other": {"train": dir, "resume": dir}}; each resumes the other's checkpoint."""
    needs("venv")
    root = tmp_path_factory.mktemp("mcore_versions")
    # One set of initial weights for both (the venvs' transformers may init differently).
    _, _, model = tiny_qwen2(vocab=250)
    model.save_pretrained(root / "init")
    pys = {"this": sys.executable, "other": OTHER_PY}
    dirs = {k: {"train": root / f"{k}_train", "resume": root / f"{k}_resume"} for k in pys}
    _run_all([(pys[k], ["train", str(dirs[k]["train"]), str(root / "init")]) for k in pys])
    crossed = {"this": "other", "other": "this"}
    _run_all([(pys[k], ["resume", str(dirs[k]["resume"]), str(root / "init"),
                        str(dirs[crossed[k]]["train"] / "ckpt")]) for k in pys])
    return dirs


def _result(folder: Path) -> dict:
    return json.loads((folder / "result.json").read_text())


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    differing = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differing, differing


def _older_newer(runs) -> tuple[str, str]:
    versions = {k: parse_version(_result(d["train"])["megatron_core"]) for k, d in runs.items()}
    assert versions["this"][:2] != versions["other"][:2], f"not two megatron-core versions: {versions}"
    return tuple(sorted(versions, key=versions.get))  # type: ignore[return-value]


def test_a_run_saved_under_each_version_exports_to_bitwise_identical_hf(runs):
    old, new = _older_newer(runs)
    a, b = runs[old]["train"], runs[new]["train"]
    assert _result(a)["losses"] == _result(b)["losses"]
    files_a, files_b = safetensors_files(a / "hf"), safetensors_files(b / "hf")
    assert [f.name for f in files_a] == [f.name for f in files_b]
    assert all(fa.read_bytes() == fb.read_bytes() for fa, fb in zip(files_a, files_b))
    _assert_bitwise(load_hf_state_dict(a / "hf"), load_hf_state_dict(b / "hf"))
    # the manifests record who saved them
    for run in (a, b):
        manifest = json.loads((run / "ckpt" / "step_00000002" / "manifest.json").read_text())
        assert manifest["versions"]["megatron_core"] == _result(run)["megatron_core"]


def test_each_version_exports_the_other_versions_checkpoint_identically(runs):
    for k in runs:
        _assert_bitwise(load_hf_state_dict(runs[k]["resume"] / "hf"),
                        load_hf_state_dict(runs[k]["train"] / "hf"))


def test_the_newer_version_resumes_the_older_checkpoint_bitwise(runs):
    old, new = _older_newer(runs)
    resumed = runs[new]["resume"]  # the newer version on the older version's checkpoint
    assert "refused" not in _result(resumed)
    assert _result(resumed)["losses"] == _result(runs[new]["train"])["losses"][-2:]
    final = load_file(str(resumed / "final.safetensors"))
    _assert_bitwise(final, load_file(str(runs[new]["train"] / "final.safetensors")))
    _assert_bitwise(final, load_file(str(runs[old]["train"] / "final.safetensors")))


def test_the_older_version_refuses_the_newer_checkpoint_naming_both_versions(runs):
    old, new = _older_newer(runs)
    refused = _result(runs[old]["resume"]).get("refused", "")
    v_old, v_new = _result(runs[old]["train"])["megatron_core"], _result(runs[new]["train"])["megatron_core"]
    assert f"saved by megatron-core {v_new}" in refused
    assert f"this run has megatron-core {v_old}" in refused
    assert "mcore-to-hf" in refused
