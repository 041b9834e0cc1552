"""One layer's attention in a step of the general (Python) path: store each chunk's new
keys and values, attend, and put the rows back in chunk order.

Single-token decodes without a mask share one batched call (the C++ decode kernel, or
SDPA); prefill chunks (and evicted sequences) go one by one with their mask. In a step
that mixes a prompt chunk with plain decodes, the plain decodes come already stored
and attended (``plain``, ``plain_out``: one C++ call a layer,
:meth:`~duetime.engine.decode_loop.DecodeLoop.store_attend`): per sequence and layer,
``KVCache.store`` and ``view`` cost ~15 µs of Python, 17 ms a step at 64 decoders.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from duetime.engine.attention import MaskCache, attend, attend_decodes, attend_prefill
from duetime.engine.attention_kernel import decode_attention
from duetime.engine.batch import StepBatch
from duetime.engine.decode_loop import PlainDecodes
from duetime.engine.kv_cache import KVCache, KVView

if TYPE_CHECKING:
    from duetime.engine.gemma3 import Gemma3

__all__ = ["attend_layer"]


def attend_layer(
    model: Gemma3,
    batch: StepBatch,
    kv: KVCache,
    layer: int,
    q: torch.Tensor,
    new_kv: torch.Tensor,
    masks: MaskCache,
    sliding: bool,
    plain: PlainDecodes | None = None,
    plain_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Store this layer's new keys/values and attend: ``[T, heads * head_dim]``."""
    outs: list[tuple[int, int, torch.Tensor]] = []  # (first row, end row, output)
    decode_rows: list[int] = []
    decode_views: list[KVView] = []
    skip = plain.chunks if plain is not None else frozenset()
    offsets = batch.offsets
    for k, (c, a, b) in enumerate(zip(batch.chunks, offsets, offsets[1:], strict=False)):
        if k in skip:
            continue
        if c.shared:  # the leader's rows first, then its own
            lead = offsets[c.leader]
            kv.store(c.slot, layer, torch.cat((new_kv[lead : lead + c.shared], new_kv[a:b])))
        else:
            kv.store(c.slot, layer, new_kv[a:b])
        view = kv.view(c.slot, layer, b - a)
        if b - a == 1 and not view.needs_mask:
            decode_rows.append(a)
            decode_views.append(view)
            continue
        q_start = c.start_pos + c.shared
        # a prompt chunk attends in the model's prefill dtype; one token (an evicted
        # sequence's decode) as every decode does
        dtype = model.prefill_attention_dtype if b - a > 1 else None
        if view.needs_mask and model.blocked_prefill_attention:
            out = attend_prefill(q[a:b], view, q_start, sliding, masks, model.scale, dtype)
        else:
            mask = masks.mask(view, q_start, b - a, sliding) if view.needs_mask else None
            out = attend(q[a:b], view, mask, model.scale, dtype)
        outs.append((a, b, out))
    # the decode kernel serves even one decode; SDPA's batched call pays from two on
    few = len(decode_views) < (1 if model.decode_kernel else 2)
    if decode_views and (few or not model.batched_decode_attention):
        for a, view in zip(decode_rows, decode_views, strict=True):
            outs.append((a, a + 1, attend(q[a : a + 1], view, None, model.scale)))
        decode_rows, decode_views = [], []
    dec = None
    if decode_views:
        if model.decode_kernel:
            keys, values = [v.keys for v in decode_views], [v.values for v in decode_views]
            dec = decode_attention(q[decode_rows], keys, values, model.scale)
        else:
            dec = attend_decodes(q[decode_rows], decode_views, model.scale)
        if not outs and plain_out is None:
            return dec  # a pure decode step: rows are already in chunk order
    if dec is None and plain_out is None and len(outs) == 1:
        return outs[0][2]
    width = q.shape[1] * q.shape[2]
    out = torch.empty((q.shape[0], width), dtype=q.dtype)
    if dec is not None:
        out[decode_rows] = dec.to(q.dtype)
    if plain is not None and plain_out is not None:
        out[plain.rows] = plain_out.to(q.dtype)
    for a, b, o in outs:
        out[a:b] = o
    return out
