"""A tensor-parallel verifier's ranks: rank 0 (the verifier process) starts the others and joins them.

`start_group` checks the degree, starts ranks 1..N-1 as child processes (``python -m
specdec.target.tp_ranks SPEC``, on loopback), loads and shards its own part while they load theirs,
waits until every rank reports ready (or its error), then forms a gloo process group of its own
with the configured timeout (core/tp_runner.py). Each child runs `main`: load, shard, report, then
follow rank 0's plans until told to stop, until rank 0 is gone, or until a collective fails; it
exits non-zero on a failure, with a log line that says which.

What rank 0 does when the group breaks is its owner's choice (``on_fault``): a served verifier
exits (`exit_on_fault`), so the orchestrator resumes its sessions on another verifier, as when a
verifier process dies.
"""
from __future__ import annotations

import atexit
import dataclasses
import datetime
import json
import logging
import os
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec.core.tensor_parallel import TensorParallelError, check_degree
from specdec.core.tp_runner import Collectives, TensorParallelRunner, dims_of, follow, join, shard_model

log = logging.getLogger(__name__)
LOAD_TIMEOUT_S = 600.0  # a rank's load and shard, before the group forms


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def check_tensor_parallel(config, model_config) -> None:
    """TensorParallelError, before any weight loads, where ``config.tensor_parallel`` ranks cannot
    serve this model here: a degree that does not split its heads evenly, a device or runner it is
    not built for, fewer cores than ranks."""
    n = config.tensor_parallel
    if n == 1:
        return
    if n < 1:
        raise TensorParallelError(f"--tensor-parallel must be at least 1; got {n}")
    if not str(config.device).startswith("cpu"):
        raise TensorParallelError(f"--tensor-parallel {n} on {config.device}: tensor parallelism on CUDA (NCCL, sharding "
                                  "the paged runner) is not built yet; today it runs on the CPU, over gloo")
    if config.runner not in ("auto", "lean") or not config.fast_forward:
        raise TensorParallelError(f"--tensor-parallel {n} shards the lean runner only; the {config.runner if config.fast_forward else 'hf'} "
                                  "runner is not sharded (not built yet)")
    check_degree(n, dims_of(model_config))
    if n > available_cores():
        raise TensorParallelError(f"--tensor-parallel {n} needs {n} CPU cores, one per rank; this process may use "
                                  f"{available_cores()}")


@dataclass(frozen=True)
class RankConfig:
    """What every rank needs of the verifier's configuration (TargetConfig's fields of these names)."""

    model_path: str
    tensor_parallel: int
    tensor_parallel_timeout_s: float = 30.0
    dtype: str = "float32"
    numerics: str = "auto"
    pack_rows: int = 8
    weight_layouts: int = 1
    threads: int | None = None

    @classmethod
    def of(cls, config) -> "RankConfig":
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})


def shard_decoder(model: torch.nn.Module, rank: int, n: int, config: RankConfig, own_weights: bool):
    """Rank ``rank``'s `LlamaDecoder` over its shard of ``model``; the model lets go of the full weights
    it held (``own_weights``); the numerics ``config`` asks (auto: exact where this CPU holds it)."""
    from specdec.core.exact_ops import ExactNumericsUnavailable
    from specdec.core.llama_decode import LlamaDecoder
    from specdec.core.models import WeightRelease, resolve_dtype

    shard = shard_model(model, rank, n)
    if own_weights:  # the shard holds copies of its parts: the model's full ones may go
        release = WeightRelease(model, (model.model.embed_tokens.weight,))
        release(model.lm_head, *[m for layer in model.model.layers for m in layer.modules()])
    build = lambda numerics: LlamaDecoder(shard, pack_rows=config.pack_rows, dtype=resolve_dtype(config.dtype),  # noqa: E731
                                          numerics=numerics, own_weights=True, layouts_per_weight=config.weight_layouts)
    try:
        return build("exact" if config.numerics == "auto" else config.numerics)
    except ExactNumericsUnavailable as exc:
        if config.numerics != "auto":
            raise
        log.warning("exact numerics unavailable on tensor-parallel rank %d, running fast numerics: %s", rank, exc)
        return build("fast")


@dataclass
class TensorParallelGroup:
    """Rank 0's view of its group: the runner the engine uses, the other ranks' processes."""

    runner: TensorParallelRunner
    processes: list[subprocess.Popen]
    numerics: str

    def stop(self, wait_s: float = 10.0) -> None:
        """Stop the other ranks: told to, then terminated where they do not exit in ``wait_s``."""
        self.runner.stop()
        deadline = time.monotonic() + wait_s
        for p in self.processes:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def kill(self) -> None:
        for p in self.processes:
            if p.poll() is None:
                p.kill()


def exit_on_fault(group: TensorParallelGroup) -> Callable[[TensorParallelError], None]:
    """An ``on_fault`` for a served verifier: log, end the other ranks, exit non-zero (its sessions resume elsewhere)."""
    def fault(err: TensorParallelError) -> None:
        log.critical("%s; exiting so that this verifier's sessions resume on another", err)
        logging.shutdown()
        group.kill()
        os._exit(3)

    return fault


