"""Train an EAGLE-1 draft head (core/eagle_head.py) for the demo target, then measure its held-out acceptance.

One command, CPU, fixed seeds, restartable:

    python scripts/train_eagle_head.py --out models/demo/eagle

Steps:
  1. corpus: the demo pair's own split (scripts/train_demo_pair.py ``split_corpus``; the held-out list
     must equal models/demo/training.json's) and its token stream (an end-of-text token before each
     training file);
  2. features: the frozen target (float32) over ``--feature-chunks`` windows of ``--seq-len`` tokens
     drawn from the training stream by a seeded permutation; the post-norm last hidden state of every
     position (core/eagle_head.py says why that one) kept as float16 in ``--work`` (features.npy,
     tokens.npy), extended in place where a run stopped, so a restart skips what is done;
  3. training (EAGLE's losses): smooth-L1 between the predicted and the true next feature (weight
     1.0) + 0.1 x a token loss on ``lm_head(predicted)``: by default KL to the target's own
     distribution at that position (``lm_head(true feature)``: EAGLE's soft-label cross-entropy
     minus a constant; it teaches the target's choice, which is what acceptance counts),
     ``--token-loss ce`` for cross-entropy to the data token instead. Both are logged either way.
     Input features get EAGLE's uniform noise (``--feature-noise``) so that the head tolerates its
     own predicted features when it chains. AdamW, warmup + cosine over ``--steps``; a checkpoint every
     ``--ckpt-every`` steps; ``--resume`` continues one bit-exactly (data order and noise are
     functions of the step); ``--budget-minutes`` stops training early (features + training
     time, summed over restarts) and keeps what it has;
  4. the head saved (float16, fc + its decoder layer only) with config.json, then reloaded and
     measured on the held-out files against the demo draft model, both as greedy drafters:
     teacher-forced 1-step acceptance and chained k = 1..5 accepted lengths at sampled positions
     (``evaluate``); written to ``--results``/acceptance.json and the card (``--out``/README.md).

Matmuls run in bf16 autocast where the CPU has native bf16 (core/cpu_features.py), fp32 elsewhere;
weights, optimizer state and losses stay fp32. Feature extraction and evaluation run the target in
float32, as the demo serves it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_demo_pair import keep_freed_memory, log, lr_at, save_ckpt, split_corpus  # noqa: E402

from specdec.core.cpu_features import describe_cpu, native_bf16  # noqa: E402
from specdec.core.eagle_head import WEIGHTS, EagleHead, HeadCache, target_fingerprint  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- corpus
def corpus_streams(tok, card: Path) -> tuple[torch.Tensor, list[tuple[str, list[int]]], str]:
    """(train stream, held-out files as (path, [eos] + ids + [eos]), file-list digest), built as
    scripts/train_demo_pair.py builds them; refuses a split that differs from the card's."""
    train, held, digest = split_corpus()
    expected = json.loads(card.read_text())["training"]
    if [rel for rel, _ in held] != expected["held_out_list"] or digest != expected["stdlib_file_list_sha256"]:
        raise SystemExit(f"this interpreter's stdlib split differs from {card} (trained on Python "
                         f"{expected['python_version']}): the features would mix held-out files in")
    eos = tok.eos_token_id
    ids: list[int] = []
    for _, text in train:
        ids.append(eos)
        ids.extend(tok(text)["input_ids"])
    held_ids = [(rel, [eos] + tok(text)["input_ids"] + [eos]) for rel, text in held]
    return torch.tensor(ids, dtype=torch.long), held_ids, digest


# --------------------------------------------------------------------------- features
@torch.no_grad()
def target_features(target, input_ids: torch.Tensor) -> torch.Tensor:
    """The post-norm last hidden states, [batch, T, hidden]: the tensor the LM head multiplies."""
    return target.model(input_ids=input_ids).last_hidden_state


