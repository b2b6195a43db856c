"""The autoscaler's loop: every interval, observe → decide → scale (or, with --dry-run, only say what it would do).

``specdec autoscale`` hooks in through `add_arguments(parser)` and `main(args)`. One replica of it
is enough (it holds no lock; two would both act on the same numbers): run it as a Deployment of one
with a ServiceAccount allowed ``get`` and ``patch`` on ``deployments/scale``.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable

import urllib3
from kubernetes.client.exceptions import ApiException

from specdec.autoscale import kube
from specdec.autoscale.flags import Deployments, add_arguments  # noqa: F401 (specdec.cli builds the parser from flags)
from specdec.autoscale.observe import MetricsTargets, Observer, parse_targets
from specdec.autoscale.policy import Decision, PolicyConfig, PolicyState, PoolDecision, PoolLimits, decide

log = logging.getLogger(__name__)

# What a failed Kubernetes call raises: an answer with an error status, or no answer at all.
KUBE_ERRORS = (ApiException, urllib3.exceptions.HTTPError, OSError)


class Autoscaler:
    """One `step()` per interval; the policy's state lives here between steps."""

    def __init__(self, observer: Observer, scaler: kube.DeploymentScaler, config: PolicyConfig,
                 deployments: Deployments = Deployments(), dry_run: bool = False,
                 report: Callable[[str], None] = lambda line: print(line, flush=True),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.observer, self.scaler, self.config = observer, scaler, config
        self.deployments, self.dry_run, self.report, self.clock = deployments, dry_run, report, clock
        self.state = PolicyState()

    def step(self) -> Decision | None:
        """Observe, decide, act. None when the Deployments could not be read (nothing is done then)."""
        observation = self.observer.observe()
        try:
            target = self.scaler.read(self.deployments.target)
            draft = self.scaler.read(self.deployments.draft)
        except KUBE_ERRORS as exc:
            log.warning("reading the Deployments' scale: %s; holding", _short(exc))
            return None
        decision = decide(observation.snapshot(target.spec_replicas, draft.spec_replicas), self.state, self.config,
                          now=self.clock())
        prefix = "dry-run: " if self.dry_run else ""
        for pool in (decision.target, decision.draft):
            self.report(prefix + pool.reason)
        if self.dry_run:
            self.state = decision.state  # as if done, so the cooldowns read as they would live
            return decision
        # A pool whose patch failed keeps its old state: the next step decides again from scratch.
        target_ok = self._apply(decision.target, self.deployments.target)
        draft_ok = self._apply(decision.draft, self.deployments.draft)
        self.state = PolicyState(decision.state.target if target_ok else self.state.target,
                                 decision.state.draft if draft_ok else self.state.draft)
        return decision

    def _apply(self, pool: PoolDecision, deployment: str) -> bool:
        if not pool.changed:
            return True
        try:
            self.scaler.set_replicas(deployment, pool.desired)
        except KUBE_ERRORS as exc:
            log.warning("scaling %s to %d: %s", deployment, pool.desired, _short(exc))
            return False
        self.report(f"scaled {deployment} from {pool.current} to {pool.desired}")
        return True

    def run(self, interval_s: float, iterations: int | None = None, stop: threading.Event | None = None) -> None:
        """Step every ``interval_s`` until ``stop`` is set or ``iterations`` steps are done."""
        stop = stop or threading.Event()
        done = 0
        while not stop.is_set() and (iterations is None or done < iterations):
            started = time.monotonic()
            self.step()
            done += 1
            if iterations is None or done < iterations:
                stop.wait(max(0.0, interval_s - (time.monotonic() - started)))


def _short(exc: Exception) -> str:
    if isinstance(exc, ApiException):
        return f"HTTP {exc.status} {exc.reason}"
    return f"{type(exc).__name__}: {exc}"


# ----------------------------------------------------------------------------- command line
def policy_config(args: argparse.Namespace) -> PolicyConfig:
    return PolicyConfig(
        target_limits=PoolLimits(args.min_target, args.max_target), draft_limits=PoolLimits(args.min_draft, args.max_draft),
        target_utilization=args.target_utilization, draft_utilization=args.draft_utilization,
        queued_steps_per_replica=args.queued_steps_per_replica, ttft_objective_s=args.ttft_objective_s,
        itl_objective_s=args.itl_objective_s, hysteresis=args.hysteresis, scale_up_cooldown_s=args.scale_up_cooldown_s,
        scale_down_cooldown_s=args.scale_down_cooldown_s, max_scale_up_factor=args.max_scale_up_factor,
        # A snapshot a few intervals old means the loop itself is stuck: do not act on it.
        max_snapshot_age_s=max(3 * args.interval_s, 30.0))


def main(args: argparse.Namespace) -> int:
    """Run the loop until SIGTERM/SIGINT or --iterations; 2 on a bad command line."""
    try:
        config = policy_config(args)
        targets = MetricsTargets(tuple(parse_targets(args.target_metrics)), tuple(parse_targets(args.draft_metrics)),
                                 tuple(parse_targets(args.orchestrator_metrics)))
    except ValueError as exc:
        print(f"specdec autoscale: {exc}", file=sys.stderr)
        return 2
    if not targets.target or not targets.draft:
        print("specdec autoscale: need --target-metrics and --draft-metrics (the pools' /metrics addresses)", file=sys.stderr)
        return 2
    api = kube.api_client(kubeconfig=args.kubeconfig, context=args.kube_context, host=args.kube_api)
    scaler = kube.DeploymentScaler(api, args.namespace or kube.default_namespace())
    observer = Observer(targets, timeout_s=args.scrape_timeout_s, latency_quantile=args.latency_quantile)
    autoscaler = Autoscaler(observer, scaler, config, Deployments(args.target_deployment, args.draft_deployment),
                            dry_run=args.dry_run)
    stop = threading.Event()
    restore = _stop_on_signals(stop)
    try:
        autoscaler.run(args.interval_s, iterations=args.iterations or None, stop=stop)
    finally:
        restore()
        observer.close()
        api.close()
    return 0


def _stop_on_signals(stop: threading.Event) -> Callable[[], None]:
    """SIGTERM (a pod being stopped) and SIGINT end the loop between steps; returns the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore
