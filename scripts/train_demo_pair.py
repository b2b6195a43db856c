"""Train specdec's demo target/draft pair from scratch on the CPython standard library.

One command, CPU only, fixed seeds, restartable (a checkpoint every few minutes):

    python scripts/train_demo_pair.py --out models/demo

Steps:
  1. corpus: every ``.py`` file of the running interpreter's standard library, test folders
     skipped; ~2% of files (chosen by a hash of their path, so the split is fixed) held out;
  2. a byte-level BPE tokenizer (``tokenizers``), saved as a ``transformers`` fast tokenizer;
  3. the target (``LlamaForCausalLM``, ~16M parameters) trained alone on next-token loss, then
     the draft (~1.6M) distilled from the finished, frozen target: mostly KL to the target's
     logits, a little next-token loss (distillation raises acceptance: Zhou et al. 2023,
     DistillSpec). The target gets the whole first phase because the compute is the limit:
     training the draft beside it cost ~30% of the target's throughput on 2 cores;
  4. both saved with ``save_pretrained`` (safetensors, float16) with the tokenizer and a model
     card holding the measured figures.

Matmuls run under bf16 autocast where the CPU has native bf16 (AVX512_BF16 or AMX: 2x the
fp32 training throughput on a 2-core Zen 4) and in fp32 elsewhere, where emulated bf16 is far
slower than fp32. Weights, optimizer state and the losses stay fp32 either way.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shutil
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

VOCAB_SIZE = 6144
EOS = "<|endoftext|>"
HOLDOUT_PERCENT = 2


@dataclass(frozen=True)
class Arch:
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int


TARGET = Arch(hidden_size=384, num_hidden_layers=8, intermediate_size=1024, num_attention_heads=6)
DRAFT = Arch(hidden_size=160, num_hidden_layers=2, intermediate_size=448, num_attention_heads=5)


def keep_freed_memory() -> None:
    """Stop glibc from unmapping big freed blocks: each step frees and reallocates the same
    activations, and the page faults of fresh mmaps cost 5-14% of a step here."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        libc.mallopt(m_mmap_threshold, 1 << 30)
        libc.mallopt(m_trim_threshold, (1 << 31) - 1)  # C int: the largest it takes
    except (OSError, AttributeError):
        pass  # not glibc: run as is


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------- corpus
def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(p in skip or p.startswith("test") for p in parts):
            continue
        files.append(path)
    return files


def is_held_out(relpath: str) -> bool:
    return int(hashlib.sha256(relpath.encode()).hexdigest(), 16) % 100 < HOLDOUT_PERCENT


def split_corpus() -> tuple[list[tuple[str, str]], list[tuple[str, str]], str]:
    """Return (train, held_out, digest): lists of (relative path, text)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, held = [], []
    digest = hashlib.sha256()
    for path in stdlib_files():
        rel = path.relative_to(root).as_posix()
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        digest.update(rel.encode() + b"\0")
        (held if is_held_out(rel) else train).append((rel, text))
    return train, held, digest.hexdigest()


# --------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts: list[str], out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=EOS,
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )
    fast.save_pretrained(out)
    return fast


# --------------------------------------------------------------------------- models
def build_model(arch: Arch, max_positions: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_attention_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return LlamaForCausalLM(cfg)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def distill_loss(draft_logits, target_logits, temperature: float = 1.0):
    """KL(target || draft) per token, averaged: the draft learns the target's whole distribution."""
    t = F.log_softmax(target_logits.float() / temperature, dim=-1)  # [B, T, V]
    d = F.log_softmax(draft_logits.float() / temperature, dim=-1)  # [B, T, V]
    return F.kl_div(d.flatten(0, 1), t.flatten(0, 1), log_target=True, reduction="batchmean")