def extract_features(target, stream: torch.Tensor, work: Path, seq_len: int, chunks: int, seed: int,
                     batch: int = 2) -> tuple[np.ndarray, np.ndarray, float]:
    """(features [chunks, seq_len, hidden] float16, tokens [chunks, seq_len] int32, seconds spent
    extracting, over restarts), cached in ``work``; a restart continues from the last chunk written."""
    meta = {"target": target_fingerprint(target), "seq_len": seq_len, "chunks": chunks, "seed": seed,
            "stream_tokens": len(stream)}
    state_path, feat_path, tok_path = work / "features.json", work / "features.npy", work / "tokens.npy"
    state = json.loads(state_path.read_text()) if state_path.exists() else {}
    if state.get("meta") != meta or not feat_path.exists():
        order = torch.randperm(len(stream) // seq_len, generator=torch.Generator().manual_seed(seed))[:chunks]
        tokens = torch.stack([stream[i * seq_len:(i + 1) * seq_len] for i in order.tolist()]).to(torch.int32)
        np.save(tok_path, tokens.numpy())
        np.lib.format.open_memmap(feat_path, mode="w+", dtype=np.float16,
                                  shape=(chunks, seq_len, target.config.hidden_size)).flush()
        state = {"meta": meta, "done": 0, "seconds": 0.0}
        state_path.write_text(json.dumps(state))
    tokens = np.load(tok_path)
    feats = np.load(feat_path, mmap_mode="r+")
    done, t0 = state["done"], time.time()
    if done < chunks:
        log(f"features: {done}/{chunks} windows cached; extracting the rest")
    while done < chunks:
        hi = min(chunks, done + batch)
        feats[done:hi] = target_features(target, torch.from_numpy(tokens[done:hi]).long()).to(torch.float16).numpy()
        done = hi
        if done % 20 == 0 or done == chunks:
            feats.flush()
            state_path.write_text(json.dumps({"meta": meta, "done": done, "seconds": state["seconds"] + time.time() - t0}))
            rate = (done - state["done"]) * seq_len / (time.time() - t0)
            log(f"features {done}/{chunks} windows, {rate:.0f} tok/s")
    seconds = json.loads(state_path.read_text())["seconds"]
    return np.load(feat_path, mmap_mode="r"), tokens, seconds


# --------------------------------------------------------------------------- training
def head_losses(head: EagleHead, feats: torch.Tensor, tokens: torch.Tensor, token_loss: str = "kl",
                feature_weight: float = 1.0, token_weight: float = 0.1, noise: float = 0.0,
                generator: torch.Generator | None = None, autocast=nullcontext) -> dict[str, torch.Tensor]:
    """EAGLE's losses over windows: ``feats`` [batch, T, hidden] (the target's f_0..f_{T-1}), ``tokens``
    [batch, T]. The head reads (f_t, token_{t+1}) for t < T-1 and predicts f_{t+1}."""
    inputs = feats[:, :-1]
    if noise:  # EAGLE: uniform noise on the input features, width ``noise``
        inputs = inputs + (torch.rand(inputs.shape, generator=generator) - 0.5) * noise
    with autocast():
        predicted = head(inputs, tokens[:, 1:])  # [batch, T-1, hidden]
        head_logits = head.logits(predicted)
    predicted, head_logits = predicted.float(), head_logits.float()  # [batch, T-1, vocab]
    true_next = feats[:, 1:]
    with torch.no_grad():
        target_logits = head.logits(true_next).float()  # the target's own logits at t+1
    feature = F.smooth_l1_loss(predicted, true_next)
    head_logp = F.log_softmax(head_logits, dim=-1)
    kl = F.kl_div(head_logp.flatten(0, 1), F.log_softmax(target_logits, -1).flatten(0, 1), log_target=True,
                  reduction="batchmean")
    ce = F.nll_loss(head_logp[:, :-1].flatten(0, 1), tokens[:, 2:].flatten())  # the data token t+2
    loss = feature_weight * feature + token_weight * (kl if token_loss == "kl" else ce)
    agree = (head_logits.argmax(-1) == target_logits.argmax(-1)).float().mean()
    return {"loss": loss, "feature": feature, "kl": kl, "ce": ce, "agree": agree}


def batch_indices(step: int, batch: int, n: int, seed: int) -> torch.Tensor:
    """Windows of a step: epochs of seeded permutations, so any step's batch is known without replay."""
    first = step * batch
    out = []
    while len(out) < batch:
        epoch, at = divmod(first + len(out), n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch))
        out.extend(perm[at: at + batch - len(out)].tolist())
    return torch.tensor(out)