def _rank_spec(config: RankConfig, rank: int, port: int) -> str:
    return json.dumps({"rank": rank, "port": port, "config": dataclasses.asdict(config)})


def start_group(model: torch.nn.Module, config: RankConfig, own_weights: bool = False,
                on_fault: Callable[[TensorParallelError], None] | None = None) -> TensorParallelGroup:
    """Rank 0 of ``config.tensor_parallel`` ranks over ``model`` (loaded here; the others load it from
    ``config.model_path``; `check_tensor_parallel` passed): the others started, every shard loaded,
    the group formed."""
    import torch.distributed as dist

    n = config.tensor_parallel
    store = dist.TCPStore("127.0.0.1", 0, n, True, timeout=datetime.timedelta(seconds=LOAD_TIMEOUT_S), wait_for_workers=False)
    env = dict(os.environ, OMP_NUM_THREADS=str(config.threads or 1))
    processes = [subprocess.Popen([sys.executable, "-m", "specdec.target.tp_ranks", _rank_spec(config, r, store.port)], env=env)
                 for r in range(1, n)]
    try:
        decoder = shard_decoder(model, 0, n, config, own_weights)
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        for r, p in enumerate(processes, start=1):
            while not store.check([f"ready/{r}"]):
                if p.poll() is not None:
                    raise TensorParallelError(f"tensor-parallel rank {r} exited with status {p.returncode} while loading")
                if time.monotonic() > deadline:
                    raise TensorParallelError(f"tensor-parallel rank {r} did not load within {LOAD_TIMEOUT_S:g} s")
                time.sleep(0.05)
            ready = json.loads(store.get(f"ready/{r}"))
            if "error" in ready:
                raise TensorParallelError(f"tensor-parallel rank {r} could not load its shard: {ready['error']}")
            if ready["numerics"] != decoder.numerics:
                raise TensorParallelError(f"tensor-parallel rank {r} runs {ready['numerics']} numerics, rank 0 "
                                          f"{decoder.numerics}: pass --numerics explicitly")
        pg = dist.ProcessGroupGloo(store, 0, n, datetime.timedelta(seconds=config.tensor_parallel_timeout_s))
    except BaseException:
        for p in processes:
            p.kill()
        raise
    group = TensorParallelGroup(None, processes, decoder.numerics)  # type: ignore[arg-type]
    comm = Collectives(pg, 0, n, decoder.numerics == "exact", config.tensor_parallel_timeout_s,
                       on_fault or (lambda err: log.error("%s", err)))
    group.runner = TensorParallelRunner(join(decoder, comm, model.config.vocab_size), comm,
                                        heartbeat_s=config.tensor_parallel_timeout_s / 4)
    atexit.register(_stop_at_exit, weakref.ref(group))  # the others stop with rank 0, told so (not by a closed socket)
    log.info("tensor-parallel verifier: %d ranks over gloo, %s numerics, timeout %g s", n, decoder.numerics,
             config.tensor_parallel_timeout_s)
    return group


def _stop_at_exit(ref: "weakref.ref[TensorParallelGroup]") -> None:
    group = ref()
    if group is not None and any(p.poll() is None for p in group.processes):
        group.stop(wait_s=2.0)


def _die_with_parent() -> None:
    """Linux: this process gets SIGTERM when the process that started it exits (prctl PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    """A rank other than 0 (started by `start_group`): load, shard, report, follow rank 0's plans."""
    import torch.distributed as dist

    from specdec.core.models import load_causal_lm

    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(argv[0])
    rank = spec["rank"]
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank-{rank} %(name)s %(levelname)s %(message)s")
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0 decides, and stops us
    config = RankConfig(**spec["config"])
    n = config.tensor_parallel
    store = dist.TCPStore("127.0.0.1", spec["port"], n, False, timeout=datetime.timedelta(seconds=LOAD_TIMEOUT_S))
    try:
        torch.set_num_threads(config.threads or 1)
        loaded = load_causal_lm(config.model_path, dtype=config.dtype, device="cpu")
        decoder = shard_decoder(loaded.model, rank, n, config, own_weights=True)
        vocab = loaded.model.config.vocab_size
    except Exception as exc:  # reported to rank 0, which names it in its own error
        log.exception("could not load shard %d of %d", rank, n)
        store.set(f"ready/{rank}", json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        return 1
    store.set(f"ready/{rank}", json.dumps({"numerics": decoder.numerics}))
    try:
        pg = dist.ProcessGroupGloo(store, rank, n, datetime.timedelta(seconds=config.tensor_parallel_timeout_s))
        comm = Collectives(pg, rank, n, decoder.numerics == "exact", config.tensor_parallel_timeout_s)
        follow(join(decoder, comm, vocab), comm)
    except (TensorParallelError, RuntimeError) as exc:
        log.error("tensor-parallel rank %d of %d stops: %s", rank, n, exc)
        return 1
    log.info("tensor-parallel rank %d of %d stopped by rank 0", rank, n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
