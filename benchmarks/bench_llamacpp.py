"""specdec against llama.cpp, single stream, on any Llama target with the demo draft (issue 26, item 5;
"weight-bound speed on CPU", item 5: the inflated target).

    python3 benchmarks/bench_llamacpp.py --build [--target DIR]  # once, 4-15 min on 2 cores: llamacpp_tools.build_tools
    python3 benchmarks/bench_llamacpp.py [--target DIR] [--threads 1,2] [--rounds 3] [--prompts 8] [--max-new-tokens 96]

Methods, greedy, on the prompts `specdec bench` uses (the pair's held-out files), at every thread count
of --threads (a method's name ends in _t<threads>), alternated prompt by prompt (every method runs each
prompt in turn, the order rotating), medians over rounds:
  llamacpp_f32, llamacpp_f16    llama.cpp target only (`llama-completion --temp 0`), the target as GGUF f32 / f16
  llamacpp_spec_f32, _f16       llama.cpp's draft-model speculation (`llama-speculative-simple`, at most
                                --llamacpp-k drafted tokens a step), the draft as GGUF f32
  llamabench_f32, _f16          `llama-bench -p 0 -n N`: pure decode from an empty context
  specdec_{f32,bf16}_METHOD     specdec in one process (all roles embedded, as `specdec bench`'s in-process
                                methods), the target in float32 or bfloat16 (--numerics: specdec's default
                                auto is exact where this CPU's kernels hold it), the draft in float32;
                                METHOD from --specdec-methods: k0 (target only), adaptive, k4 and k7 (the
                                draft model), tree7 (token trees of 7 nodes from it), ngram_k7, ngram_k3,
                                ngram_adaptive (prompt lookup), eagle_k7 (the EAGLE head, where the target
                                has one).
decode tok/s counts the tokens after the first over the time after the first token arrived (prompt
excluded, as llama.cpp's "eval time"; llama-speculative-simple reports only every token over its decode
loop: llamacpp_tools.speculative); e2e tok/s counts every token over the whole request. Outputs are
compared as text (llama.cpp prints text, not token ids), against specdec float32 k = 0 (where a run
generated more tokens, as llama-speculative-simple does, the shorter text must begin the longer).

Results: benchmarks/results/llamacpp/<name>.json (--name: the target folder's, "demo" for the demo target).
specdec runs under --specdec-python (by default a venv over a frozen clone of this repository, so a
benchmark is not broken by work in progress here); this script itself needs only the standard library.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llamacpp_tools as lcpp  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "demo"
WORK = Path(os.environ.get("SPECDEC_LLAMACPP_DIR", "/work/llamacpp"))  # builds and scratch, outside the repo
DTYPES = {"float32": "f32", "bfloat16": "bf16"}  # specdec's target dtype -> the tag in method names
# specdec method -> (fixed k, None: adaptive; drafter)
SPECDEC_METHODS = {"k0": (0, "model"), "adaptive": (None, "model"), "k4": (4, "model"), "k7": (7, "model"),
                   "tree7": (7, "tree"), "ngram_k7": (7, "ngram"), "ngram_k3": (3, "ngram"),
                   "ngram_adaptive": (None, "ngram"), "eagle_k7": (7, "eagle")}
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16")


# ----------------------------------------------------------------------------- specdec (worker side)
def worker(argv: list[str]) -> None:
    """Under --specdec-python: load one orchestrator (the target's dtype, numerics and thread count),
    warm up, say "ready" with what it loaded; then for every prompt index read on stdin run every
    method (in an order that alternates), one JSON line each. The models stay loaded across rounds."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--target"), ap.add_argument("--draft"), ap.add_argument("--prompts-json"), ap.add_argument("--methods")
    ap.add_argument("--dtype"), ap.add_argument("--numerics"), ap.add_argument("--max-new-tokens", type=int)
    ap.add_argument("--threads", type=int)
    a = ap.parse_args(argv)
    from specdec import roles
    from specdec.bench_methods import policy
    from specdec.cli_common import eagle_head_path
    from specdec.draft.drafters import DraftConfig
    from specdec.draft.engine import DraftEngine
    from specdec.orchestrator.request import GenerationRequest, OrchestratorConfig
    from specdec.target.engine import TargetConfig, VerifierEngine

    prompts = json.loads(Path(a.prompts_json).read_text())
    beside = Path(a.target).parent / "eagle"  # the demo head next to the demo target, wherever the pair lies
    head = eagle_head_path(None, a.target) or (str(beside) if (beside / "config.json").is_file() else None)
    # roles.embedded with a fixed thread count, keeping the verifier to say which numerics it runs
    verifier = VerifierEngine.from_config(TargetConfig(a.target, threads=a.threads, dtype=a.dtype, numerics=a.numerics))
    drafter = DraftEngine.from_config(DraftConfig(a.draft, a.target, threads=a.threads, eagle_head_path=head, thread_nice=0))
    orch = roles.embedded_engines(verifier, drafter, OrchestratorConfig(max_new_tokens_limit=max(2048, a.max_new_tokens)))
    policies = [(name, policy(SPECDEC_METHODS[name][0], False), SPECDEC_METHODS[name][1]) for name in a.methods.split(",")
                if SPECDEC_METHODS[name][1] in orch.target.drafters]

    async def one(prompt: str, pol, drafter: str, max_new_tokens: int) -> dict:
        t0 = time.perf_counter()
        ids, text, first, last, n_first = [], [], None, None, 0
        async for chunk in orch.generate(GenerationRequest(prompt_text=prompt, max_new_tokens=max_new_tokens,
                                                           drafter=drafter, policy=pol)):
            now = time.perf_counter()
            if chunk.token_ids and first is None:  # k = 0: the prompt's token; speculation: the first step's
                first, n_first = now, len(chunk.token_ids)
            ids.extend(chunk.token_ids)
            text.append(chunk.text)
            last = chunk
        end = time.perf_counter()
        c = last.counters
        return {"text": "".join(text), "token_ids": ids, "prompt_tokens": last.prompt_tokens, "tokens": len(ids),
                "decode_tokens": len(ids) - n_first, "decode_s": end - first, "e2e_s": end - t0,
                "verify_steps": c.verify_steps, "draft_tokens": c.draft_tokens, "accepted_tokens": c.accepted_tokens}

    async def main() -> None:
        for _, pol, drafter in policies:  # warm-up: first shapes (kernel choices were timed at load)
            await one(prompts[0], pol, drafter, min(16, a.max_new_tokens))
        half = verifier.decoder is not None and verifier.decoder.half_weights
        print("ready " + json.dumps({"numerics": verifier.numerics, "half_weights": bool(half),
                                     "methods": [p[0] for p in policies]}), flush=True)
        calls = 0
        while line := await asyncio.to_thread(sys.stdin.readline):
            order = policies if calls % 2 == 0 else policies[::-1]
            calls += 1
            prompt = prompts[int(line)]
            print(json.dumps({name: await one(prompt, pol, drafter, a.max_new_tokens) for name, pol, drafter in order}),
                  flush=True)

    asyncio.run(main())