def train_steps(head: EagleHead, opt: torch.optim.Optimizer, feats: np.ndarray, tokens: np.ndarray, start: int,
                stop: int, total: int, args, autocast=nullcontext, should_stop=lambda step: False, on_step=None) -> int:
    """Steps ``start``..``stop``-1 (of a ``total``-step schedule); returns the step reached."""
    step = start
    while step < stop and not should_stop(step):
        idx = batch_indices(step, args.batch, len(tokens), args.seed)
        x = torch.from_numpy(np.asarray(feats[idx.numpy()], dtype=np.float32))
        t = torch.from_numpy(tokens[idx.numpy()]).long()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, args.lr, args.warmup)
        noise_gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        parts = head_losses(head, x, t, args.token_loss, args.feature_weight, args.token_weight, args.feature_noise,
                            noise_gen, autocast)
        parts["loss"].backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if on_step:
            on_step(step, {k: v.item() for k, v in parts.items()}, x.shape[0] * (x.shape[1] - 1))
    return step


def make_optimizer(head: EagleHead, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))


# --------------------------------------------------------------------------- evaluation
@torch.no_grad()
def greedy_continuation(model, context: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(context features [batch, C, hidden], n greedy tokens [batch, n]) of a Hugging Face Llama."""
    out = model.model(input_ids=context, use_cache=True)
    feats, cache = out.last_hidden_state, out.cache
    tokens = [model.lm_head(feats[:, -1]).argmax(-1)]
    for _ in range(n - 1):
        out = model.model(input_ids=tokens[-1][:, None], cache=cache, use_cache=True)
        tokens.append(model.lm_head(out.last_hidden_state[:, -1]).argmax(-1))
    return feats, torch.stack(tokens, dim=1)


def accepted_lengths(drafts: torch.Tensor, truth: torch.Tensor, max_k: int) -> dict[int, float]:
    """Mean accepted tokens per verification for k = 1..max_k: the leading drafts equal to the target's
    greedy tokens (drafts, truth [batch, >= max_k])."""
    match = (drafts[:, :max_k] == truth[:, :max_k]).long().cumprod(dim=1)  # [batch, max_k]
    return {k: match[:, :k].sum(1).float().mean().item() for k in range(1, max_k + 1)}


@torch.no_grad()
def evaluate(head: EagleHead, target, draft, held: list[tuple[str, list[int]]], seq_len: int, positions: int,
             context: int, max_k: int, seed: int, batch: int = 16) -> dict:
    """Held-out acceptance of the head and of the draft model, both greedy, against the target's greedy tokens.

    one_step (teacher-forced, every position of every held-out window): the head reads the true
    f_t and the data token t+1 and proposes token t+2; the draft model reads the data tokens up to t+1;
    each counts as accepted where it equals the target's greedy token after t+1.
    chain (at ``positions`` sampled windows of ``context`` held-out tokens): the target runs over the
    window and commits its greedy token g_1 (what each drafter has after a verification); the head
    then drafts from the true features and g_1, feeding back its own features; the draft model
    drafts from the window + g_1; both propose k = max_k tokens, compared with the target's greedy
    g_2..g_{k+1}: the mean number accepted for each k."""
    hits_head = hits_draft = total = 0
    for _, ids in held:
        for s in range(0, len(ids) - 2, seq_len):
            x = torch.tensor(ids[s:s + seq_len])[None]  # [1, T]
            f = target_features(target, x)  # [1, T, hidden]
            target_greedy = target.lm_head(f).argmax(-1)[0, 1:]  # after tokens 1..T-1
            head_greedy = head.logits(head(f[:, :-1], x[:, 1:])).argmax(-1)[0]
            draft_greedy = draft(input_ids=x).logits.argmax(-1)[0, 1:]
            hits_head += (head_greedy == target_greedy).sum().item()
            hits_draft += (draft_greedy == target_greedy).sum().item()
            total += len(target_greedy)
    stream = torch.tensor([t for _, ids in held for t in ids])
    starts = torch.randint(0, len(stream) - context, (positions,), generator=torch.Generator().manual_seed(seed))
    head_len, draft_len = {k: 0.0 for k in range(1, max_k + 1)}, {k: 0.0 for k in range(1, max_k + 1)}
    for b in range(0, positions, batch):
        ctx = torch.stack([stream[s:s + context] for s in starts[b:b + batch].tolist()])  # [b, C]
        feats, truth = greedy_continuation(target, ctx, max_k + 1)  # truth: g_1..g_{k+1}
        g1 = truth[:, 0]
        cache = HeadCache()
        predicted = head(feats, torch.cat([ctx[:, 1:], g1[:, None]], dim=1), start=0, cache=cache)[:, -1]
        head_drafts = [head.logits(predicted).argmax(-1)]
        for j in range(1, max_k):
            token, predicted, _ = head.draft(predicted, head_drafts[-1], context + j - 1, cache)
            head_drafts.append(token)
        _, draft_drafts = greedy_continuation(draft, torch.cat([ctx, g1[:, None]], dim=1), max_k)
        n = ctx.shape[0]
        for k, v in accepted_lengths(torch.stack(head_drafts, 1), truth[:, 1:], max_k).items():
            head_len[k] += v * n
        for k, v in accepted_lengths(draft_drafts, truth[:, 1:], max_k).items():
            draft_len[k] += v * n
    return {
        "one_step": {"positions": total, "head": round(hits_head / total, 4), "draft_model": round(hits_draft / total, 4)},
        "chain": {"positions": positions, "context_tokens": context,
                  "head_mean_accepted": {k: round(v / positions, 4) for k, v in head_len.items()},
                  "draft_model_mean_accepted": {k: round(v / positions, 4) for k, v in draft_len.items()}},
    }


# --------------------------------------------------------------------------- card
def write_card(out: Path, config: dict, results: dict) -> None:
    tr, acc = results["training"], results["acceptance"]
    one, chain = acc["one_step"], acc["chain"]
    head_len, draft_len = chain["head_mean_accepted"], chain["draft_model_mean_accepted"]
    ks = sorted(head_len, key=int)
    rows = "\n".join(f"| {k} | {head_len[k]:.3f} | {draft_len[k]:.3f} | {head_len[k] / max(draft_len[k], 1e-9):.2f}x |"
                     for k in ks)
    beats = head_len[ks[-1]] > draft_len[ks[-1]]
    final = tr.get("final") or {}
    fmt = lambda key, spec: format(final[key], spec) if key in final else "n/a"  # noqa: E731
    token_loss = ("KL to the target's own distribution at that position" if tr["token_loss"] == "kl"
                  else "cross-entropy to the data token")
    text = f"""# EAGLE head for the demo target

An EAGLE-1 draft head ([Li et al. 2024](https://arxiv.org/abs/2401.15077)) for `models/demo/target`,
trained by `scripts/train_eagle_head.py`; the module is `core/eagle_head.py` (`specdec.core.eagle_head`).
Written by the script (`--card-only` rewrites it from `benchmarks/results/eagle_head/acceptance.json`).

- **What it is**: at position t it reads the target's feature f_t (the last hidden state *after* the
  final RMSNorm, the tensor the LM head multiplies, as in EAGLE's code) and the embedding of token
  t+1, projects the pair with `fc` (768 → 384, with bias) and runs one Llama decoder layer (width 384,
  6 heads, MLP 1024, rotary positions, its own weights) to predict f_{{t+1}}; its proposal for token
  t+2 is the target's frozen LM head on that prediction (no norm in between: the features are
  already normed). Chaining feeds its predicted feature back in.
- **What the file holds**: `head.safetensors`, {config['parameters']:,} parameters (`fc` + the decoder layer) in
  float16, {config['file_bytes'] / 1e6:.1f} MB; `config.json`, its shapes and its target. The embedding and the LM head are
  the target's and are not copied: `EagleHead.load("models/demo/eagle", target)` takes them from the
  loaded target by reference and refuses a target whose fingerprint (`target_fingerprint`: sha256 of
  its config and first weights, whatever precision it is loaded in) is not
  `{config['target_fingerprint']}`.
- **Training data**: the frozen target's features (float32, cached as float16) over {tr['feature_windows']} windows
  of {tr['seq_len']} tokens ({tr['feature_tokens']:,} tokens), drawn by a seeded permutation from the demo pair's
  training stream (the Python {tr['python_version']} stdlib split of `../training.json`; its 15 held-out
  files never seen).
- **Losses** (EAGLE's): smooth-L1 between the predicted and the true next feature (weight
  {tr['feature_weight']}) + {tr['token_weight']} × {token_loss}; uniform noise of width {tr['feature_noise']} on the
  input features. AdamW, lr {tr['lr']}, warmup + cosine over {tr['steps_planned']} steps, {tr['batch']} windows a step,
  seed {tr['seed']}.
- **Run**: {tr['steps']} steps ({tr['train_tokens']:,} token positions, about
  {tr['train_tokens'] / tr['feature_tokens']:.1f} passes over the features){'' if tr['steps'] >= tr['steps_planned'] else ', stopped by the time budget'};
  {tr['train_seconds'] / 60:.1f} min training + {tr['feature_seconds'] / 60:.1f} min feature extraction, wall clock, on
  {tr['threads']} thread(s) of {f"a {tr['cores']}-core " if 'cores' in tr else ''}{tr['machine']}; matmuls in {tr['matmul_precision']}.
  Training losses at the end (means of the last 20 steps): feature {fmt('feature', '.4f')}, KL to the
  target {fmt('kl', '.3f')}, data-token cross-entropy {fmt('ce', '.3f')}; greedy agreement with the target {fmt('agree', '.3f')}.

Command:

```
{tr['command']}
```

## Held-out acceptance (greedy, against the target's greedy tokens)

Measured by the script on the 15 held-out files after reloading the shipped file; the demo draft
model (`../draft`, 1.6M parameters, distilled from the target) measured the same way on the same
positions (`benchmarks/results/eagle_head/acceptance.json`).

**1-step, teacher-forced** ({one['positions']:,} positions: every position of every held-out window of
{tr['seq_len']} tokens): the head reads the true f_t and the data token t+1; the draft model reads the
data tokens up to t+1; each proposal for token t+2 is accepted where it equals the target's greedy token.

| | head | draft model |
|---|---|---|
| 1-step acceptance | {one['head']:.3f} | {one['draft_model']:.3f} |

**Chain** ({chain['positions']} sampled windows of {chain['context_tokens']} held-out tokens): the target commits
its greedy token g_1 (what a drafter has after a verification); the head drafts k tokens from the
target's true features and g_1, feeding back its own predicted features; the draft model drafts k
tokens greedily from the window + g_1. Mean accepted drafts per verification (the leading drafts
equal to the target's greedy g_2..g_{{k+1}}; tokens per verification is one more):

| k | head | draft model | head / draft |
|---|---|---|---|
{rows}

At k = {ks[-1]} the head {'beats' if beats else 'does **not** beat'} the draft model's accepted length
(issue 31's bar{'' if beats else '; not met within this training budget'}).

## Draft vocabulary

`draft_vocab.json`, when present (written by `scripts/draft_vocab.py`, not by this script): the
most frequent tokens of the training stream, with their coverage of it and of the held-out files.
The `eagle` drafters then score only those rows of the target's LM head (EAGLE-3's reduced draft
vocabulary): a draft token reads a third of the bytes, and a token outside it is never proposed
(acceptance and tokens/s with and without it: docs/performance.md, 12.2).
"""
    (out / "README.md").write_text(text)


# --------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", type=Path, default=ROOT / "models/demo/target")
    ap.add_argument("--draft", type=Path, default=ROOT / "models/demo/draft")
    ap.add_argument("--card", type=Path, default=ROOT / "models/demo/training.json", help="the pair's split")
    ap.add_argument("--out", type=Path, default=ROOT / "models/demo/eagle")
    ap.add_argument("--results", type=Path, default=ROOT / "benchmarks/results/eagle_head")
    ap.add_argument("--work", type=Path, default=Path("/tmp/specdec-eagle-head"), help="features, checkpoints")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--feature-chunks", type=int, default=900, help="training windows whose features are cached")
    ap.add_argument("--batch", type=int, default=4, help="windows per step")
    ap.add_argument("--steps", type=int, default=950, help="the schedule's length")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--token-loss", choices=("kl", "ce"), default="kl")
    ap.add_argument("--feature-weight", type=float, default=1.0)
    ap.add_argument("--token-weight", type=float, default=0.1)
    ap.add_argument("--feature-noise", type=float, default=0.2, help="width of EAGLE's uniform input noise")
    ap.add_argument("--budget-minutes", type=float, default=52.0, help="features + training, over restarts")
    ap.add_argument("--ckpt-every", type=int, default=25)
    ap.add_argument("--resume", action="store_true", help="continue from --work/ckpt.pt")
    ap.add_argument("--eval-only", action="store_true", help="save and evaluate the checkpoint as it is")
    ap.add_argument("--card-only", action="store_true", help="rewrite --out/README.md from --results/acceptance.json")
    ap.add_argument("--eval-positions", type=int, default=256)
    ap.add_argument("--eval-context", type=int, default=256)
    ap.add_argument("--max-k", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--bf16", choices=("auto", "on", "off"), default="auto")
    args = ap.parse_args(argv)
    command = "python scripts/train_eagle_head.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.card_only:
        results = json.loads((args.results / "acceptance.json").read_text())
        write_card(args.out, results["head"], results)
        return 0

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    keep_freed_memory()
    use_bf16 = args.bf16 == "on" or (args.bf16 == "auto" and native_bf16())
    log(f"{describe_cpu()}; matmuls in {'bf16 autocast' if use_bf16 else 'fp32'}; {args.threads} thread(s)")

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16)

    args.work.mkdir(parents=True, exist_ok=True)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    target.requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(args.target)
    stream, held, _ = corpus_streams(tok, args.card)
    log(f"train stream {len(stream):,} tokens; {len(held)} held-out files")

    ckpt_path = args.work / "ckpt.pt"
    torch.manual_seed(args.seed)
    head = EagleHead.from_target(target)
    opt = make_optimizer(head, args.lr)
    step, train_seconds = 0, 0.0
    history: list[dict] = []
    if ckpt_path.exists() and not (args.resume or args.eval_only):
        raise SystemExit(f"{ckpt_path} exists: pass --resume to continue it, or remove {args.work}")
    if ckpt_path.exists():
        state = torch.load(ckpt_path, weights_only=True)  # our own local training state
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        step, train_seconds = int(state["step"]), float(state["train_seconds"])
        history = json.loads(state["history"])
        log(f"resumed at step {step} ({train_seconds / 60:.1f} min trained)")

    feats, tokens, feature_seconds = extract_features(target, stream, args.work, args.seq_len, args.feature_chunks,
                                                      args.seed)

    def checkpoint() -> None:
        save_ckpt(ckpt_path, head=head.state_dict(), opt=opt.state_dict(), step=step, train_seconds=train_seconds,
                  history=json.dumps(history))

    budget = args.budget_minutes * 60
    session_start, session_step = time.time(), step
    trained_before = train_seconds
    window: list[dict] = []

    def on_step(s: int, parts: dict, ntok: int) -> None:
        nonlocal step, train_seconds
        step, train_seconds = s, trained_before + time.time() - session_start
        window.append(parts)
        del window[:-20]
        if s % 10 == 0:
            mean = {k: sum(p[k] for p in window) / len(window) for k in parts}
            rate = (s - session_step) * ntok / (time.time() - session_start)
            history.append({"step": s, **{k: round(v, 5) for k, v in mean.items()}})
            log(f"step {s}/{args.steps} loss {mean['loss']:.4f} feature {mean['feature']:.4f} kl {mean['kl']:.3f} "
                f"ce {mean['ce']:.3f} agree {mean['agree']:.3f} {rate:.0f} tok/s "
                f"({(feature_seconds + train_seconds) / 60:.1f}/{args.budget_minutes:.0f} min)")
        if s % args.ckpt_every == 0:
            checkpoint()

    def over_budget(_: int) -> bool:
        return feature_seconds + trained_before + time.time() - session_start >= budget

    if not args.eval_only and step < args.steps:
        head.train()
        step = train_steps(head, opt, feats, tokens, step, args.steps, args.steps, args, autocast, over_budget, on_step)
        checkpoint()
        if step < args.steps:
            log(f"budget of {args.budget_minutes} min reached at step {step}/{args.steps}: keeping that head")
    head.eval()

    # Ship in float16, then measure what ships: reload the saved file over the target.
    head.save(args.out)
    shipped = EagleHead.load(args.out, target)
    draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=torch.float32).eval()
    t_eval = time.time()
    acceptance = evaluate(shipped, target, draft, held, args.seq_len, args.eval_positions, args.eval_context,
                          args.max_k, args.seed)
    log(f"held-out acceptance ({time.time() - t_eval:.0f} s): {json.dumps(acceptance)}")
    last = {k: v for k, v in history[-1].items() if k != "step"} if history else {}
    training = {
        "command": command, "python_version": platform.python_version(), "machine": describe_cpu(),
        "threads": args.threads, "cores": os.cpu_count(), "matmul_precision": "bf16 autocast" if use_bf16 else "fp32",
        "seq_len": args.seq_len, "feature_windows": args.feature_chunks,
        "feature_tokens": args.feature_chunks * args.seq_len, "steps": step, "steps_planned": args.steps,
        "batch": args.batch, "train_tokens": step * args.batch * (args.seq_len - 1), "lr": args.lr,
        "token_loss": args.token_loss, "feature_weight": args.feature_weight, "token_weight": args.token_weight,
        "feature_noise": args.feature_noise, "seed": args.seed, "feature_seconds": round(feature_seconds),
        "train_seconds": round(train_seconds), "final": last, "history": history,
    }
    config = {"parameters": sum(p.numel() for p in shipped.parameters()),
              "file_bytes": (args.out / WEIGHTS).stat().st_size,
              "target_fingerprint": shipped.config.target_fingerprint}
    head.save(args.out, extra={"target": "models/demo/target", "trained_by": "scripts/train_eagle_head.py"})
    results = {"training": training, "acceptance": acceptance, "head": config}
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "acceptance.json").write_text(json.dumps(results, indent=2) + "\n")
    write_card(args.out, config, results)
    log(f"done: {args.out}, {args.results / 'acceptance.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
