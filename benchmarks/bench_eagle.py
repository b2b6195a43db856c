"""The EAGLE head against the draft model at the same number of verified rows, on the demo pair (issue 31).

One process, greedy, one thread, held-out prompts: for each budget k (k + 1 rows verified per step:
4, 8, 16) four drafters each decode every prompt: ``model`` (the 1.6M draft model's chain of k),
``tree`` (its trees of k nodes), ``eagle`` (the head's chain of k), ``eagle_tree`` (the head's
trees of k nodes), both scoring the head's 2,048-token draft vocabulary (scripts/draft_vocab.py),
and ``eagle_full_vocab`` (the chain scoring all 6,144 tokens). The verifier's features go to the head as they would over the wire: each chunk
is encoded to its wire bytes and decoded again (core/features.py), and those bytes and that time
are reported per step. Reported per drafter and budget: mean accepted tokens per verification,
tokens per step, tokens/s of the whole loop (draft and verify), medians over alternated rounds.
Outputs are checked equal across drafters (greedy is exact whatever drafts).

    python benchmarks/bench_eagle.py                    # results in benchmarks/results/eagle/
"""
from __future__ import annotations

import argparse
import secrets
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEMO, held_out_prompts, write_result  # noqa: E402

DRAFTERS = ("model", "tree", "eagle", "eagle_tree", "eagle_full_vocab")
OTHERS = ("ngram", "jacobi", "lookahead", "layer_skip", "layer_skip_shared")  # the model-free drafters, for the families' table (--drafters)


