"""Start-up, peak memory and decode speed on a 0.46B target: transformers against `specdec generate -k 0`.

    python3 benchmarks/make_random_target.py            # once: /tmp/specdec-big-target (1.8 GB)
    python3 benchmarks/bench_big_target.py [--target /tmp/specdec-big-target] [--reps 2] [--tag after]
        [--specdec before=/tmp/head-tree --specdec after=]   # versions side by side, alternated

Each repetition runs, alternately, fresh processes (timings vary run to run; alternation keeps
the comparison fair):

(a) transformers: import, ``AutoModelForCausalLM.from_pretrained`` (float32), then ``generate`` of
    ``--tokens`` tokens, greedy (its first token's time too: transformers maps a float32 checkpoint
    and reads the weights only when the first forward runs);
(b) ``python3 -m specdec generate PROMPT --target T --draft models/demo/draft -k 0``: start-up is the
    time from launch to the first streamed output byte (the first token), ms per token the time
    between the first and the last byte over the tokens in between.

Peak RSS is the child's own ``ru_maxrss`` (``os.wait4``). Ratios: peak RSS over the weights' bytes,
and start-up over transformers' load time, both measured from launch (imports included, as a user
waits for them) and from the end of imports. Writes benchmarks/results/big_target/<tag>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from common import DEMO, ROOT, machine  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "big_target"
PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"

# (a): the child prints its own phase times (seconds since its interpreter started) as one JSON line.
HF_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
imported = time.perf_counter() - t0
path, tokens = sys.argv[1], int(sys.argv[2])
tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
loaded = time.perf_counter() - t0
ids = torch.tensor([tok(sys.argv[3])["input_ids"]])

class FirstToken:  # generate() hands a streamer the prompt first, then each new token
    calls, at = 0, None
    def put(self, value):
        FirstToken.calls += 1
        if FirstToken.calls == 2:
            FirstToken.at = time.perf_counter() - t0
    def end(self):
        pass

with torch.inference_mode():
    out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=tok.eos_token_id,
                         streamer=FirstToken())
done = time.perf_counter() - t0
print(json.dumps({"imported_s": imported, "loaded_s": loaded, "first_token_s": FirstToken.at, "generated_s": done,
                  "new_tokens": out.shape[1] - ids.shape[1], "threads": torch.get_num_threads()}))
"""


def run_child(cmd: list[str], stream: bool, pythonpath: str = "") -> dict:
    """Run ``cmd`` (``pythonpath`` first on its import path); its stdout, the times (since launch) its
    output arrived, wall time and peak RSS."""
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH", "")) if p)
    t0 = time.perf_counter()
    # not from the repository: `-m specdec` then imports the installed package (or $PYTHONPATH's), not ./specdec
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tempfile.gettempdir(), env=env)
    chunks, times = [], []
    fd = proc.stdout.fileno()
    while True:
        data = os.read(fd, 65536)
        if not data:
            break
        chunks.append(data)
        times.append(time.perf_counter() - t0)
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {proc.returncode}: {err.decode()[-2000:]}")
    return {"stdout": b"".join(chunks).decode(errors="replace"), "times": times if stream else [], "wall_s": wall,
            "peak_rss_bytes": usage.ru_maxrss * 1024}


def run_hf(target: str, tokens: int) -> dict:
    got = run_child([sys.executable, "-c", HF_CHILD, target, str(tokens), PROMPT], stream=False)
    phases = json.loads(got["stdout"].strip().splitlines()[-1])
    return {"load_s_from_launch": phases["loaded_s"], "load_s_after_imports": phases["loaded_s"] - phases["imported_s"],
            "first_token_s_from_launch": phases["first_token_s"],
            "imports_s": phases["imported_s"], "generate_s": phases["generated_s"] - phases["loaded_s"],
            "ms_per_token": 1000 * (phases["generated_s"] - phases["loaded_s"]) / phases["new_tokens"],
            "new_tokens": phases["new_tokens"], "threads": phases["threads"], "peak_rss_bytes": got["peak_rss_bytes"],
            "wall_s": got["wall_s"]}


def imports_s() -> float:
    """How long this interpreter takes to import torch and transformers (subtracted for the 'after imports' ratio)."""
    got = run_child([sys.executable, "-c", "import time; t = time.perf_counter(); import torch, transformers; "
                     "print(time.perf_counter() - t)"], stream=False)
    return float(got["stdout"].strip())


