"""``specdec up``: every role as local processes against Redis, in the topology chosen for this machine.

Two topologies (docs/operations.md says when to use which):

- ``colocated``, the default: ``up`` starts every process on this one host, where a draft worker
  would only take cores from the verifier and add a hop to every step. Each verifier drafts its own
  sessions (in-verifier drafting) with every drafter it can build, its model threads chosen by
  measurement over this machine's cores; no draft worker runs.
- ``split``: a draft worker beside each verifier, one model thread each, every step crossing the
  draft hop: the layout for drafters and verifiers on separate machines, run here to try it.

With one process per role, ``up`` stops them all on Ctrl-C or when one dies; with ``--replicas``,
it restarts one that dies, as a Deployment would, and the others serve its sessions meanwhile.
"""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from specdec.cli_common import (
    ALL_DRAFTERS,
    ENV_API_KEYS_FILE,
    ENV_DRAFT,
    ENV_SERVICE_TOKEN,
    ENV_TARGET,
    UsageError,
    draft_placement,
    drafter_options,
    model_path,
    target_placement,
)

TOPOLOGIES = ("colocated", "split")


@dataclass(frozen=True)
class Topology:
    name: str
    commands: dict[str, list[str]]  # process name -> argv
    summary: str  # what runs where, one line for the operator


def up_ports(base: int, replicas: int) -> dict[str, list[int]]:
    """Ports of every process `specdec up` starts: replica i of a role at base + 3i (+1 draft, +2 target);
    the draft port stays reserved in the colocated topology, so a switch keeps every address."""
    return {role: [base + 3 * i + offset for i in range(replicas)]
            for role, offset in (("orchestrator", 0), ("draft", 1), ("target", 2))}


def up_http_ports(base: int, replicas: int, http_port: int | None) -> list[int]:
    """The HTTP API port of each orchestrator `specdec up` starts (none with ``http_port`` -1)."""
    if http_port is not None and http_port < 0:
        return []
    first = base + 3 * replicas if http_port is None else http_port
    return [first + i for i in range(replicas)]


def up_commands(common: list[str], host: str, ports: dict[str, list[int]], redis_url: str,
                http_ports: list[int] | None = None, topology: str = "split") -> dict[str, list[str]]:
    """name -> argv of every process: each orchestrator over a pool of all verifiers (and, split, of all
    drafters; colocated, none: the verifiers draft), orchestrator i serving HTTP on ``http_ports[i]``."""
    roles = ("target", "draft", "orchestrator") if topology == "split" else ("target", "orchestrator")
    drafters = ",".join(f"{host}:{p}" for p in ports["draft"]) if topology == "split" else ""
    verifiers = ",".join(f"{host}:{p}" for p in ports["target"])
    commands = {}
    for role in roles:
        for i, port in enumerate(ports[role]):
            name = role if len(ports[role]) == 1 else f"{role}-{i}"
            commands[name] = common + [role, "--port", str(port), "--drafter-address", drafters, "--verifier-address", verifiers,
                                       *(["--redis-url", redis_url] if role == "orchestrator" else []),
                                       *(["--http-port", str(http_ports[i])] if role == "orchestrator" and http_ports else [])]
    return commands


def choose_topology(args) -> str:
    """--topology, else colocated: every process `up` starts shares this host's cores."""
    return args.topology or "colocated"


def plan(args, common: list[str], host: str, ports: dict[str, list[int]], http_ports: list[int]) -> Topology:
    """The processes of the chosen topology, with the per-role flags it implies."""
    name = choose_topology(args)
    commands = up_commands(common, host, ports, args.redis_url, http_ports, name)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if name == "colocated":
        drafting = args.in_verifier_drafters or ALL_DRAFTERS
        # One model process per host: its thread count is measured per forward over the cores (unless
        # --threads fixes it); the orchestrators' Python takes a core only while it has work.
        threads = [] if args.threads is None else ["--threads", str(args.threads)]
        for role, argv in commands.items():
            if role.startswith("target"):
                argv += ["--in-verifier-drafters", drafting, *threads]
            else:
                argv += ["--threads", "1"]
        summary = (f"colocated on {cores} cores: orchestrator and verifier processes, each verifier drafting its "
                   f"own sessions ({'every drafter it builds' if drafting == ALL_DRAFTERS else drafting}), "
                   f"model threads {args.threads or 'measured per forward'}; no draft worker, no draft hop")
    else:
        # Orchestrator, draft worker and verifier share the cores: one torch thread each unless told otherwise.
        for role, argv in commands.items():
            argv += ["--threads", str(args.threads or 1)]
            if role.startswith("target") and args.in_verifier_drafters:
                argv += ["--in-verifier-drafters", args.in_verifier_drafters]
        summary = (f"split on {cores} cores: orchestrator, draft worker and verifier processes, one model thread "
                   f"each{', the verifier drafting ' + args.in_verifier_drafters + ' itself' if args.in_verifier_drafters else ''}; "
                   "every other step crosses the draft hop (the layout for separate machines)")
    return Topology(name, commands, summary)


