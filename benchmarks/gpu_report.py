"""benchmarks/gpu_check.py's report: progress lines, the run's environment, each section's record,
and the two files it writes (gpu_check.json with every figure, gpu_check.md with the tables).

A section is a coroutine function returning a dict with ``results``/``comparisons``, ``info``,
``skipped`` and ``errors``; ``run_section`` adds its status and seconds.
"""
from __future__ import annotations

import asyncio
import importlib
import platform
import subprocess
import time
import tomllib
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path

from common import ROOT, write_result

STARTED = time.perf_counter()
SECTIONS = ("correctness", "speed", "distributed")


def log(line: str) -> None:
    """A progress line, with the seconds since the script started."""
    print(f"[{time.perf_counter() - STARTED:7.1f}s] {line}", flush=True)


# ----------------------------------------------------------------------------- environment
def environment(device: str, **settings) -> dict:
    """Python, torch and transformers versions, the GPU, the commit, and the run's ``settings``."""
    import torch
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "transformers": transformers.__version__, "device": device, **settings}
    if device.startswith("cuda"):
        try:
            env["gpu"] = torch.cuda.get_device_name(device)
            env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
        except (RuntimeError, AssertionError) as exc:  # no CUDA here: every section will say so too
            env["gpu"] = f"none: {exc}"
    try:  # a copy of the checkout without its .git, or no git there: no commit
        env["commit"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["commit"] = None
    return env


def package_dirs() -> dict[str, Path]:
    """Installed package name -> its folder in the checkout, as pyproject.toml maps them."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping = setuptools.get("package-dir", {})
    out = {}
    for package in setuptools["packages"]:
        parts = package.split(".")
        for n in range(len(parts), 0, -1):  # its own entry, else its nearest listed ancestor's folder
            if (base := ".".join(parts[:n])) in mapping:
                out[package] = ROOT / mapping[base] / Path(*parts[n:])
                break
        else:
            out[package] = ROOT / Path(*parts)
    return out


def stale_files() -> list[str]:
    """The checkout's files that the imported specdec does not hold as they are (its wheel was built
    before the last change: rebuild it with scripts/bundle_wheels.py); empty for an editable install."""
    differ = []
    for package, folder in package_dirs().items():
        installed = Path(importlib.import_module(package).__file__).parent
        for source in sorted(folder.glob("*.py")):
            copy = installed / source.name
            if not copy.is_file() or copy.read_bytes() != source.read_bytes():
                differ.append(str(source.relative_to(ROOT)))
    return differ


# ----------------------------------------------------------------------------- sections
def run_section(name: str, run: Callable[[], Awaitable[dict]]) -> dict:
    """Run one section (a coroutine function); its exception, if any, is its record."""
    t0 = time.perf_counter()
    log(f"== {name}")
    try:
        out = asyncio.run(run())
        status = "ok" if not out.get("errors") else "errors"
    except Exception:  # the section's traceback is its record; the next section still runs
        out, status = {"errors": {name: traceback.format_exc()}}, "failed"
        log(f"{name} FAILED:\n{out['errors'][name]}")
    return {"status": status, "seconds": round(time.perf_counter() - t0, 1), **out}


# ----------------------------------------------------------------------------- files
def markdown(report: dict) -> str:
    """gpu_check.md: one table per section, then what was skipped and every traceback."""
    env = report["environment"]
    lines = [f"# gpu_check: {env.get('gpu', env['device'])}, torch {env['torch']}, commit {env.get('commit')}", ""]
    c = report["correctness"]
    lines += [f"## (a) Correctness ({c['status']}, {c['seconds']} s): all equal: {c.get('all_equal')}", "",
              "| pair | dtype | engine | reference | run | equal | differing prompts | draft tokens | accepted |", "|---" * 9 + "|"]
    for r in c.get("comparisons", []):
        lines.append(f"| {r['pair']} | {r['dtype']} | {r['engine']} | {r['reference']} | {r['run']} | {'yes' if r['equal'] else '**NO**'} "
                     f"| {len(r['differing_prompts'])}/{r['prompts']} | {r['draft_tokens']} | {r['accepted_tokens']} |")
    for name, value in (c.get("info") or {}).items():
        lines.append(f"\n{name}: {value}")
    s = report["speed"]
    lines += ["", f"## (b) Speed ({s['status']}, {s['seconds']} s)", ""]
    for name, values in (s.get("results") or {}).items():
        lines += [f"**{name}**", "", "| " + " | ".join(values) + " |", "|---" * len(values) + "|",
                  "| " + " | ".join(f"{v:.3g}" for v in values.values()) + " |", ""]
    d = report["distributed"]
    how = (d.get("info") or {}).get("deployment", "up")
    how = "specdec up" if how == "up" else how
    lines += [f"## (c) Distributed ({d['status']}, {d['seconds']} s): {(d.get('info') or {}).get('layout', '')}", "",
              f"| sessions/mode | one process tokens/s | {how} tokens/s | {how} / one process |", "|---|---|---|---|"]
    res = d.get("results") or {}
    for key, rate in (res.get("one_process") or {}).items():
        up = (res.get("distributed") or {}).get(key)
        ratio = (res.get("distributed_over_one_process") or {}).get(key)
        lines.append(f"| {key} | {rate:.1f} | {'' if up is None else f'{up:.1f}'} | {'' if ratio is None else f'{ratio:.2f}'} |")
    for name in SECTIONS:
        for what, reason in (report[name].get("skipped") or {}).items():
            lines.append(f"\nskipped ({name}, {what}): {reason}")
        for what, tb in (report[name].get("errors") or {}).items():
            lines += ["", f"**error ({name}, {what})**", "", "```", tb.strip()[-1500:], "```"]
    return "\n".join(lines) + "\n"


def write_report(out: Path, report: dict) -> None:
    """gpu_check.json (the machine first, then the report) and gpu_check.md, in ``out``."""
    write_result(out / "gpu_check.json", **report)
    (out / "gpu_check.md").write_text(markdown(report))
