"""Attention of one sequence's new tokens over its cached keys, with GQA folded in.

Grouped-query attention is computed by folding the ``rep = heads / kv_heads``
query heads that share a KV head into the query-length axis: queries become
``[kv_heads, rep * n, head_dim]`` against keys ``[kv_heads, S, head_dim]``. The
cached keys are then used as they lie (no ``repeat_interleave`` copy) and, for
Gemma 3 270M's single KV head, a decode is one ``[4, 256] x [256, S]`` product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from duetime.engine.kv_cache import KVView

__all__ = ["PREFILL_BLOCK", "MaskCache", "attend", "attend_decodes", "attend_prefill"]

# Query rows per attention call in a long prefill chunk. A chunk's queries see the
# keys up to their own position only (a sliding layer's, the last ``window`` of
# them): one call over all keys computes every masked-out score too. In blocks a
# block attends only to the keys it may see. Measured on Gemma 3 270M (q8, 2
# threads, one prompt from position 0): 1,024 / 2,048 / 4,096 tokens
# at 1,642 / 1,345 / 1,278 tok/s in blocks of 256 against 1,280 / 769 / 461 in
# one call; blocks of 128 or 384 within 5 % of 256; 512 slower by 6-15 %.
PREFILL_BLOCK = 256


class MaskCache:
    """Masks shared by the layers of one step.

    Without eviction every layer of a kind sees the same key positions, so a
    prefill chunk's mask is built once per (chunk, layer kind), not per layer.
    """

    def __init__(self, window: int) -> None:
        self.window = window
        self._masks: dict[tuple[int, int, int, int, bool], torch.Tensor] = {}
        self._bias: dict[tuple[int, int, int, int, bool], Tensor] = {}

    def mask(self, view: KVView, q_start: int, n: int, sliding: bool) -> torch.Tensor:
        """Boolean ``[n, S]`` (or ``[kv_heads, n, S]`` after eviction): True = may attend."""
        qpos = torch.arange(q_start, q_start + n)[:, None]
        if view.positions is not None:
            kpos = view.positions[:, None, :]  # [kv_heads, 1, S]
            return _visible(kpos, qpos, self.window if sliding else None)
        s = view.keys.shape[1]
        key = (q_start, n, view.first_pos, s, sliding)
        m = self._masks.get(key)
        if m is None:
            kpos = torch.arange(view.first_pos, view.first_pos + s)[None, :]
            m = self._masks[key] = _visible(kpos, qpos, self.window if sliding else None)
        return m

    def block_bias(
        self, q_start: int, n: int, k_start: int, s: int, window: int | None, dtype: torch.dtype
    ) -> Tensor:
        """Additive mask ``[n, s]`` (0 visible, -inf not) of queries at ``q_start`` over
        keys at ``k_start``: built once per step for every layer of a kind."""
        key = (q_start, n, k_start, s, window is not None)
        m = self._bias.get(key)
        if m is None:
            qpos = torch.arange(q_start, q_start + n)[:, None]
            kpos = torch.arange(k_start, k_start + s)[None, :]
            seen = _visible(kpos, qpos, window)
            m = torch.zeros(seen.shape, dtype=dtype).masked_fill_(~seen, float("-inf"))
            self._bias[key] = m
        return m


def _visible(kpos: torch.Tensor, qpos: torch.Tensor, window: int | None) -> torch.Tensor:
    m = kpos <= qpos
    if window is not None:
        m &= kpos > qpos - window
    return m


def attend(
    q: torch.Tensor,
    view: KVView,
    mask: torch.Tensor | None,
    scale: float,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Attention output ``[n, heads * head_dim]`` for queries ``q`` ``[n, heads, head_dim]``.

    ``dtype``: compute in it (queries, keys and values rounded to it going in), the
    output back in ``q``'s (:func:`attend_prefill`)."""
    n, heads, hd = q.shape
    kvh = view.keys.shape[0]
    rep = heads // kvh
    # [n, kvh, rep, hd] -> [kvh, rep*n, hd]: row r*n + i is query i of head (g, r)
    qf = q.view(n, kvh, rep, hd).permute(1, 2, 0, 3).reshape(1, kvh, rep * n, hd)
    m = None
    if mask is not None:
        s = view.keys.shape[1]
        m3 = mask if mask.dim() == 3 else mask.expand(kvh, n, s)
        m = m3[:, None].expand(kvh, rep, n, s).reshape(1, kvh, rep * n, s)
    qf, k, v, _ = _in_compute_dtype(qf, view.keys[None], view.values[None], None, dtype)
    out = F.scaled_dot_product_attention(qf, k, v, attn_mask=m, scale=scale).to(q.dtype)
    return out.view(kvh, rep, n, hd).permute(2, 0, 1, 3).reshape(n, heads * hd)


