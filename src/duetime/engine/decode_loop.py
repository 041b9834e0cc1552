"""A pure decode step's layers in one C++ call: the same ops, without Python between them.

Why: after the int8/int4 products, the fused norms and the decode attention
kernel, a batch-1 ``q8`` step of Gemma 3 270M spent ~4.6 ms in its 18 layers,
of which ~3.0 ms in the ops themselves; the rest was Python between them
(slicing, ``KVCache.store`` and ``view``, method calls, casts: ~40 dispatches a
layer). This op runs the layer loop in C++ and calls the very same ops through
torch's dispatcher (``duetime_q8::linear``, ``duetime_norm::*``,
``duetime_attn::decode``, ``at::gelu``), so its arithmetic is the Python
path's, bit for bit; it only stores each new key and value row with a
``memcpy`` into the cache buffer the Python side made room in.

It serves steps of plain single-token decodes (no shared rows, no SnapKV
window, no evicted sequence) on an fp32 ``q8`` model whose fused norms and
decode kernel are built. Up to ``Q8Linear.max_rows`` rows its products are the
int8 kernel's; beyond, where the layers' many-row products are packed bf16
(:class:`~duetime.engine.linear.Bf16Linear`), the loop calls oneDNN's packed
linear on them, the op :class:`~duetime.engine.linear.Bf16Linear` calls; elsewhere
it serves at most ``Q8Linear.max_rows`` rows. At 64 decoders the Python path paid
~28 ms a step of per-sequence slicing and KV copies (4,700 ``slice`` calls) that the
loop's ``memcpy`` does not
(:meth:`~duetime.engine.gemma3.Gemma3.hidden_states` checks;
``Gemma3.decode_loop = False`` or ``DUETIME_LOOP=0`` turn it off).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from duetime.engine.batch import StepBatch
from duetime.engine.config import Gemma3Config
from duetime.engine.cpp_ext import CppOps
from duetime.engine.kv_cache import KVCache
from duetime.engine.linear import Q8Linear

__all__ = ["MANY_ROWS", "DecodeLoop", "PlainDecodes", "decode_loop_ops"]

#: The loop's row limit where it serves steps of any size (a bound no decode batch meets).
MANY_ROWS = 1 << 20

log = logging.getLogger(__name__)


_EXT = CppOps(
    "duetime_loop", "decode_loop.cpp", what="decode layer loop", env="DUETIME_LOOP", logger=log
)


def decode_loop_ops() -> Any | None:
    """The compiled op (``.decode_layers``), or ``None`` once a build has failed or
    ``DUETIME_LOOP=0`` (logged once)."""
    return _EXT.ops()


@dataclass(frozen=True)
class PlainDecodes:
    """The plain single-token decodes of a step the loop does not run (one with a prompt
    chunk): their chunks' indices, token rows and slots, and the room made for them in
    every layer (:meth:`~duetime.engine.kv_store.KVStore.decode_room`: per layer, then
    per slot)."""

    chunks: frozenset[int]
    rows: list[int]
    slots: list[int]
    bufs: list[torch.Tensor]
    ends: list[int]
    firsts: list[int]

    def layer(self, i: int) -> tuple[list[torch.Tensor], list[int], list[int]]:
        """Layer ``i``'s buffers, new entries and first visible entries, one a slot."""
        n = len(self.slots)
        return (
            self.bufs[i * n : (i + 1) * n],
            self.ends[i * n : (i + 1) * n],
            (self.firsts[i * n : (i + 1) * n]),
        )