@torch.no_grad()
def bits_per_byte(model, tok, held_out: list[tuple[str, str]], seq_len: int) -> float:
    model.eval()
    nats, nbytes = 0.0, 0
    for _, text in held_out:
        ids = tok(text)["input_ids"] + [tok.eos_token_id]
        nbytes += len(text.encode("utf-8")) + 1
        # The first token of a file is predicted from the separator, as in training.
        ids = [tok.eos_token_id] + ids
        for start in range(0, len(ids) - 1, seq_len):
            chunk = torch.tensor(ids[start : start + seq_len + 1])[None]
            logits = model(input_ids=chunk[:, :-1]).logits
            nats += F.cross_entropy(logits[0].float(), chunk[0, 1:], reduction="sum").item()
    model.train()
    return nats / nbytes / math.log(2)


def batches(stream: torch.Tensor, batch: int, seq_len: int, seed: int, start_step: int):
    gen = torch.Generator().manual_seed(seed)
    step = 0
    while True:
        starts = torch.randint(0, len(stream) - seq_len - 1, (batch,), generator=gen)
        if step >= start_step:
            yield torch.stack([stream[s : s + seq_len + 1] for s in starts])
        step += 1


def save_ckpt(path: Path, **state) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)  # local training state only; never data from a network
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("models/demo"))
    ap.add_argument("--work", type=Path, default=Path(".train-demo"), help="checkpoints, logs")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--target-steps", type=int, default=3000)
    ap.add_argument("--distill-steps", type=int, default=2000)
    ap.add_argument("--distill-batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--draft-lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--bf16", choices=("auto", "on", "off"), default="auto",
                    help="bf16 autocast for matmuls (auto: on where the CPU has native bf16)")
    args = ap.parse_args()
    from specdec.core.llama_decode import native_bf16  # the same oneDNN check the decoder uses

    use_bf16 = args.bf16 == "on" or (args.bf16 == "auto" and native_bf16())
    log(f"matmuls in {'bf16 autocast' if use_bf16 else 'fp32'}")

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16)
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    args.work.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    train, held, digest = split_corpus()
    log(f"corpus: {len(train)} train files, {len(held)} held-out files, digest {digest[:16]}")
    tok_dir = args.out / "tokenizer"
    tok = train_tokenizer([t for _, t in train], tok_dir)
    eos = tok.eos_token_id
    ids: list[int] = []
    for _, text in train:
        ids.append(eos)
        ids.extend(tok(text)["input_ids"])
    stream = torch.tensor(ids, dtype=torch.long)
    train_bytes = sum(len(t.encode()) for _, t in train)
    log(f"tokenizer: vocab {len(tok)}; train stream {len(stream)} tokens ({train_bytes / len(stream):.2f} bytes/token)")

    target = build_model(TARGET, args.seq_len, args.seed)
    draft = build_model(DRAFT, args.seq_len, args.seed + 1)
    opt_t = torch.optim.AdamW(target.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    opt_d = torch.optim.AdamW(draft.parameters(), lr=args.draft_lr, weight_decay=0.1, betas=(0.9, 0.95))
    ckpt = args.work / "ckpt.pt"
    step, phase, elapsed = 0, "target", 0.0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        target.load_state_dict(state["target"])
        draft.load_state_dict(state["draft"])
        opt_t.load_state_dict(state["opt_t"])
        opt_d.load_state_dict(state["opt_d"])
        step, phase, elapsed = int(state["step"]), str(state["phase"]), float(state["elapsed"])
        log(f"resumed at {phase} step {step}")
    t_resume = time.time() - elapsed
    t_session, first_step = time.time(), step
    target.train(); draft.train()

    def checkpoint():
        save_ckpt(ckpt, target=target.state_dict(), draft=draft.state_dict(), opt_t=opt_t.state_dict(),
                  opt_d=opt_d.state_dict(), step=step, phase=phase, elapsed=time.time() - t_resume)

    # Phase 1: the target alone, on next-token loss.
    if phase == "target":
        data = batches(stream, args.batch, args.seq_len, args.seed, step)
        running = None
        while step < args.target_steps:
            xy = next(data)
            x, y = xy[:, :-1], xy[:, 1:]
            for g in opt_t.param_groups:
                g["lr"] = lr_at(step, args.target_steps, args.lr, 50)
            with autocast():
                logits = target(input_ids=x).logits
            loss_t = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            loss_t.backward()
            torch.nn.utils.clip_grad_norm_(target.parameters(), 1.0)
            opt_t.step(); opt_t.zero_grad(set_to_none=True)
            running = loss_t.item() if running is None else 0.98 * running + 0.02 * loss_t.item()
            step += 1
            if step % 10 == 0:
                rate = (step - first_step) * x.numel() / (time.time() - t_session)
                log(f"target step {step}/{args.target_steps} loss {loss_t.item():.3f} (mean {running:.3f}) {rate:.0f} tok/s")
            if step % 50 == 0:
                checkpoint()
        phase, step = "distill", 0
        checkpoint()
    target_time = time.time() - t_resume

    # Phase 2: the draft alone, distilled from the finished target (frozen).
    target.eval()
    data = batches(stream, args.distill_batch, args.seq_len, args.seed + 7, step)
    while phase == "distill" and step < args.distill_steps:
        xy = next(data)
        x, y = xy[:, :-1], xy[:, 1:]
        for g in opt_d.param_groups:
            g["lr"] = lr_at(step, args.distill_steps, args.draft_lr, 20)
        with torch.no_grad(), autocast():
            t_logits = target(input_ids=x).logits
        with autocast():
            d_logits = draft(input_ids=x).logits
        d_logits = d_logits.float()
        loss_kl = distill_loss(d_logits, t_logits)
        loss_ce = F.cross_entropy(d_logits.flatten(0, 1), y.flatten())
        loss = 0.9 * loss_kl + 0.1 * loss_ce
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt_d.step(); opt_d.zero_grad(set_to_none=True)
        step += 1
        if step % 10 == 0:
            log(f"distill step {step}/{args.distill_steps} kl {loss_kl.item():.3f} ce {loss_ce.item():.3f}")
        if step % 50 == 0:
            checkpoint()
    phase = "done"
    checkpoint()
    train_seconds = time.time() - t_resume

    # Ship in float16, then measure what ships: reload the saved files in float32.
    from transformers import AutoModelForCausalLM

    figures = {}
    for name, model in (("target", target), ("draft", draft)):
        path = args.out / name
        model.to(torch.float16).save_pretrained(path, safe_serialization=True)
        tok.save_pretrained(path)
        shipped = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        bpb = bits_per_byte(shipped, tok, held, args.seq_len)
        n = sum(p.numel() for p in shipped.parameters())
        figures[name] = {"parameters": n, "held_out_bits_per_byte": round(bpb, 4), "arch": asdict(TARGET if name == "target" else DRAFT)}
        log(f"{name}: {n / 1e6:.2f}M parameters, held-out {bpb:.3f} bits/byte")
    shutil.rmtree(tok_dir)  # each model folder carries its own copy of the one tokenizer

    training = {
        "python_version": platform.python_version(),
        "stdlib_file_list_sha256": digest,
        "train_files": len(train),
        "held_out_files": len(held),
        "held_out_percent": HOLDOUT_PERCENT,
        "held_out_list": [rel for rel, _ in held],
        "train_tokens_in_corpus": len(stream),
        "target_training_tokens": args.target_steps * args.batch * args.seq_len,
        "draft_distillation_tokens": args.distill_steps * args.distill_batch * args.seq_len,
        "target_phase_seconds": round(target_time),
        "total_training_seconds": round(train_seconds),
        "wall_seconds_with_tokenizer_and_eval": round(time.time() - t_start),
        "threads": args.threads,
        "matmul_precision": "bf16 autocast" if use_bf16 else "fp32",
        "seed": args.seed,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    (args.out / "training.json").write_text(json.dumps({"training": training, "models": figures}, indent=2) + "\n")
    log(f"done in {time.time() - t_start:.0f}s; figures in {args.out / 'training.json'}")


if __name__ == "__main__":
    sys.exit(main())
