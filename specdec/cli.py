"""The ``specdec`` command: generate, serve one role, or bring all roles up locally.

The composition root: it imports the roles, ``specdec bench`` and the autoscaler, and none of them
imports it back (what they share is specdec.cli_common). Only grpcio and protobuf are needed to
load this module and run ``generate --server``; the server commands import the server extra
(torch, transformers, redis, ...) when they run, and without it say what to install.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import sys
import time
from pathlib import Path

from specdec.cli_common import (
    ENV_API_KEY,
    ENV_API_KEYS_FILE,
    ENV_DRAFT,
    ENV_REDIS,
    ENV_SERVICE_TOKEN,
    ENV_TARGET,
    MODEL_PACKAGES,
    ROLE_PACKAGES,
    SERVER_EXTRA_HINT,
    DRAFTERS,
    DTYPE_CHOICES,
    RUNNER_CHOICES,
    UsageError,
    device_arg,
    ALL_DRAFTERS,
    PORTS,
    draft_placement,
    drafter_options,
    drafters_help,
    eagle_head_path,
    fraction,
    model_path,
    probability_below_one,
    require_server_extra,
    server_package_of,
    target_placement,
)
from specdec.core.errors import SpecdecError

# What of the server extra each command needs (import names); `generate --server` needs none of it.
NEEDS = {"generate": MODEL_PACKAGES, "serve": ROLE_PACKAGES, "up": ROLE_PACKAGES, "bench": ROLE_PACKAGES,
         "certs": ("cryptography",), "autoscale": ("kubernetes", "prometheus_client")}


# ----------------------------------------------------------------------------- arguments
def _add_model_args(p: argparse.ArgumentParser, draft: bool = True, target: bool = True) -> None:
    if target:
        p.add_argument("--target", help=f"target model folder (default: ${ENV_TARGET} or the demo pair)")
    if draft:
        p.add_argument("--draft", help=f"draft model folder (default: ${ENV_DRAFT} or the demo pair)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per model (default: generate, serve target and up's colocated verifier measure "
                        "1..cores per forward and use the faster; up --topology split: 1; serve draft: torch's own)")
    p.add_argument("--reference-forward", action="store_true",
                   help="run models through the HF forward instead of specdec's lean decode path (slower; for checking)")
    if target:
        p.add_argument("--device", type=device_arg, default=None, metavar="auto|cpu|cuda|cuda:N",
                       help="where the target's weights, KV cache and logits live (default auto: cuda when torch "
                            "sees a CUDA device, else cpu)")
        p.add_argument("--dtype", choices=DTYPE_CHOICES, default=None,
                       help="target model precision (default auto: bfloat16 on CUDA, float32 on the CPU; "
                            "bfloat16 on the CPU: weights in bf16, widened in specdec's C kernels where the CPU has no bf16 dot)")
        p.add_argument("--runner", choices=RUNNER_CHOICES, default="auto",
                       help="the target's model runner: lean (specdec's CPU forward), paged (paged KV cache), hf "
                            "(the transformers forward, as --reference-forward); default auto: paged on CUDA; on the CPU lean for a "
                            "plain Llama, else paged where it serves the model")
        p.add_argument("--kv-memory-fraction", type=fraction, default=None, metavar="F",
                       help="paged runner on CUDA: size the target's KV page pool as this fraction (0 < F < 1) of the "
                            "device's free memory after the weights (default: the KV budget's tokens)")
        p.add_argument("--numerics", choices=("auto", "exact", "fast"), default="auto",
                       help="exact: a row's target logits are bitwise the same whatever shares its forward "
                            "(docs/guarantees.md); fast: kernels timed at load; auto (default): exact where "
                            "this CPU holds it, else fast with a warning")
        p.add_argument("--weight-layouts", type=int, choices=(1, 2), default=1,
                       help="copies of each target weight the lean forward keeps: 1 (memory = the weights) or 2 "
                            "(the fastest kernel for one row and for more: up to twice the memory; docs/performance.md)")
    if draft:
        p.add_argument("--draft-device", type=device_arg, default=None, metavar="auto|cpu|cuda|cuda:N",
                       help="where the draft model runs (default auto: cuda when visible, else cpu); a draft on the "
                            "CPU beside a target on a GPU is a supported layout. `serve draft` takes --device (and "
                            "--dtype) for the draft's when --draft-device (--draft-dtype) is not given")
        p.add_argument("--draft-dtype", choices=DTYPE_CHOICES, default=None,
                       help="draft model precision (default auto: bfloat16 on CUDA, float32 on the CPU; bfloat16 on "
                            "the CPU: weights in bf16, widened in specdec's C kernels where the CPU has no bf16 dot)")
        p.add_argument("--eagle-head", default=None, metavar="PATH",
                       help="an EAGLE head trained on the target, for --drafter eagle (default $SPECDEC_EAGLE_HEAD, "
                            "or models/demo/eagle with the demo target)")
        p.add_argument("--layer-skip", default="", metavar="auto|LAYERS",
                       help="serve drafter layer_skip: the target's own layers as its drafter, chosen by measurement "
                            "at start-up (auto) or named (0,1,3); loads the target's weights on the drafter "
                            "(generate --drafter layer_skip without it: auto)")
        p.add_argument("--lookahead-window", type=int, default=4, metavar="W",
                       help="drafter lookahead: Jacobi guesses in its lookahead branch (default 4)")
        p.add_argument("--lookahead-ngram", type=int, default=4, metavar="N", help="drafter lookahead: n-gram size (default 4)")
        p.add_argument("--lookahead-candidates", type=int, default=4, metavar="G",
                       help="drafter lookahead: pooled n-grams verified per step (default 4)")
        p.add_argument("--draft-min-confidence", type=probability_below_one, default=0.0, metavar="P",
                       help="end a draft block after a token the draft gives less than P probability (default 0: "
                            "blocks of k; k is then an upper bound; never changes the output)")


def _add_tensor_parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="target: one verifier of N ranks (processes on this machine, gloo), each holding 1/N of the "
                        "heads, MLP units and vocabulary (the lean runner on the CPU; N divides the heads and KV heads; "
                        "docs/operations.md). Default 1")
    p.add_argument("--tensor-parallel-timeout-s", type=float, default=30.0, metavar="S",
                   help="target with --tensor-parallel: a rank that answers no collective this long is taken for dead, "
                        "and the verifier exits (its sessions resume elsewhere)")


def _add_request_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--rule", choices=("coupled", "rejection"), default=None,
                   help="how sampled drafts are verified (default coupled: a seed gives the same text whatever "
                        "the speculation; rejection: Leviathan et al.'s rule)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--drafter", default="model", help=drafters_help())
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=None, help="fixed speculation length (default: adaptive)")
    p.add_argument("--max-speculative-tokens", type=int, default=8, help="adaptive upper bound")
    p.add_argument("--no-overlap", action="store_true",
                   help="draft only after each verification (no drafting ahead); same output, usually slower")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specdec", description="Distributed, lossless speculative decoding.")
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion (all roles in this process, or --server)")
    gen.add_argument("prompt")
    gen.add_argument("--json", action="store_true", help="print one JSON object with text, ids and stats")
    gen.add_argument("--server", help="use a running orchestrator at HOST:PORT instead of this process (several, "
                                      "comma-separated: a stream whose orchestrator fails resumes on another)")
    gen.add_argument("--api-key-file", help=f"file holding the API key to send with --server (default: ${ENV_API_KEY})")
    gen.add_argument("--tls-ca", help="with --server: connect with TLS, verifying the orchestrator against this PEM CA")
    _add_model_args(gen)
    _add_tensor_parallel_args(gen)
    _add_request_args(gen)

    serve = sub.add_parser("serve", help="run one role as a gRPC server")
    serve.add_argument("role", choices=["draft", "target", "orchestrator"])
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="port (default: 50051 orchestrator, 50052 draft, 50053 target)")
    serve.add_argument("--grace-s", type=float, default=5.0,
                       help="on SIGTERM: health turns NOT_SERVING, then in-flight calls get this long to finish")
    serve.add_argument("--metrics-port", type=int, default=None,
                       help="serve Prometheus metrics over HTTP at /metrics on this port (default: none)")
    serve.add_argument("--health-port", type=int, default=None,
                       help="also serve grpc.health.v1, and only it, in plaintext on this port (probes that cannot do TLS)")
    serve.add_argument("--drafter-address", default=f"127.0.0.1:{PORTS['draft']}",
                       help="orchestrator: a draft worker, or several comma-separated; empty: none (the verifiers "
                            "draft every session themselves, --in-verifier-drafters)")
    serve.add_argument("--verifier-address", default=f"127.0.0.1:{PORTS['target']}",
                       help="orchestrator: a verifier, or several comma-separated (each session on the least loaded; "
                            "moved to another if its own fails)")
    serve.add_argument("--step-timeout-s", type=float, default=5.0,
                       help="orchestrator: a verifier silent this long mid-session is taken for gone")
    serve.add_argument("--redis-url", default=os.environ.get(ENV_REDIS),
                       help=f"session store (default ${ENV_REDIS}; none: in memory): redis://, rediss://, "
                            "redis+cluster://h:p[,h:p...] or redis+sentinel://h:p[,h:p...]/service (docs/operations.md)")
    serve.add_argument("--store-retry-s", type=float, default=None,
                       help="orchestrator: a failed session-store call is retried this long (a Redis restart, a "
                            "failover) before the stream ends with UNAVAILABLE (default: read from the store: a "
                            "cluster's or Sentinel's failover time, a restart's for one server; docs/operations.md)")
    serve.add_argument("--max-new-tokens-limit", type=int, default=2048)
    serve.add_argument("--max-concurrent-requests", type=int, default=64, help="orchestrator: requests generating at once")
    serve.add_argument("--max-waiting-requests", type=int, default=256,
                       help="orchestrator: requests waiting in line (FIFO) for a running slot; past that RESOURCE_EXHAUSTED")
    serve.add_argument("--max-prompt-bytes", type=int, default=1 << 20, help="orchestrator: longest prompt text, checked before tokenizing")
    serve.add_argument("--http-port", type=int, default=None,
                       help="orchestrator: also serve the OpenAI-compatible HTTP API on this port, with the gRPC API's keys, "
                            "TLS certificate and limits (default: none)")
    serve.add_argument("--served-model-name", default=None,
                       help="orchestrator: the model name the HTTP API serves (default: the target folder's name)")
    serve.add_argument("--no-draft-model", action="store_true", help="draft role: serve only model-free drafters")
    serve.add_argument("--in-verifier-drafters", default="", metavar="NAMES",
                       help="target role: drafters the verifier runs itself, comma-separated (e.g. eagle,eagle_tree,ngram) or all "
                            "(every one it can build): their sessions draft in the verifier's process, no draft worker "
                            "and no hop (docs/architecture.md)")
    serve.add_argument("--max-sessions", type=int, default=256, help="draft/target: sessions open at once on this worker")
    serve.add_argument("--max-kv-tokens", type=int, default=None,
                       help="target: KV budget over all sessions, in tokens; each reserves prompt + max_new_tokens "
                            "(default: max-sessions full contexts)")
    serve.add_argument("--kv-redis-url", default=None,
                       help="target: keep sessions' KV blocks in this Redis, so another verifier can resume a session "
                            "without recomputing its prefix (default: not kept)")
    serve.add_argument("--kv-block-tokens", type=int, default=16, help="target: tokens per stored KV block")
    serve.add_argument("--kv-redis-max-tokens", type=int, default=4096,
                       help="target: most positions of one session kept in Redis (its memory cap; the rest is recomputed on resume)")
    serve.add_argument("--max-session-tokens", type=int, default=1 << 16,
                       help="draft: longest sequence one session may hold (the draft model's context caps it too)")
    _add_auth_args(serve)
    _add_tls_args(serve)
    _add_model_args(serve)
    _add_tensor_parallel_args(serve)

    up = sub.add_parser("up", help="start every role on this machine as local processes (colocated: the verifier drafts)")
    up.add_argument("--topology", choices=("colocated", "split"), default=None,
                    help="colocated (default: every process shares this host): each verifier drafts its own sessions, "
                         "no draft worker and no hop; split: a draft worker beside each verifier, the layout for "
                         "separate machines (docs/operations.md)")
    up.add_argument("--redis-url", default=os.environ.get(ENV_REDIS, "redis://127.0.0.1:6379/0"),
                    help="session store: redis://, rediss://, redis+cluster://h:p[,h:p...] or "
                         "redis+sentinel://h:p[,h:p...]/service (docs/operations.md)")
    up.add_argument("--store-retry-s", type=float, default=None,
                    help="the orchestrators retry a failed session-store call this long (default: read from the store)")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--base-port", type=int, default=PORTS["orchestrator"], help="orchestrator port; draft +1, target +2")
    up.add_argument("--replicas", type=int, default=1,
                    help="processes per role (ports base + 3i, +1, +2); with 2 or more, a process that dies is "
                         "restarted and its sessions go on elsewhere (try: kill one, `generate --server A,B`)")
    up.add_argument("--api-keys-file", default=os.environ.get(ENV_API_KEYS_FILE),
                    help=f"client API keys, one per line (default ${ENV_API_KEYS_FILE}; none: the client API is open)")
    up.add_argument("--tls", action="store_true",
                    help="TLS on every hop (mutual between roles) with a development CA made for this run")
    up.add_argument("--in-verifier-drafters", default="", metavar="NAMES",
                    help="drafters each verifier runs itself, comma-separated (e.g. eagle,eagle_tree), or all (the "
                         "colocated default); split: the others draft on the draft worker")
    up.add_argument("--http-port", type=int, default=None,
                    help="the OpenAI-compatible HTTP API of orchestrator i on this port + i (default: the ports after "
                         "the gRPC ones, base + 3 x replicas; -1: no HTTP API)")
    _add_model_args(up)
    _add_tensor_parallel_args(up)

    certs = sub.add_parser("certs", help="make a development CA and a certificate for every role (TLS and mutual TLS)")
    certs.add_argument("--out", required=True, help="folder to write ca.crt, ca.key, tls.crt, tls.key")
    certs.add_argument("--name", action="append", default=[],
                       help="DNS name or IP the roles are reached at (repeatable; localhost and 127.0.0.1 are always in)")
    certs.add_argument("--days", type=int, default=30)

    autoscale = sub.add_parser("autoscale", help="size the draft and target Deployments from the roles' measured load")
    from specdec.autoscale.flags import add_arguments as add_autoscale_arguments

    add_autoscale_arguments(autoscale)

    bench = sub.add_parser("bench", help="target-only vs in-process vs distributed speculation, k = 1..8 and adaptive, one run")
    from specdec.bench import add_arguments as add_bench_arguments

    add_bench_arguments(bench)
    return ap


def _target_placement(args) -> dict:
    """--device, --dtype, --numerics, --runner, --reference-forward and --kv-memory-fraction as TargetConfig fields."""
    return target_placement(args.device, args.dtype, args.numerics, args.runner, args.reference_forward,
                            args.kv_memory_fraction)


def _tensor_parallel(args) -> dict:
    """--tensor-parallel and --tensor-parallel-timeout-s as TargetConfig fields."""
    if args.tensor_parallel < 1 or args.tensor_parallel_timeout_s <= 0:
        raise UsageError(f"--tensor-parallel must be at least 1 and --tensor-parallel-timeout-s positive; got "
                         f"{args.tensor_parallel}, {args.tensor_parallel_timeout_s}")
    return {"tensor_parallel": args.tensor_parallel, "tensor_parallel_timeout_s": args.tensor_parallel_timeout_s}


def _draft_placement(args) -> dict:
    """--draft-device and --draft-dtype as DraftConfig fields."""
    return draft_placement(args.draft_device, args.draft_dtype)


def resolve_rule(args) -> str:
    """The --rule flag, else the server's default (coupled)."""
    return args.rule or "coupled"


