"""The load generator's pure parts (benchmarks/openai_load.py) and bench_vllm_cpu's text comparison and
metrics parsing: SSE lines, percentiles, inter-token gaps, a level's summary. No server, no timing."""
from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    sys.path.insert(0, str(BENCH))  # bench_vllm_cpu imports its neighbours by name
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the class is made
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


load = _load("openai_load")
bench = _load("bench_vllm_cpu")
breakdown = _load("bench_up_breakdown")


@pytest.mark.parametrize("line, expected", [
    ('data: {"choices": [{"text": "a"}]}', {"choices": [{"text": "a"}]}),
    ('data:{"x": 1}', {"x": 1}),  # the space after the colon is optional in SSE
    ("data: [DONE]", load.DONE),
    ("", None),  # the blank line between events
    ("id: 3f2a:12", None),  # specdec's resume id
    (": keep-alive", None),  # a comment
    ("event: error", None),
    ("data: ", None),
])
def test_sse_event(line, expected):
    assert load.sse_event(line) == expected


@pytest.mark.parametrize("xs, q, expected", [
    ([5.0], 50, 5.0),
    ([1.0, 2.0, 3.0, 4.0], 50, 2.5),  # between the middle two
    ([3.0, 1.0, 2.0], 50, 2.0),  # unsorted input
    ([float(i) for i in range(101)], 99, 99.0),
    ([0.0, 10.0], 99, 9.9),  # linear between the closest ranks, as numpy's default
    ([1.0, 2.0], 0, 1.0),
    ([1.0, 2.0], 100, 2.0),
])
def test_percentile(xs, q, expected):
    assert load.percentile(xs, q) == pytest.approx(expected)


def test_percentile_empty_is_nan():
    assert math.isnan(load.percentile([], 50))


def _record(prompt: int, sent: float, events: list[tuple[float, dict]]) -> "load.StreamRecord":
    rec = load.StreamRecord(prompt, sent)
    for t, choice in events:
        rec.add(t, choice)
    rec.end = events[-1][0] if events else sent
    return rec


def test_record_counts_token_ids_and_spreads_gaps():
    # one token, then 3 tokens together (a speculative step) 0.3 s later, then one more 0.1 s later
    rec = _record(0, 10.0, [(10.5, {"text": "a", "token_ids": [1]}),
                            (10.8, {"text": "bcd", "token_ids": [2, 3, 4]}),
                            (10.9, {"text": "e", "token_ids": [5], "finish_reason": "length"})])
    assert rec.tokens == 5 and rec.token_ids == [1, 2, 3, 4, 5] and rec.text == "abcde"
    assert rec.ttft == pytest.approx(0.5)
    assert rec.gaps() == pytest.approx([0.1, 0.1, 0.1, 0.1])  # 0.3 s over 3 tokens, then 0.1 s over 1
    assert rec.finish_reason == "length"


def test_record_without_token_ids_counts_events_with_text():
    rec = _record(0, 0.0, [(0.2, {"text": "a"}), (0.3, {"text": ""}), (0.5, {"text": "b"})])
    assert rec.tokens == 2 and rec.text == "ab"
    assert rec.ttft == pytest.approx(0.2) and rec.gaps() == pytest.approx([0.3])


def test_summarize_level():
    a = _record(0, 0.0, [(0.1, {"text": "x", "token_ids": [1]}), (0.3, {"text": "y", "token_ids": [2]})])
    b = _record(1, 0.0, [(0.3, {"text": "p", "token_ids": [7]}), (0.4, {"text": "q", "token_ids": [8, 9]})])
    again = _record(0, 0.5, [(0.6, {"text": "x", "token_ids": [1]}), (0.7, {"text": "y", "token_ids": [2]})])
    failed = load.StreamRecord(2, 0.0, error="HTTP 429: over capacity")
    s = load.summarize([a, b, again, failed], wall_s=2.0)
    assert (s["requests"], s["errors"], s["tokens"]) == (4, 1, 7)
    assert s["tokens_per_s"] == pytest.approx(3.5)
    assert s["ttft_p50_s"] == pytest.approx(0.1)  # TTFTs 0.1, 0.3, 0.1
    assert s["itl_p50_s"] == pytest.approx(0.075)  # gaps 0.2, then 0.1 over 2 tokens: 0.05, 0.05, then 0.1
    assert s["error_samples"] == ["HTTP 429: over capacity"]
    assert s["texts"] == {"0": "xy", "1": "pq"}  # a prompt sent twice with one text keeps one


