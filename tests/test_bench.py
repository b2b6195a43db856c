"""`specdec bench` on the tiny random-weight pair: every method runs, ratios are to target_only,
greedy outputs are all identical, and a mismatch is caught and named."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import sys

import pytest

from specdec import bench, bench_report, cli
from specdec.bench_common import BUILTIN_PROMPTS, bench_prompts
from specdec.bench_runners import Run
from specdec.core.sessions import SpecCounters

IN_PROCESS = ["target_only", "specdec_k0", "inproc_seq_k1", "inproc_seq_k2", "inproc_seq_adaptive",
              "inproc_overlap_k4", "inproc_overlap_adaptive", "inproc_seq_tree3", "inproc_seq_tree7", "inproc_seq_tree15",
              "inproc_seq_ngram_k4", "inproc_seq_jacobi_k4", "inproc_seq_lookahead_tree7", "inproc_seq_layer_skip_k3"]


@pytest.fixture(scope="module")
def in_process_run(tiny_pair, tmp_path_factory):
    """`specdec bench --skip-distributed` as a user types it, in this process: (exit code, stdout, out dir)."""
    target, draft = tiny_pair
    out = tmp_path_factory.mktemp("bench")
    capture = pytest.MonkeyPatch()
    lines: list[str] = []
    capture.setattr(sys, "stdout", _Lines(lines))
    try:
        code = cli.main(["bench", "--target", target, "--draft", draft, "--prompts", "2", "--max-new-tokens", "8",
                         "--k", "1,2", "--skip-distributed", "--out", str(out)])
    finally:
        capture.undo()
    return code, "".join(lines), out


class _Lines:
    def __init__(self, into: list[str]) -> None:
        self.into = into

    def write(self, s: str) -> None:
        self.into.append(s)

    def flush(self) -> None:
        pass


def test_every_in_process_method_runs_and_matches_target_only(in_process_run):
    code, stdout, out = in_process_run
    rep = json.loads((out / "bench.json").read_text())
    assert code == 0 and rep["outputs_identical"] and rep["mismatches"] == []
    assert list(rep["methods"]) == IN_PROCESS
    assert "all outputs identical to target_only" in stdout
    base = rep["methods"]["target_only"]["tokens_per_s"]
    for name, row in rep["methods"].items():
        assert name in stdout
        assert row["tokens"] == 2 * 8 and len(row["seconds_per_prompt"]) == 2
        assert row["ratio_vs_target_only"] == pytest.approx(row["tokens_per_s"] / base, abs=1e-3)
        ms = row["ms_per_step"]
        if name != "target_only":  # the split adds up to the wall time of a step
            assert ms["verify"] > 0 and ms["verify"] + ms["draft"] + ms["network_other"] == pytest.approx(ms["total"], abs=2e-3)
            assert 1.0 <= row["mean_accepted_length"] and 0.0 <= row["acceptance_rate"] <= 1.0
    assert rep["methods"]["specdec_k0"]["counters"]["draft_tokens"] == 0
    assert rep["methods"]["inproc_seq_k2"]["counters"]["draft_tokens"] > 0
    assert rep["methods"]["inproc_seq_k1"]["counters"]["predrafted_steps"] == 0  # no overlap, no pre-drafted block
    assert rep["config"]["prompt_source"] == "built-in code openings"  # the tiny pair has no training.json
    assert rep["machine"]["cores"] >= 1
    assert (out / "bench.png").is_file() == (importlib.util.find_spec("matplotlib") is not None)


def test_without_matplotlib_the_json_is_written_and_the_png_skipped(in_process_run, tmp_path, monkeypatch):
    rep = json.loads((in_process_run[2] / "bench.json").read_text())
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    said: list[str] = []
    bench_report.write(rep, tmp_path, lambda line, end=False: said.append(line))
    assert (tmp_path / "bench.json").is_file() and not (tmp_path / "bench.png").exists()
    assert "matplotlib is not installed" in said[0]


def test_a_mismatch_is_named_and_fails_the_run():
    """The detection itself, with canned outputs: inproc_seq_k1 differs on the second prompt at token 2."""
    class Canned:
        async def run(self, method, prompt):
            wrong = method.name == "inproc_seq_k1" and prompt == "b"
            return Run((1, 2, 9 if wrong else 3), 0.01, None if method.policy is None else SpecCounters(verify_steps=3))

        async def close(self):
            pass

    config = bench.BenchConfig("t", "d", ("a", "b"), ks=(1,), distributed=False)
    methods = bench.select(bench.all_methods((1,)), ("inproc_seq",))
    results = asyncio.run(bench._run_all(config, methods, Canned(), lambda *a, **k: None, None))
    assert results.mismatches == [{"prompt": 1, "method": "inproc_seq_k1", "first_difference_at": 2}]
    rep = {"methods": {}, "config": {"prompts": 2, "prompt_source": "x", "max_new_tokens": 3},
           "machine": {"cpu": "cpu", "cores": 2}, "outputs_identical": False, "mismatches": results.mismatches}
    assert bench_report.exit_code(rep) == 1
    assert "prompt 1, inproc_seq_k1: first different token at 2" in bench_report.table(rep)


@pytest.mark.parametrize("patterns, expected", [
    ((), None),  # no filter: everything
    (("k2",), ["target_only", "inproc_seq_k2", "dist_seq_k2", "dist_overlap_k2"]),  # substring
    (("dist_*_adaptive",), ["target_only", "dist_seq_adaptive", "dist_overlap_adaptive"]),  # glob
    (("specdec_k0", "inproc_overlap"), ["target_only", "specdec_k0", "inproc_overlap_k4", "inproc_overlap_adaptive"]),
    (("nothing-like-this",), ["target_only"]),  # the baseline always runs: ratios and equality are against it
])
def test_methods_filter_by_substring_or_glob(patterns, expected):
    methods = bench.all_methods((1, 2))
    names = [m.name for m in bench.select(methods, patterns)]
    assert names == (expected or [m.name for m in methods])


def test_prompts_come_from_a_file_or_the_built_in_openings(tiny_pair, tmp_path):
    target, _ = tiny_pair
    prompts, source = bench_prompts(10, target)
    assert source == "built-in code openings" and prompts[:len(BUILTIN_PROMPTS)] == list(BUILTIN_PROMPTS) and len(prompts) == 10
    (tmp_path / "p.json").write_text(json.dumps(["def a():\n", "class B:\n"]))
    assert bench_prompts(3, target, tmp_path / "p.json")[0] == ["def a():\n", "class B:\n", "def a():\n"]
    (tmp_path / "p.txt").write_text("import os\n\nimport sys\n")
    assert bench_prompts(2, target, tmp_path / "p.txt")[0] == ["import os", "import sys"]


def test_bad_k_is_a_usage_error():
    with pytest.raises(cli.UsageError, match="--k"):
        bench.run(cli.build_parser().parse_args(["bench", "--k", "two"]))
    assert cli.main(["bench", "--k", "0,2"]) == 2


def test_the_distributed_path_runs_through_its_own_specdec_up(tiny_pair, tmp_path):
    """Smoke: a `specdec up` on free ports, one prompt, both overlap settings; stopped afterwards."""
    target, draft = tiny_pair
    config = bench.BenchConfig(target, draft, (BUILTIN_PROMPTS[0],), max_new_tokens=4, ks=(1,), methods=("dist_*_k1",),
                               redis_url="", out=tmp_path)
    rep = bench.bench(config, progress=lambda *a, **k: None)
    assert list(rep["methods"]) == ["target_only", "dist_seq_k1", "dist_overlap_k1"] and rep["outputs_identical"]
    assert rep["methods"]["dist_seq_k1"]["counters"]["verify_steps"] >= 1
    assert "ready" in (tmp_path / "specdec-up.log").read_text()


def test_concurrency_levels_run_every_mode_and_batch_sessions(tiny_pair, tmp_path, capsys):
    target, draft = tiny_pair
    code = cli.main(["bench", "--target", target, "--draft", draft, "--prompts", "3", "--max-new-tokens", "8",
                     "--concurrency", "1,3", "--modes", "off,k1,adaptive", "--tokens-per-level", "24", "--rounds", "2",
                     "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "load.json").read_text())
    assert report["rounds"] == 2
    for figures in report["results"].values():  # the median of two rounds lies between them
        low, high = sorted(figures["tokens_per_s_rounds"])
        assert low <= figures["tokens_per_s"] <= high
    assert set(report["results"]) == {f"{n}/{m}" for n in (1, 3) for m in ("off", "k1", "adaptive")}
    for figures in report["results"].values():
        assert figures["tokens"] > 0 and figures["tokens_per_s"] > 0 and figures["itl_p99_ms"] >= figures["itl_p50_ms"]
        assert figures["decode_tokens_per_s"] > 0
    assert report["results"]["1/off"]["mean_batch_sessions"] == 1.0
    for n in (1, 3):  # what speculation did, from the requests' own counters
        assert report["results"][f"{n}/off"]["draft_tokens_per_step"] == 0.0
        assert 0.0 < report["results"][f"{n}/k1"]["draft_tokens_per_step"] <= 1.0
        assert 0.0 <= report["results"][f"{n}/k1"]["acceptance"] <= 1.0
    # Three clients may share target forwards (how often is timing: the bench's to measure; that
    # steps waiting together share one is tests/test_batching.py's).
    assert 1.0 <= report["results"]["3/off"]["mean_batch_sessions"] <= 3.0
    assert "adaptive_vs_best" in report["summary"]["3"]
    assert (tmp_path / "load.png").stat().st_size > 0


def test_a_level_reports_its_decoding_rate_apart_from_its_prefills():
    from specdec.bench_load import combine

    # 4 sessions, each waited 1 s for its first token and then 10 ms per token: 400 tokens/s while decoding.
    run = {"tokens": 400, "seconds": 2.0, "ttft_s": [1.0] * 4, "itl_s": [0.01] * 396, "mean_batch_sessions": 4.0}
    figures = combine([run], 4)
    assert figures["tokens_per_s"] == 200.0
    assert figures["decode_tokens_per_s"] == pytest.approx(400.0)
    assert figures["itl_mean_ms"] == pytest.approx(10.0)


@pytest.mark.parametrize("flags", [["--concurrency", "1,x"], ["--concurrency", "0"], ["--concurrency", "1", "--modes", "k1,fast"],
                                   ["--concurrency", "1", "--rounds", "0"]])
def test_bad_concurrency_flags_are_usage_errors(tiny_pair, flags, capsys):
    target, draft = tiny_pair
    assert cli.main(["bench", "--target", target, "--draft", draft, *flags]) == 2
    assert "--concurrency" in capsys.readouterr().err