def _add_auth_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-keys-file", default=os.environ.get(ENV_API_KEYS_FILE),
                   help=f"orchestrator: client API keys, one per line (default ${ENV_API_KEYS_FILE}; none: the client API is open)")
    p.add_argument("--service-token-file",
                   help=f"the deployment's service token: workers admit only callers holding it, orchestrators and "
                        f"verifiers send it (default ${ENV_SERVICE_TOKEN}; none: internal hops are open)")


def _add_tls_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-cert", help="PEM certificate: this role serves TLS with it, and shows it to the roles it calls")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", help="PEM CA of the deployment: workers admit only callers with a certificate it signed "
                                    "(mutual TLS); callers verify the workers against it")


def tls_files(args) -> "TlsFiles | None":
    from specdec.rpc.tls import TlsFiles

    try:
        return TlsFiles.from_flags(args.tls_cert, args.tls_key, args.tls_ca)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def _secret(path: str | None, env: str) -> str | None:
    if path:
        return Path(path).read_text().strip() or None
    return os.environ.get(env) or None


def server_credentials(args) -> tuple["Credentials", str | None]:
    """(what this server accepts, the service token it sends upstream)."""
    from specdec.rpc.auth import Credentials

    token = _secret(args.service_token_file, ENV_SERVICE_TOKEN)
    if args.role == "orchestrator":
        accepted = Credentials.from_file(args.api_keys_file) if args.api_keys_file else Credentials()
    else:
        accepted = Credentials((token,) if token else ())
    return accepted, token


