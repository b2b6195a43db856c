"""Session KV in Redis: the block format refuses anything it cannot use exactly, and a session that
opens on another verifier takes its prefix from the stored blocks and goes on with the very same
tokens (a real Redis, one server and a Redis Cluster; the verifier engines in this process, and over
gRPC through a pool)."""
from __future__ import annotations

import secrets

import pytest
import pytest_asyncio
import torch

from specdec.core.kv_blocks import BlockLayout, CorruptBlock, HostCopy, PendingBlock, decode_block, encode_block, model_fingerprint
from specdec.core.redis_connect import connect_sync
from specdec.core.redis_kv import RedisKVStore
from specdec.core.sampling import SamplingParams
from specdec.core.steps import DraftProposal, SessionSpec
from specdec.target.engine import TargetConfig, VerifierEngine
from specdec.target.scheduler import VerifierScheduler

from redis_server import delete_prefix

B = 16


def layout(fingerprint: bytes = b"f" * 16, **change) -> BlockLayout:
    fields = dict(layers=2, kv_heads=2, head_dim=8, dtype=torch.float32, block_tokens=4, model_fingerprint=fingerprint)
    fields.update(change)
    return BlockLayout(**fields)


def block(lay: BlockLayout) -> torch.Tensor:
    return torch.randn(lay.layers, 2, lay.kv_heads, lay.block_tokens, lay.head_dim, generator=torch.Generator().manual_seed(0))


TOKENS = list(range(100, 120))


def test_a_block_round_trips_exactly():
    lay = layout()
    kv = block(lay)
    assert torch.equal(decode_block(encode_block(lay, 8, TOKENS, kv), lay, 8, TOKENS), kv)


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:]


@pytest.mark.parametrize("damage, reader, why", [
    (lambda d: d[:40], lambda: (layout(), 8, TOKENS), "shorter than a header"),
    (lambda d: d[:-1], lambda: (layout(), 8, TOKENS), "payload"),
    (lambda d: _flip(d, len(d) - 3), lambda: (layout(), 8, TOKENS), "checksum"),
    (lambda d: b"XXXX" + d[4:], lambda: (layout(), 8, TOKENS), "not a specdec KV block"),
    (lambda d: d[:4] + b"\x09\x00" + d[6:], lambda: (layout(), 8, TOKENS), "format version"),
    (lambda d: d, lambda: (layout(b"g" * 16), 8, TOKENS), "another model"),
    (lambda d: d, lambda: (layout(head_dim=4), 8, TOKENS), "layout"),
    (lambda d: d, lambda: (layout(), 4, TOKENS), "position"),
    (lambda d: d, lambda: (layout(), 8, TOKENS[:3] + [7] + TOKENS[4:]), "other tokens"),  # an earlier token differs
], ids=["truncated-header", "truncated-payload", "flipped-byte", "magic", "version", "foreign-model", "layout",
        "start", "other-prefix"])
def test_every_kind_of_unusable_block_is_refused(damage, reader, why):
    lay = layout()
    data = damage(encode_block(lay, 8, TOKENS, block(lay)))
    want_layout, start, tokens = reader()
    with pytest.raises(CorruptBlock, match=why):
        decode_block(data, want_layout, start, tokens)


def test_two_checkpoints_of_one_architecture_have_different_fingerprints(tiny_pair):
    from specdec.core.models import load_causal_lm

    target, draft = (load_causal_lm(p).model for p in tiny_pair)
    assert model_fingerprint(target, torch.float32) != model_fingerprint(draft, torch.float32)
    assert model_fingerprint(target, torch.float32) != model_fingerprint(target, torch.bfloat16)
    assert model_fingerprint(target, torch.float32) == model_fingerprint(load_causal_lm(tiny_pair[0]).model, torch.float32)


@pytest.fixture
def redis_url(any_redis_url):
    """These tests run on one Redis server and on a Redis Cluster."""
    return any_redis_url


@pytest.fixture
def redis_prefix(any_redis_prefix):
    return any_redis_prefix


@pytest_asyncio.fixture
async def stores(redis_url, redis_prefix, tiny_pair):
    """A factory of verifier engines over one Redis key space, as replicas of one pool."""
    made = []

    def make(**store_kw) -> VerifierScheduler:
        engine = VerifierEngine.from_config(TargetConfig(tiny_pair[0], kv_block_tokens=B))
        store = RedisKVStore.from_url(redis_url, engine.layout, prefix=redis_prefix, **store_kw)
        made.append(store)
        return VerifierScheduler(engine, threaded=False, kv_store=store)

    yield make
    for store in made:
        await store.aclose()
    delete_prefix(redis_url, redis_prefix)


async def _steps(engine: VerifierScheduler, sid: str, n: int) -> list[tuple[int, ...]]:
    out = []
    for i in range(n):
        out.append((await engine.verify(sid, DraftProposal((5 + i % 3, 9)))).token_ids)
    return out


