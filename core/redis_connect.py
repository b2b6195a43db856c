"""One place that turns a Redis URL into a client: a single server, a Redis Cluster or a
Sentinel-managed primary (the session store, `--redis-url`, and KV blocks, `--kv-redis-url`).

Accepted forms (``ACCEPTED_FORMS``):
  redis://[[user]:password@]host[:port][/db]     one server (redis-py's own URL syntax and options)
  rediss://...                                   the same over TLS
  unix://[[user]:password@]/path/to/socket[?db=N]
  redis+cluster://[[user]:password@]host:port[,host:port...]
  rediss+cluster://...                           a Redis Cluster (any reachable nodes: the client
                                                 learns the rest and follows MOVED/ASK)
  redis+sentinel://[[user]:password@]host:port[,host:port...]/service_name[/db]
  rediss+sentinel://...                          the primary that the Sentinels name ``service_name``
                                                 (the password is the primary's; the Sentinels need none)
Options of the cluster and sentinel forms, as a query string: ``replica_acks`` (default 1: a write
is acknowledged once it reached that many replicas, so a promoted replica has every write a
client was told about; 0 for a cluster without replicas), ``replica_ack_timeout_ms`` (500),
``socket_timeout`` (2 s: a frozen node is given up on and a promoted replica found),
``socket_connect_timeout`` (1 s), ``ssl_ca_certs`` (a CA file for the TLS forms).

`retry_budget` says how long a failed call is worth trying again on the deployment a client
reaches: long enough to ride out its failover, read from the deployment itself.
"""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.exceptions import ClusterDownError, ReadOnlyError, RedisClusterException, RedisError, TryAgainError

from specdec.core.errors import InvalidRequest

ACCEPTED_FORMS = ("redis://[[user]:password@]host[:port][/db], rediss://..., unix:///path, "
                  "redis+cluster://host:port[,host:port...] (rediss+cluster:// for TLS), or "
                  "redis+sentinel://host:port[,host:port...]/service_name[/db] (rediss+sentinel:// for TLS)")
_SINGLE, _CLUSTER, _SENTINEL = "single", "cluster", "sentinel"
_SCHEMES = {"redis": (_SINGLE, False), "rediss": (_SINGLE, True), "unix": (_SINGLE, False),
            "redis+cluster": (_CLUSTER, False), "rediss+cluster": (_CLUSTER, True),
            "redis+sentinel": (_SENTINEL, False), "rediss+sentinel": (_SENTINEL, True)}
_OPTIONS = ("replica_acks", "replica_ack_timeout_ms", "socket_timeout", "socket_connect_timeout", "ssl_ca_certs")


class RedisUrlError(InvalidRequest, ValueError):
    """A Redis URL none of the accepted forms matches (the message names them)."""


@dataclass(frozen=True)
class RedisTarget:
    """What a Redis URL names. ``replica_acks``: replicas a durable write must reach before it is
    acknowledged (0: the primary's word is enough, as for a single server)."""

    kind: str  # "single" | "cluster" | "sentinel"
    url: str  # the URL as given (single: what redis-py parses)
    nodes: tuple[tuple[str, int], ...] = ()  # cluster: startup nodes; sentinel: the Sentinels
    service_name: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False
    replica_acks: int = 0
    replica_ack_timeout_ms: int = 500
    socket_timeout: float = 2.0
    socket_connect_timeout: float = 1.0
    ssl_ca_certs: str | None = None

    @property
    def replicated(self) -> bool:
        return self.kind != _SINGLE


def _fail(url: str, why: str) -> RedisUrlError:
    shown = url if len(url) <= 200 else url[:200] + "..."
    if "@" in shown:  # never echo a password
        shown = shown.split("://", 1)[0] + "://***@" + shown.rsplit("@", 1)[1]
    return RedisUrlError(f"bad Redis URL {shown!r}: {why}; accepted: {ACCEPTED_FORMS}")


def _host_ports(url: str, netloc: str) -> tuple[tuple[str, int], ...]:
    nodes = []
    for part in netloc.split(","):
        host, sep, port = part.strip().rpartition(":")
        host = host.strip("[]")  # [::1]:7000
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise _fail(url, f"{part!r} is not host:port")
        nodes.append((host, int(port)))
    return tuple(nodes)