def request_from_args(args) -> "GenerationRequest":
    from specdec.core.sampling import SamplingParams, VerificationRule
    from specdec.core.speculation import SpeculationMode, SpeculationPolicy
    from specdec.orchestrator.request import GenerationRequest

    seed = args.seed if args.seed is not None else secrets.randbits(63)
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, seed, VerificationRule(resolve_rule(args)))
    if args.num_speculative_tokens is None:
        policy = SpeculationPolicy(SpeculationMode.ADAPTIVE, min(4, args.max_speculative_tokens), args.max_speculative_tokens,
                                   overlap=not args.no_overlap)
    else:
        policy = SpeculationPolicy(SpeculationMode.FIXED, args.num_speculative_tokens,
                                   max(args.num_speculative_tokens, args.max_speculative_tokens), overlap=not args.no_overlap)
    return GenerationRequest(prompt_text=args.prompt, max_new_tokens=args.max_new_tokens, sampling=sampling,
                             seed_given=args.seed is not None, stop=tuple(args.stop), drafter=args.drafter, policy=policy)


# ----------------------------------------------------------------------------- generate
async def _generate_embedded(args) -> int:
    from specdec import roles
    from specdec.draft.drafters import DraftConfig
    from specdec.orchestrator.request import OrchestratorConfig
    from specdec.target.engine import TargetConfig

    if args.drafter not in DRAFTERS:  # before any model loads
        raise UsageError(f"unknown drafter {args.drafter[:64]!r}; specdec generate serves {', '.join(sorted(DRAFTERS))}")
    target = model_path(args.target, ENV_TARGET, "target")
    # The drafters over the draft model need it; the others load it only when named.
    draft = model_path(args.draft, ENV_DRAFT, "draft") if args.drafter in ("model", "tree") else (args.draft or os.environ.get(ENV_DRAFT))
    options = drafter_options(args)
    if args.drafter == "layer_skip" and not options["layer_skip"]:
        options["layer_skip"] = "auto"  # named without its flag: its layers chosen by measurement, as --layer-skip auto
    request = request_from_args(args)
    # Drafter and verifier take turns on one model thread; unless --threads fixes it, each forward's
    # torch thread count is chosen by measuring: more threads win on an idle machine and lose badly
    # while another process keeps a core busy (docs/performance.md).
    threads = args.threads
    orch = roles.embedded(TargetConfig(target, threads=threads, weight_layouts=args.weight_layouts, **_target_placement(args),
                                       **_tensor_parallel(args)),
                          DraftConfig(draft, target, threads=threads, fast_draft_forward=not args.reference_forward,
                                      min_confidence=args.draft_min_confidence, eagle_head_path=eagle_head_path(args.eagle_head, target), **options,
                                      **_draft_placement(args)),
                          OrchestratorConfig(default_drafter=args.drafter))
    if args.drafter not in orch.target.drafters:  # its factory found something missing (services/draft/drafters.py)
        raise UsageError(f"--drafter {args.drafter} needs {DRAFTERS[args.drafter][1] or 'what these flags do not give'}; "
                         f"as given, this process serves {', '.join(sorted(orch.target.drafters))}")
    t0 = time.perf_counter()
    ids: list[int] = []
    pieces: list[str] = []
    last = None
    async for chunk in orch.generate(request):
        ids.extend(chunk.token_ids)
        pieces.append(chunk.text)
        last = chunk
        if not args.json:
            print(chunk.text, end="", flush=True)
    elapsed = time.perf_counter() - t0
    if args.json:
        c = last.counters
        print(json.dumps({
            "session_id": last.session_id, "text": "".join(pieces), "token_ids": ids, "finish_reason": last.finish_reason.value,
            "usage": {"prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens},
            "stats": {"drafts": c.drafts, "draft_tokens": c.draft_tokens, "accepted_tokens": c.accepted_tokens,
                      "verify_steps": c.verify_steps, "acceptance_rate": round(c.acceptance_rate, 4),
                      "mean_accepted_length": round(c.mean_accepted_length, 4)},
            "seed": last.seed, "elapsed_s": round(elapsed, 3), "tokens_per_s": round(len(ids) / elapsed, 2),
        }, indent=2))
    else:
        print()
    return 0


async def _generate_remote(args) -> int:
    import grpc

    from specdec.rpc.tls import client_tls
    from specdec.v1 import common_pb2, generation_pb2 as pb
    from specdec.v1.common_pb2 import SPECULATION_MODE_ADAPTIVE, SPECULATION_MODE_FIXED

    rules = {"coupled": common_pb2.VERIFICATION_RULE_COUPLED, "rejection": common_pb2.VERIFICATION_RULE_REJECTION}
    sampling = common_pb2.SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, rule=rules[resolve_rule(args)])
    if args.seed is not None:
        sampling.seed = args.seed
    policy = common_pb2.SpeculationPolicy(mode=SPECULATION_MODE_ADAPTIVE, max_speculative_tokens=args.max_speculative_tokens,
                                          overlap=not args.no_overlap)
    if args.num_speculative_tokens is not None:
        policy = common_pb2.SpeculationPolicy(mode=SPECULATION_MODE_FIXED, num_speculative_tokens=args.num_speculative_tokens,
                                              overlap=not args.no_overlap)
    req = pb.GenerateRequest(text=args.prompt, max_new_tokens=args.max_new_tokens, sampling=sampling, stop=args.stop,
                             drafter=args.drafter, speculation=policy)
    try:
        credentials = client_tls(args.tls_ca)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    from specdec.client import ResumingClient

    # Several orchestrators (comma-separated): a stream that breaks goes on on another.
    addresses = [a.strip() for a in args.server.split(",") if a.strip()]
    whole = pb.GenerateResponse()
    async with ResumingClient(addresses, credentials, _secret(args.api_key_file, ENV_API_KEY)) as client:
        try:
            async for msg in client.stream(req):
                whole.session_id, whole.seed = msg.session_id, msg.seed
                whole.text += msg.text
                whole.token_ids.extend(msg.token_ids)
                if msg.finish_reason:
                    whole.finish_reason = msg.finish_reason
                    whole.usage.CopyFrom(msg.usage)
                    whole.stats.CopyFrom(msg.stats)
                if not args.json:
                    print(msg.text, end="", flush=True)
        except grpc.aio.AioRpcError as err:
            hint = ""
            if err.code() == grpc.StatusCode.UNAVAILABLE and not args.tls_ca:
                hint = " (if the server serves TLS, pass --tls-ca with its CA)"
            print(f"specdec: {err.code().name}: {err.details()}{hint}", file=sys.stderr)
            return 2
    if args.json:
        from google.protobuf.json_format import MessageToJson

        print(MessageToJson(whole, preserving_proto_field_name=True))
    else:
        print()
    return 0


