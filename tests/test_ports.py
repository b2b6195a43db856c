"""specdec/ports.py: ports for servers about to start come from below the kernel's ephemeral range
(where an outgoing connection cannot take them between the check and the bind), free, consecutive,
and never twice from one process."""
from __future__ import annotations

import socket

from specdec import ports


def test_blocks_are_free_consecutive_below_the_ephemeral_range_and_never_repeated():
    low = ports._ephemeral_low()
    seen = set()
    for count in (1, 3, 1, 3, 2):
        base = ports.free_ports(count)
        block = set(range(base, base + count))
        assert not block & seen
        seen |= block
        if low > 2048:
            assert base + count <= low
        for port in block:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))  # free: binding it raises nothing


def test_a_taken_port_is_skipped(monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: port + 1)  # the taken port is the range's top
        draws = iter([port, port])
        real = ports._random.randint
        monkeypatch.setattr(ports._random, "randint", lambda lo, hi: next(draws, None) or real(lo, hi))
        got = ports.free_ports(1)
        assert got != port and next(draws, None) is None  # it was drawn twice, refused twice
    finally:
        taken.close()
