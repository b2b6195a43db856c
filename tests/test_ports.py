"""specdec/ports.py: ports for servers about to start come from below the kernel's ephemeral range
(where an outgoing connection cannot take them between the check and the bind), free, consecutive,
and never twice from one process."""
from __future__ import annotations

import socket

import pytest

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


def test_two_shards_never_hand_out_one_port(monkeypatch):
    """Parallel test workers (tests/conftest.py) each draw from their own shard, bus ports included."""
    drawn = {}
    for shard in ("0/2", "1/2"):
        monkeypatch.setenv("SPECDEC_PORT_SHARD", shard)
        monkeypatch.setattr(ports, "_given", set())  # two processes: neither knows the other's ports
        got = [ports.free_ports(3) for _ in range(20)] + [ports.free_ports(1, plus=10000) for _ in range(5)]
        drawn[shard] = {p for base in got[:20] for p in range(base, base + 3)} | {p for base in got[20:] for p in (base, base + 10000)}
        index = int(shard[0])
        assert all((p // 64) % 2 == index for p in drawn[shard])
    assert not drawn["0/2"] & drawn["1/2"]


def test_a_malformed_shard_is_refused(monkeypatch):
    monkeypatch.setenv("SPECDEC_PORT_SHARD", "2/2")
    with pytest.raises(ValueError, match="0 <= i < n"):
        ports.free_ports(1)
