"""What the ``specdec`` command's parts share: environment names, the demo pair, usage errors,
argument types, and the check for the server extra.

The CLI (specdec.cli) and ``specdec bench`` both import this module, and it imports neither, nor
anything beyond the standard library: it must load on a client-only install (grpcio and protobuf).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parents[1] / "models" / "demo"
ENV_TARGET, ENV_DRAFT, ENV_REDIS = "SPECDEC_TARGET_MODEL", "SPECDEC_DRAFT_MODEL", "SPECDEC_REDIS_URL"
ENV_EAGLE_HEAD = "SPECDEC_EAGLE_HEAD"
ALL_DRAFTERS = "all"  # --in-verifier-drafters: every drafter the verifier's configuration builds
PORTS = {"orchestrator": 50051, "draft": 50052, "target": 50053}  # each role's default gRPC port
# Secrets come from files or the environment, never from argv (which `ps` shows to everyone).
ENV_API_KEY, ENV_API_KEYS_FILE, ENV_SERVICE_TOKEN = "SPECDEC_API_KEY", "SPECDEC_API_KEYS_FILE", "SPECDEC_SERVICE_TOKEN"

# The server extra (`pip install 'specdec[server]'`, pyproject.toml): import name -> distribution.
# The client (specdec.client, specdec.v1) needs none of these.
SERVER_PACKAGES = {
    "torch": "torch",
    "transformers": "transformers",
    "tokenizers": "tokenizers",
    "safetensors": "safetensors",
    "numpy": "numpy",
    "redis": "redis",
    "cryptography": "cryptography",
    "prometheus_client": "prometheus-client",
    "kubernetes": "kubernetes",
    "grpc_health": "grpcio-health-checking",
    "grpc_reflection": "grpcio-reflection",
    "starlette": "starlette",
    "uvicorn": "uvicorn",
}
_BROUGHT_BY = {"urllib3": "kubernetes"}  # imported by specdec.autoscale, installed by kubernetes
SERVER_EXTRA_HINT = "pip install 'specdec[server]'"
# What of it each kind of command imports: the models alone, or a role's server around them.
MODEL_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "numpy")
ROLE_PACKAGES = (*MODEL_PACKAGES, "redis", "prometheus_client", "grpc_health", "grpc_reflection", "starlette", "uvicorn")


class UsageError(Exception):
    """A mistake on the command line; printed without a traceback."""


class MissingServerExtra(UsageError):
    """A server command on an install without the server extra."""

    def __init__(self, command: str, distributions: list[str]) -> None:
        self.distributions = distributions
        remote = "; or generate on a running orchestrator: --server HOST:PORT" if command == "generate" else ""
        super().__init__(f"`specdec {command}` needs packages that are not installed: {', '.join(distributions)}. "
                         f"They come with the server extra: {SERVER_EXTRA_HINT} (the client alone needs only "
                         f"grpcio and protobuf){remote}")


def missing_packages(modules: tuple[str, ...]) -> list[str]:
    """Distributions of those server-extra modules that cannot be imported here, in order."""
    missing = []
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:  # an import hook that refuses it counts as absent
            found = False
        if not found:
            missing.append(SERVER_PACKAGES[module])
    return missing


def require_server_extra(command: str, modules: tuple[str, ...]) -> None:
    """Raise MissingServerExtra naming every one of ``modules`` (import names) that is not installed."""
    missing = missing_packages(modules)
    if missing:
        raise MissingServerExtra(command, missing)


def server_package_of(error: ModuleNotFoundError) -> str | None:
    """The server-extra distribution a failed import was looking for, or None if it is not one of them."""
    module = (error.name or "").split(".")[0]
    return SERVER_PACKAGES.get(module) or _BROUGHT_BY.get(module)


def model_path(flag: str | None, env: str, demo: str) -> str:
    """A model folder from the flag, else the environment, else the bundled demo pair."""
    path = flag or os.environ.get(env) or (str(DEMO_DIR / demo) if (DEMO_DIR / demo / "config.json").is_file() else None)
    if not path:
        raise UsageError(
            f"no {demo} model: pass --{demo} PATH (a folder saved with save_pretrained) or set {env}; "
            f"the demo pair is expected at {DEMO_DIR / demo}"
        )
    return path


def eagle_head_path(flag: str | None, target: str | None) -> str | None:
    """The EAGLE head drafter ``eagle`` runs (core/eagle_head.py): the flag, else $SPECDEC_EAGLE_HEAD,
    else the demo head when the target is the demo target; None: no ``eagle`` drafter."""
    if flag or os.environ.get(ENV_EAGLE_HEAD):
        return flag or os.environ.get(ENV_EAGLE_HEAD)
    demo_head = DEMO_DIR / "eagle"
    if target and Path(target).resolve() == (DEMO_DIR / "target").resolve() and (demo_head / "config.json").is_file():
        return str(demo_head)
    return None


_EAGLE_NEEDS = (f"an EAGLE head trained on the target: --eagle-head PATH or ${ENV_EAGLE_HEAD} (default: "
                f"models/demo/eagle, with the demo target only)")
# Every drafter `--drafter` may name (the registry, services/draft/drafters.py NAMES; tests/test_cli.py
# checks the two agree) -> (what it drafts with, for --help; what `specdec generate` needs to serve
# it beyond the target, "" for nothing). This module loads without torch, so it cannot ask the registry.
DRAFTERS: dict[str, tuple[str, str]] = {
    "model": ("the draft model", f"a draft model: --draft PATH or ${ENV_DRAFT} (default: the demo draft)"),
    "tree": ("token trees from the draft model",
             f"a draft model (--draft PATH or ${ENV_DRAFT}) on specdec's lean forward: a Llama draft, no --reference-forward"),
    "eagle": ("an EAGLE head over the target's features", _EAGLE_NEEDS),
    "eagle_tree": ("token trees from the EAGLE head", _EAGLE_NEEDS),
    "ngram": ("prompt lookup", ""),
    "jacobi": ("the target's own Jacobi iterates", ""),
    "lookahead": ("Jacobi iterates and an n-gram pool, as one token tree", ""),
    "layer_skip": ("some of the target's own layers",
                   "--layer-skip auto|LAYERS (`generate --drafter layer_skip` alone: auto, chosen by measurement at start-up)"),
}


def drafters_help() -> str:
    """``--drafter``'s help: every name, with what it drafts with."""
    return "; ".join(f"{name}: {what}" for name, (what, _) in DRAFTERS.items()) + " (default: model)"


