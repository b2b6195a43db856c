"""Scrape each role's /metrics and turn two successive scrapes into the loads the policy reads.

A pool is named by a list of ``host:port`` entries; a host may be a DNS name with many addresses
(a Kubernetes headless Service), so it is resolved again before every scrape and each address is
one pod. Rates come from counter deltas over the time between a pod's two scrapes. Only pods read
at both ends of a window count towards rates; a pod that appeared since the last scrape counts in
the gauges (queued rounds, requests waiting) but not yet in the rates; a pod that went away is
dropped. A pod whose counters went backwards or whose ``*_created`` times changed restarted inside
the window: its data covers only part of the window, so it is treated like a pod that just appeared.
"""
from __future__ import annotations

import logging
import math
import socket
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from specdec import metrics as m
from specdec.autoscale.policy import DrafterLoad, RequestLoad, Snapshot, VerifierLoad

log = logging.getLogger(__name__)

Labels = tuple[tuple[str, str], ...]
Resolver = Callable[..., list]


# ----------------------------------------------------------------------------- addresses
def split_host_port(entry: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` into (host, port); ValueError when there is no port."""
    entry = entry.strip()
    host, sep, port = entry.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {entry!r}")
    return host.removeprefix("[").removesuffix("]"), int(port)


def parse_targets(values: Iterable[str]) -> list[tuple[str, int]]:
    """Flag values, each a comma-separated list of HOST:PORT, into (host, port) pairs."""
    return [split_host_port(part) for value in values for part in value.split(",") if part.strip()]


def resolve(targets: Sequence[tuple[str, int]], resolver: Resolver = socket.getaddrinfo) -> list[str]:
    """Every address behind each (host, port), as ``ip:port``; a name that does not resolve gives none."""
    addresses: list[str] = []
    for host, port in targets:
        try:
            infos = resolver(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:  # a headless Service with no ready pod has no DNS records at all
            log.info("metrics target %s:%d does not resolve: %s", host, port, exc)
            continue
        for family, *_, sockaddr in infos:
            ip = sockaddr[0]
            address = f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
            if address not in addresses:
                addresses.append(address)
    return addresses


# ----------------------------------------------------------------------------- one scrape
@dataclass(frozen=True)
class Scrape:
    """One pod's metrics at one moment: sample name -> labels -> value."""

    address: str
    at: float  # the observer's clock when the scrape finished
    samples: Mapping[str, Mapping[Labels, float]]
    monotone: frozenset[str]  # sample names that only grow while the process lives (counters, histograms)

    def total(self, name: str) -> float | None:
        """The sum over every label set of ``name``; None when the pod does not export it."""
        series = self.samples.get(name)
        return None if series is None else sum(series.values())

    def restarted_since(self, earlier: Scrape) -> bool:
        for name in self.monotone:
            before = earlier.samples.get(name, {})
            for labels, value in self.samples[name].items():
                if value < before.get(labels, 0.0):
                    return True
        for name, series in self.samples.items():  # a series' creation time changes only with a new process
            if name.endswith("_created"):
                before = earlier.samples.get(name, {})
                if any(labels in before and before[labels] != value for labels, value in series.items()):
                    return True
        return False


def parse_scrape(address: str, at: float, text: str) -> Scrape:
    samples: dict[str, dict[Labels, float]] = {}
    monotone: set[str] = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
            if family.type == "counter" and sample.name.endswith("_total") or \
                    family.type == "histogram" and sample.name.endswith(("_bucket", "_count", "_sum")):
                monotone.add(sample.name)
    return Scrape(address, at, samples, frozenset(monotone))


def scrape(address: str, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> Scrape | None:
    """GET http://address/metrics; None (logged) when the pod does not answer or answers garbage."""
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as response:
            text = response.read().decode("utf-8")
        return parse_scrape(address, clock(), text)
    except (OSError, ValueError) as exc:  # refused, timed out, HTTP error (an OSError), unparsable
        log.info("scraping %s: %s", address, exc)
        return None


def scrape_all(addresses: Sequence[str], timeout_s: float, clock: Callable[[], float] = time.monotonic,
               pool: ThreadPoolExecutor | None = None) -> dict[str, Scrape]:
    """Scrape every address at once (one slow pod must not delay the others' timestamps)."""
    if pool is None:
        results = [scrape(a, timeout_s, clock) for a in addresses]
    else:
        results = list(pool.map(lambda a: scrape(a, timeout_s, clock), addresses))
    return {s.address: s for s in results if s is not None}


# ----------------------------------------------------------------------------- two scrapes
class PoolWindow:
    """A pool between two rounds of scrapes: the pods seen at both ends, and every pod seen now."""

    def __init__(self, before: Mapping[str, Scrape], now: Mapping[str, Scrape]) -> None:
        self.now = dict(now)
        self.pairs = [(before[a], s) for a, s in now.items()
                      if a in before and s.at > before[a].at and not s.restarted_since(before[a])]

    @property
    def pods(self) -> int:
        return len(self.pairs)

    def increase(self, name: str) -> float:
        """Σ over paired pods of how much the counter grew."""
        return sum(_delta(b, a, name) for b, a in self.pairs)

    def rate(self, name: str) -> float:
        """Σ over paired pods of growth per second: the pool's rate."""
        return sum(_delta(b, a, name) / (a.at - b.at) for b, a in self.pairs)

    def mean_fraction(self, name: str) -> float:
        """Mean over paired pods of a seconds-counter's growth per second (busy fraction), in [0, 1]."""
        if not self.pairs:
            return 0.0
        return sum(min(1.0, max(0.0, _delta(b, a, name) / (a.at - b.at))) for b, a in self.pairs) / len(self.pairs)

    def gauge(self, name: str) -> float:
        """Σ over every pod answering now of a gauge."""
        return sum(s.total(name) or 0.0 for s in self.now.values())

    def histogram(self, name: str) -> tuple[list[tuple[float, float]], float, float]:
        """The window's (upper bound, cumulative count) buckets, count and sum, over paired pods."""
        buckets: dict[float, float] = {}
        for b, a in self.pairs:
            before = b.samples.get(name + "_bucket", {})
            for labels, value in a.samples.get(name + "_bucket", {}).items():
                le = float(dict(labels)["le"])
                buckets[le] = buckets.get(le, 0.0) + value - before.get(labels, 0.0)
        return sorted(buckets.items()), self.increase(name + "_count"), self.increase(name + "_sum")


def _delta(before: Scrape, after: Scrape, name: str) -> float:
    return (after.total(name) or 0.0) - (before.total(name) or 0.0)


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """Prometheus's histogram_quantile over (upper bound, cumulative count) buckets; None when empty.

    Linear within the bucket the rank falls in; in the +Inf bucket, the highest finite bound.
    """
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


# ----------------------------------------------------------------------------- the observer
@dataclass(frozen=True)
class Observation:
    """The loads over one window (None: no pod of that pool read at both ends of it)."""

    taken_at: float
    window_s: float  # 0.0 on the first observation: there is no window yet
    target: VerifierLoad | None
    draft: DrafterLoad | None
    requests: RequestLoad | None

    def snapshot(self, target_replicas: int, draft_replicas: int) -> Snapshot:
        return Snapshot(self.taken_at, self.window_s, target_replicas, draft_replicas, self.target, self.draft,
                        self.requests)


@dataclass(frozen=True)
class MetricsTargets:
    """Where each pool's metrics are: (host, port) pairs, a host possibly naming many pods."""

    target: tuple[tuple[str, int], ...] = ()
    draft: tuple[tuple[str, int], ...] = ()
    orchestrator: tuple[tuple[str, int], ...] = ()


class Observer:
    """Keeps the previous round of scrapes; each `observe()` scrapes again and measures the window."""

    def __init__(self, targets: MetricsTargets, timeout_s: float = 2.0, latency_quantile: float = 0.9,
                 resolver: Resolver = socket.getaddrinfo, clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < latency_quantile <= 1:
            raise ValueError(f"latency_quantile must be in (0, 1], got {latency_quantile}")
        self.targets, self.timeout_s, self.quantile = targets, timeout_s, latency_quantile
        self.resolver, self.clock = resolver, clock
        self._last: dict[str, dict[str, Scrape]] = {"target": {}, "draft": {}, "orchestrator": {}}
        self._last_at: float | None = None
        self._threads = ThreadPoolExecutor(max_workers=16, thread_name_prefix="scrape")

    def close(self) -> None:
        self._threads.shutdown(wait=False)

    def observe(self) -> Observation:
        windows = {}
        for pool in ("target", "draft", "orchestrator"):
            now = scrape_all(resolve(getattr(self.targets, pool), self.resolver), self.timeout_s, self.clock,
                             self._threads)
            windows[pool] = PoolWindow(self._last[pool], now)
            self._last[pool] = now
        at = self.clock()
        window_s = 0.0 if self._last_at is None else at - self._last_at
        self._last_at = at
        return Observation(at, window_s, verifier_load(windows["target"], windows["draft"]),
                           drafter_load(windows["draft"]), request_load(windows["orchestrator"], self.quantile))


def verifier_load(target: PoolWindow, draft: PoolWindow) -> VerifierLoad | None:
    if not target.pods:
        return None
    rounds_per_s = target.rate(m.VERIFY_ROUNDS)
    # Tokens the drafters drafted (blocks drafted ahead included: they cost drafter time too) per round.
    per_round = draft.rate(m.DRAFTER_DRAFT_TOKENS) / rounds_per_s if rounds_per_s > 0 and draft.pods else None
    return VerifierLoad(pods=target.pods, busy_fraction=target.mean_fraction(m.VERIFIER_BUSY_SECONDS),
                        queued_steps=target.gauge(m.VERIFIER_QUEUED_STEPS), verify_rounds_per_s=rounds_per_s,
                        draft_tokens_per_round=per_round)


def drafter_load(draft: PoolWindow) -> DrafterLoad | None:
    if not draft.pods:
        return None
    tokens = draft.increase(m.DRAFTER_DRAFT_TOKENS)
    cost = draft.increase(m.DRAFTER_BUSY_SECONDS) / tokens if tokens > 0 else None
    return DrafterLoad(pods=draft.pods, busy_fraction=draft.mean_fraction(m.DRAFTER_BUSY_SECONDS),
                       draft_cost_s_per_token=cost)


def request_load(orchestrators: PoolWindow, quantile: float) -> RequestLoad | None:
    if not orchestrators.now:
        return None

    def latency(name: str) -> float | None:
        buckets, count, _ = orchestrators.histogram(name)
        return histogram_quantile(quantile, buckets) if count > 0 else None

    return RequestLoad(running=orchestrators.gauge(m.NUM_REQUESTS_RUNNING),
                       waiting=orchestrators.gauge(m.NUM_REQUESTS_WAITING),
                       ttft_s=latency(m.TIME_TO_FIRST_TOKEN), itl_s=latency(m.INTER_TOKEN_LATENCY))
