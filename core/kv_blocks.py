"""One block of a session's KV cache as bytes: a fixed, versioned header, then the raw tensor.

A block holds the keys and values of B consecutive positions of every layer, as the lean Llama
forward stores them ([layers, 2, kv_heads, B, head_dim], little-endian). It is only valid for the
model that computed it and for the exact tokens before and in it (attention reads the whole
prefix), so the header names both: a fingerprint of the model and a hash of the token ids
[0, end). A reader checks everything before using a byte: a corrupt, truncated, foreign-model,
wrong-version or other-prefix block is an error (the caller recomputes), never a cache.
Never pickle: the layout is struct-packed fields and the tensor's own bytes.

Header, little-endian (80 bytes):
  magic  4s  b"SDKV"         version u16   dtype u8 (1: float32, 2: bfloat16)   pad u8
  layers u16  kv_heads u16  head_dim u16   block_tokens u32   start u32
  model_fingerprint 16s      prefix_hash 16s (sha256[:16] of the int32 token ids [0, start+B))
  payload_sha256 16s (of the tensor bytes)  payload_bytes u32
"""
from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

MAGIC = b"SDKV"
VERSION = 1
_HEADER = struct.Struct("<4sHBB HHH II 16s16s16s I")
HEADER_BYTES = _HEADER.size
_DTYPES = {torch.float32: 1, torch.bfloat16: 2}
_BY_CODE = {v: k for k, v in _DTYPES.items()}


class CorruptBlock(ValueError):
    """The bytes are not a usable block for this model and these tokens; recompute instead."""


@dataclass(frozen=True)
class BlockLayout:
    """What every block of one model looks like; a block of another layout is foreign."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_tokens: int
    model_fingerprint: bytes  # 16 bytes

    @property
    def payload_bytes(self) -> int:
        return self.layers * 2 * self.kv_heads * self.block_tokens * self.head_dim * torch.finfo(self.dtype).bits // 8


def model_fingerprint(model: torch.nn.Module, dtype: torch.dtype, numerics: str = "fast") -> bytes:
    """Names a model's weights and numerics: its config, the precision the cache is kept in, the
    forward's numerics mode (exact keys and values differ from fast ones in the last bits), and a
    sample of its first weights (two checkpoints of one architecture differ there)."""
    h = hashlib.sha256(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode())
    h.update(str(dtype).encode())
    if numerics != "fast":  # fast mode's fingerprint stays what blocks already stored carry
        h.update(numerics.encode())
    first = next(model.parameters()).detach().flatten()[:4096].float().cpu().contiguous()  # (a model on a GPU too)
    h.update(first.numpy().tobytes())
    return h.digest()[:16]


def prefix_hash(token_ids: Sequence[int]) -> bytes:
    return hashlib.sha256(np.asarray(token_ids, dtype="<i4").tobytes()).digest()[:16]


def encode_block(layout: BlockLayout, start: int, token_ids: Sequence[int], kv: torch.Tensor) -> bytes:
    """``kv``: [layers, 2, kv_heads, block_tokens, head_dim] for positions [start, start + B);
    ``token_ids``: the sequence's ids at least up to start + B."""
    b = layout.block_tokens
    expected = (layout.layers, 2, layout.kv_heads, b, layout.head_dim)
    if tuple(kv.shape) != expected or kv.dtype != layout.dtype:
        raise ValueError(f"a block is {expected} {layout.dtype}, got {tuple(kv.shape)} {kv.dtype}")
    if start % b or len(token_ids) < start + b:
        raise ValueError(f"block at {start} of {b} tokens needs aligned start and {start + b} token ids")
    payload = kv.contiguous().view(torch.uint8).numpy().tobytes()
    header = _HEADER.pack(MAGIC, VERSION, _DTYPES[layout.dtype], 0, layout.layers, layout.kv_heads, layout.head_dim,
                          b, start, layout.model_fingerprint, prefix_hash(token_ids[: start + b]),
                          hashlib.sha256(payload).digest()[:16], len(payload))
    return header + payload


def decode_block(data: bytes, layout: BlockLayout, start: int, token_ids: Sequence[int]) -> torch.Tensor:
    """The block's tensor, [layers, 2, kv_heads, B, head_dim], if it is exactly the one these
    tokens need from this model at ``start``; CorruptBlock saying what is wrong otherwise."""
    if len(data) < HEADER_BYTES:
        raise CorruptBlock(f"{len(data)} bytes is shorter than a header")
    (magic, version, dtype_code, _, layers, kv_heads, head_dim, b, block_start, fingerprint, prefix, digest,
     size) = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CorruptBlock("not a specdec KV block")
    if version != VERSION:
        raise CorruptBlock(f"format version {version}, expected {VERSION}")
    if fingerprint != layout.model_fingerprint:
        raise CorruptBlock("computed by another model (or precision)")
    if (layers, kv_heads, head_dim, b, _BY_CODE.get(dtype_code)) != (layout.layers, layout.kv_heads, layout.head_dim,
                                                                      layout.block_tokens, layout.dtype):
        raise CorruptBlock("another cache layout")
    if block_start != start:
        raise CorruptBlock(f"block of position {block_start}, expected {start}")
    if len(token_ids) < start + b or prefix != prefix_hash(token_ids[: start + b]):
        raise CorruptBlock("computed for other tokens")
    payload = data[HEADER_BYTES:]
    if size != layout.payload_bytes or len(payload) != size:
        raise CorruptBlock(f"payload of {len(payload)} bytes, expected {layout.payload_bytes}")
    if hashlib.sha256(payload).digest()[:16] != digest:
        raise CorruptBlock("checksum mismatch")
    flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return flat.view(layout.dtype).view(layout.layers, 2, layout.kv_heads, b, layout.head_dim)


class HostCopy:
    """A tensor's copy into host memory, started without waiting and read later.

    On a CUDA device the copy goes into a pinned buffer with ``non_blocking`` on the current stream,
    after the forward that computed it, and an event marks its end: the model's thread queues it and
    goes on, and whoever reads it (the KV store's writer) waits for the event. Stream order keeps it
    right: later forwards that reuse the pages run after the copy. A host tensor is copied at once
    (a slot may be reused after its session closes, before the writer reads)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._event = None
        if tensor.device.type == "cuda":
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tensor.to("cpu", copy=True)

    def tensor(self) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host


@dataclass(frozen=True)
class PendingBlock:
    """A block whose bytes are made when written (`encode`), off the model's thread."""

    layout: BlockLayout
    start: int
    token_ids: tuple[int, ...]  # the sequence's ids up to start + block_tokens
    kv: HostCopy  # [layers, 2, kv_heads, n, head_dim] holding the block at ``offset``
    offset: int

    def encode(self) -> bytes:
        b = self.layout.block_tokens
        return encode_block(self.layout, self.start, self.token_ids, self.kv.tensor()[:, :, :, self.offset:self.offset + b])
