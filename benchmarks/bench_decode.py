"""Tokens/s of target-only decoding vs specdec, on the same prompts and models, in one run.

    python benchmarks/bench_decode.py [--target PATH --draft PATH] [--prompts 8] [--max-new-tokens 96]
    python benchmarks/bench_decode.py --out benchmarks/results/decode/speed.json   # the model card's figures

Methods, run alternately prompt by prompt so machine noise hits all alike (docs/performance.md,
"How to read these figures"):
  target_only_hf     transformers generate(), greedy, the target alone (the baseline)
  assisted_hf        transformers assisted generation with the same draft (assistant_model=)
  specdec_k0         specdec with k = 0: target-only decoding through specdec's own forward (lean,
                     oneDNN-packed), so speculation's share of the speed-up can be told from the forward's
  specdec_inproc     specdec, all roles in one process (the embedded path), model drafter, adaptive k
  specdec_inproc_k4  the same with fixed k = 4
  specdec_inproc_hf  adaptive k with both models on the reference HF forward (--reference-forward)
  specdec_3proc      specdec over gRPC: orchestrator, draft and target as three processes (`specdec up`)
Greedy everywhere, so every method must produce the same tokens; the script checks that.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import torch
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from common import pair_arguments, Timer, held_out_prompts, median  # noqa: E402
from specdec.ports import free_ports  # noqa: E402


def main() -> int:
    ap = pair_arguments(__doc__.splitlines()[0])
    ap.add_argument("--skip-3proc", action="store_true")
    ap.add_argument("--out", help="write the JSON result here too")
    args = ap.parse_args()
    torch.set_num_threads(2)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec import roles
    from specdec.core.speculation import SpeculationMode, SpeculationPolicy
    from specdec.draft.drafters import DraftConfig
    from specdec.orchestrator.loop import collect
    from specdec.orchestrator.request import GenerationRequest, OrchestratorConfig
    from specdec.target.engine import TargetConfig

    tok = AutoTokenizer.from_pretrained(args.target, local_files_only=True)
    target = AutoModelForCausalLM.from_pretrained(args.target, local_files_only=True, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(args.draft, local_files_only=True, dtype=torch.float32).eval()
    orch = roles.embedded(TargetConfig(args.target), DraftConfig(args.draft, args.target), OrchestratorConfig())
    orch_hf = roles.embedded(TargetConfig(args.target, fast_forward=False),
                             DraftConfig(args.draft, args.target, fast_draft_forward=False), OrchestratorConfig())
    prompts = held_out_prompts(args.prompts, Path(args.target).parent)
    N = args.max_new_tokens

    def hf(prompt, assistant=None):
        ids = torch.tensor([tok(prompt)["input_ids"]])
        kw = dict(max_new_tokens=N, do_sample=False, pad_token_id=tok.eos_token_id)
        if assistant is not None:
            kw["assistant_model"] = assistant
        with torch.inference_mode():
            out = target.generate(ids, **kw)
        return tuple(out[0, ids.shape[1]:].tolist()), None

    def specdec_inproc(prompt, policy, orchestrator=orch):
        req = GenerationRequest(prompt_text=prompt, max_new_tokens=N, drafter="model", policy=policy)
        last, ids, _ = asyncio.run(collect(orchestrator.generate(req)))
        return ids, last.counters

    stub = None
    procs = None
    if not args.skip_3proc:
        import grpc

        from specdec.v1 import generation_pb2 as pb, generation_pb2_grpc

        base = free_ports(3)
        procs = subprocess.Popen([sys.executable, "-m", "specdec", "up", "--topology", "split", "--target", args.target,
                                  "--draft", args.draft, "--base-port", str(base)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        channel = grpc.insecure_channel(f"127.0.0.1:{base}")
        stub = generation_pb2_grpc.GenerationStub(channel)
        deadline = time.time() + 120
        while True:
            try:
                stub.Generate(pb.GenerateRequest(text="x", max_new_tokens=2), timeout=30)
                break
            except grpc.RpcError:
                if time.time() > deadline:
                    raise
                time.sleep(0.5)

        def specdec_3proc(prompt):
            r = stub.Generate(pb.GenerateRequest(text=prompt, max_new_tokens=N), timeout=300)
            return tuple(r.token_ids), r.stats

    methods = {
        "target_only_hf": lambda p: hf(p),
        "assisted_hf": lambda p: hf(p, draft),
        "specdec_k0": lambda p: specdec_inproc(p, SpeculationPolicy(SpeculationMode.FIXED, 0)),
        "specdec_inproc": lambda p: specdec_inproc(p, SpeculationPolicy()),
        "specdec_inproc_k4": lambda p: specdec_inproc(p, SpeculationPolicy(SpeculationMode.FIXED, 4)),
        "specdec_inproc_hf": lambda p: specdec_inproc(p, SpeculationPolicy(), orch_hf),
    }
    if stub is not None:
        methods["specdec_3proc"] = specdec_3proc

    for fn in methods.values():  # warm-up: first calls pay one-off costs
        fn(prompts[0])
    times = {m: [] for m in methods}
    tokens = {m: 0 for m in methods}
    accepted = drafted = 0
    mismatches = []
    try:
        for i, prompt in enumerate(prompts):
            ref = None
            for name, fn in methods.items():
                with Timer() as t:
                    ids, stats = fn(prompt)
                times[name].append(t.seconds)
                tokens[name] += len(ids)
                if ref is None:
                    ref = ids
                elif ids != ref:
                    mismatches.append((i, name))
                if name == "specdec_inproc" and stats is not None:
                    accepted += stats.accepted_tokens
                    drafted += stats.draft_tokens
            print(f"prompt {i}: " + ", ".join(f"{m} {times[m][-1]:.2f}s" for m in methods), file=sys.stderr, flush=True)
    finally:
        if procs is not None:
            procs.terminate()
            procs.wait(timeout=30)

    base_tps = tokens["target_only_hf"] / sum(times["target_only_hf"])
    k0_tps = tokens["specdec_k0"] / sum(times["specdec_k0"])
    result = {
        "prompts": len(prompts), "max_new_tokens": N, "outputs_identical": not mismatches, "mismatches": mismatches,
        "specdec_inproc_acceptance_rate": round(accepted / max(1, drafted), 4),
        "methods": {
            m: {"tokens_per_s": round(tokens[m] / sum(times[m]), 2),
                "speedup_vs_target_only": round(tokens[m] / sum(times[m]) / base_tps, 3),
                "speedup_vs_specdec_k0": round(tokens[m] / sum(times[m]) / k0_tps, 3),
                "median_s_per_prompt": round(median(times[m]), 3)}
            for m in methods
        },
    }
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if not mismatches else 1


if __name__ == "__main__":
    sys.exit(main())