def _positive(url: str, options: dict[str, str], name: str, default: float) -> float:
    if name not in options:
        return default
    try:
        value = float(options[name])
    except ValueError:
        raise _fail(url, f"{name}={options[name]!r} is not a number") from None
    if not (value > 0 and math.isfinite(value)):
        raise _fail(url, f"{name} must be positive")
    return value


def parse_redis_url(url: str) -> RedisTarget:
    """What ``url`` names; RedisUrlError (a ValueError) when it is none of ``ACCEPTED_FORMS``."""
    if not isinstance(url, str) or "://" not in url:
        raise _fail(str(url), "no scheme")
    scheme = url.split("://", 1)[0].lower()
    if scheme not in _SCHEMES:
        raise _fail(url, f"unknown scheme {scheme!r}")
    kind, tls = _SCHEMES[scheme]
    if kind == _SINGLE:
        try:
            aioredis.connection.parse_url(url)  # redis-py's own check, without connecting
        except ValueError as exc:
            raise _fail(url, str(exc)) from None
        return RedisTarget(_SINGLE, url, tls=tls)
    parts = urlsplit(url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    options = dict(parse_qsl(parts.query, keep_blank_values=True))
    if unknown := sorted(set(options) - set(_OPTIONS)):
        raise _fail(url, f"unknown option(s) {unknown}; the options are {list(_OPTIONS)}")
    if not hosts:
        raise _fail(url, "no host:port")
    nodes = _host_ports(url, hosts)
    path = [unquote(p) for p in parts.path.split("/") if p]
    service, db = "", 0
    if kind == _CLUSTER and path:
        raise _fail(url, "a cluster URL has no path (a cluster has one database)")
    if kind == _SENTINEL:
        if not path or len(path) > 2:
            raise _fail(url, "a sentinel URL names the service: redis+sentinel://host:port/service_name[/db]")
        service = path[0]
        if len(path) == 2:
            if not path[1].isdigit():
                raise _fail(url, f"database {path[1]!r} is not a number")
            db = int(path[1])
    acks = options.get("replica_acks", "1")
    if not acks.isdigit() or int(acks) > 16:
        raise _fail(url, f"replica_acks={acks!r} must be 0-16")
    return RedisTarget(
        kind, url, nodes, service, db, unquote(username) or None, unquote(password) if userinfo else None, tls,
        replica_acks=int(acks),
        replica_ack_timeout_ms=round(_positive(url, options, "replica_ack_timeout_ms", 500)),
        socket_timeout=_positive(url, options, "socket_timeout", 2.0),
        socket_connect_timeout=_positive(url, options, "socket_connect_timeout", 1.0),
        ssl_ca_certs=options.get("ssl_ca_certs"),
    )


def _connection_kwargs(target: RedisTarget) -> dict:
    kwargs: dict = {"decode_responses": False, "socket_timeout": target.socket_timeout,
                    "socket_connect_timeout": target.socket_connect_timeout}
    if target.username is not None:
        kwargs["username"] = target.username
    if target.password is not None:
        kwargs["password"] = target.password
    if target.tls:
        kwargs["ssl"] = True
        if target.ssl_ca_certs:
            kwargs["ssl_ca_certs"] = target.ssl_ca_certs
    return kwargs


def connect(url: str | RedisTarget) -> aioredis.Redis | RedisCluster:
    """An asyncio client (its own connection pool) for ``url``; nothing connects until first used.

    Bytes in, bytes out (no decoding). A cluster client tolerates uncovered slots (a shard that is
    down fails only the keys it holds); a Sentinel client asks the Sentinels for the primary on
    every new connection, so it follows a promotion."""
    target = url if isinstance(url, RedisTarget) else parse_redis_url(url)
    if target.kind == _SINGLE:
        return aioredis.Redis.from_url(target.url, decode_responses=False)
    kwargs = _connection_kwargs(target)
    if target.kind == _CLUSTER:
        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in target.nodes], require_full_coverage=False,
                            **kwargs)
    sentinel_kwargs = {"socket_timeout": target.socket_timeout, "socket_connect_timeout": target.socket_connect_timeout}
    sentinel = Sentinel(list(target.nodes), sentinel_kwargs=sentinel_kwargs)
    return sentinel.master_for(target.service_name, redis_class=aioredis.Redis, db=target.db, **kwargs)


