"""A pool of verifier replicas: each session runs on the least-loaded one, and moves on failure.

Replicas come from addresses and from names that resolve to many (a headless Service), looked up
again now and then. A session is placed on the replica with the fewest open sessions (their WorkerStatus, refreshed
at most every ``status_ttl_s``) and kept there. When that replica becomes unreachable or stops
answering mid-stream, the session resumes on another replica from what it has committed: the
prompt plus every committed token becomes the new replica's prompt, with the tokens still to
generate as its budget. Every position keeps its place in the sequence, so greedy output, and
sampled output under the coupled rule (noise keyed by seed and position), continue exactly as
an uninterrupted run; the client sees only a pause. So does the rejection rule at a fixed k (every
draw is keyed by seed and position); at an adaptive k the resumed session's controller is a new
one (started at the session's last k) and may speculate on another schedule: its tokens keep the
target's distribution, not necessarily the very same tokens.
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace

from specdec.core.errors import WorkerUnavailable
from specdec.core.sessions import short_id
from specdec.core.steps import MAX_FALLBACK_DRAFTERS, SessionRun, StepCommit, VerifyWorker, WorkerInfo

log = logging.getLogger(__name__)
STATUS_TIMEOUT_S = 2.0


def expand(address: str) -> list[tuple[str, str | None]]:
    """``host:port`` -> (``ip:port``, host) for every address the name resolves to, as a Kubernetes
    headless Service resolves to its ready pods; an IP literal is itself (no name to verify)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        ipaddress.ip_address(host)
        return [(address, None)]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (socket.gaierror, ValueError):
        return []  # not resolvable now (no ready pod yet): looked up again at the next refresh
    out = []
    for family, *_, sockaddr in infos:
        ip = sockaddr[0]
        target = f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
        if (target, host) not in out:
            out.append((target, host))
    return out


class ReplicaPool:
    """Replicas of one role found from addresses and names, with their load.

    ``make_replica(address, server_name)`` opens one replica's client (anything with ``status()``);
    ``resolve`` (default: `expand`) turns a configured address into replicas, again every
    ``resolve_every_s``, so pods that come and go behind a name are followed.
    """

    role = "worker"

    def __init__(self, addresses: Sequence[str], make_replica: Callable[[str, str | None], VerifyWorker],
                 status_ttl_s: float = 1.0, resolve_every_s: float = 10.0,
                 resolve: Callable[[str], list[tuple[str, str | None]]] = expand) -> None:
        if not addresses:
            raise ValueError(f"a {self.role} pool needs at least one address")
        self._names = list(addresses)
        self._make, self._resolve = make_replica, resolve
        self._ttl, self._resolve_every = status_ttl_s, resolve_every_s
        self.replicas: dict[str, VerifyWorker] = {}
        self.server_names: dict[str, str | None] = {}  # the name each replica's certificate carries
        self._retired: list[VerifyWorker] = []
        self._resolved_at = float("-inf")
        self._load: dict[str, float] = {}  # replica -> open sessions as last reported (inf: unreachable)
        self._checked_at = float("-inf")
        self._placed: dict[str, int] = {}  # sessions this orchestrator runs there now
        self.failovers = 0
        self._polling: asyncio.Task | None = None
        self._discover()

    def _discover(self) -> None:
        self._resolved_at = time.monotonic()
        found: dict[str, str | None] = {}
        for name in self._names:
            for address, server_name in self._resolve(name):
                found.setdefault(address, server_name)
        for address, server_name in found.items():
            if address not in self.replicas:
                self.replicas[address] = self._make(address, server_name)
                self.server_names[address] = server_name
                self._checked_at = float("-inf")  # a new replica: ask everyone's load again
        for address in [a for a in self.replicas if a not in found and not self._placed.get(a)]:
            self._retired.append(self.replicas.pop(address))  # gone from the name and idle here
            self._load.pop(address, None)

    async def status(self) -> WorkerInfo:
        """The first replica that answers (they serve one model)."""
        last: Exception | None = None
        if not self.replicas:
            self._discover()
        for replica in list(self.replicas.values()):
            try:
                return await replica.status()
            except WorkerUnavailable as exc:
                last = exc
        raise WorkerUnavailable(f"no {self.role} of the pool {', '.join(self._names)} answers: {last}")

    async def _refresh(self, avoid: frozenset[str] = frozenset()) -> None:
        """Loads at most ``status_ttl_s`` old. Once some are known, fresh ones are asked for in the
        background and placement goes on with the last ones: a replica that froze (SIGSTOP, a hung
        host) costs the next placement nothing, instead of the status call's timeout. Replicas in
        ``avoid`` (just failed) are not asked."""
        if time.monotonic() - self._resolved_at >= self._resolve_every:
            self._discover()
        if time.monotonic() - self._checked_at < self._ttl:
            return
        self._checked_at = time.monotonic()
        if self._polling is None or self._polling.done():
            self._polling = asyncio.ensure_future(self._poll(avoid))
        if not self._load:  # nothing known yet: wait for the first answers
            await asyncio.shield(self._polling)

    async def _poll(self, avoid: frozenset[str]) -> None:
        async def load(address: str) -> float:
            if address in avoid:
                return float("inf")
            try:
                return float((await asyncio.wait_for(self.replicas[address].status(), STATUS_TIMEOUT_S)).active_sessions)
            except (WorkerUnavailable, asyncio.TimeoutError):
                return float("inf")

        addresses = list(self.replicas)
        loads = await asyncio.gather(*(load(a) for a in addresses))
        self._load = dict(zip(addresses, loads))
        self._polled()

    def _polled(self) -> None:
        """Called when fresh loads are in."""

    async def _pick(self, avoid: set[str]) -> str:
        await self._refresh(frozenset(avoid))
        if not self.replicas:
            raise WorkerUnavailable(f"no {self.role} found at {', '.join(self._names)}")
        candidates = [a for a in self.replicas if a not in avoid] or list(self.replicas)
        # Open sessions as last reported, plus those placed since: fresh placements spread out too.
        return min(candidates, key=lambda a: (self._load.get(a, 0.0) + self._placed.get(a, 0), a))

    async def aclose(self) -> None:
        if self._polling is not None:
            self._polling.cancel()
        for replica in (*self.replicas.values(), *self._retired):
            close = getattr(replica, "aclose", None)
            if close is not None:
                await close()