def test_summarize_keeps_every_text_of_a_prompt_that_differs():
    a = _record(0, 0.0, [(0.1, {"text": "xy", "token_ids": [1, 2]})])
    b = _record(0, 0.0, [(0.1, {"text": "xz", "token_ids": [1, 3]})])
    assert load.summarize([a, b], 1.0)["texts"] == {"0": ["xy", "xz"]}


def test_usage_mismatch_is_counted():
    rec = _record(0, 0.0, [(0.1, {"text": "a", "token_ids": [1]})])
    rec.usage_tokens = 2
    assert load.summarize([rec], 1.0)["usage_count_mismatches"] == 1


def test_request_body_is_greedy_streamed():
    body = load.request_body("m", "def f(", 96)
    assert body["temperature"] == 0 and body["stream"] is True and body["max_tokens"] == 96
    assert body["return_token_ids"] is True and body["stream_options"] == {"include_usage": True}


def test_compare_texts_names_the_odd_one_and_where_it_leaves():
    texts = {"0": {"specdec@1#r0": "abc", "vllm@1#r0": "abc"},
             "1": {"specdec@1#r0": "hello", "vllm@1#r0": "help!", "vllm-spec@1#r0": "hello"}}
    [m] = bench.compare_texts(texts)
    assert m["prompt"] == 1
    assert m["variants"][0] == {"text": "hello", "where": ["specdec@1#r0", "vllm-spec@1#r0"], "differs_at": None}
    assert m["variants"][1] == {"text": "help!", "where": ["vllm@1#r0"], "differs_at": 3}


def test_compare_texts_a_prefix_differs_at_its_end():
    [m] = bench.compare_texts({"4": {"a": "abcd", "b": "abcd", "c": "ab"}})
    assert m["variants"][1]["differs_at"] == 2


def test_spec_counters_sum_engines():
    text = "\n".join([
        "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 5.0',
        'vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.79e+09',  # a timestamp, not a count
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 15.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 6.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="m"} 4.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 2.0',
    ])
    assert bench.spec_counters(text) == {"num_drafts": 5.0, "num_draft_tokens": 15.0, "num_accepted_tokens": 10.0}


@pytest.mark.parametrize("cores, expected", [({0, 1}, "0-1"), ({3}, "3-3"), ({0, 2, 3}, "0,2,3")])
def test_core_range(monkeypatch, cores, expected):
    monkeypatch.setattr(bench.os, "sched_getaffinity", lambda pid: cores)
    assert bench.core_range() == expected


def test_two_checkouts_compare_by_the_median_of_their_rounds():
    """bench_up_breakdown --pythons: per level, each side's medians over rounds and its speed over the first side's."""
    def level(tps, ttft, cpu):
        return {"tokens_per_s": tps, "ttft_p50_ms": ttft, "by_process": {"target": {"cpu_us_per_token": cpu}}}

    runs = {"before": [{64: level(1000, 300, 900)}, {64: level(1200, 500, 800)}, {64: level(1100, 400, 1000)}],
            "after": [{64: level(1300, 250, 700)}, {64: level(1500, 200, 600)}]}
    row = breakdown.compare(runs, [64])[64]
    assert row["before"]["tokens_per_s"] == 1100 and row["before"]["ttft_p50_ms"] == 400
    assert row["before"]["cpu_us_per_token"] == {"target": 900} and row["before"]["speed"] == 1.0
    assert row["after"]["tokens_per_s"] == 1400 and row["after"]["rounds"] == [1300, 1500]
    assert math.isclose(row["after"]["speed"], 1400 / 1100)
