"""GPU health through NVML (nvidia-ml-py's ``pynvml``), the library nvidia-smi and DCGM read.

Thresholds follow what NVIDIA's own tools treat as a failed GPU (docs/slurm_admin.md):
any volatile uncorrectable ECC error, a retired page or remapped row waiting for a reset, a
failed row remap; hardware slowdown or thermal slowdown now in force; MIG on (our NCCL
groups and megatron ranks take whole GPUs). Warnings: persistence mode off (the first CUDA
call on a GPU then re-initialises the driver, seconds per process), a temperature within
5 C of the slowdown threshold, uncorrectable rows that were remapped (the GPU goes on, but
it is ageing)."""

from __future__ import annotations

import re
import subprocess

from areal_mcore.doctor.table import Check, fail

# NVML's clock-event reason bits (nvml.h: nvmlClocksEventReason*): the ones that mean the
# GPU is slowed by something other than being idle or an application's clock setting.
_SLOWDOWN = {0x8: "hardware slowdown (power brake or thermal)", 0x40: "hardware thermal slowdown",
             0x80: "hardware power brake", 0x20: "software thermal slowdown"}
# Xid codes that mean the GPU must be drained (NVIDIA's Xid catalogue: 48 double-bit ECC,
# 63/64 row remapping, 74 NVLink, 79 fallen off the bus, 94/95 contained/uncontained ECC).
FATAL_XIDS = {48, 63, 64, 74, 79, 94, 95}
_XID = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F:.]+)\): (\d+)")


def gpu_checks(expected: int, node: str, nvml=None) -> tuple[list[Check], float | None]:
    """The checks, and the smallest GPU's memory in GiB (None without GPUs). ``expected``:
    GPUs this node's steps will ask for (0: a CPU node, where NVML may be absent). ``nvml``:
    the pynvml module (tests pass it with its library stood in)."""
    if nvml is None:
        import pynvml as nvml
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as e:
        if not expected:
            return [Check("gpu.count", "skip", f"no NVML ({e}); no GPUs planned on this node", where=node)], None
        return [fail("gpu.count", f"NVML does not start: {e}", f"{expected} GPUs",
                     "install or load the NVIDIA driver on this node (nvidia-smi must work), or drain it", node)], None
    try:
        return _device_checks(nvml, expected, node)
    finally:
        nvml.nvmlShutdown()


def _device_checks(nvml, expected: int, node: str) -> tuple[list[Check], float | None]:
    count = nvml.nvmlDeviceGetCount()
    checks = [Check("gpu.count", "pass" if count >= expected else "fail", f"{count} GPUs", f">= {expected}",
                    "the allocation's GRES binding gives this node fewer GPUs than launch.gpus_per_node: "
                    "check gres.conf and --gpus-per-node", node)]
    memory = []
    for i in range(count):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        memory.append(nvml.nvmlDeviceGetMemoryInfo(h).total / 2**30)
        gpu = f"{node}:gpu{i}"
        checks += [_ecc(nvml, h, gpu), _pages(nvml, h, gpu), _clocks(nvml, h, gpu), _temperature(nvml, h, gpu),
                   _persistence(nvml, h, gpu), _mig(nvml, h, gpu)]
    checks.append(xid_check(node))
    return [c for c in checks if c is not None], min(memory, default=None)


def _supported(nvml, call, *args):
    """The call's value, or None where this GPU does not support it (NVML_ERROR_NOT_SUPPORTED:
    no ECC on a consumer board, no row remapping before Ampere)."""
    try:
        return call(*args)
    except nvml.NVMLError_NotSupported:
        return None


def _ecc(nvml, h, gpu: str) -> Check:
    errors = _supported(nvml, nvml.nvmlDeviceGetTotalEccErrors, h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                        nvml.NVML_VOLATILE_ECC)
    if errors is None:
        return Check("gpu.ecc", "skip", "ECC not supported", where=gpu)
    return Check("gpu.ecc", "pass" if errors == 0 else "fail", f"{errors} uncorrectable ECC errors since the "
                 "last driver load", "0", "drain the node and reset the GPU (nvidia-smi -r) or replace it; "
                 "a job on it dies with an Xid 48/94/95 or silently corrupt results", gpu)