def decode(engine, drafter, name: str, prompt_ids: list[int], k: int, new_tokens: int) -> dict:
    """One prompt: output ids, accepted per step, seconds, and the features' wire bytes and time."""
    from specdec.core import features
    from specdec.core.sampling import SamplingParams
    from specdec.core.steps import SessionSpec

    sid = secrets.token_hex(16)
    wire_bytes, wire_ns = [], []

    def hand_over(session, state) -> None:
        """The verifier's chunks to the head through their wire form (what a remote drafter gets)."""
        t0 = time.perf_counter_ns()
        sent = 0
        for chunk in state.features_out:
            first, width, data = features.encode(chunk)
            sent += len(data)
            session.add_features(features.decode(first, width, data))
        state.features_out.clear()
        wire_bytes.append(sent)
        wire_ns.append(time.perf_counter_ns() - t0)

    t0 = time.perf_counter()
    spec = SessionSpec(sid, tuple(prompt_ids), SamplingParams(), drafter.name)
    engine.open(spec, new_tokens + 32)
    state = engine.sessions.get(sid)
    session = drafter.open_for(spec) if hasattr(drafter, "open_for") else drafter.open(prompt_ids, SamplingParams())
    if state.wants_features:
        hand_over(session, state)
        wire_bytes.clear(), wire_ns.clear()  # the prompt's: once per session, not per step
    committed, accepted = list(prompt_ids), []
    while len(committed) - len(prompt_ids) < new_tokens:
        proposal = session.propose(committed, k)
        base = len(committed)
        outcome = engine.verify(sid, proposal)
        accepted.append(outcome.num_accepted)
        committed.extend(outcome.token_ids)
        if state.wants_features:
            hand_over(session, state)
        if state.rows_out is not None:  # jacobi, lookahead: the target's guesses after each draft
            session.add_row_tokens(base, outcome.token_ids, state.rows_out[1], state.rows_out[2], state.rows_out[0])
            state.rows_out = None
    seconds = time.perf_counter() - t0
    engine.close(sid)
    return {"out": committed[len(prompt_ids):len(prompt_ids) + new_tokens], "accepted": accepted, "seconds": seconds,
            "wire_bytes": wire_bytes, "wire_ns": wire_ns}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--budgets", default="3,7,15", help="k: draft tokens (chain) or nodes (tree) per step")
    ap.add_argument("--rounds", type=int, default=2, help="alternated timing rounds")
    ap.add_argument("--drafters", default=",".join(DRAFTERS),
                    help=f"comma-separated, from {', '.join(DRAFTERS + OTHERS)} and lookahead_W_N_G (the first is the reference)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "eagle")
    ap.add_argument("--result", default="eagle.json", help="the result file's name under --out")
    args = ap.parse_args(argv)

    from specdec.draft.drafters import DraftConfig, build_drafters
    from specdec.target.engine import TargetConfig, VerifierEngine

    torch.set_num_threads(1)
    target = str(DEMO / "target")
    engine = VerifierEngine.from_config(TargetConfig(target, max_sessions=4))
    drafters = build_drafters(DraftConfig(str(DEMO / "draft"), target, eagle_head_path=str(DEMO / "eagle")))
    names = tuple(args.drafters.split(","))
    if "eagle_full_vocab" in names:
        drafters["eagle_full_vocab"] = build_drafters(DraftConfig(None, target, eagle_head_path=str(DEMO / "eagle"),
                                                                  eagle_draft_vocab=False))["eagle"]
    for name in names:  # lookahead_W_N_G: lookahead decoding with window W, n-grams of N, G candidates
        if name.startswith("lookahead_"):
            from specdec.draft.jacobi import LookaheadDrafter

            drafters[name] = LookaheadDrafter(*(int(x) for x in name.split("_")[1:]))
    if "layer_skip_shared" in names:  # inside the verifier: its decoder's first layers over the session's own cache
        from specdec.draft.layer_skip import shared_in_verifier

        drafters["layer_skip_shared"] = shared_in_verifier(engine, DraftConfig(None, target, layer_skip="auto"))
        print(f"layer_skip_shared runs layers {drafters['layer_skip_shared'].layers}: {drafters['layer_skip_shared'].scores}", flush=True)
    if "layer_skip" in names:  # the target's own layers, chosen by measurement at build
        drafters["layer_skip"] = build_drafters(DraftConfig(None, target, layer_skip="auto"))["layer_skip"]
        print(f"layer_skip runs layers {drafters['layer_skip'].layers}: {drafters['layer_skip'].scores}", flush=True)
    tok = engine.loaded.tokenizer
    prompts = [tok(p)["input_ids"] for p in held_out_prompts(args.prompts)]
    budgets = [int(b) for b in args.budgets.split(",")]
    rows = []
    for k in budgets:
        stats = {name: {"accepted": [], "seconds": [], "tokens": 0, "wire_bytes": [], "wire_ns": []} for name in names}
        outputs: dict[str, list[list[int]]] = {name: [] for name in names}
        for r in range(args.rounds):
            order = names if r % 2 == 0 else names[::-1]
            for name in order:
                seconds = 0.0
                for p in prompts:
                    result = decode(engine, drafters[name], name, p, k, args.new_tokens)
                    seconds += result["seconds"]
                    if r == 0:
                        outputs[name].append(result["out"])
                        stats[name]["accepted"] += result["accepted"]
                        stats[name]["tokens"] += len(result["out"])
                        stats[name]["wire_bytes"] += result["wire_bytes"]
                        stats[name]["wire_ns"] += result["wire_ns"]
                stats[name]["seconds"].append(seconds)
        for name in names:
            assert outputs[name] == outputs[names[0]], f"greedy outputs differ: {name} against {names[0]}"
        for name, st in stats.items():
            steps = len(st["accepted"])
            row = {"drafter": name, "k": k, "verified_rows": k + 1, "mean_accepted": round(statistics.mean(st["accepted"]), 3),
                   "tokens_per_step": round(st["tokens"] / steps, 3),
                   "tokens_per_s": round(st["tokens"] / statistics.median(st["seconds"]), 1)}
            if st["wire_bytes"]:
                row["feature_bytes_per_step"] = round(statistics.mean(st["wire_bytes"]))
                row["feature_wire_us_per_step"] = round(statistics.median(st["wire_ns"]) / 1e3, 1)
            rows.append(row)
    for k in budgets:
        by = {r["drafter"]: r for r in rows if r["k"] == k}
        for name in names[1:]:
            by[name]["accepted_vs_model"] = round(by[name]["mean_accepted"] / by[names[0]]["mean_accepted"], 3)
            by[name]["tokens_per_s_vs_model"] = round(by[name]["tokens_per_s"] / by[names[0]]["tokens_per_s"], 3)
    write_result(args.out / args.result, prompts=args.prompts, new_tokens=args.new_tokens, rows=rows)
    print("| drafter | rows verified | mean accepted | tokens/step | tokens/s | accepted vs model | tokens/s vs model | feature bytes/step | wire µs/step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['drafter']} | {r['verified_rows']} | {r['mean_accepted']} | {r['tokens_per_step']} | {r['tokens_per_s']} "
              f"| {r.get('accepted_vs_model', '')} | {r.get('tokens_per_s_vs_model', '')} | {r.get('feature_bytes_per_step', '')} "
              f"| {r.get('feature_wire_us_per_step', '')} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