def connect_sync(url: str | RedisTarget) -> redis.Redis | redis.cluster.RedisCluster:
    """The blocking twin of `connect` (tests, tools): same URL forms, same options."""
    from redis.cluster import ClusterNode as SyncClusterNode, RedisCluster as SyncRedisCluster
    from redis.sentinel import Sentinel as SyncSentinel

    target = url if isinstance(url, RedisTarget) else parse_redis_url(url)
    if target.kind == _SINGLE:
        return redis.Redis.from_url(target.url, decode_responses=False)
    kwargs = _connection_kwargs(target)
    if target.kind == _CLUSTER:
        return SyncRedisCluster(startup_nodes=[SyncClusterNode(h, p) for h, p in target.nodes],
                                require_full_coverage=False, **kwargs)
    sentinel_kwargs = {"socket_timeout": target.socket_timeout, "socket_connect_timeout": target.socket_connect_timeout}
    return SyncSentinel(list(target.nodes), sentinel_kwargs=sentinel_kwargs).master_for(
        target.service_name, redis_class=redis.Redis, db=target.db, **kwargs)



class ReplicaAckMissing(redis.exceptions.ConnectionError):
    """A write landed on its primary but did not reach enough replicas in time: not yet durable
    (a promotion now could lose it). Retry: the store's writes are safe to repeat."""


async def eval_acked(client: aioredis.Redis | RedisCluster, script: str, keys: list[str], args: list,
                     replicas: int, timeout_ms: int) -> object:
    """EVAL ``script`` on the primary of ``keys`` (one slot), then WAIT on the same connection until
    ``replicas`` replicas have it: its reply, or ReplicaAckMissing.

    WAIT counts the writes of its own connection, so both commands go down one connection, in one
    round trip. Only a reply of 1 (what every store script answers when it wrote) needs the replicas. On a cluster the pipeline is sent to
    the slot's primary directly (redis-py's cluster pipeline may re-route a redirected command to
    another connection, which would make WAIT vouch for a write it never saw): MOVED refreshes the
    slot map and tries again, ASK goes to the importing node with ASKING, TRYAGAIN waits a moment."""
    if not isinstance(client, RedisCluster):
        async with client.pipeline(transaction=False) as pipe:
            pipe.eval(script, len(keys), *keys, *args)
            pipe.execute_command("WAIT", replicas, timeout_ms)
            result, acked = await pipe.execute()
        return _acked(result, acked, replicas, timeout_ms)
    from redis.asyncio.cluster import PipelineCommand
    from redis.exceptions import AskError, MovedError, TryAgainError

    await client.initialize()
    node, asking = client.get_node_from_key(keys[0]), False
    for _ in range(5):
        commands = [PipelineCommand(0, "ASKING")] if asking else []
        commands += [PipelineCommand(len(commands), "EVAL", script, len(keys), *keys, *args),
                     PipelineCommand(len(commands) + 1, "WAIT", replicas, timeout_ms)]
        try:
            await node.execute_pipeline(commands)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError):
            await client.nodes_manager.initialize()  # the primary may have moved: look again before the retry
            raise
        result, acked = commands[-2].result, commands[-1].result
        if isinstance(result, MovedError):  # before AskError: a MovedError is one
            await client.nodes_manager.initialize()
            node, asking = client.get_node_from_key(keys[0]), False
        elif isinstance(result, AskError):
            node = client.get_node(host=result.host, port=result.port)
            if node is None:
                await client.nodes_manager.initialize()
                node = client.get_node(host=result.host, port=result.port) or client.get_node_from_key(keys[0])
            asking = True
        elif isinstance(result, TryAgainError):  # a multi-key command mid-migration
            await asyncio.sleep(0.05)
        elif isinstance(result, Exception):
            raise result
        else:
            return _acked(result, acked, replicas, timeout_ms)
    raise redis.exceptions.ConnectionError(f"keys {keys[0]!r}...: still redirected after 5 tries (resharding?)")


def _acked(result: object, acked: object, replicas: int, timeout_ms: int) -> object:
    if isinstance(acked, Exception):
        raise acked
    if result == 1 and int(acked) < replicas:  # 1: the script wrote (every store script returns 1 when it did)
        raise ReplicaAckMissing(f"the write reached {acked} of {replicas} replicas in {timeout_ms} ms")
    return result