async def test_a_session_resumed_elsewhere_takes_its_prefix_from_redis_and_goes_on_identically(stores):
    a, b = stores(), stores()
    sid = secrets.token_hex(16)
    sampling = SamplingParams(temperature=1.0, seed=11)  # coupled: every token depends on its exact logits
    prompt = tuple(range(1, 30))
    await a.open(SessionSpec(sid, prompt, sampling, "ngram"), max_new_tokens=120)
    await _steps(a, sid, 25)
    await a.kv_store.flush()
    committed = tuple(a.engine.sessions.get(sid).committed)
    assert a.kv_store.written >= 2
    # B has never seen the session: it opens it from the committed tokens and the stored blocks.
    await b.open(SessionSpec(sid, committed, sampling, "ngram"), max_new_tokens=60)
    reused = (len(committed) - 1) // B * B
    assert b.engine.last_prefill_tokens == len(committed) - reused  # only the tail was recomputed
    assert await _steps(b, sid, 10) == await _steps(a, sid, 10)  # and it goes on exactly as A does


async def test_a_corrupt_block_is_recomputed_from_there_and_changes_nothing(stores, redis_url):
    a, b = stores(), stores()
    sid = secrets.token_hex(16)
    prompt = tuple(range(1, 60))
    await a.open(SessionSpec(sid, prompt, SamplingParams(seed=3), "ngram"), max_new_tokens=100)
    await _steps(a, sid, 12)
    await a.kv_store.flush()
    committed = tuple(a.engine.sessions.get(sid).committed)
    client = connect_sync(redis_url)
    key = a.kv_store.key(sid, 1)
    data = client.get(key)
    client.set(key, data[:-5] + b"\x00\x01\x02\x03\x04")  # block 1 damaged on disk or in flight
    await b.open(SessionSpec(sid, committed, SamplingParams(seed=3), "ngram"), max_new_tokens=40)
    assert b.kv_store.rejected == 1
    assert b.engine.last_prefill_tokens == len(committed) - B  # block 0 used, everything from block 1 recomputed
    assert await _steps(b, sid, 6) == await _steps(a, sid, 6)


async def test_redis_memory_per_session_is_capped_and_expires_with_the_record(stores, redis_url):
    """At most max_session_tokens positions of a session are kept (a resume recomputes the rest), and
    each block expires within the session TTL of its writing, so none outlives the record."""
    a, b = stores(max_session_tokens=2 * B), stores()
    sid = secrets.token_hex(16)
    await a.open(SessionSpec(sid, tuple(range(1, 60)), SamplingParams(seed=3), "ngram"), max_new_tokens=100)
    await _steps(a, sid, 12)
    await a.kv_store.flush()
    committed = tuple(a.engine.sessions.get(sid).committed)
    assert len(committed) >= 4 * B
    client = connect_sync(redis_url)
    kept = sorted(int(k.rsplit(b":", 1)[1]) for k in client.scan_iter(match=a.kv_store.key(sid, 0)[:-1] + "*"))
    assert kept == [0, 1] and a.kv_store.written == 2
    assert all(0 < client.pttl(a.kv_store.key(sid, i)) <= 3600 * 1000 for i in kept)
    # What a block costs Redis: its payload and 80-byte header, rounded up to the allocator's size
    # class (jemalloc: at most a quarter more), plus Redis's own bookkeeping.
    stored = a.kv_store.layout.payload_bytes + 80
    assert all(stored <= client.memory_usage(a.kv_store.key(sid, i)) <= 1.25 * stored + 1024 for i in kept)
    await b.open(SessionSpec(sid, committed, SamplingParams(seed=3), "ngram"), max_new_tokens=40)
    assert b.engine.last_prefill_tokens == len(committed) - 2 * B  # the two kept blocks, the rest recomputed
    assert await _steps(b, sid, 6) == await _steps(a, sid, 6)


def test_a_pending_block_encodes_as_the_block_was_when_offered():
    lay = layout()
    kv = torch.cat([block(lay), block(lay) * 2], dim=3)  # two blocks' positions
    pending = [PendingBlock(lay, 4 * i, tuple(TOKENS), HostCopy(kv), 4 * i) for i in range(2)]
    expected = [encode_block(lay, 4 * i, TOKENS, kv[:, :, :, 4 * i:4 * i + 4]) for i in range(2)]
    kv.zero_()  # the cache moves on (a slot reused): the copy taken when offered is what is written
    assert [p.encode() for p in pending] == expected


async def test_blocks_from_device_memory_are_encoded_by_the_writer(redis_url, redis_prefix):
    sid = secrets.token_hex(16)
    lay = layout()
    kv = torch.cat([block(lay), block(lay) * 2], dim=3)
    store = RedisKVStore.from_url(redis_url, lay, prefix=redis_prefix)
    try:
        host = HostCopy(kv)
        store.offer(sid, [(0, encode_block(lay, 0, TOKENS, kv[:, :, :, :4])),
                               (1, PendingBlock(lay, 4, tuple(TOKENS), host, 4))])
        await store.flush(timeout_s=60)
        assert store.written == 2
        loaded = await store.load(sid, TOKENS[:9])
        assert len(loaded) == 2 and torch.equal(torch.cat(loaded, dim=3), kv)
    finally:
        await store.aclose()
