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


def probability_below_one(text: str) -> float:
    """A probability in [0, 1), for argparse."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text}")
    return value


def target_numerics(dtype: str, numerics: str, reference_forward: bool = False) -> dict[str, str]:
    """The target's --dtype and --numerics as TargetConfig fields; a combination this machine or
    forward cannot run is a usage error, not a traceback from deep in the load."""
    if numerics == "exact" and reference_forward:
        raise UsageError("--numerics exact needs specdec's lean forward: drop --reference-forward")
    if dtype == "bfloat16":
        from specdec.core.cpu_features import describe_cpu, native_bf16

        if not native_bf16():
            raise UsageError(f"--dtype bfloat16 needs a CPU with native bf16 (avx512_bf16 or amx_bf16); "
                             f"this one has neither ({describe_cpu()}): use --dtype float32")
    return {"dtype": dtype, "numerics": numerics}
