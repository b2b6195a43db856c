"""Real multi-node Redis deployments for the tests and benchmarks: a Redis Cluster (3 primaries,
3 replicas, made with ``redis-cli --cluster create``) and a Sentinel-managed primary (1 primary,
2 replicas, 1 Sentinel), each in a temp dir on free loopback ports, without persistence.

Both are started on first use and stopped at exit (and by their fixtures' finalizers): every
server runs in its own process group, killed with SIGKILL (after SIGCONT, should a test have
frozen it). Short timeouts make a failover take seconds, not the defaults' tens of seconds:
``cluster-node-timeout`` 1000 ms, ``down-after-milliseconds`` 1000 ms.
"""
from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import redis
from redis.crc import key_slot

from redis_server import ping
from specdec.ports import free_ports

NODE_TIMEOUT_MS = 1000
SERVICE = "mymaster"


def free_cluster_port(taken: set[int]) -> int:
    """A free port P <= 55535 whose cluster bus port P + 10000 is free too (both outside the ephemeral
    range: specdec/ports.py)."""
    for _ in range(100):
        port = free_ports(1, plus=10000)
        if port <= 55535 and port not in taken and port + 10000 not in taken:
            taken.update((port, port + 10000))
            return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


class Server:
    """One redis-server (or Sentinel) process in its own process group."""

    def __init__(self, argv: list[str], port: int, workdir: Path, name: str) -> None:
        self.argv, self.port, self.workdir, self.name = argv, port, workdir, name
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 30.0) -> None:
        with open(self.workdir / f"{self.name}.log", "ab") as log:
            self.proc = subprocess.Popen(self.argv, cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not ping("127.0.0.1", self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start: {(self.workdir / f'{self.name}.log').read_text()[-2000:]}")
            time.sleep(0.02)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        if self.running:
            try:
                self.signal(signal.SIGCONT)
                self.signal(signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc is not None:
            self.proc.wait()

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)


def _wait(what: str, probe, timeout_s: float, every_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            got = probe()
        except (redis.RedisError, OSError):
            got = None
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout_s} s")
        time.sleep(every_s)


class RedisClusterProcs:
    """6 cluster nodes: 3 primaries with a replica each; ``url`` is ``redis+cluster://`` with all six."""

    def __init__(self, redis_server: str, redis_cli: str, nodes: int = 6, replicas: int = 1) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="specdec-redis-cluster-"))
        self.redis_cli = redis_cli
        taken: set[int] = set()
        self.servers: dict[int, Server] = {}
        for _ in range(nodes):
            port = free_cluster_port(taken)
            argv = [redis_server, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                    "--cluster-config-file", f"nodes-{port}.conf", "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                    "--cluster-require-full-coverage", "no", "--cluster-replica-validity-factor", "0",
                    "--save", "", "--appendonly", "no", "--repl-diskless-sync-delay", "0", "--dir", str(self.workdir)]
            self.servers[port] = Server(argv, port, self.workdir, f"node-{port}")
        self.replicas = replicas
        atexit.register(self.stop)

    @property
    def ports(self) -> list[int]:
        return list(self.servers)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start(self, timeout_s: float = 60.0) -> None:
        for server in self.servers.values():
            server.start()
        subprocess.run([self.redis_cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                        "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                       check=True, capture_output=True, timeout=timeout_s)
        self.wait_ok(timeout_s)
        self.wait_replicas_online(timeout_s)

    def wait_replicas_online(self, timeout_s: float = 60.0) -> None:
        """Until every primary has a replica in sync (writes that need a replica's ack can go on)."""
        def online() -> bool:
            for port in self.primaries():
                info = self.servers[port].client().info("replication")
                if not any(isinstance(v, dict) and v.get("state") == "online" for k, v in info.items() if k.startswith("slave")):
                    return False
            return True
        _wait("a replica online for every primary", online, timeout_s)

    def wait_ok(self, timeout_s: float = 60.0, ports: list[int] | None = None) -> None:
        """Until every (listed) running node says cluster_state:ok and agrees on who serves every slot."""
        def ok() -> bool:
            running = [p for p in (ports or self.ports) if self.servers[p].running]
            if not all(b"cluster_state:ok" in self.servers[p].client().execute_command("CLUSTER", "INFO") for p in running):
                return False
            maps = {p: self._slot_owners(p) for p in running}
            return len({tuple(sorted(m.items())) for m in maps.values()}) == 1
        _wait("cluster_state:ok on every node", ok, timeout_s)

    def _slot_owners(self, port: int) -> dict[int, int]:
        """first slot of each range -> port of its primary, as node ``port`` sees it."""
        slots = self.servers[port].client().execute_command("CLUSTER", "SLOTS")
        return {int(start): int(nodes[0][1]) for start, _end, *nodes in ((r[0], r[1], *r[2:]) for r in slots)}

    def nodes(self, via: int | None = None) -> list[dict]:
        """CLUSTER NODES as seen by a running node: dicts of id, port, flags, master (id or '-'), slots."""
        via = via or next(p for p in self.ports if self.servers[p].running)
        text = self.servers[via].client().execute_command("CLUSTER", "NODES")
        text = text.decode() if isinstance(text, bytes) else text
        out = []
        for line in text.strip().splitlines():
            fields = line.split()
            out.append({"id": fields[0], "port": int(fields[1].split("@")[0].rsplit(":", 1)[1]),
                        "flags": set(fields[2].split(",")), "master": fields[3], "slots": fields[8:]})
        return out

    def primary_of(self, key: str) -> int:
        """The port of the primary that serves ``key``'s slot now."""
        slot = key_slot(key.encode())
        via = next(p for p in self.ports if self.servers[p].running)
        for start, end, *nodes in self.servers[via].client().execute_command("CLUSTER", "SLOTS"):
            if int(start) <= slot <= int(end):
                return int(nodes[0][1])
        raise KeyError(f"slot {slot} is not served")

    def primaries(self) -> list[int]:
        return sorted(n["port"] for n in self.nodes() if "master" in n["flags"] and "fail" not in n["flags"] and n["slots"])

    def replica_of(self, primary: int) -> int:
        nodes = self.nodes()
        pid = next(n["id"] for n in nodes if n["port"] == primary)
        return next(n["port"] for n in nodes if n["master"] == pid)

    def wait_primary_changes(self, key: str, old: int, timeout_s: float = 60.0) -> int:
        """Until another node than ``old`` serves ``key`` (a replica was promoted): its port."""
        return _wait(f"a new primary for {key!r}", lambda: (p := self.primary_of(key)) != old and p, timeout_s)

    def restart(self, port: int) -> None:
        """Start a killed node again (same port and node id): it rejoins, as a replica when its slots moved."""
        self.servers[port].start()

    def stop(self) -> None:
        for server in self.servers.values():
            server.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)


class SentinelProcs:
    """A primary with two replicas and one Sentinel (quorum 1) watching it as ``mymaster``.

    Two replicas, so that after a promotion the new primary still has one to acknowledge writes."""

    def __init__(self, redis_server: str) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="specdec-redis-sentinel-"))
        taken: set[int] = set()
        self.primary_port = free_cluster_port(taken)
        self.replica_ports = [free_cluster_port(taken), free_cluster_port(taken)]
        self.sentinel_port = free_cluster_port(taken)
        common = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--repl-diskless-sync-delay", "0",
                  "--dir", str(self.workdir)]
        self.servers: dict[int, Server] = {
            self.primary_port: Server([redis_server, "--port", str(self.primary_port), *common], self.primary_port,
                                      self.workdir, f"redis-{self.primary_port}")}
        for port in self.replica_ports:
            self.servers[port] = Server([redis_server, "--port", str(port), "--replicaof", "127.0.0.1",
                                         str(self.primary_port), *common], port, self.workdir, f"redis-{port}")
        conf = self.workdir / "sentinel.conf"
        conf.write_text(f"port {self.sentinel_port}\nbind 127.0.0.1\ndir {self.workdir}\n"
                        f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary_port} 1\n"
                        f"sentinel down-after-milliseconds {SERVICE} 1000\n"
                        f"sentinel failover-timeout {SERVICE} 3000\n"
                        f"sentinel parallel-syncs {SERVICE} 2\n")
        self.sentinel = Server([redis_server, str(conf), "--sentinel"], self.sentinel_port, self.workdir, "sentinel")
        atexit.register(self.stop)

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.sentinel_port}/{SERVICE}"

    def start(self, timeout_s: float = 60.0) -> None:
        for server in self.servers.values():
            server.start()
        primary = self.servers[self.primary_port].client()
        _wait("both replicas in sync", lambda: primary.info("replication").get("connected_slaves") == 2
              and all(primary.info("replication")[f"slave{i}"]["state"] == "online" for i in range(2)), timeout_s)
        self.sentinel.start()
        _wait("the Sentinel sees both replicas", lambda: len(self.sentinel_replicas()) == 2, timeout_s)

    def sentinel_replicas(self) -> list[dict]:
        return [r for r in self.sentinel.client().sentinel_slaves(SERVICE) if not r.get("is_sdown")]

    def current_primary(self) -> int:
        return int(self.sentinel.client().sentinel_get_master_addr_by_name(SERVICE)[1])

    def wait_promotion(self, old: int, timeout_s: float = 60.0) -> int:
        """Until the Sentinel names another primary than ``old`` and it has a replica online: its port."""
        def promoted():
            port = self.current_primary()
            if port == old:
                return None
            info = self.servers[port].client().info("replication")
            return port if info.get("role") == "master" and info.get("connected_slaves", 0) >= 1 else None
        return _wait("a promotion", promoted, timeout_s)

    def restart_as_replica(self, port: int, of: int) -> None:
        """Start a killed server again, as a replica of the primary on ``of`` (a restarted old primary
        must not come back as a primary)."""
        old = self.servers[port]
        argv = [a for a in old.argv]
        if "--replicaof" in argv:
            i = argv.index("--replicaof")
            del argv[i : i + 3]
        self.servers[port] = Server([*argv, "--replicaof", "127.0.0.1", str(of)], port, self.workdir, old.name)
        self.servers[port].start()

    def wait_replicas(self, n: int, timeout_s: float = 60.0) -> None:
        """Until the current primary has ``n`` replicas online and the Sentinel sees them."""
        def ready() -> bool:
            info = self.servers[self.current_primary()].client().info("replication")
            online = sum(1 for k, v in info.items() if k.startswith("slave") and isinstance(v, dict) and v.get("state") == "online")
            return online >= n and len(self.sentinel_replicas()) >= n
        _wait(f"{n} replicas online", ready, timeout_s)

    def stop(self) -> None:
        for server in (self.sentinel, *self.servers.values()):
            server.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)


def tools() -> tuple[str, str] | None:
    """(redis-server, redis-cli), or None when either is missing."""
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    return (server, cli) if server and cli else None


MISSING = ("needs redis-server and redis-cli on PATH to start a Redis Cluster and a Sentinel "
           "(apt-get install redis-server)")