# ----------------------------------------------------------------------------- serve / up
async def _serve(args) -> int:
    from specdec import roles
    from specdec.rpc.server import ServerConfig, serve_forever

    accepted, token = server_credentials(args)
    tls = tls_files(args)
    registry = metrics_server = None
    if args.metrics_port is not None:
        from prometheus_client import CollectorRegistry

        from specdec.metrics import start_metrics_server

        registry = CollectorRegistry()  # this process's own, never the global default
        metrics_server = start_metrics_server(registry, args.host, args.metrics_port)
    # Workers with a CA demand a client certificate; the client API authenticates by API key instead.
    server = ServerConfig(args.host, args.port if args.port is not None else PORTS[args.role], credentials=accepted, tls=tls,
                          require_client_cert=args.role != "orchestrator" and tls is not None and tls.ca_file is not None,
                          health_port=args.health_port, grace_s=args.grace_s)
    if args.role == "draft":
        from specdec.draft.drafters import DraftConfig

        draft = None if args.no_draft_model else model_path(args.draft, ENV_DRAFT, "draft")
        target = args.target or os.environ.get(ENV_TARGET)
        # One role, one model: `serve draft` takes --device and --dtype for the draft's when
        # --draft-device and --draft-dtype are not given (`up` passes both, explicitly).
        placement = draft_placement(args.draft_device or args.device, args.draft_dtype or args.dtype,
                                    ("--draft-device" if args.draft_device or not args.device else "--device",
                                     "--draft-dtype" if args.draft_dtype or not args.dtype else "--dtype"))
        config = DraftConfig(draft, target, threads=args.threads, fast_draft_forward=not args.reference_forward,
                             min_confidence=args.draft_min_confidence, **placement,
                             eagle_head_path=eagle_head_path(args.eagle_head, target), **drafter_options(args), max_sessions=args.max_sessions,
                             max_session_tokens=args.max_session_tokens)
        running, _ = await roles.start_draft(config, server, registry)
    elif args.role == "target":
        from specdec.draft.drafters import DraftConfig
        from specdec.target.engine import TargetConfig

        config = TargetConfig(model_path(args.target, ENV_TARGET, "target"), threads=args.threads,
                              max_sessions=args.max_sessions, max_kv_tokens=args.max_kv_tokens,
                              kv_redis_url=args.kv_redis_url, kv_block_tokens=args.kv_block_tokens,
                              kv_redis_max_tokens=args.kv_redis_max_tokens, weight_layouts=args.weight_layouts,
                              **_target_placement(args), **_tensor_parallel(args))
        names = tuple(n.strip() for n in args.in_verifier_drafters.split(",") if n.strip())
        in_verifier = None
        if names:
            target = config.model_path
            everything = names == (ALL_DRAFTERS,)
            names = () if everything else names  # empty: every drafter this configuration builds
            draft = model_path(args.draft, ENV_DRAFT, "draft") if everything or {"model", "tree"} & set(names) else None
            in_verifier = DraftConfig(draft, target, threads=args.threads, eagle_head_path=eagle_head_path(args.eagle_head, target), **drafter_options(args),
                                      min_confidence=args.draft_min_confidence, **_draft_placement(args),
                                      max_sessions=args.max_sessions, max_session_tokens=args.max_session_tokens)
        running, _ = await roles.start_target(config, server, service_token=token, registry=registry,
                                              in_verifier=in_verifier, in_verifier_drafters=names)
    else:
        from specdec.orchestrator.request import OrchestratorConfig

        config = OrchestratorConfig(max_new_tokens_limit=args.max_new_tokens_limit, max_concurrent_requests=args.max_concurrent_requests,
                                    max_waiting_requests=args.max_waiting_requests,
                                    max_prompt_bytes=args.max_prompt_bytes, store_retry_s=args.store_retry_s)
        store = roles.make_store(args.redis_url, config.session_ttl_s)
        upstreams = roles.Upstreams(args.drafter_address, args.verifier_address, model_path(args.target, ENV_TARGET, "target"),
                                    service_token=token, tls=tls, step_timeout_s=args.step_timeout_s)
        running, orch = await roles.start_orchestrator(config, upstreams, store, server, registry=registry)
        if args.http_port is not None:
            name = args.served_model_name or Path(upstreams.tokenizer_path).name
            running = _WithHttp(running, await roles.start_http_api(orch, server, args.http_port, name))
    extra = "".join([f", health on {running.health_address}" if running.health_address else "",
                     f", HTTP API on {running.http.url}/v1" if isinstance(running, _WithHttp) else "",
                     f", metrics on :{metrics_server.port}/metrics" if metrics_server else ""])
    print(f"specdec {args.role} serving on {running.address}{extra}", flush=True)
    await serve_forever(running, server.grace_s, on_stop=metrics_server.stop if metrics_server else None)
    return 0