class SpecdecWorker:
    """A worker process (see ``worker``) for one target dtype and thread count, driven prompt by prompt."""

    def __init__(self, args, prompts_json: Path, dtype: str, threads: int) -> None:
        self.tag, self.threads = DTYPES[dtype], threads
        log = args.work / "logs" / f"specdec-{args.name}-{self.tag}-t{threads}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log, self.info = log, {"dtype": dtype, "threads": threads}
        self.proc = subprocess.Popen(
            [args.specdec_python, __file__, "--worker", "--target", args.target, "--draft", args.draft,
             "--prompts-json", str(prompts_json), "--dtype", dtype, "--numerics", args.numerics,
             "--max-new-tokens", str(args.max_new_tokens), "--threads", str(threads), "--methods", args.specdec_methods],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log, "wb"), text=True,
            env={**os.environ, "OMP_NUM_THREADS": str(threads)}, cwd=lcpp.NEUTRAL)

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"specdec worker {self.tag} t{self.threads} exited ({self.proc.wait()}); log {self.log}:\n"
                               + self.log.read_text(errors="replace")[-3000:])
        return line

    def ready(self) -> None:
        while not (line := self._line()).startswith("ready "):
            pass
        self.info |= json.loads(line.removeprefix("ready "))

    def run(self, i: int) -> dict:
        self.proc.stdin.write(f"{i}\n")
        self.proc.stdin.flush()
        return {f"specdec_{self.tag}_{name}_t{self.threads}": r for name, r in json.loads(self._line()).items()}

    def close(self) -> None:
        try:  # peak resident memory, while it still runs
            status = Path(f"/proc/{self.proc.pid}/status").read_text()
            self.info["peak_rss_mb"] = int(re.search(r"VmHWM:\s*(\d+) kB", status).group(1)) // 1024
        except (OSError, AttributeError):
            pass
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def specdec_prompts(args) -> tuple[list[str], str]:
    """The prompts `specdec bench` uses (its bench_prompts, from the frozen specdec): the target's
    held-out files, else the draft's (an inflated target lies outside the pair's folder)."""
    code = ("import json, sys; from specdec.bench_common import bench_prompts; "
            "p, s = bench_prompts(int(sys.argv[1]), sys.argv[2])\n"
            "if s.startswith('built-in'): p, s = bench_prompts(int(sys.argv[1]), sys.argv[3])\n"
            "print(json.dumps([p, s]))")
    out = subprocess.run([args.specdec_python, "-c", code, str(args.prompts), args.target, args.draft],
                         capture_output=True, text=True, check=True, cwd=lcpp.NEUTRAL).stdout
    return json.loads(out)