# ----------------------------------------------------------------------------- riding out a failover
# How long a failed store call is worth trying again (docs/operations.md, "Failover settings"):
# one server, its restart; a Redis Cluster or a Sentinel-managed primary, twice the time it takes
# to declare a primary dead (the election after it can take as long again) plus the margin, which
# also covers the client finding the promoted replica. Redis's own defaults when the setting cannot
# be read (CONFIG renamed or refused, nodes unreachable at start).
RESTART_RETRY_S = 5.0
FAILOVER_MARGIN_S = 5.0
REDIS_DEFAULT_NODE_TIMEOUT_MS = 15_000  # cluster-node-timeout
SENTINEL_DEFAULT_DOWN_AFTER_MS = 30_000  # down-after-milliseconds

# What a store call meets while a primary fails over: worth trying again within the budget.
FAILOVER_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError, ClusterDownError,
                   TryAgainError, ReadOnlyError, RedisClusterException)


@dataclass(frozen=True)
class RetryBudget:
    """How long a failed store call is tried again before it fails, and where that figure comes from."""

    seconds: float
    source: str  # for the log line at start


def failover_budget_s(detection_ms: float) -> float:
    """The retry budget that covers a failover whose failure detection takes ``detection_ms``."""
    return 2 * detection_ms / 1000 + FAILOVER_MARGIN_S


async def retry_budget(client: aioredis.Redis | RedisCluster) -> RetryBudget:
    """The budget for ``client``'s deployment, read from it once: a cluster's ``cluster-node-timeout``
    (the largest its nodes report), a Sentinel's ``down-after-milliseconds`` for the service."""
    if isinstance(client, RedisCluster):
        timeouts, why = await _cluster_node_timeouts(client)
        if timeouts:
            ms = max(timeouts)
            return RetryBudget(failover_budget_s(ms), f"a Redis Cluster with cluster-node-timeout {ms} ms")
        ms = REDIS_DEFAULT_NODE_TIMEOUT_MS
        return RetryBudget(failover_budget_s(ms), f"a Redis Cluster whose cluster-node-timeout could not be read ({why}): "
                                                  f"Redis's default {ms} ms assumed")
    pool = client.connection_pool
    if isinstance(pool, SentinelConnectionPool):
        ms, why = await _sentinel_down_after(pool)
        if ms is not None:
            return RetryBudget(failover_budget_s(ms), f"a Sentinel-managed primary with down-after-milliseconds {ms} ms")
        ms = SENTINEL_DEFAULT_DOWN_AFTER_MS
        return RetryBudget(failover_budget_s(ms), f"a Sentinel-managed primary whose down-after-milliseconds could not be "
                                                  f"read ({why}): Sentinel's default {ms} ms assumed")
    return RetryBudget(RESTART_RETRY_S, "one Redis server: a restart")


async def _cluster_node_timeouts(client: RedisCluster) -> tuple[list[int], str]:
    """``cluster-node-timeout`` of every node that tells it, and why none did (if none)."""
    try:
        await client.initialize()
    except (RedisError, RedisClusterException, OSError) as exc:
        return [], f"the cluster is unreachable: {exc}"

    async def node_timeout(node: ClusterNode) -> int:
        reply = await client.execute_command("CONFIG", "GET", "cluster-node-timeout", target_nodes=node)
        return int(reply[b"cluster-node-timeout"])  # KeyError: a reply without it, as a refusal

    replies = await asyncio.gather(*(node_timeout(n) for n in client.get_nodes()), return_exceptions=True)
    timeouts = [r for r in replies if isinstance(r, int)]
    refused = [r for r in replies if isinstance(r, Exception)]
    if not timeouts and refused:  # CONFIG renamed or not allowed to this user, or every node down
        return [], f"CONFIG GET: {refused[0]!r}"[:300]
    return timeouts, "no nodes"


async def _sentinel_down_after(pool: SentinelConnectionPool) -> tuple[int | None, str]:
    why = "no Sentinel answered"
    for sentinel in pool.sentinel_manager.sentinels:
        try:
            state = await sentinel.sentinel_master(pool.service_name)
            return int(state["down-after-milliseconds"]), ""
        except (RedisError, OSError, KeyError, TypeError, ValueError) as exc:
            why = f"SENTINEL MASTER: {exc}"
    return None, why