class _WithHttp:
    """An orchestrator's gRPC server and its HTTP API, drained together on SIGTERM."""

    def __init__(self, running, http) -> None:
        self.running, self.http = running, http
        self.address, self.health_address = running.address, running.health_address

    async def stop(self, grace_s: float) -> None:
        await asyncio.gather(self.running.stop(grace_s), self.http.stop(grace_s))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if not (args.command == "generate" and args.server):
            require_server_extra(args.command, NEEDS[args.command])
        if args.command == "generate":
            return asyncio.run(_generate_remote(args) if args.server else _generate_embedded(args))
        if args.command == "serve":
            return asyncio.run(_serve(args))
        if args.command == "certs":
            from specdec.rpc.certs import make_dev_certs

            paths = make_dev_certs(args.out, args.name, args.days)
            print(f"specdec certs: wrote {', '.join(str(p) for p in paths.values())}; serve with "
                  f"--tls-cert {paths['tls.crt']} --tls-key {paths['tls.key']} --tls-ca {paths['ca.crt']}")
            return 0
        if args.command == "autoscale":
            from specdec.autoscale.run import main as autoscale_main

            return autoscale_main(args)
        if args.command == "bench":
            from specdec import bench

            return bench.run(args)
        from specdec import up

        return up.run(args)
    except (UsageError, SpecdecError) as exc:
        print(f"specdec: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:  # a server package missing that the check above did not foresee
        if server_package_of(exc) is None:
            raise
        print(f"specdec: `specdec {args.command}` needs {server_package_of(exc)}, which is not installed: "
              f"{SERVER_EXTRA_HINT}", file=sys.stderr)
        return 2
