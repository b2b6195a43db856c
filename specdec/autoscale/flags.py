"""The flags of ``specdec autoscale``, apart from the loop so that building the CLI's parser does
not import the Kubernetes client (a slow import every other command would pay: docs/performance.md, 8)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from specdec.autoscale.policy import PolicyConfig


@dataclass(frozen=True)
class Deployments:
    target: str = "specdec-target"
    draft: str = "specdec-draft"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``specdec autoscale``."""
    where = p.add_argument_group("what to scale")
    where.add_argument("--namespace", default=None, help="namespace of the Deployments (default: this pod's, else default)")
    where.add_argument("--target-deployment", default=Deployments.target)
    where.add_argument("--draft-deployment", default=Deployments.draft)
    where.add_argument("--kubeconfig", default=None,
                       help="kubeconfig file (default: the pod's service account in a cluster, else ~/.kube/config)")
    where.add_argument("--kube-context", default=None, help="context in the kubeconfig")
    where.add_argument("--kube-api", default=None, metavar="URL",
                       help="talk to this API URL without credentials (kubectl proxy), instead of a kubeconfig")
    metrics = p.add_argument_group("where the metrics are",
                                   "HOST:PORT, comma-separated or repeated; a DNS name with many addresses (a headless "
                                   "Service) counts one pod per address")
    metrics.add_argument("--target-metrics", action="append", default=[], metavar="HOST:PORT")
    metrics.add_argument("--draft-metrics", action="append", default=[], metavar="HOST:PORT")
    metrics.add_argument("--orchestrator-metrics", action="append", default=[], metavar="HOST:PORT")
    metrics.add_argument("--scrape-timeout-s", type=float, default=2.0)
    metrics.add_argument("--latency-quantile", type=float, default=0.9, help="quantile of TTFT and ITL held to the objectives")
    loop = p.add_argument_group("loop")
    loop.add_argument("--interval-s", type=float, default=15.0, help="seconds between decisions (one measurement window)")
    loop.add_argument("--dry-run", action="store_true", help="print each decision and its reason; scale nothing")
    loop.add_argument("--iterations", type=int, default=0, help="stop after this many decisions (0: run until stopped)")
    d = PolicyConfig()
    policy = p.add_argument_group("policy")
    policy.add_argument("--min-target", type=int, default=d.target_limits.min_replicas)
    policy.add_argument("--max-target", type=int, default=d.target_limits.max_replicas)
    policy.add_argument("--min-draft", type=int, default=d.draft_limits.min_replicas)
    policy.add_argument("--max-draft", type=int, default=d.draft_limits.max_replicas)
    policy.add_argument("--target-utilization", type=float, default=d.target_utilization,
                        help="busy fraction each verifier should run at")
    policy.add_argument("--draft-utilization", type=float, default=d.draft_utilization,
                        help="busy fraction each drafter should run at")
    policy.add_argument("--queued-steps-per-replica", type=float, default=d.queued_steps_per_replica,
                        help="verification rounds a verifier may have queued before it counts as behind")
    policy.add_argument("--ttft-objective-s", type=float, default=d.ttft_objective_s, help="time to first token (default: none)")
    policy.add_argument("--itl-objective-s", type=float, default=d.itl_objective_s, help="inter-token latency (default: none)")
    policy.add_argument("--hysteresis", type=float, default=d.hysteresis,
                        help="hold while the wanted replicas are within this fraction of the current count")
    policy.add_argument("--scale-up-cooldown-s", type=float, default=d.scale_up_cooldown_s,
                        help="between scale-ups of a pool (longer than a pod takes to load its model)")
    policy.add_argument("--scale-down-cooldown-s", type=float, default=d.scale_down_cooldown_s,
                        help="how long a pool must want fewer replicas before it shrinks")
    policy.add_argument("--max-scale-up-factor", type=float, default=d.max_scale_up_factor)
