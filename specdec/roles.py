"""Composition root: wire engines, servicers, stores and the loop into runnable roles.

Each role can run as its own gRPC server (``specdec serve ...``), or all roles in one process with
direct calls and the in-memory store (``specdec generate``): the same engines and loop; in one
process the verifier's model work runs on the drafter's thread (``DraftEngine.submit``), so the two
models take turns with every core rather than split the cores between them.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specdec.core.errors import SpecdecError
from specdec.core.sessions import InMemorySessionStore, SessionStore
from specdec.core.steps import SessionRun
from specdec.core.threads import ThreadChooser
from specdec.draft.drafters import DraftConfig
from specdec.draft.engine import DraftEngine
from specdec.orchestrator.loop import Orchestrator, TargetInfo
from specdec.orchestrator.request import DEFAULT_STORE_RETRY_S, OrchestratorConfig
from specdec.rpc.server import RunningServer, ServerConfig, start_server
from specdec.rpc.tls import TlsFiles
from specdec.target.engine import TargetConfig, VerifierEngine
from specdec.target.scheduler import VerifierScheduler
from specdec.target.loop import LoopConfig
from specdec.target.worker import LocalVerifier

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from specdec.orchestrator.http_server import HttpServer

log = logging.getLogger(__name__)


def make_store(redis_url: str | None, ttl_s: float) -> SessionStore:
    """Redis when a URL is configured, else the in-memory store (the embedded default)."""
    if redis_url:
        from specdec.core.redis_store import RedisSessionStore

        return RedisSessionStore.from_url(redis_url, ttl_s=ttl_s)
    return InMemorySessionStore(ttl_s=ttl_s)


async def with_store_retry(config: OrchestratorConfig, store: SessionStore) -> OrchestratorConfig:
    """``config`` with its store retry budget decided, and logged once: the operator's
    (``store_retry_s`` set), else a Redis store's failover time read from the deployment (a
    cluster's ``cluster-node-timeout``, a Sentinel's ``down-after-milliseconds``), else the default."""
    from specdec.core.redis_store import RedisSessionStore

    if config.store_retry_s is not None:
        seconds, source = config.store_retry_s, "set by the operator (--store-retry-s)"
    elif isinstance(store, RedisSessionStore):
        budget = await store.retry_budget()
        seconds, source = budget.seconds, budget.source
    else:
        seconds, source = DEFAULT_STORE_RETRY_S, "the default"
    log.info("a failed session-store call is tried again for up to %g s before its stream fails with UNAVAILABLE (%s)",
             seconds, source)
    return dataclasses.replace(config, store_retry_s=seconds)


def embedded(target: TargetConfig, draft: DraftConfig, config: OrchestratorConfig, store: SessionStore | None = None,
             loop_config: LoopConfig = LoopConfig()) -> Orchestrator:
    """All roles in this process: the same engines and loop as the servers, no sockets.

    ``target.threads`` None: every forward's torch thread count is chosen by measuring (one thread
    up to this process's cores, core/threads.py); a number fixes it."""
    threads = None
    if target.threads is None:
        threads = ThreadChooser(range(1, available_cores() + 1))
        # Every other thread (the event loop's, say) keeps one torch thread: a second OpenMP team
        # spinning beside the model thread's costs it more than the extra threads give.
        target, draft = dataclasses.replace(target, threads=1), dataclasses.replace(draft, threads=1)
    # One model thread for both: its niceness would slow the verifier's work too.
    drafter = DraftEngine.from_config(dataclasses.replace(draft, thread_nice=0))
    return embedded_engines(VerifierEngine.from_config(target), drafter, config, store, loop_config, threads)


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def embedded_engines(verifier: VerifierEngine, drafter: DraftEngine, config: OrchestratorConfig,
                     store: SessionStore | None = None, loop_config: LoopConfig = LoopConfig(),
                     threads: ThreadChooser | None = None) -> Orchestrator:
    """An orchestrator over engines already loaded, in this process; the verifier's model work runs
    on the drafter's thread. ``threads``: choose forwards' thread counts by measurement."""
    from specdec.draft.link import LocalDraftLink

    loaded = verifier.loaded
    info = TargetInfo(loaded.tokenizer, loaded.vocab_size, loaded.context_length, loaded.eos_token_id, tuple(drafter.drafters))
    scheduler = VerifierScheduler(verifier, executor=drafter, threads=threads)
    local = LocalVerifier(scheduler, lambda run: LocalDraftLink(drafter), loop_config)
    return Orchestrator(info, local, store or InMemorySessionStore(config.session_ttl_s), config)


