"""Download, here, the wheels a CUDA machine without network lacks to run specdec, and build specdec's own.

The GPU machines this project is lent (docs/performance.md, "GPU check") have Python 3.12 with their
own CUDA torch, transformers, grpcio, protobuf and prometheus-client, and no network. Everything else
specdec's servers import comes along as wheels for CPython 3.12 on manylinux x86_64, each at the
version installed here (what the test suite ran with; the newest where it is not installed), one
version of each, without their dependencies (the machine has the rest):

    python3 scripts/bundle_wheels.py                  # -> wheels/ (ignored by git; about 9 MiB)
    python3 scripts/bundle_wheels.py --with-autoscale --with-certs   # + kubernetes, cryptography (about 15 MiB more)

There, from the repository root (the folder travels in the device tool's ``carry``: ["wheels"]):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site wheels/*.whl
    export PYTHONPATH=/tmp/site

Then ``python3 benchmarks/gpu_check.py`` runs. grpcio and protobuf come too (``--without-grpc``:
not), pinned to this machine's: specdec's generated stubs check the runtime's version at import.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What `serve`, `up` and `bench` import (specdec.cli_common.ROLE_PACKAGES) beyond the machine's own.
ROLES = ("grpcio-health-checking", "grpcio-reflection", "redis", "starlette", "uvicorn")
GRPC = ("grpcio", "protobuf")  # present there, but perhaps older than specdec's stubs accept
CERTS = ("cryptography", "cffi", "pycparser")  # `specdec certs`, `up --tls`
# `specdec autoscale`: kubernetes and what it needs that the machine lacks.
AUTOSCALE = ("kubernetes", "durationpy", "oauthlib", "requests-oauthlib", "websocket-client", "aiohttp-retry",
             "pydantic", "pydantic-core", "annotated-types", "typing-inspection")
# pip matches each manylinux tag exactly (the device README): every glibc from 2.17 to the machine's.
PLATFORMS = ("manylinux1_x86_64", "manylinux2014_x86_64",
             *(f"manylinux_2_{n}_x86_64" for n in (17, 24, 26, 27, 28, 31, 34, 35, 36, 38, 39)))
BUDGET_MB = 24  # the device tool carries 64 MiB with the working tree (about 40 of it: the demo pair and the rest)


def pinned(name: str) -> str:
    """``name==version`` as installed here, else ``name`` (the newest)."""
    try:
        return f"{name}=={metadata.version(name)}"
    except metadata.PackageNotFoundError:
        return name


def download(requirements: list[str], dest: Path, python: str) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "--implementation", "cp",
           "--python-version", python, *(a for p in PLATFORMS for a in ("--platform", p)), "-d", str(dest), *requirements]
    subprocess.run(cmd, check=True)


def build_own(dest: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", str(ROOT), "-w", str(dest)], check=True)


def project(wheel: Path) -> str:
    """The normalised project name of a wheel file (PEP 427: name-version-...)."""
    return re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()


def check(dest: Path) -> list[Path]:
    """Every wheel, after refusing two versions of one project (pip --no-index stops on that)."""
    wheels = sorted(dest.glob("*.whl"))
    seen: dict[str, list[str]] = {}
    for w in wheels:
        seen.setdefault(project(w), []).append(w.name)
    doubles = {k: v for k, v in seen.items() if len(v) > 1}
    if doubles:
        raise SystemExit(f"two versions of a project in {dest}: {doubles}; empty the folder (--clean) and run again")
    return wheels


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", type=Path, default=ROOT / "wheels", help="folder for the wheels (default: wheels/)")
    ap.add_argument("--python-version", default="3.12", help="the GPU machine's Python (default 3.12)")
    ap.add_argument("--with-certs", action="store_true", help="also cryptography (specdec certs, up --tls)")
    ap.add_argument("--with-autoscale", action="store_true", help="also kubernetes and its needs (specdec autoscale)")
    ap.add_argument("--without-grpc", action="store_true", help="use the machine's own grpcio and protobuf")
    ap.add_argument("--clean", action="store_true", help="empty --dest first")
    args = ap.parse_args(argv)
    if args.clean and args.dest.exists():
        shutil.rmtree(args.dest)
    args.dest.mkdir(parents=True, exist_ok=True)
    names = [*ROLES, *(() if args.without_grpc else GRPC), *(CERTS if args.with_certs else ()),
             *(AUTOSCALE if args.with_autoscale else ())]
    requirements = [pinned(n) for n in names]
    print(f"downloading for CPython {args.python_version} manylinux x86_64: {' '.join(requirements)}", flush=True)
    download(requirements, args.dest, args.python_version)
    for old in args.dest.glob("specdec-*.whl"):
        old.unlink()  # always this checkout's
    print("building specdec's wheel", flush=True)
    build_own(args.dest)
    wheels = check(args.dest)
    total = sum(w.stat().st_size for w in wheels)
    for w in wheels:
        print(f"  {w.stat().st_size / 1e6:6.2f} MB  {w.name}")
    print(f"{len(wheels)} wheels, {total / 2**20:.1f} MiB in {args.dest}")
    if total > BUDGET_MB * 2**20:
        print(f"warning: over {BUDGET_MB} MiB: with the working tree this may pass the device tool's 64 MiB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
