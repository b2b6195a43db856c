"""Can Jacobi decoding pay on the demo target? Its accepted tokens per verification, measured (issue 30).

Jacobi decoding (Santilli et al. 2023; the iteration lookahead decoding builds on) needs no drafter:
the verify forward's rows past the accepted prefix are the target's own guesses for the positions
after it, conditioned on the (wrong) drafts before them, and they become the next step's drafts.
This runs it greedily with the lean forward of the demo target on held-out prompts: each step feeds
the last committed token and k guesses, accepts the guesses equal to the target's argmax before the
first that differs, commits the target's token there, and takes the rows after it as the next
guesses (topped up to k with the last of them). Reported per k: mean accepted guesses per step and
tokens per step; outputs are checked equal to k = 0 decoding (greedy is exact whatever is guessed).

    python benchmarks/bench_jacobi.py            # results in benchmarks/results/jacobi/
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEMO, held_out_prompts, write_result  # noqa: E402


def jacobi(decoder, prompt: list[int], k: int, new_tokens: int) -> tuple[list[int], list[int]]:
    """(output ids, accepted guesses per step) of greedy Jacobi decoding with k guesses a step."""
    cache = decoder.new_cache()
    decoder.forward(cache, prompt[:-1], 0, 1)
    committed = list(prompt)
    guesses = [prompt[-1]] * k  # the cold start: any tokens; verification keeps the output exact
    accepted_counts = []
    while len(committed) - len(prompt) < new_tokens:
        n = len(committed)
        rows = decoder.forward(cache, [committed[-1], *guesses], n - 1, k + 1).argmax(-1).tolist()  # [k + 1]
        accepted = 0
        while accepted < k and guesses[accepted] == rows[accepted]:
            accepted += 1
        committed += guesses[:accepted] + [rows[accepted]]
        accepted_counts.append(accepted)
        rest = rows[accepted + 1:]
        guesses = (rest + [rest[-1] if rest else rows[accepted]] * k)[:k]
    cache.free()
    return committed[len(prompt):len(prompt) + new_tokens], accepted_counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--ks", default="1,2,3,4,6,8")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "jacobi")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from specdec.core.llama_decode import LlamaDecoder
    from specdec.core.models import load_causal_lm

    torch.set_num_threads(1)
    loaded = load_causal_lm(DEMO / "target")
    decoder = LlamaDecoder(loaded.model, numerics="fast")
    tok = AutoTokenizer.from_pretrained(DEMO / "target")
    prompts = [tok(p)["input_ids"] for p in held_out_prompts(args.prompts)]
    plain = [jacobi(decoder, p, 0, args.new_tokens)[0] for p in prompts]
    rows = []
    for k in (int(x) for x in args.ks.split(",")):
        counts = []
        for p, expected in zip(prompts, plain):
            out, accepted = jacobi(decoder, p, k, args.new_tokens)
            assert out == expected, "Jacobi changed greedy output"
            counts += accepted
        rows.append({"k": k, "verified_rows": k + 1, "mean_accepted": round(statistics.mean(counts), 3),
                     "tokens_per_step": round(1 + statistics.mean(counts), 3), "steps": len(counts)})
    write_result(args.out / "jacobi.json", prompts=args.prompts, new_tokens=args.new_tokens, rows=rows)
    print("| k (rows verified) | mean accepted guesses | tokens per step |\n|---|---|---|")
    for r in rows:
        print(f"| {r['k']} ({r['verified_rows']}) | {r['mean_accepted']} | {r['tokens_per_step']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
