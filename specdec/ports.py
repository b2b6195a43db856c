"""Free loopback ports for servers this process is about to start (`specdec bench`'s deployment,
benchmarks/ and the tests).

A port the kernel hands out for ``bind(0)`` lies in its ephemeral range, and once that socket is
closed any outgoing connection may take it before the server binds it (a test's Redis failed so:
"Address already in use"). These ports come from just below that range instead, which the kernel
never assigns by itself, and a process never hands out one port twice.
"""
from __future__ import annotations

import os
import random
import socket
from collections.abc import Callable
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_SPAN = 12000  # ports tried below the ephemeral range
_given: set[int] = set()
_random = random.Random()  # its own: a test that seeds the global RNG must not make two runs pick alike


def _ephemeral_low() -> int:
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; elsewhere a guess


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _shard() -> Callable[[int], bool]:
    """Which ports this process may hand out: with ``SPECDEC_PORT_SHARD=i/n`` (processes that pick
    ports at once, such as parallel test workers, each with its own i, and the servers they start
    inherit it) only the ports of blocks i, i + n, ... of 64, so two of them never pick one port
    between checking it and binding it."""
    spec = os.environ.get("SPECDEC_PORT_SHARD", "")
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        return lambda port: True
    if not 0 <= i < n:
        raise ValueError(f"SPECDEC_PORT_SHARD={spec!r}: want i/n with 0 <= i < n")
    return lambda port: (port // 64) % n == i


def free_ports(count: int = 1, plus: int = 0) -> int:
    """The first of ``count`` consecutive ports that nothing on 127.0.0.1 listens on now, outside the
    ephemeral range where possible (where that range starts too low, the kernel's own choice); with
    ``plus``, the same ports shifted by ``plus`` are free and below the range too (a Redis Cluster
    node's bus port is its port + 10000). Under ``SPECDEC_PORT_SHARD`` only that shard's ports."""
    in_shard = _shard()

    def take(base: int) -> bool:
        ports = [*range(base, base + count), *(range(base + plus, base + plus + count) if plus else ())]
        if max(ports) > 65535 or _given.intersection(ports) or not all(map(in_shard, ports)):
            return False
        if not all(_bindable(p) for p in ports):
            return False
        _given.update(ports)
        return True

    high = _ephemeral_low() - count - plus
    low = max(1024, high - _SPAN)
    for _ in range(2000 if high > low else 0):
        base = _random.randint(low, high)
        if take(base):
            return base
    for _ in range(50):  # no room below the range: the kernel's choice, as before
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if take(base):
            return base
    raise OSError(f"no {count} consecutive free ports on 127.0.0.1")
