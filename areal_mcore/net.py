"""Small network helpers shared by the launchers, the weight syncer and the CLI (a leaf)."""

from __future__ import annotations

import errno
import random
import socket
from collections.abc import MutableMapping

# Below the kernel's ephemeral range (net.ipv4.ip_local_port_range, 32768-60999 by default)
# lies nothing the kernel hands out by itself. A port picked there can only be taken
# between the check and the caller's bind by another process that picks ports the same
# way; one picked by bind(0) comes from the ephemeral range, where every outgoing connection
# of the machine (HTTP polls, gloo's store clients) draws its local port: a server that
# starts 10 s after bind(0) named its port can find it in use ("Address already in use").
_LOW = 10_000
_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def _ephemeral_start() -> int:
    try:
        with open(_EPHEMERAL_RANGE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: the IANA dynamic range
        return 49152


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now, outside the kernel's ephemeral range.

    Another process may still take it before the caller binds; outside the ephemeral range
    only another explicit pick can, at random among ~20k ports. Falls back to a port the OS
    picks (bind(0)) when the range below the ephemeral one is unusable."""
    top = _ephemeral_start()
    rng = random.SystemRandom()
    for _ in range(64 if top - _LOW > 1000 else 0):
        port = rng.randrange(_LOW, top)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError as e:
                if e.errno in (errno.EADDRINUSE, errno.EACCES):
                    continue
                raise
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# What the weight-update group needs in every process of it, the trainer's and each
# server's: SGLang sets both to 0 in its own process unless they are set
# (srt/entrypoints/engine.py, _set_envs_and_config), because its NCCL buffers allocated
# through cuMem cannot be registered across processes, and NVLS (NVLink SHARP) buffers
# neither; a trainer or vLLM server left at NCCL's defaults meets it with other settings.
NCCL_ENV = {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}


def set_nccl_env(env: MutableMapping[str, str]) -> None:
    """Fills ``NCCL_ENV`` into ``env`` (``os.environ``, or a child's) where it is unset."""
    for key, value in NCCL_ENV.items():
        env.setdefault(key, value)


def healthy(address: str, timeout_s: float = 2.0) -> bool:
    """Whether ``http://address/health`` answers 200, asked directly: ``urlopen`` goes
    through ``http_proxy`` from the environment (clusters set one on compute nodes, and
    then a server on the next node is never seen healthy), while the trainer's aiohttp
    ignores proxies by default (``trust_env=False``)."""
    import urllib.error
    import urllib.request

    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with direct.open(f"http://{address}/health", timeout=timeout_s) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def interface_toward(address: str) -> str | None:
    """The name of this host's network interface on the route to ``address`` (IPv4 or a
    host name), or None where Linux's SIOCGIFADDR cannot say."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((address, 1))  # picks the route; sends nothing
            local = s.getsockname()[0]
    except OSError:
        return None
    return next((name for _, name in socket.if_nameindex() if ipv4_of(name) == local), None)


def ipv4_of(name: str) -> str | None:
    """Interface ``name``'s IPv4 address, or None (no such interface, or no address)."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:  # SIOCGIFADDR: the interface's IPv4 address (bytes 20-24 of struct ifreq)
            ifreq = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(ifreq[20:24])


def set_gloo_interface(env: MutableMapping[str, str], master_address: str) -> None:
    """Points gloo at the interface that reaches the trainer's master node, unless the
    site set ``GLOO_SOCKET_IFNAME``. Without it gloo binds the address its host name
    resolves to, which is 127.0.1.1 on Debian-style /etc/hosts (pytorch#68726): megatron's
    gloo groups (``create_gloo_process_groups``, on by default; its distributed optimizer's
    checkpoint gathers use them) and our control group across trainer nodes never connect."""
    if "GLOO_SOCKET_IFNAME" not in env:
        name = interface_toward(master_address)
        if name:
            env["GLOO_SOCKET_IFNAME"] = name


def port_holder(port: int) -> tuple[int | None, str] | None:
    """Who listens on TCP ``port`` on this host, any address: (pid, its command line), pid
    None where the kernel does not tell us (another user's socket, unless we are root);
    None when nothing listens there."""
    import psutil

    for c in psutil.net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port:
            if c.pid is None:
                return None, "another user's process"
            try:
                cmd = " ".join(psutil.Process(c.pid).cmdline())
                return c.pid, cmd if len(cmd) <= 160 else cmd[:157] + "..."
            except psutil.Error:
                return c.pid, "a process that just exited"
    return None


def listens_within(pid: int, port: int) -> bool:
    """Whether ``pid`` or one of its descendants listens on TCP ``port``: a server we
    started, not another job's that answers on the same port."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return False
    for p in procs:
        try:
            if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                   for c in p.net_connections(kind="inet")):
                return True
        except psutil.Error:
            continue
    return False