def bf16_here(python: str) -> bool:
    """Whether specdec runs a bfloat16 target on this CPU (a bf16 dot, or its C kernels reading bf16)."""
    code = ("from specdec.core import llama_decode as d; "
            "print(int(bool(getattr(d, 'bfloat16_supported', d.native_bf16)())))")  # older specdec: native only
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=lcpp.NEUTRAL)
    return r.returncode == 0 and r.stdout.strip() == "1"


def specdec_venv(args) -> str:
    """--specdec-python; the default one is made here: a clone of this repository's HEAD, installed
    editable in a venv that sees the system's torch and transformers."""
    py = Path(args.specdec_python)
    if py.exists() or py != args.work / "venv" / "bin" / "python":
        return str(py)
    clone = args.work / "specdec-main"
    if not clone.exists():
        lcpp.sh(["git", "clone", "-q", str(ROOT), str(clone)])
    lcpp.sh([sys.executable, "-m", "venv", "--system-site-packages", str(args.work / "venv")])
    lcpp.sh([str(py), "-m", "pip", "install", "-q", "--no-deps", "-e", str(clone)])
    return str(py)


# ----------------------------------------------------------------------------- the run
def summarize(runs: list[dict]) -> dict:
    """One method, one round, every prompt: aggregate tok/s (total tokens over total seconds)."""
    out = {"decode_tok_s": sum(r["decode_tokens"] for r in runs) / sum(r["decode_s"] for r in runs),
           "e2e_tok_s": sum(r["tokens"] for r in runs) / sum(r["e2e_s"] for r in runs),
           "tokens": sum(r["tokens"] for r in runs)}
    if "verify_steps" in runs[0]:
        out["tokens_per_verify"] = out["tokens"] / max(1, sum(r["verify_steps"] for r in runs))
    if "draft_tokens" in runs[0]:
        drafted = sum(r["draft_tokens"] for r in runs)
        out["acceptance"] = sum(r["accepted_tokens"] for r in runs) / drafted if drafted else None
    return out