def role_flags(args) -> list[str]:
    """The flags every process gets: models, placement (resolved and refused here, before any process
    starts, so each gets the same explicit values), drafter options."""
    flags = ["--target", model_path(args.target, ENV_TARGET, "target"), "--draft", model_path(args.draft, ENV_DRAFT, "draft")]
    if args.store_retry_s is not None:  # else each orchestrator reads it from the store
        flags += ["--store-retry-s", str(args.store_retry_s)]
    if args.reference_forward:
        flags += ["--reference-forward"]
    placed = target_placement(args.device, args.dtype, args.numerics, args.runner, args.reference_forward,
                              args.kv_memory_fraction)
    draft_placed = draft_placement(args.draft_device, args.draft_dtype)
    flags += ["--draft-device", draft_placed["draft_device"], "--draft-dtype", draft_placed["draft_dtype"],
              "--draft-min-confidence", str(args.draft_min_confidence)]
    flags += ["--device", placed["device"], "--dtype", placed["dtype"], "--numerics", args.numerics,
              "--weight-layouts", str(args.weight_layouts)]
    if not args.reference_forward:
        flags += ["--runner", placed["runner"]]
    if args.tensor_parallel != 1:  # (every serve takes it; only the verifiers use it)
        flags += ["--tensor-parallel", str(args.tensor_parallel), "--tensor-parallel-timeout-s", str(args.tensor_parallel_timeout_s)]
    if placed["kv_memory_fraction"] is not None:
        flags += ["--kv-memory-fraction", str(placed["kv_memory_fraction"])]
    if args.eagle_head:
        flags += ["--eagle-head", str(Path(args.eagle_head).resolve())]
    for field, value in drafter_options(args).items():
        if value != "":
            flags += [f"--{field.replace('_', '-')}", str(value)]
    return flags


def run(args) -> int:
    """Start the processes, say what runs where, wait for Ctrl-C (or a death, with one of each)."""
    if args.replicas < 1:
        raise UsageError(f"--replicas must be >= 1, got {args.replicas}")
    ports = up_ports(args.base_port, args.replicas)
    common = [sys.executable, "-m", "specdec", "serve", "--host", args.host, *role_flags(args)]
    # A fresh service token per run, through the environment: only these processes hold it. OpenMP
    # threads sleep when idle instead of spinning on a core another process needs (docs/performance.md).
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
           ENV_SERVICE_TOKEN: os.environ.get(ENV_SERVICE_TOKEN) or secrets.token_urlsafe(32)}
    if args.api_keys_file:
        env[ENV_API_KEYS_FILE] = str(Path(args.api_keys_file).resolve())
    ca_file = tls_dir = None
    if args.tls:
        import tempfile

        from specdec.rpc.certs import make_dev_certs

        # A CA per run, like the token: nothing outside these processes (and the user) trusts it.
        tls_dir = tempfile.mkdtemp(prefix="specdec-tls-")
        paths = make_dev_certs(tls_dir, [args.host], days=1)
        ca_file = str(paths["ca.crt"])
        common += ["--tls-cert", str(paths["tls.crt"]), "--tls-key", str(paths["tls.key"]), "--tls-ca", ca_file]
    http_ports = up_http_ports(args.base_port, args.replicas, args.http_port)
    topology = plan(args, common, args.host, ports, http_ports)
    commands = topology.commands
    procs = {name: subprocess.Popen(argv, env=env) for name, argv in commands.items()}
    orchestrators = ",".join(f"{args.host}:{p}" for p in ports["orchestrator"])
    drafters = f", draft {','.join(map(str, ports['draft']))}" if topology.name == "split" else ""
    print(f"specdec up: starting orchestrator {orchestrators}{drafters}, target {','.join(map(str, ports['target']))}; "
          f"sessions in {args.redis_url}", flush=True)
    print(f"specdec up: topology {topology.summary} (--topology; docs/operations.md)", flush=True)
    if not args.api_keys_file:
        print(f"specdec up: warning: no --api-keys-file: the client API (gRPC and HTTP) is open to anyone who can reach "
              f"{args.host}, sessions included; pass --api-keys-file for anything shared", file=sys.stderr, flush=True)
    stopping = False
    ready = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        while not stopping:
            dead = [name for name, p in procs.items() if p.poll() is not None]
            if dead and args.replicas == 1:
                print(f"specdec up: {', '.join(dead)} exited; stopping the others", file=sys.stderr)
                break
            for name in dead:  # replicas: the others serve its sessions meanwhile
                print(f"specdec up: {name} exited ({procs[name].returncode}); restarting it", file=sys.stderr, flush=True)
                procs[name] = subprocess.Popen(commands[name], env=env)
            if not ready and healthy(f"{args.host}:{ports['orchestrator'][0]}", ca_file):
                ready = True
                tls_hint = f" --tls-ca {ca_file}" if ca_file else ""
                print(f"specdec up: ready. Try: specdec generate --server {orchestrators}{tls_hint} "
                      f"\"def fib(n):\"", flush=True)
                scheme = "https" if ca_file else "http"
                for port in http_ports:
                    print(f"specdec up: OpenAI-compatible HTTP API on {scheme}://{url_host(args.host)}:{port}/v1", flush=True)
            time.sleep(0.2)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        if tls_dir:
            import shutil

            shutil.rmtree(tls_dir, ignore_errors=True)
    return 0 if stopping else 1


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def healthy(address: str, ca_file: str | None = None) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = (grpc.secure_channel(address, grpc.ssl_channel_credentials(Path(ca_file).read_bytes())) if ca_file
               else grpc.insecure_channel(address))
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="specdec.v1.Generation"), timeout=0.5)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