async def start_draft(config: DraftConfig, server: ServerConfig,
                      registry: "CollectorRegistry | None" = None) -> tuple[RunningServer, DraftEngine]:
    """``registry``: where the drafter's Prometheus metrics go (None: none kept)."""
    from specdec.draft import servicer
    from specdec.metrics import DrafterMetrics

    engine = DraftEngine.from_config(config, DrafterMetrics(registry) if registry is not None else None)
    return await start_server(server, servicer.register(engine), [servicer.SERVICE_NAME]), engine


async def start_target(config: TargetConfig, server: ServerConfig, loop_config: LoopConfig = LoopConfig(),
                       service_token: str | None = None, registry: "CollectorRegistry | None" = None,
                       in_verifier: DraftConfig | None = None,
                       in_verifier_drafters: tuple[str, ...] = ()) -> tuple[RunningServer, LocalVerifier]:
    """``service_token``: what the verifier shows the drafters it streams from (with ``server.tls``:
    mutual TLS too). ``in_verifier``: drafters this process runs itself (in-verifier drafting): a
    session whose drafter is one of them drafts here, taking turns with the verify forwards on one
    model thread as in one process, with no draft worker and no hop; the others stream from draft
    workers. ``in_verifier_drafters``: which of the drafters ``in_verifier`` can build (empty: all);
    ``layer_skip`` among them drafts with this verifier's own decoder over its sessions' own caches."""
    from specdec.draft.link import LocalDraftLink
    from specdec.target import servicer
    from specdec.target.draft_client import DraftChannels, RemoteDraftLink

    channels = DraftChannels(service_token, server.tls)
    from specdec.metrics import VerifierMetrics

    threads = None
    if config.threads is None:  # each forward's thread count measured over this process's cores, as embedded()
        threads = ThreadChooser(range(1, available_cores() + 1))
        config = dataclasses.replace(config, threads=1)
        in_verifier = dataclasses.replace(in_verifier, threads=1) if in_verifier is not None else None
    verifier_engine = VerifierEngine.from_config(config)
    if verifier_engine.tensor_parallel is not None:  # a rank lost: this verifier exits, its sessions resume elsewhere
        from specdec.target.tp_ranks import exit_on_fault

        verifier_engine.tensor_parallel.runner.comm.on_fault = exit_on_fault(verifier_engine.tensor_parallel)
    kv_store = None
    if config.kv_redis_url and verifier_engine.layout is not None:
        from specdec.core.redis_kv import RedisKVStore

        kv_store = RedisKVStore.from_url(config.kv_redis_url, verifier_engine.layout, prefix=config.kv_prefix,
                                         max_session_tokens=config.kv_redis_max_tokens)
    local = None
    if in_verifier is not None:
        # Layer skip drafts over the verifier's own sessions and weights: named, or among all with --layer-skip.
        shares_cache = "layer_skip" in in_verifier_drafters or (not in_verifier_drafters and bool(in_verifier.layer_skip))
        names = tuple(n for n in in_verifier_drafters if n != "layer_skip") if in_verifier_drafters else None
        local = in_verifier_engine(in_verifier, names, verifier_engine if shares_cache else None)
    scheduler = VerifierScheduler(verifier_engine, metrics=VerifierMetrics(registry) if registry is not None else None,
                                  kv_store=kv_store, executor=local, threads=threads)

    def link(run: SessionRun):
        if local is not None and run.spec.drafter in local.drafters:
            return LocalDraftLink(local)
        return RemoteDraftLink(channels, run.drafter_address, run.drafter_server_name) if run.drafter_address else None

    verifier = LocalVerifier(scheduler, link, loop_config, tuple(local.drafters) if local is not None else ())
    return await start_server(server, servicer.register(verifier), [servicer.SERVICE_NAME]), verifier


def in_verifier_engine(config: DraftConfig, names: tuple[str, ...] | None = None,
                       shared_with: VerifierEngine | None = None) -> DraftEngine:
    """The draft engine of a verifier's own drafters: those of ``names`` (None: all it can build),
    and with ``shared_with`` the layer-skip drafter over that verifier's own decoder and caches."""
    from specdec.draft.drafters import build_drafters
    from specdec.draft.layer_skip import shared_in_verifier

    built = build_drafters(dataclasses.replace(config, layer_skip=""))  # (a layer-skip drafter here shares the verifier's)
    missing = sorted(set(names or ()) - set(built))
    if missing:
        raise ValueError(f"in-verifier drafters {missing} cannot be built here (this configuration builds {sorted(built)}: "
                         "a model drafter needs --draft, eagle a head for the target, --eagle-head)")
    drafters = {name: d for name, d in built.items() if names is None or name in names}
    if shared_with is not None:
        drafters["layer_skip"] = shared_in_verifier(shared_with, config)
    return DraftEngine(drafters, dataclasses.replace(config, thread_nice=0))