def probability_below_one(text: str) -> float:
    """A probability in [0, 1), for argparse."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text}")
    return value


def fraction(text: str) -> float:
    """A number strictly between 0 and 1, for argparse."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text!r}") from None
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text}")
    return value


# ----------------------------------------------------------------------------- devices and dtypes
DTYPE_CHOICES = ("auto", "float32", "bfloat16")
RUNNER_CHOICES = ("auto", "lean", "paged", "hf")


def device_arg(text: str) -> str:
    """auto | cpu | cuda | cuda:N, for argparse: the spelling only (what is visible: `resolve_device`)."""
    head, _, index = text.partition(":")
    if text in ("auto", "cpu", "cuda") or (head == "cuda" and index.isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")


def resolve_device(arg: str | None, flag: str = "--device") -> str:
    """A device flag as a torch device name: auto (or None) is cuda when torch sees a CUDA device,
    else cpu; cuda and cuda:N must be visible, else a UsageError saying what torch sees."""
    import torch

    arg = device_arg(arg or "auto")
    if arg == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if arg == "cpu":
        return arg
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise UsageError(f"{flag} {arg}: no CUDA device is available to this torch ({torch.__version__}, {build}; "
                         f"{torch.cuda.device_count()} CUDA devices visible): use {flag} cpu, or auto")
    index = int(arg.partition(":")[2] or 0)
    if index >= count:
        raise UsageError(f"{flag} {arg}: torch sees {count} CUDA device{'s' if count > 1 else ''} "
                         f"(cuda:0{f' .. cuda:{count - 1}' if count > 1 else ''})")
    return arg


def resolve_dtype_for(device: str, arg: str | None, flag: str = "--dtype") -> str:
    """A dtype flag for a model on ``device`` (resolved): auto (or None) is bfloat16 on CUDA, float32 on
    the CPU; bfloat16 on a CPU without native bf16 is a UsageError (emulated, it runs several times slower)."""
    dtype = arg or "auto"
    if dtype not in DTYPE_CHOICES:
        raise UsageError(f"{flag} takes {', '.join(DTYPE_CHOICES)}; got {dtype!r}")
    on_cpu = device == "cpu"
    if dtype == "auto":
        return "float32" if on_cpu else "bfloat16"
    if dtype == "bfloat16" and on_cpu:
        import torch

        from specdec.core.cpu_features import describe_cpu, native_bf16
        from specdec.core.native_kernels import weight_dtypes

        if not native_bf16() and torch.bfloat16 not in weight_dtypes():
            raise UsageError(f"{flag} bfloat16 needs a CPU with native bf16 (avx512_bf16 or amx_bf16) or specdec's "
                             "native kernels (a C compiler and AVX2 with FMA); "
                             f"this one has neither ({describe_cpu()}): use {flag} float32")
    return dtype


def target_runner(runner: str | None, reference_forward: bool, device: str,
                  kv_memory_fraction: float | None = None) -> dict:
    """The target's --runner, --reference-forward and --kv-memory-fraction as TargetConfig fields
    (runner, fast_forward, kv_memory_fraction); --reference-forward is --runner hf."""
    runner = runner or "auto"
    if runner not in RUNNER_CHOICES:
        raise UsageError(f"--runner takes {', '.join(RUNNER_CHOICES)}; got {runner!r}")
    if reference_forward:
        if runner not in ("auto", "hf"):
            raise UsageError(f"--reference-forward is --runner hf: drop one of --reference-forward and --runner {runner}")
        runner = "hf"
    if kv_memory_fraction is not None and runner in ("lean", "hf"):
        raise UsageError(f"--kv-memory-fraction sizes the paged runner's page pool; --runner {runner} has none")
    if kv_memory_fraction is not None and device == "cpu":
        raise UsageError("--kv-memory-fraction sizes the paged runner's page pool from a CUDA device's free memory; "
                         "on the CPU the pool follows the KV budget: drop it")
    return {"runner": runner, "fast_forward": runner != "hf", "kv_memory_fraction": kv_memory_fraction}


def target_placement(device: str | None, dtype: str | None, numerics: str = "auto", runner: str | None = None,
                     reference_forward: bool = False, kv_memory_fraction: float | None = None) -> dict:
    """The target's device, dtype, numerics and runner flags as TargetConfig fields, resolved and checked
    in one place (auto: CUDA when visible; bfloat16 there, float32 on the CPU)."""
    device = resolve_device(device, "--device")
    fields = target_runner(runner, reference_forward, device, kv_memory_fraction)
    return {"device": device, **fields, **target_numerics(dtype, numerics, fields["runner"] == "hf", device)}


def draft_placement(device: str | None, dtype: str | None,
                    flags: tuple[str, str] = ("--draft-device", "--draft-dtype")) -> dict[str, str]:
    """The draft's --draft-device and --draft-dtype as DraftConfig fields, resolved as the target's are
    (``flags``: the names errors give, where the values came from other flags)."""
    device = resolve_device(device, flags[0])
    return {"draft_device": device, "draft_dtype": resolve_dtype_for(device, dtype, flags[1])}


def target_numerics(dtype: str | None, numerics: str, reference_forward: bool = False, device: str = "cpu") -> dict[str, str]:
    """The target's --dtype and --numerics as TargetConfig fields, for a target on ``device`` (resolved);
    a combination this machine or forward cannot run is a usage error, not a traceback from deep in the load."""
    if numerics == "exact" and reference_forward:
        raise UsageError("--numerics exact needs specdec's lean forward: drop --reference-forward")
    return {"dtype": resolve_dtype_for(device, dtype), "numerics": numerics}


def drafter_options(args) -> dict:
    """--lookahead-window, --lookahead-ngram, --lookahead-candidates and --layer-skip as DraftConfig fields."""
    if args.lookahead_window < 1 or args.lookahead_ngram < 2 or args.lookahead_candidates < 0:
        raise UsageError(f"lookahead needs --lookahead-window >= 1, --lookahead-ngram >= 2, --lookahead-candidates >= 0; "
                         f"got {args.lookahead_window}, {args.lookahead_ngram}, {args.lookahead_candidates}")
    return {"lookahead_window": args.lookahead_window, "lookahead_ngram": args.lookahead_ngram,
            "lookahead_candidates": args.lookahead_candidates, "layer_skip": args.layer_skip}
