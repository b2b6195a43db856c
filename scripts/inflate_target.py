"""A bigger Llama target that computes exactly the source's function: more width, heads, MLP units
and layers, all of which cost full compute and none of which change a logit. For measuring speed at
sizes the 16.5M demo target does not reach, with outputs still comparable token for token.

    python scripts/inflate_target.py --source models/demo/target --out /tmp/target-1536 \\
        --hidden 1536 --layers 16 --heads 24 --kv-heads 8 --intermediate 4608 --dtype bfloat16

Construction (h, H: source and new hidden size):
- The residual stream's dimensions h..H-1 stay exactly zero: embedding (and untied LM head) columns
  beyond h are zero, and every matrix that writes the residual (o_proj, down_proj) has zero rows
  beyond h.
- Source KV head m becomes KV head m; where the new model has fewer query heads per KV head than
  the source, c = ceil(source group / new group) KV heads m*c..m*c+c-1 each hold a copy of it.
  Source query head j becomes a query head of a group that reads (a copy of) its own KV head. head_dim and the rotary settings are the source's.
  Extra heads, extra MLP units and extra layers get random q/k/v/gate/up rows (normal, std 0.02,
  seeded) and zero o_proj/down_proj columns: full compute, nothing written to the residual.
- RMSNorm: the mean of squares over H dimensions of which only h are non-zero is h/H times the
  mean over h, so every weight is scaled by sqrt(h/H) and eps by h/H; weights beyond h are zero.
- Extra layers come after the source's last layer (their outputs are zero, so any place would do).

float32 holds the source's half-precision weights exactly; bfloat16 rounds them (as loading the
source in bfloat16 does) and the scaled norm weights. Weights are built and written one tensor at
a time (a streaming safetensors writer), so a 0.45B float32 model never sits in memory whole.
Writes model.safetensors, config.json, the source's generation config and tokenizer files, and
inflation.json (source, shapes, head/layer maps).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import struct
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[1]
INIT_STD = 0.02  # the usual Llama initializer_range: extra rows look like a freshly initialised model
COPIED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
          "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


class ShapeError(ValueError):
    """A requested shape that cannot hold the source; the message says what to change."""


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int


@dataclass(frozen=True)
class Plan:
    """Where each part of the source goes in the new model."""
    source: Shape
    shape: Shape
    head_dim: int
    query_head_of: tuple[int, ...]  # source query head j -> new query head
    source_kv_of: tuple[int | None, ...]  # new KV head -> source KV head it copies, None: random
    source_layer_of: tuple[int | None, ...]  # new layer -> source layer, None: extra (writes nothing)
    norm_scale: float  # sqrt(h/H)
    rms_norm_eps: float  # source eps * h/H


def source_shape(config: dict) -> tuple[Shape, int]:
    """The source's shape and head_dim; refuses what this construction does not cover."""
    if config.get("model_type") != "llama":
        raise ShapeError(f"source model_type is {config.get('model_type')!r}; only llama is supported")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ShapeError("source has attention or MLP biases; only a bias-free Llama is supported")
    shape = Shape(config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
                  config.get("num_key_value_heads") or config["num_attention_heads"], config["intermediate_size"])
    return shape, config.get("head_dim") or shape.hidden // shape.heads


