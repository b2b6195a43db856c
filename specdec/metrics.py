"""Prometheus metrics of each role, on a registry the composition root creates and passes in.

Names follow vLLM's, with a ``specdec_`` prefix and base units (seconds, bytes, tokens), plus what
the autoscaler (``specdec.autoscale``) needs to size the pools; each series: docs/operations.md,
"Metrics". Each role owns one small class whose methods the role calls where the event happens;
nothing here touches the process-wide default registry, so tests and the embedded mode (all roles
in one process) can hold as many registries as they like.

A note on names: prometheus-client's ``Counter`` appends ``_total`` itself, so counters are
declared as ``specdec_generation_tokens`` and exposed as ``specdec_generation_tokens_total``.
The constants below are the exposed names, the ones a scraper or a dashboard uses.

Busy time is exported as a counter of busy seconds, not as a utilisation gauge: a scraper takes two
scrapes and gets the busy fraction over exactly the window it wants (Δbusy / Δt), and nothing is
lost between scrapes.
"""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily

# Exposed names (counters with their _total), for scrapers; see the module docstring.
SPEC_DECODE_NUM_DRAFTS = "specdec_spec_decode_num_drafts_total"
SPEC_DECODE_NUM_DRAFT_TOKENS = "specdec_spec_decode_num_draft_tokens_total"
SPEC_DECODE_NUM_ACCEPTED_TOKENS = "specdec_spec_decode_num_accepted_tokens_total"
SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS = "specdec_spec_decode_num_accepted_tokens_per_pos_total"
SPEC_DECODE_DRAFTER_ROUNDS = "specdec_spec_decode_drafter_rounds_total"
SPEC_DECODE_DRAFTER_DRAFT_TOKENS = "specdec_spec_decode_drafter_draft_tokens_total"
SPEC_DECODE_DRAFTER_ACCEPTED_TOKENS = "specdec_spec_decode_drafter_accepted_tokens_total"
NUM_REQUESTS_RUNNING = "specdec_num_requests_running"
NUM_REQUESTS_WAITING = "specdec_num_requests_waiting"
TIME_TO_FIRST_TOKEN = "specdec_time_to_first_token_seconds"
INTER_TOKEN_LATENCY = "specdec_inter_token_latency_seconds"
E2E_REQUEST_LATENCY = "specdec_e2e_request_latency_seconds"
GENERATION_TOKENS = "specdec_generation_tokens_total"
VERIFIER_BUSY_SECONDS = "specdec_verifier_busy_seconds_total"
VERIFIER_QUEUED_STEPS = "specdec_verifier_queued_steps"
VERIFY_DRAFT_WAIT = "specdec_verify_draft_wait_seconds"
VERIFY_ROUNDS = "specdec_verify_rounds_total"
DRAFTER_BUSY_SECONDS = "specdec_drafter_busy_seconds_total"
DRAFTER_DRAFT_TOKENS = "specdec_drafter_draft_tokens_total"
WORKER_KV_BYTES = "specdec_worker_kv_bytes"
WORKER_SESSIONS = "specdec_worker_sessions"