def run_specdec(target: str, draft: str, tokens: int, threads: int | None, pythonpath: str = "") -> dict:
    cmd = [sys.executable, "-m", "specdec", "generate", PROMPT, "--target", target, "--draft", draft, "-k", "0",
           "--max-new-tokens", str(tokens)]
    if threads:
        cmd += ["--threads", str(threads)]
    got = run_child(cmd, stream=True, pythonpath=pythonpath)
    times = got["times"]
    first, last = times[0], times[-1]
    return {"startup_s": first, "ms_per_token": 1000 * (last - first) / max(1, tokens - 1), "chunks": len(times),
            "peak_rss_bytes": got["peak_rss_bytes"], "wall_s": got["wall_s"], "text_chars": len(got["stdout"])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="/tmp/specdec-big-target")
    ap.add_argument("--draft", default=str(DEMO / "draft"))
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per run (both)")
    ap.add_argument("--threads", type=int, default=None, help="specdec --threads (default: its own choice)")
    ap.add_argument("--tag", default="run", help="results file name")
    ap.add_argument("--only", choices=("hf", "specdec"), default=None, help="run one side only")
    ap.add_argument("--specdec", action="append", default=[], metavar="NAME=PYTHONPATH",
                    help="a specdec version to run (repeatable; alternated): a tree laid out as the installed package, "
                         "put first on the import path (default: specdec= , the installed one)")
    args = ap.parse_args()
    variants = dict(v.split("=", 1) for v in args.specdec) or {"specdec": ""}
    card = Path(args.target) / "random_target.json"
    weight_bytes = (json.loads(card.read_text())["weight_bytes"] if card.is_file()
                    else sum(p.stat().st_size for p in Path(args.target).glob("*.safetensors")))
    runs: dict[str, list[dict]] = {"hf": [], **{name: [] for name in variants}}
    for rep in range(args.reps):
        if args.only != "specdec":
            runs["hf"].append(run_hf(args.target, args.tokens))
            print("hf", rep, json.dumps(runs["hf"][-1]), flush=True)
        if args.only != "hf":
            for name, path in variants.items():
                runs[name].append(run_specdec(args.target, args.draft, args.tokens, args.threads, path))
                print(name, rep, json.dumps(runs[name][-1]), flush=True)

    def med(side: str, key: str) -> float | None:
        values = [r[key] for r in runs[side]]
        return statistics.median(values) if values else None

    summary = {
        "weight_bytes": weight_bytes,
        "hf_load_s_from_launch": med("hf", "load_s_from_launch"), "hf_load_s_after_imports": med("hf", "load_s_after_imports"),
        "hf_imports_s": med("hf", "imports_s"), "hf_first_token_s_from_launch": med("hf", "first_token_s_from_launch"),
        "hf_peak_rss_bytes": med("hf", "peak_rss_bytes"),
        "hf_ms_per_token": med("hf", "ms_per_token"),
    }
    if summary["hf_peak_rss_bytes"] is not None:
        summary["hf_rss_over_weights"] = summary["hf_peak_rss_bytes"] / weight_bytes
    for name in variants:
        if not runs[name]:
            continue
        summary |= {f"{name}_startup_s": med(name, "startup_s"), f"{name}_peak_rss_bytes": med(name, "peak_rss_bytes"),
                    f"{name}_ms_per_token": med(name, "ms_per_token")}
        summary[f"{name}_rss_over_weights"] = summary[f"{name}_peak_rss_bytes"] / weight_bytes
        if summary["hf_load_s_from_launch"] is not None:
            summary[f"{name}_startup_over_hf_load"] = summary[f"{name}_startup_s"] / summary["hf_load_s_from_launch"]
            summary[f"{name}_startup_over_hf_first_token"] = summary[f"{name}_startup_s"] / summary["hf_first_token_s_from_launch"]
            summary[f"{name}_decode_speedup_over_hf"] = summary["hf_ms_per_token"] / summary[f"{name}_ms_per_token"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{args.tag}.json"
    out.write_text(json.dumps({"machine": machine(), "args": vars(args), "variants": variants, "summary": summary,
                               "runs": runs}, indent=2))

    def fmt(v, unit=""):
        return "-" if v is None else (f"{v / 1e9:.2f} GB" if unit == "GB" else f"{v:.2f}{unit}")

    print(f"\nweights {weight_bytes / 1e9:.2f} GB; medians of {args.reps}\n")
    print("| | start-up (from launch) | peak RSS | RSS / weights | ms per token |")
    print("|---|---|---|---|---|")
    print(f"| transformers | load {fmt(summary['hf_load_s_from_launch'], ' s')} (after imports {fmt(summary['hf_load_s_after_imports'], ' s')}), "
          f"first token {fmt(summary['hf_first_token_s_from_launch'], ' s')} "
          f"| {fmt(summary['hf_peak_rss_bytes'], 'GB')} | {fmt(summary.get('hf_rss_over_weights'), 'x')} | {fmt(summary['hf_ms_per_token'])} |")
    for name in variants:
        if f"{name}_startup_s" in summary:
            print(f"| {name} -k 0 | first token {fmt(summary[f'{name}_startup_s'], ' s')} "
                  f"({fmt(summary.get(f'{name}_startup_over_hf_load'), 'x')} HF load, "
                  f"{fmt(summary.get(f'{name}_startup_over_hf_first_token'), 'x')} HF first token) | {fmt(summary[f'{name}_peak_rss_bytes'], 'GB')} "
                  f"| {fmt(summary[f'{name}_rss_over_weights'], 'x')} | {fmt(summary[f'{name}_ms_per_token'])} |")
    print(f"\nwritten {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
