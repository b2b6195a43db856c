"""How ``specdec bench`` runs each method: the target alone through ``transformers``, specdec in this
process, or specdec through a ``specdec up`` of its own (three processes on free loopback ports)."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path

from specdec.bench_methods import BenchConfig, Method
from specdec.core.sessions import SpecCounters
from specdec.core.speculation import SpeculationMode, SpeculationPolicy
from specdec.ports import free_ports


class BenchError(Exception):
    """The distributed deployment failed to start or to answer; printed without a traceback."""


@dataclass(frozen=True)
class Run:
    """One method on one prompt."""

    token_ids: tuple[int, ...]
    seconds: float
    counters: SpecCounters | None = None  # None: not specdec (target_only)


class Runners:
    """Loads the models once and runs any method on a prompt."""

    def __init__(self, config: BenchConfig, address: str | None, in_process: bool = True, layer_skip: bool = False) -> None:
        """``address``: the distributed orchestrator (None: none); ``in_process``: load specdec here too;
        ``layer_skip``: with the layer-skip drafter (its layers chosen by measurement at start-up)."""
        import torch
        from transformers import AutoTokenizer

        from specdec import roles
        from specdec.core.models import load_causal_lm
        from specdec.draft.drafters import DraftConfig
        from specdec.orchestrator.request import OrchestratorConfig
        from specdec.target.engine import TargetConfig

        self.n = config.max_new_tokens
        self.hf_threads = config.threads or roles.available_cores()  # the baseline too; auto: every core
        self.threads = config.threads or 1
        self.auto_threads = config.threads is None
        self.tokenizer = AutoTokenizer.from_pretrained(config.target, local_files_only=True)
        # The baseline runs on the target's device, in float32 (bench_methods.BenchConfig.reference).
        self.hf = load_causal_lm(config.target, torch.float32, device=config.device).model
        self.orch = None
        if in_process:
            self.orch = roles.embedded(TargetConfig(config.target, threads=config.threads, **config.target_fields()),
                                       DraftConfig(config.draft, config.target, threads=config.threads, **config.draft_fields(),
                                                   layer_skip="auto" if layer_skip else ""),
                                       OrchestratorConfig(max_new_tokens_limit=max(2048, self.n)))
        self.address, self.channel, self.stub = address, None, None

    async def open(self, wait_s: float = 300.0) -> None:
        """Connect to the distributed orchestrator, waiting while its processes load their models."""
        if self.address is None:
            return
        import grpc

        from specdec.rpc.server import CHANNEL_OPTIONS
        from specdec.v1 import generation_pb2 as pb, generation_pb2_grpc

        self.channel = grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                await self.stub.Generate(pb.GenerateRequest(text="x", max_new_tokens=1), timeout=30)
                return
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise BenchError(f"the distributed orchestrator at {self.address} did not answer: "
                                     f"{err.code().name}: {err.details()}") from err
                await asyncio.sleep(0.5)

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()

    async def run(self, method: Method, prompt: str) -> Run:
        t0 = time.perf_counter()
        if method.policy is None and self.orch is not None and self.auto_threads:
            # On the in-process model thread: a second OpenMP team of every core, on this thread,
            # would make libgomp throttle both teams' spinning (more OpenMP threads than cores).
            ids, counters = await self.orch.verifier.scheduler.on_model_thread(self._hf, prompt), None
        elif method.policy is None:
            ids, counters = self._hf(prompt), None
        elif method.distributed:
            ids, counters = await self._remote(prompt, method.policy, method.drafter)
        else:
            ids, counters = await self._inproc(prompt, method.policy, method.drafter)
        return Run(ids, time.perf_counter() - t0, counters)

    def _hf(self, prompt: str) -> tuple[int, ...]:
        import torch

        ids = torch.tensor([self.tokenizer(prompt)["input_ids"]], device=self.hf.device)
        torch.set_num_threads(self.hf_threads)  # this thread's count (the model thread's chooser sets its own per call)
        try:
            with torch.inference_mode():
                out = self.hf.generate(ids, max_new_tokens=self.n, do_sample=False, pad_token_id=self.tokenizer.eos_token_id)
        finally:
            torch.set_num_threads(self.threads)
        return tuple(out[0, ids.shape[1]:].tolist())

    async def _inproc(self, prompt: str, pol: SpeculationPolicy, drafter: str = "model") -> tuple[tuple[int, ...], SpecCounters]:
        from specdec.orchestrator.loop import collect
        from specdec.orchestrator.request import GenerationRequest

        last, ids, _ = await collect(self.orch.generate(
            GenerationRequest(prompt_text=prompt, max_new_tokens=self.n, drafter=drafter, policy=pol)))
        return ids, last.counters

    async def _remote(self, prompt: str, pol: SpeculationPolicy, drafter: str = "model") -> tuple[tuple[int, ...], SpecCounters]:
        import grpc

        from specdec.v1 import common_pb2, generation_pb2 as pb

        mode = common_pb2.SPECULATION_MODE_FIXED if pol.mode is SpeculationMode.FIXED else common_pb2.SPECULATION_MODE_ADAPTIVE
        spec = common_pb2.SpeculationPolicy(mode=mode, num_speculative_tokens=pol.num_speculative_tokens,
                                            max_speculative_tokens=pol.max_speculative_tokens, overlap=pol.overlap)
        try:
            r = await self.stub.Generate(pb.GenerateRequest(text=prompt, max_new_tokens=self.n, drafter=drafter, speculation=spec),
                                         timeout=600)
        except grpc.aio.AioRpcError as err:
            raise BenchError(f"the distributed orchestrator at {self.address} failed: {err.code().name}: {err.details()}") from err
        s = r.stats
        return tuple(r.token_ids), SpecCounters(s.drafts, s.draft_tokens, s.accepted_tokens, s.verify_steps, s.predrafted_steps,
                                                round(s.verify_time_ms * 1e6), round(s.draft_wait_time_ms * 1e6))


@dataclass
class Deployment:
    """A ``specdec up`` of our own (own process group, free ports), logging to ``log``."""

    proc: subprocess.Popen
    address: str
    log: Path

    @classmethod
    def start(cls, config: BenchConfig) -> Deployment:
        base = free_base_port()
        log = config.out / "specdec-up.log"
        with open(log, "wb") as f:
            proc = subprocess.Popen([sys.executable, "-m", "specdec", "up", "--topology", "split",  # the drafter a process apart
                                     "--target", config.target, "--draft", config.draft,
                                     "--base-port", str(base), "--redis-url", config.redis_url,
                                     "--threads", str(config.threads or 1),
                                     "--draft-min-confidence", str(config.draft_min_confidence),
                                     "--dtype", config.dtype, "--numerics", config.numerics, "--device", config.device,
                                     "--draft-device", config.draft_device, "--draft-dtype", config.draft_dtype,
                                     "--runner", config.runner,
                                     *([] if config.kv_memory_fraction is None
                                       else ["--kv-memory-fraction", str(config.kv_memory_fraction)])],
                                    stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        return cls(proc, f"127.0.0.1:{base}", log)

    def stop(self) -> None:
        """SIGTERM (``up`` stops its three servers gracefully), then kill the group if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def free_base_port() -> int:
    """A port p with p, p+1 and p+2 free on loopback (orchestrator, draft, target)."""
    try:
        return free_ports(3)
    except OSError as exc:
        raise BenchError(str(exc)) from exc


async def until_exit_or(awaitable: Awaitable, deployment: Deployment):
    """Await, but fail at once (with the log's tail) if the deployment's process exits meanwhile."""
    task = asyncio.ensure_future(awaitable)
    while not task.done():
        await asyncio.wait([task], timeout=0.5)
        if not task.done() and deployment.proc.poll() is not None:
            task.cancel()
            tail = deployment.log.read_text(errors="replace")[-2000:]
            raise BenchError(f"specdec up exited with {deployment.proc.returncode}:\n{tail}")
    return task.result()