def plan(config: dict, shape: Shape) -> Plan:
    """Check that ``shape`` can hold the source described by ``config`` and say where everything goes."""
    src, head_dim = source_shape(config)
    for field, flag in (("hidden", "--hidden"), ("heads", "--heads"), ("kv_heads", "--kv-heads"),
                        ("layers", "--layers"), ("intermediate", "--intermediate")):
        if getattr(shape, field) < getattr(src, field):
            raise ShapeError(f"{flag} {getattr(shape, field)} is smaller than the source's {getattr(src, field)}: "
                             f"use {flag} {getattr(src, field)} or more")
    if shape.heads % shape.kv_heads:
        raise ShapeError(f"--heads {shape.heads} is not a multiple of --kv-heads {shape.kv_heads}: "
                         f"choose heads divisible by kv-heads")
    if shape.hidden != shape.heads * head_dim:
        raise ShapeError(f"--hidden {shape.hidden} != --heads {shape.heads} x the source's head_dim {head_dim}: "
                         f"head_dim must stay {head_dim} (rotary and attention scale depend on it), so use "
                         f"--hidden {shape.heads * head_dim}"
                         + (f" or --heads {shape.hidden // head_dim}" if shape.hidden % head_dim == 0 else ""))
    group_src = src.heads // src.kv_heads  # query heads per KV head in the source
    group = shape.heads // shape.kv_heads
    copies = -(-group_src // group)  # new KV heads that hold one source KV head, so its queries all fit
    if src.kv_heads * copies > shape.kv_heads:
        raise ShapeError(f"the source's {src.heads} query heads read {src.kv_heads} KV heads in groups of {group_src}; "
                         f"with {group} query heads per KV head each group needs {copies} KV heads, "
                         f"{src.kv_heads * copies} in all, but --kv-heads is {shape.kv_heads}: use --kv-heads "
                         f"{shape.heads} (always fits) or at least {group_src} query heads per KV head")
    query_head_of = []
    for j in range(src.heads):
        m, r = divmod(j, group_src)  # source KV head m, r-th query head of its group
        query_head_of.append((m * copies + r // group) * group + r % group)
    source_kv_of = [None] * shape.kv_heads
    for m in range(src.kv_heads):
        for t in range(copies):
            source_kv_of[m * copies + t] = m
    ratio = src.hidden / shape.hidden
    return Plan(src, shape, head_dim, tuple(query_head_of), tuple(source_kv_of),
                tuple(range(src.layers)) + (None,) * (shape.layers - src.layers),
                math.sqrt(ratio), config["rms_norm_eps"] * ratio)


Spec = tuple[str, tuple[int, ...], Callable[[], torch.Tensor]]


def tensor_specs(p: Plan, tied: bool, source: Callable[[str], torch.Tensor], vocab: int,
                 generator: torch.Generator) -> list[Spec]:
    """Every tensor of the new model in file order: name, shape and how to build it (float32).
    Builders draw from ``generator``, so they must run in this order."""
    h, H, hd = p.source.hidden, p.shape.hidden, p.head_dim
    i_src, I = p.source.intermediate, p.shape.intermediate

    def fresh(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=generator) * INIT_STD

    def padded(name: str, rows: int, cols: int) -> torch.Tensor:  # the source block in zeros
        out = torch.zeros(rows, cols)
        w = source(name)
        out[: w.shape[0], : w.shape[1]] = w
        return out

    def norm(name: str | None) -> torch.Tensor:
        if name is None:  # an extra layer's: any value, its output is zeroed
            return torch.full((H,), p.norm_scale)
        out = torch.zeros(H)
        out[:h] = source(name) * p.norm_scale
        return out

    def reads(new: str, src: str | None, proj: str, rows: int, placed: list[tuple[int, int]], block: int) -> Spec:
        """q/k/v/gate/up [rows, H]: random rows, then the source's, ``block`` rows per ``(src_row, new_row)``."""
        def build() -> torch.Tensor:
            out = fresh(rows, H)
            if src is not None:
                w = source(f"{src}.{proj}.weight")  # [rows_src, h]
                for src_row, new_row in placed:
                    out[new_row: new_row + block] = 0
                    out[new_row: new_row + block, :h] = w[src_row: src_row + block]
            return out
        return f"{new}.{proj}.weight", (rows, H), build

    def attn_out(layer: str | None) -> torch.Tensor:  # o_proj [H, heads*hd]: source head j's columns at its new head
        out = torch.zeros(H, p.shape.heads * hd)
        if layer is not None:
            w = source(f"{layer}.self_attn.o_proj.weight")  # [h, heads_src*hd]
            for j, q in enumerate(p.query_head_of):
                out[:h, q * hd: (q + 1) * hd] = w[:, j * hd: (j + 1) * hd]
        return out

    q, kv = p.shape.heads * hd, p.shape.kv_heads * hd
    q_rows = [(j * hd, n * hd) for j, n in enumerate(p.query_head_of)]
    kv_rows = [(m * hd, n * hd) for n, m in enumerate(p.source_kv_of) if m is not None]
    specs: list[Spec] = [("model.embed_tokens.weight", (vocab, H), lambda: padded("model.embed_tokens.weight", vocab, H))]
    for n, s in enumerate(p.source_layer_of):
        new, src = f"model.layers.{n}", None if s is None else f"model.layers.{s}"
        specs += [
            (f"{new}.input_layernorm.weight", (H,), lambda src=src: norm(src and f"{src}.input_layernorm.weight")),
            reads(new, src, "self_attn.q_proj", q, q_rows, hd),
            reads(new, src, "self_attn.k_proj", kv, kv_rows, hd),
            reads(new, src, "self_attn.v_proj", kv, kv_rows, hd),
            (f"{new}.self_attn.o_proj.weight", (H, q), lambda src=src: attn_out(src)),
            (f"{new}.post_attention_layernorm.weight", (H,), lambda src=src: norm(src and f"{src}.post_attention_layernorm.weight")),
            reads(new, src, "mlp.gate_proj", I, [(0, 0)], i_src),
            reads(new, src, "mlp.up_proj", I, [(0, 0)], i_src),
            (f"{new}.mlp.down_proj.weight", (H, I),
             lambda src=src: torch.zeros(H, I) if src is None else padded(f"{src}.mlp.down_proj.weight", H, I)),
        ]
    specs.append(("model.norm.weight", (H,), lambda: norm("model.norm.weight")))
    if not tied:
        specs.append(("lm_head.weight", (vocab, H), lambda: padded("lm_head.weight", vocab, H)))
    return specs


def write_safetensors(path: Path, specs: list[Spec], dtype: torch.dtype) -> int:
    """Write ``specs`` as one safetensors file, building each tensor just before it is written; returns bytes."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in specs:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format pads the header to 8 bytes
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name, shape, build in specs:
            t = build().to(dtype).contiguous()
            if tuple(t.shape) != shape:
                raise AssertionError(f"{name}: built {tuple(t.shape)}, planned {shape}")
            f.write(t.reshape(-1).view(torch.uint8).numpy())
    os.replace(partial, path)
    return 8 + len(blob) + offset


class Source:
    """The source's tensors, read one at a time (as float32) from its safetensors files."""

    def __init__(self, folder: Path) -> None:
        self.files = sorted(folder.glob("*.safetensors"))
        if not self.files:
            raise ShapeError(f"no safetensors files in {folder}")
        handles = [safe_open(str(f), "pt") for f in self.files]
        self.where = {k: h for h in handles for k in h.keys()}

    def __call__(self, name: str) -> torch.Tensor:
        return self.where[name].get_tensor(name).float()

    def sha256(self) -> dict[str, str]:
        out = {}
        for f in self.files:
            digest = hashlib.sha256()
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    digest.update(chunk)
            out[f.name] = digest.hexdigest()
        return out


def inflate(source_dir: Path, out: Path, shape: Shape, dtype: torch.dtype, seed: int = 0) -> dict:
    """Build the inflated model in ``out``; returns what inflation.json records."""
    config = json.loads((source_dir / "config.json").read_text())
    p = plan(config, shape)  # refuses before anything is written
    tied = bool(config.get("tie_word_embeddings", True))
    source = Source(source_dir)
    out.mkdir(parents=True, exist_ok=True)
    specs = tensor_specs(p, tied, source, config["vocab_size"], torch.Generator().manual_seed(seed))
    nbytes = write_safetensors(out / "model.safetensors", specs, dtype)

    new = dict(config, hidden_size=shape.hidden, num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
               num_key_value_heads=shape.kv_heads, intermediate_size=shape.intermediate, head_dim=p.head_dim,
               rms_norm_eps=p.rms_norm_eps)
    new["torch_dtype" if "torch_dtype" in config else "dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(new, indent=2, sort_keys=True) + "\n")
    for name in COPIED:
        if (source_dir / name).is_file():
            shutil.copyfile(source_dir / name, out / name)

    record = {
        "source": str(source_dir), "source_sha256": source.sha256(),
        "source_shape": asdict(p.source), "shape": asdict(shape), "head_dim": p.head_dim,
        "dtype": new.get("dtype", new.get("torch_dtype")), "seed": seed,
        "parameters": sum(math.prod(s) for _, s, _ in specs), "file_bytes": nbytes,
        "construction": {
            "residual": f"dimensions {p.source.hidden}..{shape.hidden - 1} are zero everywhere: embedding"
                        f"{'' if tied else ' and lm_head'} columns and o_proj/down_proj rows beyond the source width are zero",
            "query_head_of_source_head": list(p.query_head_of),
            "source_kv_head_of_kv_head": list(p.source_kv_of),
            "mlp": f"source units are units 0..{p.source.intermediate - 1}",
            "source_layer_of_layer": list(p.source_layer_of),
            "extra_layers": "after the source's last layer; o_proj and down_proj all zero",
            "extra_weights": f"q/k/v/gate/up rows of extra heads, units and layers: normal(0, {INIT_STD}) from seed {seed}; "
                             "their o_proj/down_proj columns are zero",
            "norms": f"weights x sqrt({p.source.hidden}/{shape.hidden}) = {p.norm_scale:.6f}, zero beyond the source "
                     f"width (extra layers: all {p.norm_scale:.6f}); rms_norm_eps x {p.source.hidden}/{shape.hidden}",
            "rotary": "the source's head_dim and rope settings, unchanged",
        },
    }
    (out / "inflation.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", type=Path, default=ROOT / "models/demo/target")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--hidden", type=int, required=True)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--heads", type=int, required=True)
    ap.add_argument("--kv-heads", type=int, required=True)
    ap.add_argument("--intermediate", type=int, required=True)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    shape = Shape(args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate)
    try:
        record = inflate(args.source, args.out, shape, getattr(torch, args.dtype), args.seed)
    except ShapeError as e:
        ap.error(str(e))
    print(f"{args.out}: {record['parameters'] / 1e6:.1f}M parameters, {record['file_bytes'] / 2**20:.0f} MiB "
          f"({record['dtype']})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