class VerifierPool(ReplicaPool):
    """The VerifyWorker protocol over many verifier replicas: placement, and failover by resuming."""

    role = "verifier"

    async def run(self, run: SessionRun) -> AsyncIterator[StepCommit]:
        committed: list[int] = []  # what the session has committed so far, over every replica
        last_k: int | None = None
        failed: set[str] = set()
        current = run
        while True:
            address = await self._pick(failed)
            self._placed[address] = self._placed.get(address, 0) + 1
            steps = self.replicas[address].run(current)
            try:
                async for step in steps:
                    committed.extend(step.token_ids)
                    last_k = step.num_draft_tokens
                    yield step
                return
            except WorkerUnavailable as exc:
                failed.add(address)
                self._load[address] = float("inf")
                if failed >= set(self.replicas):
                    raise
                remaining = run.max_new_tokens - len(committed)
                if remaining <= 0:
                    return
                self.failovers += 1
                log.warning("session %s: verifier %s failed (%s); resuming on another replica after %d tokens",
                            short_id(run.spec.session_id), address, exc, len(committed))
                spec = replace(run.spec, prompt_ids=tuple(run.spec.prompt_ids) + tuple(committed))
                current = replace(run, spec=spec, max_new_tokens=remaining, policy=run.policy.resumed_at(last_k))
            finally:
                self._placed[address] -= 1
                await steps.aclose()


class DrafterPool(ReplicaPool):
    """Where each new session drafts: the draft replica with the fewest open sessions. A session
    stays with its drafter; if that one dies its verifier decodes alone (speed, not output) and
    opens its next draft stream on one of the others (`fallbacks`)."""

    role = "drafter"

    async def place(self) -> tuple[str, str]:
        """(address, the name its certificate carries or "") for a new session."""
        address = await self._pick(set())
        self._placed[address] = self._placed.get(address, 0) + 1  # counted until the next status refresh
        return address, self.server_names.get(address) or ""

    def fallbacks(self, address: str, limit: int = MAX_FALLBACK_DRAFTERS) -> tuple[tuple[str, str], ...]:
        """The other replicas that answered last time, least loaded first: where a session placed on
        ``address`` drafts if that one fails."""
        others = sorted((a for a in self.replicas if a != address and self._load.get(a, 0.0) != float("inf")),
                        key=lambda a: (self._load.get(a, 0.0) + self._placed.get(a, 0), a))
        return tuple((a, self.server_names.get(a) or "") for a in others[:limit])

    def _polled(self) -> None:
        self._placed.clear()  # the fresh statuses count those sessions now
