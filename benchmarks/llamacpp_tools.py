"""llama.cpp's side of benchmarks/bench_llamacpp.py: build its CPU tools, convert Hugging Face Llama
folders to GGUF (cached per folder name), and run them greedy with their own timings.

llama.cpp's source comes from the llama-cpp-python sdist (it vendors llama.cpp under
vendor/llama.cpp): no GitHub needed. Standard library only, except ``--convert`` (run under a python
with torch, transformers and sentencepiece, llama.cpp's converter needs them).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"  # the sdist whose vendor/llama.cpp is built
TOOLS = ("llama-completion", "llama-speculative-simple", "llama-bench")
OUTTYPES = ("f32", "f16")  # the target's GGUFs; the draft runs as f32 (llama.cpp's speculation reads it alone)
# `python -c` puts its working directory first on sys.path: run specdec's python from here, not from a
# checkout, so it imports the specdec it has installed.
NEUTRAL = "/"


@dataclass(frozen=True)
class LlamaCpp:
    """Where llama.cpp lives on this machine (all outside the repository)."""

    src: Path  # vendor/llama.cpp of the sdist
    build: Path  # its cmake build folder, with bin/
    gguf: Path  # GGUF cache: <gguf>/<model folder name>/<outtype>.gguf

    def tool(self, name: str) -> str:
        return str(self.build / "bin" / name)

    def commit(self) -> str:
        r = subprocess.run(["git", "-C", str(self.src), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        return r.stdout.strip() or "unknown"


def sh(cmd: list[str]) -> None:
    print("+", " ".join(map(str, cmd)), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)


# ----------------------------------------------------------------------------- build
def build_tools(lc: LlamaCpp, work: Path) -> None:
    """Fetch llama.cpp (the sdist from PyPI) and build TOOLS for this CPU (-march=native)."""
    work.mkdir(parents=True, exist_ok=True)
    if not (lc.src / "CMakeLists.txt").is_file():
        sh([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(work / "dl")])
        with tarfile.open(work / "dl" / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz") as tar:
            tar.extractall(work, filter="tar")
        lc.src.parent.mkdir(parents=True, exist_ok=True)
        lc.src.symlink_to(work / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp")
    # Unix Makefiles, not Ninja: with the sdist's vendored git metadata (build-info depends on its git
    # index) ninja stopped with "manifest 'build.ninja' still dirty after 100 tries" here.
    sh(["cmake", "-S", str(lc.src), "-B", str(lc.build), "-G", "Unix Makefiles", "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF"])
    sh(["cmake", "--build", str(lc.build), "-j2", "--target", *TOOLS])


def missing_tools(lc: LlamaCpp) -> list[str]:
    return [lc.tool(t) for t in TOOLS if not Path(lc.tool(t)).exists()]


# ----------------------------------------------------------------------------- GGUF
def gguf_path(lc: LlamaCpp, model_dir: str, outtype: str) -> Path:
    return lc.gguf / Path(model_dir).name / f"{outtype}.gguf"


def _source_stamp(model_dir: str) -> dict:
    """What a cached GGUF was made from: the folder and its weight files' sizes and mtimes."""
    files = sorted(Path(model_dir).glob("*.safetensors")) or sorted(Path(model_dir).glob("*.bin"))
    return {"source": str(Path(model_dir).resolve()),
            "weights": {f.name: [f.stat().st_size, int(f.stat().st_mtime)] for f in files}}


def ensure_gguf(lc: LlamaCpp, python: str, model_dir: str, outtype: str) -> Path:
    """The GGUF of ``model_dir`` in ``outtype``, converted on first use and cached under the folder's name;
    a cache made from another folder of the same name, or from other weights, is converted again."""
    out = gguf_path(lc, model_dir, outtype)
    stamp_file = out.with_suffix(".source.json")
    stamp = _source_stamp(model_dir)
    if out.is_file() and stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp:
        return out
    if subprocess.run([python, "-c", "import sentencepiece"], capture_output=True).returncode:
        sh([python, "-m", "pip", "install", "sentencepiece"])  # convert_hf_to_gguf imports it for every model
    out.parent.mkdir(parents=True, exist_ok=True)
    sh([python, __file__, "--convert", str(lc.src), model_dir, "--outtype", outtype, "--outfile", str(out)])
    stamp_file.write_text(json.dumps(stamp, indent=1))
    return out