def attend_prefill(
    q: Tensor,
    view: KVView,
    q_start: int,
    sliding: bool,
    masks: MaskCache,
    scale: float,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """Attention output ``[n, heads * head_dim]`` of a chunk of ``n`` > 1 queries at
    positions ``q_start ...``, each over the keys it may see (causal; a sliding layer's
    last ``masks.window``).

    A whole prompt in one chunk is one causal call, a sliding layer's too while the
    prompt fits its window: no mask is built and copied per head, the same output bit
    for bit, and a q8 prefill step of a 256-token (192-token) prompt 2.4 (10) ms
    faster, paired medians of 12 alternating steps in one process. A long chunk goes in blocks of
    :data:`PREFILL_BLOCK` queries, each over its visible keys only; a short one, or a
    sequence whose KV was evicted (per-head key positions), is one masked call.
    Queries are not folded over the KV heads here (``enable_gqa``): the mask then
    broadcasts over heads instead of being copied for each.

    ``dtype``: compute in it where it is not ``q``'s (``q8`` passes bfloat16 on a CPU
    that computes it natively, as its many-row products do): torch's flash attention
    for a 320-token causal prompt, one layer of Gemma 3 270M, took 0.6 ms in bf16
    (casts included) against 1.9-4.1 ms in fp32 on the 2-core Xeon.
    """
    n = q.shape[0]
    window = masks.window if sliding else None
    first = view.first_pos
    keys, values = view.keys, view.values
    whole = view.positions is None and q_start == first and n == keys.shape[1]
    if whole and (window is None or n <= window):  # the window cuts no key: plain causal
        return _sdpa_heads(q, keys, values, None, scale, causal=True, dtype=dtype)
    if view.positions is not None or n <= PREFILL_BLOCK:
        return attend(q, view, masks.mask(view, q_start, n, sliding), scale, dtype)
    outs = []
    for a in range(0, n, PREFILL_BLOCK):
        b = min(a + PREFILL_BLOCK, n)
        lo = first if window is None else max(first, q_start + a - window + 1)
        hi = q_start + b  # the block's last query sees no key past its own
        bias = masks.block_bias(q_start + a, b - a, lo, hi - lo, window, q.dtype)
        k, v = keys[:, lo - first : hi - first], values[:, lo - first : hi - first]
        outs.append(_sdpa_heads(q[a:b], k, v, bias, scale, dtype=dtype))
    return torch.cat(outs)


def _in_compute_dtype(
    q: Tensor, keys: Tensor, values: Tensor, bias: Tensor | None, dtype: torch.dtype | None
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Queries, keys, values and bias in ``dtype`` (default: the queries'); a bf16 cache
    under fp32 queries has its keys and values widened. Nothing is copied when all agree."""
    want = dtype or q.dtype
    if want == q.dtype and want == keys.dtype:
        return q, keys, values, bias
    bias = bias.to(want) if bias is not None else None
    return q.to(want), keys.to(want), values.to(want), bias


def _sdpa_heads(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    bias: Tensor | None,
    scale: float,
    causal: bool = False,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """SDPA of ``q`` ``[n, heads, hd]`` over ``[kv_heads, S, hd]`` keys: ``[n, heads * hd]``,
    computed in ``dtype`` where given."""
    n, heads, hd = q.shape
    qh, keys, values, bias = _in_compute_dtype(q.permute(1, 0, 2)[None], keys, values, bias, dtype)
    out = F.scaled_dot_product_attention(
        qh, keys[None], values[None], attn_mask=bias, is_causal=causal, scale=scale,
        enable_gqa=True,
    )  # fmt: skip
    return out[0].to(q.dtype).permute(1, 0, 2).reshape(n, heads * hd)


def attend_decodes(q: torch.Tensor, views: list[KVView], scale: float) -> torch.Tensor:
    """One SDPA for single-token decodes of several sequences: ``[B, heads * head_dim]``.

    ``q`` is ``[B, heads, head_dim]``; ``views[i]`` are sequence i's unmasked keys
    (``needs_mask`` False). Keys are copied into one zero-padded ``[B, kv_heads,
    S_max, head_dim]`` tensor and the padding masked out: one kernel call instead
    of one per sequence (a per-sequence call costs ~20-170 µs here, the copy a
    few µs). Masked keys get exactly zero weight, so results equal :func:`attend`'s
    up to fp32 summation order. The padding is done by ``pad_sequence`` (one
    C++ call for keys, one for values) rather than 2·B slice copies from Python:
    ~170 µs less per layer at 16 sequences, ~3 ms per decode step.

    In fp32, when it builds, the model calls
    :func:`~duetime.engine.attention_kernel.decode_attention` instead, which does
    the same without any copy (it reads each sequence's KV where it lies).
    """
    b, heads, hd = q.shape
    kvh = views[0].keys.shape[0]
    rep = heads // kvh
    lengths = [v.keys.shape[1] for v in views]
    s_max = max(lengths)
    # [S, kv_heads, hd] per sequence -> [B, S_max, kv_heads, hd] -> [B, kv_heads, S_max, hd]
    keys = pad_sequence([v.keys.transpose(0, 1) for v in views], batch_first=True)
    values = pad_sequence([v.values.transpose(0, 1) for v in views], batch_first=True)
    mask = None
    if min(lengths) < s_max:
        mask = (torch.arange(s_max)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]
    qf = q.view(b, kvh, rep, hd)
    keys, values = keys.to(q.dtype), values.to(q.dtype)  # a bf16 cache: no-op in fp32
    out = F.scaled_dot_product_attention(
        qf, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=scale
    )
    return out.reshape(b, heads * hd)