@dataclass(frozen=True)
class Upstreams:
    drafter_address: str
    verifier_address: str
    tokenizer_path: str  # the target's tokenizer (usually the target model folder)
    timeout_s: float = 30.0  # a worker's first answer (a session's first step includes its prefill)
    step_timeout_s: float = 5.0  # each later step: a verifier silent this long is taken for gone
    service_token: str | None = None  # shown to the workers, which admit only the deployment
    tls: TlsFiles | None = None  # mutual TLS to the workers: our certificate, their CA


async def start_orchestrator(config: OrchestratorConfig, upstreams: Upstreams, store: SessionStore, server: ServerConfig,
                             wait_s: float = 60.0, registry: "CollectorRegistry | None" = None) -> tuple[RunningServer, Orchestrator]:
    from transformers import AutoTokenizer

    from specdec.orchestrator import servicer
    from specdec.orchestrator.pool import DrafterPool, VerifierPool, expand
    from specdec.orchestrator.remote import RemoteVerifyWorker, RemoteWorker

    config = await with_store_retry(config, store)

    def pool_of(addresses: str) -> tuple[list[str], bool]:
        """The addresses, and whether they are one IP address (else: a pool, names followed)."""
        listed = [a.strip() for a in addresses.split(",") if a.strip()]
        return listed, len(listed) == 1 and expand(listed[0]) == [(listed[0], None)]

    draft_addresses, one_drafter = pool_of(upstreams.drafter_address)
    draft_replica = lambda address, server_name=None: RemoteWorker(address, "draft", upstreams.timeout_s,  # noqa: E731
                                                                   upstreams.service_token, upstreams.tls, server_name)
    # Several drafters, or a name: each new session drafts on the least-loaded replica. None: the
    # verifiers draft every session themselves (in-verifier drafting).
    drafters = None if one_drafter or not draft_addresses else DrafterPool(draft_addresses, draft_replica)
    drafter = draft_replica(draft_addresses[0]) if one_drafter else drafters
    addresses, single = pool_of(upstreams.verifier_address)

    def replica(address: str, server_name: str | None = None) -> RemoteVerifyWorker:
        return RemoteVerifyWorker(address, upstreams.timeout_s, upstreams.service_token, upstreams.tls,
                                  upstreams.step_timeout_s, server_name)

    # One IP address: one verifier. Several, or names (a headless Service resolves to its pods):
    # a pool, each session on the least-loaded replica, moved to another if its own fails.
    verifier = replica(addresses[0]) if single else VerifierPool(addresses, replica)
    status = await _wait_for(verifier.status, wait_s, f"verifier at {upstreams.verifier_address}")
    draft_served: tuple[str, ...] = ()
    if drafter is not None:
        draft_served = (await _wait_for(drafter.status, wait_s, f"drafter at {upstreams.drafter_address}")).drafters
        if drafters is None:
            await drafter.aclose()
    elif not status.drafters:
        raise SpecdecError(f"no draft worker (--drafter-address is empty) and the verifier at {upstreams.verifier_address} "
                         "drafts nothing itself: give a draft worker's address or start the verifier with --in-verifier-drafters")
    tokenizer = AutoTokenizer.from_pretrained(upstreams.tokenizer_path, local_files_only=True)
    # The drafters of the draft workers and those the verifiers run themselves (in-verifier drafting).
    drafter_names = tuple(dict.fromkeys((*draft_served, *status.drafters)))
    info = TargetInfo(tokenizer, status.vocab_size, status.context_length, tokenizer.eos_token_id, drafter_names)
    from specdec.metrics import OrchestratorMetrics

    orch = Orchestrator(info, verifier, store, config, drafter_address=upstreams.drafter_address,
                        metrics=OrchestratorMetrics(registry) if registry is not None else None, drafters=drafters)
    orch.start_reaper()
    return await start_server(server, servicer.register(orch, server.credentials), [servicer.SERVICE_NAME]), orch


async def start_http_api(orchestrator: Orchestrator, server: ServerConfig, port: int, model_name: str) -> "HttpServer":
    """The OpenAI-compatible HTTP API on ``server.host:port``, beside the gRPC API of ``server``: the
    same orchestrator (validation, admission, sessions, limits), API keys and TLS certificate."""
    from specdec.orchestrator.http import HttpApi, HttpConfig
    from specdec.orchestrator.http_server import start_http

    return await start_http(HttpApi(orchestrator, HttpConfig(model_name), server.credentials), server.host, port, server.tls)


async def _wait_for(probe, wait_s: float, what: str):
    """Workers may still be loading their models: retry until they answer or the wait runs out."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        try:
            return await probe()
        except Exception as exc:  # connection refused while the worker starts: retry, then report
            if loop.time() > deadline:
                raise ConnectionError(f"{what} did not answer within {wait_s:.0f}s: {exc}") from exc
            await asyncio.sleep(0.2)
