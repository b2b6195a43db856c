"""benchmarks/gpu_check.py, the prepared GPU check, runs on the CPU (``--device cpu --small``) so that it
cannot rot between the runs on a GPU: every section completes, specdec's greedy output equals the
references, and every speed figure is a positive number. No assertion on how fast anything was."""
from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(_spec)
sys.modules["gpu_check"] = gpu_check  # its dataclasses look their module up
_spec.loader.exec_module(gpu_check)

pytestmark = pytest.mark.skipif(not (ROOT / "models" / "demo" / "target" / "config.json").is_file(),
                                reason="demo pair not built (scripts/train_demo_pair.py)")


def numbers(tree, path: str = ""):
    """(path, value) of every leaf of a JSON tree of dicts and lists."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from numbers(value, f"{path}/{key}")
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            yield from numbers(value, f"{path}/{i}")
    else:
        yield path, tree


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu_check")
    code = gpu_check.main(["--device", "cpu", "--small", "--out", str(out)])
    result = json.loads((out / "gpu_check.json").read_text())
    result["exit_code"] = code
    result["markdown"] = (out / "gpu_check.md").read_text()
    return result


def test_every_section_ran_without_errors(report):
    for name in ("correctness", "speed", "distributed"):
        assert report[name]["status"] == "ok", f"{name}: {json.dumps(report[name].get('errors'), indent=1)}"
    assert report["exit_code"] == 0
    assert report["environment"]["device"] == "cpu"


def test_greedy_output_equals_the_references(report):
    rows = report["correctness"]["comparisons"]
    wrong = [r for r in rows if not r["equal"]]
    assert not wrong, json.dumps(wrong, indent=1)
    assert report["correctness"]["all_equal"] is True
    # Every comparison the issue names is there: against transformers in float32 on the demo pair, and
    # against specdec's own k = 0 on the demo pair and the random target, each k and both drafters.
    runs = {"k=0", "k=1", "k=3", "k=5", "adaptive", "ngram k=3", "ngram adaptive"}
    against_hf = {r["run"] for r in rows if r["reference"] == "transformers generate" and r["pair"] == "demo"}
    assert against_hf == runs
    for pair in ("demo", report["environment"]["random_pair"]):
        assert {r["run"] for r in rows if r["reference"] == "specdec k=0" and r["pair"] == pair} == runs - {"k=0"}
        assert any(r["reference"] == "the row decoded alone" and r["pair"] == pair for r in rows)
    assert sum(r["draft_tokens"] for r in rows if r["run"] == "k=3") > 0, "k = 3 never drafted: speculation untested"


def test_every_speed_figure_is_a_positive_number(report):
    speed = report["speed"]["results"]
    for name in ("tokens_per_s demo", "verify_cost_ratio", "exact_over_fast"):
        assert any(key.startswith(name) for key in speed), f"no {name} in {sorted(speed)}"
    distributed = report["distributed"]["results"]
    assert set(distributed["one_process"]) == set(distributed["distributed"]) and distributed["distributed_over_one_process"]
    leaves = [*numbers(speed, "speed"), *numbers(distributed, "distributed")]
    bad = [(path, value) for path, value in leaves
           if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0]
    assert leaves and not bad, bad
    assert "cuda_graphs" in report["speed"]["skipped"]  # said, not silently absent, on the CPU


def test_the_table_has_every_section(report):
    for heading in ("## (a) Correctness", "## (b) Speed", "## (c) Distributed"):
        assert heading in report["markdown"]
    assert "**NO**" not in report["markdown"]


def test_the_gpu_runs_specdec_up_with_flags_the_cli_takes():
    """--small runs (c) in this process; the GPU run starts `specdec up` with these arguments."""
    from specdec.cli import build_parser

    plan = gpu_check.make_plan(gpu_check.argparse.Namespace(device="cpu", draft_device=None, runner="auto", small=False,
                                                            threads=None, out="/tmp/unused", deployment=None, max_new=None))
    assert plan.deployment == "up"
    pair = gpu_check.Pair("demo", "/models/target", "/models/draft")
    args = build_parser().parse_args(gpu_check.up_argv(plan, pair, "bfloat16", 50051))
    assert (args.device, args.draft_device, args.dtype, args.redis_url) == ("cpu", "cpu", "bfloat16", "")
