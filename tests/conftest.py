"""Shared fixtures: a Redis, the tiny model pair, TLS files, and the end-to-end clusters.

The test command is the one CI runs (.ci/run): ``python3 -m pytest -q --durations=15``; each test
has a ceiling (pytest-timeout, ``timeout`` in pyproject.toml). Nothing here asserts how fast
something was: where a test needs something to have happened, it waits for exactly that (with a
generous ceiling), and where timing would decide what the code does (which draft blocks are ready,
which steps share a forward), the test pins it down (tests/cluster.py) or asserts only what the code
decides. Speed is measured by benchmarks/, not asserted here.

``SPECDEC_FULL_GRID=1`` runs the exhaustive sweeps (tests/grid.py): every prompt x seed x sampling
configuration of tests/test_seed_exact.py rather than the default subset, which still covers every
k, drafter, configuration, seed and path. It takes several times longer; benchmarks and release
checks run it.

The suite runs on two workers (pytest-xdist, ``-n 2 --dist loadfile`` in pyproject.toml): each file
stays on one worker, the slowest files start first, and each worker hands out its own shard of ports.
"""
from __future__ import annotations

import os

# Before anything imports Triton: its kernels (core/triton_exact.py) run on CPU tensors under its
# interpreter here; there is no GPU in the test suite.
os.environ.setdefault("TRITON_INTERPRET", "1")

from triton_rows import row_invariant_dot  # noqa: E402

if os.environ["TRITON_INTERPRET"] == "1":
    row_invariant_dot()  # a row's bits in the interpreter's tl.dot must not depend on numpy's BLAS

# Two workers start servers at once: each picks ports only from its own shard (specdec/ports.py), and
# the servers it starts inherit the shard.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ["SPECDEC_PORT_SHARD"] = (f"{int(os.environ['PYTEST_XDIST_WORKER'].removeprefix('gw'))}/"
                                        f"{os.environ['PYTEST_XDIST_WORKER_COUNT']}")

import uuid  # noqa: E402
from collections.abc import Iterator
from contextlib import ExitStack

import pytest  # noqa: E402

from redis_cluster import MISSING as REDIS_TOOLS_MISSING, RedisClusterProcs, SentinelProcs, tools as redis_tools
from redis_server import delete_prefix, redis_url_for_tests


# The slowest files (docs/operations.md "Running the tests"), started first so that none of them is
# left running alone at the end of a parallel run; the rest keep their order.
START_FIRST = ("test_tensor_parallel_serving.py", "test_faults.py", "test_cli.py", "test_bf16_greedy.py",
               "test_e2e.py", "test_paged_runner.py", "test_eagle_drafter.py", "test_bench.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(START_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(START_FIRST)))


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A Redis for this test session (see tests/redis_server.py); fails, saying what to install, if none."""
    with ExitStack() as stack:
        try:
            url = stack.enter_context(redis_url_for_tests())
        except RuntimeError as e:
            pytest.fail(str(e))
        yield url


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    """A key prefix unique to this test; its keys are deleted afterwards."""
    prefix = f"specdec-test-{uuid.uuid4().hex[:8]}"
    yield prefix
    delete_prefix(redis_url, prefix)


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterProcs]:
    """A real Redis Cluster (3 primaries, 3 replicas; tests/redis_cluster.py), started the first time
    a test asks for it and stopped at the end of the session; skipped without redis-server."""
    if (found := redis_tools()) is None:
        pytest.skip(REDIS_TOOLS_MISSING)
    procs = RedisClusterProcs(*found)
    try:
        procs.start()
        yield procs
    finally:
        procs.stop()


@pytest.fixture(scope="session")
def redis_cluster_url(redis_cluster: RedisClusterProcs) -> str:
    return redis_cluster.url


@pytest.fixture(scope="session")
def redis_sentinel() -> Iterator[SentinelProcs]:
    """A Sentinel-managed primary with two replicas (tests/redis_cluster.py), started on first use."""
    if (found := redis_tools()) is None:
        pytest.skip(REDIS_TOOLS_MISSING)
    procs = SentinelProcs(found[0])
    try:
        procs.start()
        yield procs
    finally:
        procs.stop()


@pytest.fixture(params=["single", "cluster"])
def any_redis_url(request: pytest.FixtureRequest) -> str:
    """The URL of a single Redis server, then of the Redis Cluster: a test that takes it runs on both."""
    return request.getfixturevalue("redis_url" if request.param == "single" else "redis_cluster_url")


@pytest.fixture
def any_redis_prefix(any_redis_url: str) -> Iterator[str]:
    """As ``redis_prefix``, on whichever Redis ``any_redis_url`` is."""
    prefix = f"specdec-test-{uuid.uuid4().hex[:8]}"
    yield prefix
    delete_prefix(any_redis_url, prefix)


# ----------------------------------------------------------------------------- models and servers
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest_asyncio  # noqa: E402

from cluster import Cluster, start_cluster  # noqa: E402
from specdec.rpc.certs import make_dev_certs  # noqa: E402
from specdec.rpc.tls import TlsFiles  # noqa: E402
from tiny_models import build_model, build_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def tiny_pair() -> Iterator[tuple[str, str]]:
    """(target, draft) folders: random-weight Llamas sharing one trained byte-level BPE tokenizer."""
    with tempfile.TemporaryDirectory(prefix="specdec-models-") as tmp:
        root = Path(tmp)
        tok = build_tokenizer(root)
        target = build_model(root / "target", tok, hidden=64, layers=2, seed=0)
        draft = build_model(root / "draft", tok, hidden=32, layers=1, seed=1)
        yield str(target), str(draft)


@pytest.fixture(scope="session")
def dev_tls() -> Iterator[TlsFiles]:
    """A development CA and certificate (``specdec certs``) for TLS on every hop of the test clusters."""
    with tempfile.TemporaryDirectory(prefix="specdec-tls-") as tmp:
        paths = make_dev_certs(tmp)
        yield TlsFiles(str(paths["tls.crt"]), str(paths["tls.key"]), str(paths["ca.crt"]))


@pytest_asyncio.fixture(scope="session")
async def cluster(tiny_pair, redis_url, dev_tls) -> Cluster:
    """Drafter, verifier and orchestrator gRPC servers on loopback, sessions in Redis, TLS on every hop."""
    target, draft = tiny_pair
    c = await start_cluster(target, draft, redis_url, prefix=f"specdec-test-{uuid.uuid4().hex[:8]}", tls=dev_tls)
    yield c
    await c.stop()
    delete_prefix(redis_url, c.store._prefix)


@pytest_asyncio.fixture(scope="session")
async def twin_cluster(tiny_pair, redis_url, dev_tls) -> Cluster:
    """As ``cluster``, but the draft model is the target itself."""
    target, _ = tiny_pair
    c = await start_cluster(target, target, redis_url, prefix=f"specdec-test-{uuid.uuid4().hex[:8]}", tls=dev_tls)
    yield c
    await c.stop()
    delete_prefix(redis_url, c.store._prefix)