# Buckets for LLM serving. TTFT spans a cached short prompt (a few ms) to a long prefill behind a
# queue (tens of seconds); inter-token latency spans a tiny model on a GPU (1 ms) to a saturated
# CPU verifier (~2 s); the end-to-end latency of a request runs to minutes for long generations.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                  40.0, 80.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                 0.4, 0.5, 0.75, 1.0, 2.0)
E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0, 1200.0)
# A block drafted ahead is there at once (0); a just-in-time block waits k draft tokens and a hop.
DRAFT_WAIT_BUCKETS_S = (0.0, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class BusyClock:
    """Seconds during which at least one unit of work was in progress, as a Prometheus counter.

    Overlapping work (a batch of sessions verified by one forward, or calls from several threads)
    counts once: the clock measures how long the worker was busy, not the sum of the calls. An
    interval still running is included at scrape time, so a long forward does not read as idle.
    """

    def __init__(self, name: str, documentation: str, clock: Callable[[], float] = time.perf_counter) -> None:
        self._name, self._doc, self._clock = name, documentation, clock
        self._lock = threading.Lock()
        self._done_s = 0.0
        self._in_progress = 0
        self._since = 0.0

    @contextmanager
    def busy(self) -> Iterator[None]:
        with self._lock:
            if self._in_progress == 0:
                self._since = self._clock()
            self._in_progress += 1
        try:
            yield
        finally:
            with self._lock:
                self._in_progress -= 1
                if self._in_progress == 0:
                    self._done_s += self._clock() - self._since

    def add(self, seconds: float) -> None:
        """Busy time the caller measured itself (e.g. a forward's own timer)."""
        if seconds < 0:
            raise ValueError(f"busy seconds must be >= 0, got {seconds}")
        with self._lock:
            self._done_s += seconds

    def seconds(self) -> float:
        with self._lock:
            running = self._clock() - self._since if self._in_progress else 0.0
            return self._done_s + running

    def collect(self):  # the prometheus_client Collector protocol
        # CounterMetricFamily appends _total, like Counter.
        yield CounterMetricFamily(self._name.removesuffix("_total"), self._doc, value=self.seconds())

    def describe(self):
        return list(self.collect())


class WorkerMetrics:
    """Gauges every worker pool exports, labelled ``role`` (draft, target).

    One instance per registry: in one process running both roles, pass the same instance to
    `VerifierMetrics` and `DrafterMetrics` (a registry refuses a name registered twice).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.kv_bytes = Gauge(WORKER_KV_BYTES, "Bytes of KV cache held for sessions.", ["role"], registry=registry)
        self.sessions = Gauge(WORKER_SESSIONS, "Sessions open on this worker.", ["role"], registry=registry)

    def watch(self, role: str, sessions: Callable[[], float] | None = None, kv_bytes: Callable[[], float] | None = None) -> None:
        """Read the values at scrape time from callables (called from the metrics server's thread)."""
        if sessions is not None:
            self.sessions.labels(role=role).set_function(sessions)
        if kv_bytes is not None:
            self.kv_bytes.labels(role=role).set_function(kv_bytes)


class VerifierMetrics:
    """The target role: one verification round at a time, as the verifier's loop sees it."""

    role = "target"

    def __init__(self, registry: CollectorRegistry, worker: WorkerMetrics | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.num_drafts = Counter(SPEC_DECODE_NUM_DRAFTS.removesuffix("_total"),
                                  "Verification rounds that checked at least one draft token.", registry=registry)
        self.num_draft_tokens = Counter(SPEC_DECODE_NUM_DRAFT_TOKENS.removesuffix("_total"),
                                        "Draft tokens proposed to the verifier.", registry=registry)
        self.num_accepted_tokens = Counter(SPEC_DECODE_NUM_ACCEPTED_TOKENS.removesuffix("_total"),
                                           "Draft tokens the verifier accepted.", registry=registry)
        self.num_accepted_tokens_per_pos = Counter(
            SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS.removesuffix("_total"),
            "Accepted draft tokens by their position in the block (0: the first draft token).", ["position"],
            registry=registry)
        # The same, by the request's drafter (model, ngram, tree, ...): which kind pays, per deployment.
        self.drafter_rounds = Counter(SPEC_DECODE_DRAFTER_ROUNDS.removesuffix("_total"),
                                      "Verification rounds that checked drafts, by drafter.", ["drafter"], registry=registry)
        self.drafter_draft_tokens = Counter(SPEC_DECODE_DRAFTER_DRAFT_TOKENS.removesuffix("_total"),
                                            "Draft tokens (tree nodes) proposed, by drafter.", ["drafter"], registry=registry)
        self.drafter_accepted_tokens = Counter(SPEC_DECODE_DRAFTER_ACCEPTED_TOKENS.removesuffix("_total"),
                                               "Draft tokens accepted, by drafter.", ["drafter"], registry=registry)
        self.verify_rounds = Counter(VERIFY_ROUNDS.removesuffix("_total"),
                                     "Verification rounds (target forwards per session), with or without drafts.",
                                     registry=registry)
        self.draft_wait = Histogram(VERIFY_DRAFT_WAIT, "How long a verification round waited for its draft block.",
                                    buckets=DRAFT_WAIT_BUCKETS_S, registry=registry)
        self.queued_steps = Gauge(VERIFIER_QUEUED_STEPS, "Verification rounds waiting for the target model.",
                                  registry=registry)
        self.busy_clock = BusyClock(VERIFIER_BUSY_SECONDS, "Seconds the target model was busy verifying.", clock)
        registry.register(self.busy_clock)
        self.worker = worker or WorkerMetrics(registry)

    def observe_round(self, num_draft_tokens: int, num_accepted: int, draft_wait_s: float | None = None,
                      drafter: str = "") -> None:
        """After each verification round: tokens drafted (0: plain decoding) and accepted, by ``drafter``
        where named.

        Accepted tokens are a prefix of the block (of a tree: the accepted path, position by depth),
        so positions 0..num_accepted-1 were accepted.
        """
        if not 0 <= num_accepted <= num_draft_tokens:
            raise ValueError(f"accepted {num_accepted} of {num_draft_tokens} draft tokens")
        self.verify_rounds.inc()
        if num_draft_tokens:
            self.num_drafts.inc()
            self.num_draft_tokens.inc(num_draft_tokens)
            self.num_accepted_tokens.inc(num_accepted)
            for position in range(num_accepted):
                self.num_accepted_tokens_per_pos.labels(position=str(position)).inc()
            if drafter:
                self.drafter_rounds.labels(drafter=drafter).inc()
                self.drafter_draft_tokens.labels(drafter=drafter).inc(num_draft_tokens)
                self.drafter_accepted_tokens.labels(drafter=drafter).inc(num_accepted)
        if draft_wait_s is not None:
            self.draft_wait.observe(draft_wait_s)

    def busy(self):
        """Context manager around each target forward; overlapping forwards count once."""
        return self.busy_clock.busy()

    def set_queued_steps(self, n: int) -> None:
        self.queued_steps.set(n)

    def watch(self, sessions: Callable[[], float] | None = None, kv_bytes: Callable[[], float] | None = None,
              queued_steps: Callable[[], float] | None = None) -> None:
        """Read gauges at scrape time from callables instead of setting them as things change."""
        self.worker.watch(self.role, sessions, kv_bytes)
        if queued_steps is not None:
            self.queued_steps.set_function(queued_steps)


class DrafterMetrics:
    """The draft role: what drafting costs, so the autoscaler can size the pool to the demand."""

    role = "draft"

    def __init__(self, registry: CollectorRegistry, worker: WorkerMetrics | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.draft_tokens = Counter(DRAFTER_DRAFT_TOKENS.removesuffix("_total"),
                                    "Tokens drafted, blocks drafted ahead for branches that were dropped included.",
                                    registry=registry)
        self.busy_clock = BusyClock(DRAFTER_BUSY_SECONDS, "Seconds the drafter was busy (prefills and drafting).", clock)
        registry.register(self.busy_clock)
        self.worker = worker or WorkerMetrics(registry)

    def busy(self):
        """Context manager around each piece of draft work (a prefill, a block, a batch of branches)."""
        return self.busy_clock.busy()

    def observe_drafted(self, num_tokens: int) -> None:
        """After drafting: tokens drafted, summed over every branch (they all cost draft forwards)."""
        self.draft_tokens.inc(num_tokens)

    def watch(self, sessions: Callable[[], float] | None = None, kv_bytes: Callable[[], float] | None = None) -> None:
        self.worker.watch(self.role, sessions, kv_bytes)


@dataclass
class RequestTimer:
    """One client request at the orchestrator; `OrchestratorMetrics.start_request` makes it."""

    metrics: OrchestratorMetrics
    started: float
    last_token_at: float | None = None
    done: bool = field(default=False, repr=False)

    def tokens(self, n: int) -> None:
        """Each time n tokens go to the client. The first records TTFT; later ones the inter-token
        latency, once per token: a chunk of n tokens after a gap g counts n gaps of g/n, so the
        histogram's mean is the time per output token whatever the speculation length."""
        if n <= 0 or self.done:
            return
        m = self.metrics
        now = m.clock()
        m.generation_tokens.inc(n)
        if self.last_token_at is None:
            m.time_to_first_token.observe(now - self.started)
            gaps = n - 1  # the rest of the first chunk came at once
            gap_s = 0.0
        else:
            gaps, gap_s = n, (now - self.last_token_at) / n
        for _ in range(gaps):
            m.inter_token_latency.observe(gap_s)
        self.last_token_at = now

    def finish(self) -> None:
        """When the request ends, however it ends; a second call does nothing."""
        if self.done:
            return
        self.done = True
        m = self.metrics
        m.e2e_request_latency.observe(m.clock() - self.started)
        m.requests_running.dec()


class OrchestratorMetrics:
    """The client-facing role: requests, latencies and tokens as the client sees them."""

    def __init__(self, registry: CollectorRegistry, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.requests_running = Gauge(NUM_REQUESTS_RUNNING, "Requests being generated.", registry=registry)
        self.requests_waiting = Gauge(NUM_REQUESTS_WAITING, "Requests admitted and waiting to start.", registry=registry)
        self.time_to_first_token = Histogram(TIME_TO_FIRST_TOKEN, "Seconds from a request's arrival to its first token.",
                                             buckets=TTFT_BUCKETS_S, registry=registry)
        self.inter_token_latency = Histogram(INTER_TOKEN_LATENCY, "Seconds between tokens sent to the client.",
                                             buckets=ITL_BUCKETS_S, registry=registry)
        self.e2e_request_latency = Histogram(E2E_REQUEST_LATENCY, "Seconds from a request's arrival to its end.",
                                             buckets=E2E_BUCKETS_S, registry=registry)
        self.generation_tokens = Counter(GENERATION_TOKENS.removesuffix("_total"), "Tokens sent to clients.",
                                         registry=registry)

    def start_request(self) -> RequestTimer:
        """When a request arrives (before tokenizing: TTFT is what the client waits)."""
        self.requests_running.inc()
        return RequestTimer(self, self.clock())

    def waiting(self):
        """Context manager around the time a request waits for admission."""
        return self.requests_waiting.track_inprogress()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # a scrape every few seconds would flood stderr
        pass


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in flight must not keep the process alive


class MetricsServer:
    """A running /metrics endpoint; call it (or `.stop()`) to stop. `port` is the port bound."""

    def __init__(self, server: WSGIServer, thread: threading.Thread) -> None:
        self._server, self._thread = server, thread
        self.host, self.port = server.server_address[:2]

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)

    __call__ = stop


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> MetricsServer:
    """Serve ``registry`` as Prometheus text on http://host:port/metrics from a daemon thread.

    Returns the stop callable (a `MetricsServer`, which also tells the port bound). Port 0 binds a
    free port here (tests use it); a command-line flag such as ``--metrics-port`` should treat 0 as
    "no metrics server" and not call this at all.

    prometheus_client.start_http_server does the same with its own thread, but its server polls
    for shutdown every 0.5 s; this one stops within 0.1 s.
    """
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]  # an IPv6 host needs an IPv6 socket
    server_class = type("MetricsHTTPServer", (_ThreadingWSGIServer,), {"address_family": family})
    server = make_server(host, port, make_wsgi_app(registry), server_class, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True,
                              name=f"metrics:{server.server_address[1]}")
    thread.start()
    return MetricsServer(server, thread)