class DecodeLoop:
    """What the C++ layer loop needs of one model (its int8 weights, norms and layer
    kinds, gathered once), and the call for one step."""

    def __init__(
        self,
        ops: Any,
        config: Gemma3Config,
        products: Sequence[Q8Linear],
        norms: list[torch.Tensor],
        scale: float,
    ) -> None:
        self.ops = ops
        self.config = config
        self.weights = [t for p in products for t in (p.q.packed, p.q.scale)]
        self.outs = [p.q.out_features for p in products]
        self.norms = norms
        self.sliding = [int(b) for b in config.sliding_layers]
        self.scale = scale
        # the most rows a step may have for every layer product to take the int8 kernel
        self.few_rows = min(p.max_rows for p in products)
        # beyond them, each product's packed bf16 weight, where every one has it
        packed = [getattr(p.fallback, "packed", None) for p in products]
        self.many = [t for t in packed if t is not None]
        if len(self.many) != len(products):
            self.many = []
        # the most rows the loop serves: any, where the packed bf16 weights are there
        self.max_rows = MANY_ROWS if self.many else self.few_rows

    @classmethod
    def of(
        cls, layers: Sequence[Any], config: Gemma3Config, dtype: torch.dtype, scale: float
    ) -> DecodeLoop | None:
        """The loop for a model's ``layers``, or None where it cannot serve them: only
        fp32 layers whose four products are all :class:`Q8Linear`, and the loop built."""
        products = [p for ly in layers for p in (ly.qkv, ly.o, ly.gate_up, ly.down)]
        q8 = [p for p in products if isinstance(p, Q8Linear)]
        if dtype != torch.float32 or not products or len(q8) != len(products):
            return None
        ops = decode_loop_ops()
        if ops is None:
            return None
        kinds = ("in_norm", "qk_norm", "post_attn", "pre_ffw", "post_ffw")
        norms = [getattr(ly, k) for ly in layers for k in kinds]
        return cls(ops, config, q8, norms, scale)

    def run(
        self,
        batch: StepBatch,
        kv: KVCache,
        x: torch.Tensor,
        rope_local: tuple[torch.Tensor, ...],
        rope_global: tuple[torch.Tensor, ...],
    ) -> torch.Tensor | None:
        """The residual stream after the last layer for a step of plain single-token
        decodes (``x``: the embedded tokens; the ropes' cos and sin), its keys and
        values stored in ``kv``; None, with nothing done, where the step is not one."""
        chunks = batch.chunks
        t = len(chunks)
        if batch.offsets[-1] != t or t > self.max_rows or any(c.shared for c in chunks):
            return None
        slots = [c.slot for c in chunks]
        room = kv.decode_room(slots)
        if room is None:
            return None
        bufs, ends, firsts = room
        cfg = self.config
        d = cfg.head_dim
        out = self.ops.decode_layers(
            x.contiguous(),
            self.weights,
            self.outs,
            self.many,
            self.few_rows,
            self.norms,
            self.sliding,
            rope_local[0].reshape(t, d),
            rope_local[1].reshape(t, d),
            rope_global[0].reshape(t, d),
            rope_global[1].reshape(t, d),
            bufs,
            ends,
            firsts,
            cfg.num_heads,
            cfg.num_kv_heads,
            d,
            cfg.rms_norm_eps,
            self.scale,
        )
        kv.decoded(slots)
        return out

    def plain_decodes(self, batch: StepBatch, kv: KVCache) -> PlainDecodes | None:
        """Room in every layer for the step's plain single-token decodes (no shared rows,
        consecutive positions, no SnapKV window), or None where it has none. The caller
        stores and attends them a layer at a time (:meth:`store_attend`) and completes
        them with ``kv.decoded(slots)`` instead of ``advance``."""
        offsets = batch.offsets
        picked = [
            (k, offsets[k], c.slot)
            for k, c in enumerate(batch.chunks)
            if len(c) == 1 and not c.shared and kv.plain(c.slot)
        ]
        if not picked:
            return None
        slots = [s for _, _, s in picked]
        room = kv.decode_room(slots)
        assert room is not None, "decode_room refused plain sequences"
        return PlainDecodes(
            frozenset(k for k, _, _ in picked), [a for _, a, _ in picked], slots, *room
        )

    def store_attend(
        self, qk: torch.Tensor, qkv: torch.Tensor, plain: PlainDecodes, layer: int
    ) -> torch.Tensor:
        """Layer ``layer``'s keys and values of ``plain``'s rows stored, their queries
        attended: ``[len(plain.rows), heads * head_dim]`` (the op the loop runs a layer)."""
        cfg = self.config
        bufs, ends, firsts = plain.layer(layer)
        return self.ops.store_attend(
            qk, qkv, plain.rows, bufs, ends, firsts,
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.scale,
        )  # fmt: skip