def convert(argv: list[str]) -> None:
    """convert_hf_to_gguf.py, with one fallback: the converter names a BPE pre-tokenizer by the hash
    of its tokens on a test string, and knows only published models' hashes. A tokenizer whose
    pre-tokenizer is plain GPT-2 byte-level (ByteLevel with the GPT-2 regex, no prefix space, no
    normalizer: the demo pair's, and any target made from it) is exactly llama.cpp's "gpt-2";
    anything else still fails."""
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
                print(f"llamacpp_tools: unknown pre-tokenizer hash for {model_dir}; it is GPT-2 byte-level: 'gpt-2'",
                      file=sys.stderr)
                return "gpt-2"
            raise

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    import runpy

    sys.argv = [str(src / "convert_hf_to_gguf.py"), *argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")


# ----------------------------------------------------------------------------- running
PERF = {
    "prompt": re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens"),
    "eval": re.compile(r"\beval time =\s*([\d.]+) ms /\s*(\d+) runs"),
    "sampling": re.compile(r"sampling time =\s*([\d.]+) ms"),
}
SPEC = {
    "encoded": re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds"),
    "decoded": re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds"),
    "drafted": re.compile(r"n_drafted\s*=\s*(\d+)"),
    "accepted": re.compile(r"n_accept\s*=\s*(\d+)"),
}


def _run(cmd: list[str], want: dict[str, re.Pattern], attempts: int = 3) -> tuple[subprocess.CompletedProcess, dict]:
    """llama.cpp's logger thread may drop its last lines at exit (its common/log.cpp says so): a run
    without the timings, which come after the text, is run again."""
    for _ in range(attempts):
        r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", stdin=subprocess.DEVNULL, timeout=900)
        if r.returncode:
            raise RuntimeError(f"{' '.join(cmd[:3])} ... failed ({r.returncode}):\n{r.stderr[-2000:]}")
        got = {k: rx.findall(r.stderr) for k, rx in want.items()}
        if all(got.values()):
            return r, got
    raise RuntimeError(f"no timings in {Path(cmd[0]).name}'s output, {attempts} times:\n{r.stderr[-2000:]}")


def completion(lc: LlamaCpp, gguf: Path, prompt: str, max_new_tokens: int, threads: int) -> dict:
    """One greedy generation, target only; llama.cpp's own timings (the first token comes from the
    prompt's forward, so "eval" is the remaining n - 1 decode steps)."""
    cmd = [lc.tool("llama-completion"), "-m", str(gguf), "-p", prompt, "--no-escape", "-n", str(max_new_tokens),
           "-t", str(threads), "-tb", str(threads), "--temp", "0", "-c", "512", "--seed", "0",
           "--no-display-prompt", "-no-cnv"]
    r, got = _run(cmd, {"prompt": PERF["prompt"], "eval": PERF["eval"]})
    got["sampling"] = PERF["sampling"].findall(r.stderr)
    (prompt_ms, prompt_tokens), (eval_ms, eval_runs) = got["prompt"][-1], got["eval"][-1]
    text = r.stdout.removesuffix("\n\n").removesuffix(" [end of text]\n")  # what llama-completion adds at the end
    return {"text": text, "prompt_tokens": int(prompt_tokens), "tokens": int(eval_runs) + 1,
            "decode_tokens": int(eval_runs), "decode_s": float(eval_ms) / 1e3,
            "e2e_s": (float(prompt_ms) + float(eval_ms) + float(got["sampling"][-1] if got["sampling"] else 0)) / 1e3}


def speculative(lc: LlamaCpp, gguf: Path, draft_gguf: Path, prompt: str, max_new_tokens: int, threads: int, k: int) -> dict:
    """One greedy generation with llama.cpp's draft-model speculation (`llama-speculative-simple`, at
    most k drafted tokens a step, no minimum draft probability). Its timings: "encoded" is the prompt
    but its last token, "decoded" every generated token (the first included: the prompt's last token
    is verified with the first draft), so decode tok/s here counts all tokens over the decode time.
    It stops once it has generated more than -n tokens, the last step's accepted drafts included: with
    -n N - 1 it gives from N to N - 1 + k tokens (compare its text as a continuation of N tokens')."""
    cmd = [lc.tool("llama-speculative-simple"), "-m", str(gguf), "-md", str(draft_gguf), "--spec-type", "draft-simple",
           "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0", "--spec-draft-p-min", "0",
           "-p", prompt, "--no-escape", "-n", str(max_new_tokens - 1), "-t", str(threads), "-tb", str(threads),
           "-td", str(threads), "-tbd", str(threads), "--temp", "0", "--top-k", "1", "-c", "512", "--seed", "0"]
    r, got = _run(cmd, {k: SPEC[k] for k in ("encoded", "decoded")})
    (n_enc, enc_s), (n_dec, dec_s) = got["encoded"][-1], got["decoded"][-1]
    drafted, accepted = SPEC["drafted"].findall(r.stderr), SPEC["accepted"].findall(r.stderr)
    # stdout: "\n\n", the prompt's tokens as text, the generated text, "\n\n" twice
    out = r.stdout.removeprefix("\n\n").removesuffix("\n\n").removesuffix("\n\n")
    at = out.find(prompt)
    text = out[at + len(prompt):] if at >= 0 else out
    accepted = int(accepted[-1]) if accepted else 0
    return {"text": text, "prompt_tokens": int(n_enc), "tokens": int(n_dec), "decode_tokens": int(n_dec),
            "decode_s": float(dec_s), "e2e_s": float(enc_s) + float(dec_s), "draft_tokens": int(drafted[-1]) if drafted else 0,
            "accepted_tokens": accepted, "verify_steps": int(n_dec) - accepted}  # a step: its accepted drafts + 1


def bench(lc: LlamaCpp, ggufs: list[Path], threads: list[int], n: int) -> dict[tuple[str, int], float]:
    """`llama-bench` pure decode (tg n from an empty context): mean tok/s per (model file, threads)."""
    cmd = [lc.tool("llama-bench"), "-m", ",".join(map(str, ggufs)), "-t", ",".join(map(str, threads)), "-p", "0",
           "-n", str(n), "-r", "3", "-o", "json"]
    r = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=900, check=True)
    return {(str(Path(row["model_filename"])), int(row["n_threads"])): row["avg_ts"] for row in json.loads(r.stdout)}


if __name__ == "__main__" and sys.argv[1:2] == ["--convert"]:
    convert(sys.argv[2:])