def run(args) -> dict:
    """Rounds; in each, prompt by prompt, every method at every thread count (the order rotating by
    round and prompt), then llama-bench (first in odd rounds, last in even ones)."""
    lc, n = args.lc, args.max_new_tokens
    if missing := lcpp.missing_tools(lc):
        sys.exit("bench_llamacpp: missing " + ", ".join(missing) + f"\n  build them: python3 {Path(__file__).relative_to(ROOT)}"
                 " --build   (or pass --llamacpp-build)")
    py = specdec_venv(args)
    gguf = {q: lcpp.ensure_gguf(lc, py, args.target, q) for q in lcpp.OUTTYPES}
    draft_gguf = lcpp.ensure_gguf(lc, py, args.draft, "f32")
    args.out.mkdir(parents=True, exist_ok=True)
    prompts, source = specdec_prompts(args)
    prompts_json = args.out / f"{args.name}.prompts.json"
    prompts_json.write_text(json.dumps(prompts, indent=1))
    dtypes = args.dtypes
    if "bfloat16" in dtypes and not bf16_here(args.specdec_python):
        print("bench_llamacpp: specdec runs no bfloat16 target on this CPU: specdec bf16 skipped", file=sys.stderr)
        dtypes = [d for d in dtypes if d != "bfloat16"]
    workers: list[SpecdecWorker] = []
    try:
        for t in args.threads:
            for d in dtypes:  # one at a time: each times its kernels at load
                workers.append(SpecdecWorker(args, prompts_json, d, t))
                workers[-1].ready()
        units = []
        for t in args.threads:
            for q in lcpp.OUTTYPES:
                units.append(lambda i, q=q, t=t: {f"llamacpp_{q}_t{t}": lcpp.completion(lc, gguf[q], prompts[i], n, t)})
                units.append(lambda i, q=q, t=t: {f"llamacpp_spec_{q}_t{t}": lcpp.speculative(
                    lc, gguf[q], draft_gguf, prompts[i], n, t, args.llamacpp_k)})
        units += [w.run for w in workers]

        def bench() -> dict:
            if not args.llama_bench:
                return {}
            tg = lcpp.bench(lc, [gguf[q] for q in lcpp.OUTTYPES], args.threads, n)
            return {f"llamabench_{q}_t{t}": {"decode_tok_s": tg[(str(gguf[q]), t)]} for t in args.threads for q in lcpp.OUTTYPES}

        rounds: list[dict] = []
        t0 = time.perf_counter()
        for r in range(args.rounds):
            per_prompt: dict[str, list[dict]] = {}
            load = [os.getloadavg()[0]]
            tg = bench() if r % 2 else None
            for i in range(len(prompts)):
                print(f"round {r + 1}/{args.rounds}  prompt {i + 1}/{len(prompts)}  elapsed {time.perf_counter() - t0:5.0f}s  "
                      f"load {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
                shift = (r + i) % len(units)
                for unit in units[shift:] + units[:shift]:
                    for m, res in unit(i).items():
                        per_prompt.setdefault(m, []).append(res)
            tg = bench() if tg is None else tg
            load.append(os.getloadavg()[0])
            rounds.append({"loadavg_1min_start_end": load, "per_prompt": per_prompt,
                           "summary": {m: summarize(v) for m, v in per_prompt.items()} | tg})
    finally:
        for w in workers:
            w.close()
    return {
        "what": "single stream, greedy; decode tok/s excludes the prompt; medians over alternated rounds; "
                "outputs compared as text",
        "machine": machine(),
        "llama_cpp": {"source": f"llama-cpp-python=={lcpp.LLAMA_CPP_PYTHON} sdist, vendor/llama.cpp", "commit": lc.commit(),
                      "build": str(lc.build), "gguf": {q: str(p) for q, p in gguf.items()}, "draft_gguf": str(draft_gguf),
                      "speculative_k": args.llamacpp_k},
        "specdec": {"python": args.specdec_python, "commit": specdec_commit(args.specdec_python),
                    "numerics_asked": args.numerics, "workers": [w.info for w in workers]},
        "target": args.target, "draft": args.draft, "name": args.name, "threads": args.threads, "prompts": len(prompts),
        "prompt_source": source, "max_new_tokens": n, "rounds": len(rounds),
        **analyse(rounds, args.threads), "per_round": rounds,
    }


def split_threads(method: str) -> tuple[str, int]:
    m = re.fullmatch(r"(.*)_t(\d+)", method)
    return (m.group(1), int(m.group(2))) if m else (method, 1)


def family(base: str) -> int:
    """Row order within a thread count: llama.cpp, its speculation, llama-bench, specdec f32, bf16."""
    for i, prefix in enumerate(("llamacpp_spec_", "llamacpp_", "llamabench_", "specdec_f32_", "specdec_bf16_")):
        if base.startswith(prefix):
            return (1, 0, 2, 3, 4)[i]
    return 5


def plain_of(method: str, t0: int) -> str:
    """The same engine and precision without speculation, at the first thread count."""
    base, _ = split_threads(method)
    if base.startswith("llamacpp_"):
        return f"llamacpp_{base.removeprefix('llamacpp_spec_').removeprefix('llamacpp_')}_t{t0}"
    return f"specdec_{base.split('_')[1]}_k0_t{t0}"


def analyse(rounds: list[dict], threads: list[int]) -> dict:
    """Medians, text agreement (round 1) and ratios to llama.cpp at the same thread count."""
    seen = list(rounds[0]["summary"])
    methods = sorted(seen, key=lambda m: (split_threads(m)[1], family(split_threads(m)[0]), seen.index(m)))
    med = {m: {key: statistics.median(r["summary"][m][key] for r in rounds)
               for key in rounds[0]["summary"][m] if rounds[0]["summary"][m][key] is not None} for m in methods}
    pp, t0 = rounds[0]["per_prompt"], threads[0]
    ref = f"specdec_f32_k0_t{t0}" if f"specdec_f32_k0_t{t0}" in pp else f"llamacpp_f32_t{t0}"

    def agree(x: dict, y: dict) -> bool:
        """Same text; where one generated more tokens (llama-speculative-simple overshoots -n), the
        other's text begins it."""
        short, long = sorted((x, y), key=lambda r: r["tokens"])
        return short["text"] == long["text"] if short["tokens"] == long["tokens"] else long["text"].startswith(short["text"])

    def same(a: str, b: str) -> int | None:
        return sum(agree(x, y) for x, y in zip(pp[a], pp[b])) if a in pp and b in pp else None

    def common_prefix(a: str, b: str) -> list[int]:
        return [len(os.path.commonprefix([x["text"], y["text"]])) for x, y in zip(pp[a], pp[b])]

    def ratios(num: str, den: str) -> dict:
        per_round = [r["summary"][num]["decode_tok_s"] / r["summary"][den]["decode_tok_s"] for r in rounds]
        return {"of_medians": med[num]["decode_tok_s"] / med[den]["decode_tok_s"], "per_round": per_round}

    headline = {}
    for m in methods:  # specdec against llama.cpp's same kind (plain or speculative) and nearest precision
        base, t = split_threads(m)
        if base.startswith("specdec_"):
            q = "f32" if base.startswith("specdec_f32_") else "f16"
            den = f"llamacpp_{q}_t{t}" if base.endswith("_k0") else f"llamacpp_spec_{q}_t{t}"
            if den in med:
                headline[f"{m} / {den}"] = ratios(m, den)
    return {"median": med, "ratios": headline, "text_reference": ref,
            "greedy_text_equal_to_reference_round1": {m: same(m, ref) for m in pp},
            "text_common_prefix_chars_with_reference_round1": {m: common_prefix(m, ref) for m in pp} if ref in pp else {},
            "greedy_text_equal_to_plain_round1": {m: same(m, plain_of(m, t0)) for m in pp},
            "prompt_tokens_round1": {m: [r["prompt_tokens"] for r in runs] for m, runs in pp.items()}}


def table(rep: dict) -> str:
    med, n = rep["median"], rep["prompts"]
    flags = rep["machine"].get("cpu_flags", {})
    have = ", ".join(f for f, v in flags.items() if v) or "not recorded"
    lines = [f"{rep.get('name', rep['target'])}: {n} prompts x {rep['max_new_tokens']} tokens, threads "
             f"{', '.join(map(str, rep.get('threads', [1])))}, median of {rep['rounds']} alternated rounds",
             f"{rep['machine']['cpu']}, {rep['machine']['cores']} cores; CPU flags: {have}", "",
             "| method | threads | decode tok/s | e2e tok/s | vs llama.cpp f32 | vs llama.cpp f16 | tokens/verify | acceptance "
             f"| same text as {rep['text_reference']} | same text as plain |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for m, v in med.items():
        base, t = split_threads(m)
        f32, f16 = (med.get(f"llamacpp_{q}_t{t}", {}).get("decode_tok_s") for q in ("f32", "f16"))
        vs = [f"{v['decode_tok_s'] / d:.2f}x" if d else "-" for d in (f32, f16)]
        cells = [f"{v[k]:.{p}f}" if k in v else "-" for k, p in (("e2e_tok_s", 1), ("tokens_per_verify", 2), ("acceptance", 2))]
        agree = [rep[k].get(m) for k in ("greedy_text_equal_to_reference_round1", "greedy_text_equal_to_plain_round1")]
        agree = ["-" if a is None else f"{a}/{n}" for a in agree]
        lines.append(f"| {base} | {t} | {v['decode_tok_s']:.1f} | {cells[0]} | {vs[0]} | {vs[1]} | {cells[1]} | {cells[2]} "
                     f"| {agree[0]} | {agree[1]} |")
    lines += ["", "| ratio (decode tok/s) | of medians | per round |", "|---|---|---|"]
    lines += [f"| {k} | {v['of_medians']:.2f}x | {', '.join(f'{x:.2f}' for x in v['per_round'])} |"
              for k, v in rep["ratios"].items()]
    return "\n".join(lines)


def cpu_flags() -> dict[str, bool]:
    flags: set[str] = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            break
    return {f: f in flags for f in CPU_FLAGS}


def machine() -> dict:
    name = platform.processor()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            name = line.split(":", 1)[1].strip()
            break
    return {"cpu": name, "cores": os.cpu_count(), "cpu_flags": cpu_flags(), "python": platform.python_version()}


def specdec_commit(python: str) -> str:
    r = subprocess.run([python, "-c", "import specdec, pathlib; print(pathlib.Path(specdec.__file__).parents[1])"],
                       capture_output=True, text=True, cwd=lcpp.NEUTRAL)
    g = subprocess.run(["git", "-C", r.stdout.strip() or ".", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", r.stdout.strip() or ".", "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return (g.stdout.strip() or "unknown") + (" (with uncommitted changes)" if dirty else "")


def saved_table(path: Path) -> str:
    """The table of a saved run; runs from before --threads (one thread, no suffix) included."""
    saved = json.loads(path.read_text())
    rounds = saved["per_round"]
    if "threads" not in saved:
        rounds = [{k: {f"{m}_t1": v for m, v in r[k].items()} if k in ("per_prompt", "summary") else r[k] for k in r}
                  for r in rounds]
    return table(saved | analyse(rounds, saved.get("threads", [1])))


def main() -> int:
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2:])
        return 0
    if sys.argv[1:2] == ["--convert"]:  # kept for older callers: llamacpp_tools.py --convert
        lcpp.convert(sys.argv[2:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", action="store_true", help="fetch and build llama.cpp, convert the pair, then stop")
    ap.add_argument("--work", type=Path, default=WORK, help=f"scratch folder outside the repo (default {WORK}; "
                    "env SPECDEC_LLAMACPP_DIR)")
    ap.add_argument("--llamacpp-src", type=Path, help="llama.cpp source (default WORK/llama.cpp)")
    ap.add_argument("--llamacpp-build", type=Path, help="its cmake build folder, with bin/ (default WORK/build)")
    ap.add_argument("--gguf-dir", type=Path, help="GGUF cache, <model folder name>/<f32|f16>.gguf (default WORK/gguf)")
    ap.add_argument("--specdec-python", help="python that imports specdec (default WORK/venv/bin/python); "
                    "`python3` for the specdec installed here")
    ap.add_argument("--target", default=str(DEMO / "target"), help="a Hugging Face Llama folder (default: the demo target)")
    ap.add_argument("--draft", default=str(DEMO / "draft"))
    ap.add_argument("--name", help="results file name (default: the target folder's name; demo for the demo target)")
    ap.add_argument("--threads", default="1", help="comma-separated thread counts, e.g. 1,2 (default 1)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="specdec target dtypes (default float32,bfloat16)")
    ap.add_argument("--numerics", default="auto", choices=("auto", "exact", "fast"), help="specdec's target numerics")
    ap.add_argument("--specdec-methods", default="k0,adaptive,k4",
                    help=f"comma-separated, of {', '.join(SPECDEC_METHODS)} (default k0,adaptive,k4)")
    ap.add_argument("--llamacpp-k", type=int, default=4, help="llama-speculative-simple's most drafted tokens a step")
    ap.add_argument("--no-llama-bench", dest="llama_bench", action="store_false")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--table", type=Path, metavar="JSON", help="only print the table of a saved run")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "llamacpp")
    args = ap.parse_args()
    if args.table:
        print(saved_table(args.table))
        return 0
    args.lc = lcpp.LlamaCpp(args.llamacpp_src or args.work / "llama.cpp", args.llamacpp_build or args.work / "build",
                            args.gguf_dir or args.work / "gguf")
    args.specdec_python = args.specdec_python or str(args.work / "venv" / "bin" / "python")
    args.threads = [int(t) for t in args.threads.split(",")]
    args.dtypes = args.dtypes.split(",")
    bad = [m for m in args.specdec_methods.split(",") if m not in SPECDEC_METHODS] + [d for d in args.dtypes if d not in DTYPES]
    if bad:
        ap.error(f"unknown specdec method or dtype: {', '.join(bad)}")
    args.target, args.draft = str(Path(args.target).resolve()), str(Path(args.draft).resolve())  # workers run in NEUTRAL
    args.name = args.name or ("demo" if Path(args.target) == (DEMO / "target").resolve() else Path(args.target).name)
    args.out = args.out.resolve()
    if args.build:
        lcpp.build_tools(args.lc, args.work)
        py = specdec_venv(args)
        for q in lcpp.OUTTYPES:
            lcpp.ensure_gguf(args.lc, py, args.target, q)
        lcpp.ensure_gguf(args.lc, py, args.draft, "f32")
        return 0
    rep = run(args)
    out = args.out / f"{args.name}.json"
    out.write_text(json.dumps(rep, indent=1))
    print(table(rep))
    print(f"\nwritten: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
