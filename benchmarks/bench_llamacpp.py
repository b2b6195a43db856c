"""specdec against llama.cpp, single stream, one thread, on the demo pair (issue 26, item 5).

    python3 benchmarks/bench_llamacpp.py --build      # once, ~10-15 min on 2 cores: see build()
    python3 benchmarks/bench_llamacpp.py [--rounds 3] [--prompts 8] [--max-new-tokens 96]

Methods, greedy, on the prompts `specdec bench` uses (the pair's held-out files), alternated prompt by
prompt (every method runs each prompt in turn, the order rotating), medians over rounds:
  llamacpp_f32, llamacpp_f16   llama.cpp target-only (`llama-completion -t 1 --temp 0`), GGUF f32 / f16
  llamabench_f32, llamabench_f16   `llama-bench -t 1 -p 0 -n N`: pure decode from an empty context
  specdec_{f32,bf16}_{k0,adaptive,ngram_k7,ngram_k3,ngram_adaptive,eagle_k7}   specdec in one process (all roles embedded, as
                               `specdec bench`'s in-process methods), torch at 1 thread; the target in
                               float32, or in bfloat16 with exact numerics; k = 0 (target only), the draft
                               model adaptive, prompt lookup at k = 7 (8 rows), k = 3 or adaptive k,
                               or the EAGLE head at k = 7.
decode tok/s counts the tokens after the first over the time after the first token arrived (prompt
excluded, as llama.cpp's "eval time"); e2e tok/s counts every token over the whole request.

specdec runs under --specdec-python (by default a venv over a frozen clone of this repository, so a
benchmark is not broken by work in progress here); this script itself needs only the standard library.
llama.cpp's source comes from the llama-cpp-python sdist (it vendors llama.cpp): no GitHub needed.
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
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "demo"
WORK = Path(os.environ.get("SPECDEC_LLAMACPP_DIR", "/work/llamacpp"))  # builds and scratch, outside the repo
LLAMA_CPP_PYTHON = "0.3.36"  # the sdist whose vendor/llama.cpp is built
TOOLS = ("llama-completion", "llama-bench")
# `python -c` puts its working directory first on sys.path: run specdec's python from here, not from a
# checkout, so it imports the specdec it has installed.
NEUTRAL = os.sep


# ----------------------------------------------------------------------------- build
def build(args) -> None:
    """Fetch llama.cpp (from PyPI), build its CPU tools, convert the pair, make specdec's venv."""
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    src = args.llamacpp_src
    if not (src / "CMakeLists.txt").is_file():
        sh([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(work / "dl")])
        with tarfile.open(work / "dl" / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz") as tar:
            tar.extractall(work, filter="tar")
        src.parent.mkdir(parents=True, exist_ok=True)
        src.symlink_to(work / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp")
    # Unix Makefiles, not Ninja: with the sdist's vendored git metadata (build-info depends on its git
    # index) ninja stopped with "manifest 'build.ninja' still dirty after 100 tries" here.
    sh(["cmake", "-S", str(src), "-B", str(args.llamacpp_build), "-G", "Unix Makefiles", "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF"])
    sh(["cmake", "--build", str(args.llamacpp_build), "-j2", "--target", *TOOLS])
    py = specdec_venv(args)
    if subprocess.run([py, "-c", "import sentencepiece"], capture_output=True).returncode:
        sh([py, "-m", "pip", "install", "sentencepiece"])  # convert_hf_to_gguf imports it for every model
    args.gguf_dir.mkdir(parents=True, exist_ok=True)
    for role, model in (("target", args.target), ("draft", args.draft)):
        for outtype in ("f32", "f16"):
            sh([py, __file__, "--convert", str(src), model, "--outtype", outtype,
                "--outfile", str(args.gguf_dir / f"{role}-{outtype}.gguf")])


def specdec_venv(args) -> str:
    """--specdec-python; the default one is made here: a clone of this repository's HEAD, installed
    editable in a venv that sees the system's torch and transformers."""
    py = Path(args.specdec_python)
    if py.exists() or py != args.work / "venv" / "bin" / "python":
        return str(py)
    clone = args.work / "specdec-main"
    if not clone.exists():
        sh(["git", "clone", "-q", str(ROOT), str(clone)])
    sh([sys.executable, "-m", "venv", "--system-site-packages", str(args.work / "venv")])
    sh([str(py), "-m", "pip", "install", "-q", "--no-deps", "-e", str(clone)])
    return str(py)


def convert(argv: list[str]) -> None:
    """convert_hf_to_gguf.py, with one fallback: the converter names a BPE pre-tokenizer by the hash
    of its tokens on a test string, and knows only published models' hashes. A tokenizer whose
    pre-tokenizer is plain GPT-2 byte-level (ByteLevel with the GPT-2 regex, no prefix space, no
    normalizer: the demo pair's) is exactly llama.cpp's "gpt-2"; anything else still fails."""
    src, model_dir = Path(argv[0]), Path(argv[1])
    sys.path[:0] = [str(src), str(src / "gguf-py")]
    from conversion import base  # llama.cpp's converter package (vendored gguf-py beside it)

    original = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            tok = json.loads((Path(self.dir_model) / "tokenizer.json").read_text())
            pre = tok.get("pre_tokenizer") or {}
            if (tok.get("normalizer") is None and pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
                    and not pre.get("add_prefix_space", False)):
                print(f"bench_llamacpp: unknown pre-tokenizer hash for {model_dir}; it is GPT-2 byte-level: 'gpt-2'",
                      file=sys.stderr)
                return "gpt-2"
            raise

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    import runpy

    sys.argv = [str(src / "convert_hf_to_gguf.py"), *argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")


def sh(cmd: list[str]) -> None:
    print("+", " ".join(map(str, cmd)), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)


# ----------------------------------------------------------------------------- llama.cpp
PERF = {
    "prompt": re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens"),
    "eval": re.compile(r"\beval time =\s*([\d.]+) ms /\s*(\d+) runs"),
    "sampling": re.compile(r"sampling time =\s*([\d.]+) ms"),
}


def llamacpp_completion(args, gguf: Path, prompt: str, attempts: int = 3) -> dict:
    """One greedy generation, one thread; llama.cpp's own timings (the first token comes from the
    prompt's forward, so "eval" is the remaining n - 1 decode steps). llama.cpp's logger thread may
    drop its last lines at exit (its common/log.cpp says so): a run without the timings, which come
    after the text, is run again."""
    cmd = [str(args.llamacpp_build / "bin" / "llama-completion"), "-m", str(gguf), "-p", prompt, "--no-escape",
           "-n", str(args.max_new_tokens), "-t", "1", "-tb", "1", "--temp", "0", "-c", "512", "--seed", "0",
           "--no-display-prompt", "-no-cnv"]
    for attempt in range(1, attempts + 1):
        r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", stdin=subprocess.DEVNULL, timeout=600)
        if r.returncode:
            raise RuntimeError(f"{' '.join(cmd[:3])} ... failed ({r.returncode}):\n{r.stderr[-2000:]}")
        got = {k: rx.findall(r.stderr) for k, rx in PERF.items()}
        if got["prompt"] and got["eval"]:
            break
    else:
        raise RuntimeError(f"no timings in llama-completion's output, {attempts} times:\n{r.stderr[-2000:]}")
    (prompt_ms, prompt_tokens), (eval_ms, eval_runs) = got["prompt"][-1], got["eval"][-1]
    text = r.stdout.removesuffix("\n\n").removesuffix(" [end of text]\n")  # what llama-completion adds at the end
    return {"text": text, "prompt_tokens": int(prompt_tokens), "tokens": int(eval_runs) + 1,
            "decode_tokens": int(eval_runs), "decode_s": float(eval_ms) / 1e3, "attempts": attempt,
            "e2e_s": (float(prompt_ms) + float(eval_ms) + float(got["sampling"][-1] if got["sampling"] else 0)) / 1e3}


def llamabench(args, ggufs: list[Path]) -> dict[str, float]:
    """`llama-bench` pure decode (tg N from an empty context), one thread: mean tok/s per model."""
    cmd = [str(args.llamacpp_build / "bin" / "llama-bench"), "-m", ",".join(map(str, ggufs)), "-t", "1", "-p", "0",
           "-n", str(args.max_new_tokens), "-r", "3", "-o", "json"]
    r = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600, check=True)
    return {Path(row["model_filename"]).name: row["avg_ts"] for row in json.loads(r.stdout)}


# ----------------------------------------------------------------------------- specdec (worker side)
def worker(argv: list[str]) -> None:
    """Under --specdec-python: load one orchestrator (the target's dtype and numerics), warm up, say
    "ready"; then for every prompt index read on stdin run k = 0 and adaptive (in an order that
    alternates), one JSON line each. The models stay loaded across rounds."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--target"), ap.add_argument("--draft"), ap.add_argument("--prompts-json")
    ap.add_argument("--dtype"), ap.add_argument("--numerics"), ap.add_argument("--max-new-tokens", type=int)
    a = ap.parse_args(argv)
    from specdec import roles
    from specdec.bench_methods import policy
    from specdec.draft.drafters import DraftConfig
    from specdec.orchestrator.request import GenerationRequest, OrchestratorConfig
    from specdec.target.engine import TargetConfig

    from specdec.cli_common import eagle_head_path

    prompts = json.loads(Path(a.prompts_json).read_text())
    beside = Path(a.target).parent / "eagle"  # the demo head next to the demo target, wherever the pair lies
    head = eagle_head_path(None, a.target) or (str(beside) if (beside / "config.json").is_file() else None)
    orch = roles.embedded(TargetConfig(a.target, threads=1, dtype=a.dtype, numerics=a.numerics),
                          DraftConfig(a.draft, a.target, threads=1, eagle_head_path=head),
                          OrchestratorConfig(max_new_tokens_limit=max(2048, a.max_new_tokens)))
    # (name, policy, drafter): target only, the draft model adaptive, prompt lookup and the EAGLE
    # head at 8 verified rows (their best in docs/performance.md 11.4 and 12.2)
    policies = [("k0", policy(0, False), "model"), ("adaptive", policy(None, False), "model"),
                ("ngram_k7", policy(7, False), "ngram"), ("ngram_k3", policy(3, False), "ngram"),
                ("ngram_adaptive", policy(None, False), "ngram")]  # fewer rows: where a CPU's 8-row step costs far more than 1
    if "eagle" in orch.target.drafters:
        policies.append(("eagle_k7", policy(7, False), "eagle"))

    async def one(prompt: str, pol, drafter: str) -> dict:
        t0 = time.perf_counter()
        ids, text, first, last, n_first = [], [], None, None, 0
        async for chunk in orch.generate(GenerationRequest(prompt_text=prompt, max_new_tokens=a.max_new_tokens,
                                                           drafter=drafter, policy=pol)):
            now = time.perf_counter()
            if chunk.token_ids and first is None:  # k = 0: the prompt's token; adaptive: the first step's
                first, n_first = now, len(chunk.token_ids)
            ids.extend(chunk.token_ids)
            text.append(chunk.text)
            last = chunk
        end = time.perf_counter()
        c = last.counters
        return {"text": "".join(text), "prompt_tokens": last.prompt_tokens, "tokens": len(ids),
                "decode_tokens": len(ids) - n_first, "decode_s": end - first, "e2e_s": end - t0,
                "verify_steps": c.verify_steps, "draft_tokens": c.draft_tokens, "accepted_tokens": c.accepted_tokens}

    async def main() -> None:
        for _, pol, drafter in policies:  # warm-up: first shapes, kernel choices
            await one(prompts[0], pol, drafter)
        print("ready", flush=True)
        calls = 0
        while line := await asyncio.to_thread(sys.stdin.readline):
            order = policies if calls % 2 == 0 else policies[::-1]
            calls += 1
            prompt = prompts[int(line)]
            print(json.dumps({name: await one(prompt, pol, drafter) for name, pol, drafter in order}), flush=True)

    asyncio.run(main())


class SpecdecWorker:
    """A worker process (see ``worker``) for one target dtype, driven prompt by prompt."""

    def __init__(self, args, prompts_json: Path, tag: str, dtype: str, numerics: str) -> None:
        self.tag = tag
        log = args.work / "logs" / f"specdec-{tag}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log
        self.proc = subprocess.Popen(
            [args.specdec_python, __file__, "--worker", "--target", args.target, "--draft", args.draft,
             "--prompts-json", str(prompts_json), "--dtype", dtype, "--numerics", numerics,
             "--max-new-tokens", str(args.max_new_tokens)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log, "wb"), text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=NEUTRAL)

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"specdec worker {self.tag} exited ({self.proc.wait()}); log {self.log}:\n"
                               + self.log.read_text(errors="replace")[-3000:])
        return line

    def ready(self) -> None:
        while self._line().strip() != "ready":
            pass

    def run(self, i: int) -> dict:
        self.proc.stdin.write(f"{i}\n")
        self.proc.stdin.flush()
        return {f"specdec_{self.tag}_{name}": r for name, r in json.loads(self._line()).items()}

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def specdec_prompts(args) -> tuple[list[str], str]:
    """The prompts `specdec bench` uses (its bench_prompts, from the frozen specdec), and their source."""
    code = ("import json, sys; from specdec.bench_common import bench_prompts; "
            "print(json.dumps(bench_prompts(int(sys.argv[1]), sys.argv[2])))")
    out = subprocess.run([args.specdec_python, "-c", code, str(args.prompts), args.target],
                         capture_output=True, text=True, check=True, cwd=NEUTRAL).stdout
    return json.loads(out)


def native_bf16(python: str) -> bool:
    code = "from specdec.core.llama_decode import native_bf16; print(int(bool(native_bf16())))"
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=NEUTRAL)
    return r.returncode == 0 and r.stdout.strip() == "1"


# ----------------------------------------------------------------------------- the run
def summarize(runs: list[dict]) -> dict:
    """One method, one round, every prompt: aggregate tok/s (total tokens over total seconds)."""
    out = {"decode_tok_s": sum(r["decode_tokens"] for r in runs) / sum(r["decode_s"] for r in runs),
           "e2e_tok_s": sum(r["tokens"] for r in runs) / sum(r["e2e_s"] for r in runs),
           "tokens": sum(r["tokens"] for r in runs)}
    if "verify_steps" in runs[0]:
        out["tokens_per_verify"] = out["tokens"] / max(1, sum(r["verify_steps"] for r in runs))
        drafted = sum(r["draft_tokens"] for r in runs)
        out["acceptance"] = sum(r["accepted_tokens"] for r in runs) / drafted if drafted else None
    return out


def run(args) -> dict:
    """Rounds; in each, prompt by prompt, every method (the order rotating by round and prompt), then
    llama-bench (first in odd rounds, last in even ones)."""
    missing = [p for p in [*(args.llamacpp_build / "bin" / t for t in TOOLS), *args.gguf.values()] if not p.exists()]
    if missing:
        sys.exit("bench_llamacpp: missing " + ", ".join(map(str, missing)) + "\n  build them: python3 "
                 f"{Path(__file__).relative_to(ROOT)} --build   (or pass --llamacpp-build / --gguf-dir)")
    args.out.mkdir(parents=True, exist_ok=True)
    prompts, source = specdec_prompts(args)
    prompts_json = args.out / "prompts.json"
    prompts_json.write_text(json.dumps(prompts, indent=1))
    configs = [("f32", "float32", "fast")]
    if native_bf16(args.specdec_python):
        configs.append(("bf16", "bfloat16", "exact"))
    else:
        print("bench_llamacpp: no native bf16 on this CPU: specdec bf16 skipped", file=sys.stderr)
    workers = [SpecdecWorker(args, prompts_json, *c) for c in configs]
    try:
        for w in workers:
            w.ready()
        units = [lambda i, q=q: {f"llamacpp_{q}": llamacpp_completion(args, args.gguf[q], prompts[i])} for q in ("f32", "f16")]
        units += [w.run for w in workers]
        bench = lambda: llamabench(args, [args.gguf["f32"], args.gguf["f16"]])  # noqa: E731
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
            tg = tg or bench()
            load.append(os.getloadavg()[0])
            rounds.append({"loadavg_1min_start_end": load, "per_prompt": per_prompt,
                           "summary": {m: summarize(v) for m, v in per_prompt.items()}
                           | {f"llamabench_{q}": {"decode_tok_s": tg[args.gguf[q].name]} for q in ("f32", "f16")}})
    finally:
        for w in workers:
            w.close()
    return report(args, prompts, source, rounds)


def report(args, prompts: list[str], source: str, rounds: list[dict]) -> dict:
    methods = list(rounds[0]["summary"])
    med = {m: {key: statistics.median(r["summary"][m][key] for r in rounds)
               for key in rounds[0]["summary"][m] if rounds[0]["summary"][m][key] is not None} for m in methods}
    ref = rounds[0]["per_prompt"]["llamacpp_f32"]
    agree = {m: sum(a["text"] == b["text"] for a, b in zip(ref, rounds[0]["per_prompt"][m]))
             for m in rounds[0]["per_prompt"]}
    prompt_tokens = {m: [r["prompt_tokens"] for r in runs] for m, runs in rounds[0]["per_prompt"].items()}
    pp = rounds[0]["per_prompt"]
    pairs = [("llamacpp_f16", "llamacpp_f32"), ("specdec_f32_adaptive", "specdec_f32_k0"),
             ("specdec_bf16_adaptive", "specdec_bf16_k0"), ("specdec_bf16_k0", "llamacpp_f16")]
    same = {f"{a} == {b}": sum(x["text"] == y["text"] for x, y in zip(pp[a], pp[b])) for a, b in pairs if a in pp and b in pp}

    def ratios(num: str, den: str) -> dict:
        per_round = [r["summary"][num]["decode_tok_s"] / r["summary"][den]["decode_tok_s"] for r in rounds]
        return {"of_medians": med[num]["decode_tok_s"] / med[den]["decode_tok_s"], "per_round": per_round}

    headline = {"specdec_f32_adaptive / llamacpp_f32": ratios("specdec_f32_adaptive", "llamacpp_f32"),
                "specdec_f32_k0 / llamacpp_f32": ratios("specdec_f32_k0", "llamacpp_f32")}
    for m in ("specdec_f32_ngram_k7", "specdec_f32_ngram_k3", "specdec_f32_ngram_adaptive", "specdec_f32_eagle_k7"):
        if m in med:
            headline[f"{m} / llamacpp_f32"] = ratios(m, "llamacpp_f32")
    for m in ("specdec_bf16_ngram_k7", "specdec_bf16_ngram_k3", "specdec_bf16_ngram_adaptive", "specdec_bf16_eagle_k7"):
        if m in med:
            headline[f"{m} / llamacpp_f16"] = ratios(m, "llamacpp_f16")
    if "specdec_bf16_adaptive" in med:
        headline["specdec_bf16_adaptive / llamacpp_f16"] = ratios("specdec_bf16_adaptive", "llamacpp_f16")
        headline["specdec_bf16_k0 / llamacpp_f16"] = ratios("specdec_bf16_k0", "llamacpp_f16")
    return {
        "what": "single stream, 1 thread, greedy; decode tok/s excludes the prompt; medians over alternated rounds",
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version()},
        "llama_cpp": {"source": f"llama-cpp-python=={LLAMA_CPP_PYTHON} sdist, vendor/llama.cpp", "commit": llamacpp_commit(args),
                      "build": str(args.llamacpp_build), "gguf": {k: str(v) for k, v in args.gguf.items()}},
        "specdec": {"python": args.specdec_python, "commit": specdec_commit(args.specdec_python)},
        "target": args.target, "draft": args.draft, "prompts": len(prompts), "prompt_source": source, "max_new_tokens": args.max_new_tokens,
        "rounds": len(rounds), "median": med, "ratios": headline,
        "greedy_text_equal_to_llamacpp_f32_round1": agree, "greedy_text_equal_round1": same, "prompt_tokens_round1": prompt_tokens,
        "per_round": rounds,
    }


def table(rep: dict) -> str:
    med = rep["median"]
    f32, f16 = med["llamacpp_f32"]["decode_tok_s"], med["llamacpp_f16"]["decode_tok_s"]
    lines = [f"{rep['prompts']} prompts x {rep['max_new_tokens']} tokens, 1 thread, median of {rep['rounds']} alternated rounds "
             f"({rep['machine']['cpu']})", "",
             "| method | decode tok/s | e2e tok/s | vs llama.cpp f32 | vs llama.cpp f16 | tokens/verify | same text as llama.cpp f32 |",
             "|---|---|---|---|---|---|---|"]
    for m, v in med.items():
        e2e = f"{v['e2e_tok_s']:.0f}" if "e2e_tok_s" in v else "-"
        tpv = f"{v['tokens_per_verify']:.2f}" if "tokens_per_verify" in v else "-"
        agree = rep["greedy_text_equal_to_llamacpp_f32_round1"].get(m)
        agree = "-" if agree is None else f"{agree}/{rep['prompts']}"
        lines.append(f"| {m} | {v['decode_tok_s']:.0f} | {e2e} | {v['decode_tok_s'] / f32:.2f}x | {v['decode_tok_s'] / f16:.2f}x "
                     f"| {tpv} | {agree} |")
    lines += ["", "Same greedy text (round 1): " + ", ".join(f"{k}: {v}/{rep['prompts']}" for k, v in rep["greedy_text_equal_round1"].items())]
    lines += ["", "| ratio (decode tok/s) | of medians | per round |", "|---|---|---|"]
    lines += [f"| {k} | {v['of_medians']:.2f}x | {', '.join(f'{x:.2f}' for x in v['per_round'])} |" for k, v in rep["ratios"].items()]
    return "\n".join(lines)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def llamacpp_commit(args) -> str:
    r = subprocess.run(["git", "-C", str(args.llamacpp_src), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


def specdec_commit(python: str) -> str:
    r = subprocess.run([python, "-c", "import specdec, pathlib; print(pathlib.Path(specdec.__file__).parents[1])"],
                       capture_output=True, text=True, cwd=NEUTRAL)
    g = subprocess.run(["git", "-C", r.stdout.strip() or ".", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return g.stdout.strip() or "unknown"


def main() -> int:
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2:])
        return 0
    if sys.argv[1:2] == ["--convert"]:
        convert(sys.argv[2:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", action="store_true", help="fetch, build and convert everything below, then stop")
    ap.add_argument("--work", type=Path, default=WORK, help=f"scratch folder outside the repo (default {WORK}; "
                    "env SPECDEC_LLAMACPP_DIR)")
    ap.add_argument("--llamacpp-src", type=Path, help="llama.cpp source (default WORK/llama.cpp)")
    ap.add_argument("--llamacpp-build", type=Path, help="its cmake build folder, with bin/ (default WORK/build)")
    ap.add_argument("--gguf-dir", type=Path, help="target-f32.gguf, target-f16.gguf, draft-*.gguf (default WORK/gguf)")
    ap.add_argument("--specdec-python", help="python that imports specdec (default WORK/venv/bin/python)")
    ap.add_argument("--target", default=str(DEMO / "target"))
    ap.add_argument("--draft", default=str(DEMO / "draft"))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--table", type=Path, metavar="JSON", help="only print the table of a saved run")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "llamacpp")
    args = ap.parse_args()
    args.llamacpp_src = args.llamacpp_src or args.work / "llama.cpp"
    args.llamacpp_build = args.llamacpp_build or args.work / "build"
    args.gguf_dir = args.gguf_dir or args.work / "gguf"
    args.specdec_python = args.specdec_python or str(args.work / "venv" / "bin" / "python")
    args.gguf = {q: args.gguf_dir / f"target-{q}.gguf" for q in ("f32", "f16")}
    args.target, args.draft = str(Path(args.target).resolve()), str(Path(args.draft).resolve())  # workers run in NEUTRAL
    args.out = args.out.resolve()
    if args.build:
        build(args)
        return 0
    if args.table:
        saved = json.loads(args.table.read_text())
        print(table(report(args, [None] * saved["prompts"], saved["prompt_source"], saved["per_round"])))
        return 0
    rep = run(args)
    (args.out / "llamacpp.json").write_text(json.dumps(rep, indent=1))
    print(table(rep))
    print(f"\nwritten: {args.out / 'llamacpp.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