def _pages(nvml, h, gpu: str) -> Check | None:
    rows = _supported(nvml, nvml.nvmlDeviceGetRemappedRows, h)
    if rows is not None:
        corrected, uncorrected, pending, failed = rows
        if failed or pending:
            return fail("gpu.memory_rows", f"row remapping {'failed' if failed else 'pending a reset'} "
                        f"({uncorrected} uncorrectable rows)", "no pending or failed remap",
                        "reset the GPU (pending) or replace it (failed) before scheduling jobs", gpu)
        return Check("gpu.memory_rows", "warn" if uncorrected else "pass",
                     f"{corrected} corrected, {uncorrected} uncorrectable rows remapped", "0 uncorrectable",
                     "the GPU works on spare rows; plan its replacement", gpu)
    pending = _supported(nvml, nvml.nvmlDeviceGetRetiredPagesPendingStatus, h)
    if pending is None:
        return None
    return Check("gpu.memory_rows", "fail" if pending else "pass",
                 "retired pages pending a reset" if pending else "no retired page pending", "none pending",
                 "reset the GPU (nvidia-smi -r) when no job runs on it", gpu)


def _clocks(nvml, h, gpu: str) -> Check | None:
    reasons = _supported(nvml, nvml.nvmlDeviceGetCurrentClocksEventReasons, h)
    if reasons is None:
        return None
    slow = [why for bit, why in _SLOWDOWN.items() if reasons & bit]
    return Check("gpu.clocks", "fail" if slow else "pass", ", ".join(slow) or "no slowdown in force",
                 "no hardware or thermal slowdown", "check the node's cooling and power (nvidia-smi -q -d "
                 "PERFORMANCE); one slow GPU sets the pace of every rank", gpu)


def _temperature(nvml, h, gpu: str) -> Check | None:
    now = _supported(nvml, nvml.nvmlDeviceGetTemperature, h, nvml.NVML_TEMPERATURE_GPU)
    limit = _supported(nvml, nvml.nvmlDeviceGetTemperatureThreshold, h, nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)
    if now is None or limit is None:
        return None
    return Check("gpu.temperature", "warn" if now >= limit - 5 else "pass", f"{now} C", f"< {limit - 5} C "
                 f"(slowdown at {limit} C)", "the GPU is near its slowdown temperature while idle: check cooling",
                 gpu)


def _persistence(nvml, h, gpu: str) -> Check | None:
    on = _supported(nvml, nvml.nvmlDeviceGetPersistenceMode, h)
    if on is None:
        return None
    return Check("gpu.persistence", "pass" if on == nvml.NVML_FEATURE_ENABLED else "warn",
                 "on" if on == nvml.NVML_FEATURE_ENABLED else "off", "on",
                 "run nvidia-persistenced (or nvidia-smi -pm 1): without it each process's first CUDA "
                 "call re-initialises the GPU", gpu)


def _mig(nvml, h, gpu: str) -> Check | None:
    modes = _supported(nvml, nvml.nvmlDeviceGetMigMode, h)
    if modes is None:
        return None
    current, pending = modes
    on = nvml.NVML_DEVICE_MIG_ENABLE in (current, pending)
    return Check("gpu.mig", "fail" if on else "pass", "MIG enabled" if on else "MIG off", "MIG off",
                 "disable MIG (nvidia-smi -mig 0, then reset): a trainer rank or a server takes a whole GPU", gpu)


def xid_check(node: str, kernel_log: str | None = None) -> Check:
    """Xid events in the kernel log since boot, where this user may read it (dmesg)."""
    if kernel_log is None:
        try:
            kernel_log = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10, check=True).stdout
        except (OSError, subprocess.SubprocessError):
            return Check("gpu.xid", "skip", "kernel log not readable here (dmesg)", where=node)
    events = [(pci, int(code)) for pci, code in _XID.findall(kernel_log)]
    fatal = sorted({f"Xid {code} on {pci}" for pci, code in events if code in FATAL_XIDS})
    if fatal:
        return fail("gpu.xid", ", ".join(fatal), f"none of Xid {sorted(FATAL_XIDS)}",
                    "drain the node: these Xids mean a GPU lost memory or fell off the bus", node)
    return Check("gpu.xid", "warn" if events else "pass", f"{len(events)} Xid events since boot", "0",
                 "read them (dmesg | grep Xid): application Xids (13, 31, 43) are usually a crashed job", node)
