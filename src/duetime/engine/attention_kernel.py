"""Decode attention straight from each sequence's own KV tensors (C++, built on first use).

Why: with per-sequence KV tensors (kv_cache.py), one batched SDPA call for B
decodes needs every sequence's keys and values copied into one zero-padded
``[B, kv_heads, S_max, head_dim]`` pair first. At 16 sequences that copy and
fill were ~10 ms of an ~80 ms decode step on Gemma 3 270M (80 MB moved per
step), more than the attention itself. This op reads each sequence's keys and
values where they lie (any row stride, unit stride along ``head_dim``), once:

    p[r, j] = softmax_j(scale · q_r · k_j),   out_r = Σ_j p[r, j] · v_j

for the ``rep = heads / kv_heads`` query heads ``r`` that share a KV head,
in fp32 with the usual max-subtraction; (sequence, KV head) pairs are spread
over threads with ``at::parallel_for``. Only unmasked single-token decodes
(every stored key visible) come here; anything else keeps SDPA.

Up to four query heads of a KV head go together: each key is read
once for all of them; the weighted sum keeps their sums for 16-32 columns in
registers over a block of 128 keys, whose values stay in cache (one head at a
time, it loaded and stored the output row for every key); the softmax's
exponentials are eight at a time (a Cephes-style polynomial, relative error
~1e-7, where ``std::exp`` was one at a time). 1.4-1.6x faster for 16 sequences
of 200-600 keys in a microbenchmark; at 1,024 keys each, reading the keys and
values from memory bounds both. With fewer (sequence, KV head) pairs than
threads (batch 1 on a one-KV-head model), a pair's keys go in pieces of 256
over the threads, merged by their maxima (flash-decoding).

Keys and values may be bf16 (``q8``'s cache where the CPU computes bf16,
:attr:`~duetime.engine.gemma3.Gemma3.kv_dtype`): each row is widened to fp32 as
it is read and the arithmetic stays fp32. A large step's attention reads every
sequence's cache from DRAM, so half the bytes made it 1.6-1.9x faster (90
sequences x 320 keys, one layer).

The score pass is bound by its FMAs, the weighted sum by DRAM when it fetches
its values itself, so the score loop fetches each key's value row into L2 as
it goes, and the sum then reads them from there: 18 layers of 96 sequences x
320 bf16 keys from DRAM 24-29 ms against 33-39 ms (docs/results.md#engine-decode-vprefetch).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from duetime.engine.cpp_ext import CppOps

__all__ = ["decode_attention", "decode_attention_ops"]

log = logging.getLogger(__name__)


_EXT = CppOps(
    "duetime_attn",
    "attention_kernel.cpp",
    what="decode attention kernel",
    env="DUETIME_ATTN",
    logger=log,
)


def decode_attention_ops() -> Any | None:
    """The compiled op, or ``None`` (no compiler / no AVX2 / ``DUETIME_ATTN=0``)."""
    return _EXT.ops()


def decode_attention(
    q: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], scale: float
) -> torch.Tensor:
    """``[B, heads * head_dim]`` attention of one query per sequence over its own keys.

    ``q``: ``[B, heads, head_dim]`` fp32; ``keys[i]`` / ``values[i]``:
    ``[kv_heads, S_i, head_dim]`` views (unit stride on ``head_dim``), all fp32 or all bf16.
    The op must be built (:func:`decode_attention_ops` not ``None``).
    """
    ops = decode_attention_ops()
    if ops is None:
        raise RuntimeError("the decode attention kernel is not available (see the warning)")
    return ops.decode(q, list(keys), list(values), scale)
