"""KV eviction methods the executor applies when a policy asks for ratio α.

Both drop exactly ``n_drop`` of the ``old = KVCache.num_tokens(slot)`` tokens a
sequence counts: every global (full-attention) layer keeps ``old - n_drop``
entries per KV head and no sliding-window layer keeps more, so the executor's
token accounting (``old - n_drop``) and the cache agree exactly afterwards.

StreamingLLM (Xiao et al. 2023): keep the first ``sinks`` positions (attention
sinks) and the most recent ones, drop the middle. Each layer and KV head keeps
its own oldest ``sinks`` and newest ``old - n_drop - sinks`` entries, counted on
the ``old`` entries a global layer holds; a sliding-window layer holds only the
newest of those, so it keeps the sinks only while it still has them. Until a
SnapKV eviction every head of every layer holds the same positions, so these
are the same positions everywhere. After one, heads and layers hold different
positions, and every global layer still keeps exactly ``old - n_drop``
(positions chosen on one head of one global layer are not all in the others).

SnapKV (Li et al. 2024, the method TimeBill evicts with): per layer and per KV
head, score each entry by the attention the last ``window`` prompt queries (the
observation window) pay to it,

    s[h, j] = Σ_{query heads r of group h} Σ_{i in window} softmax_j(q_{r,i}·k_{h,j} / √d),

smooth the scores of the prefix (entries before the window) with a 1-D pooling
of width ``kernel`` (avg or max, stride 1, zero padding, as SnapKV's code), and
keep the top-scored prefix entries plus the whole window. Heads keep different
positions (:meth:`KVCache.retain` takes one index row per KV head). The
window's queries come from :class:`~duetime.engine.obs_window.ObsWindow`, which
the model fills during prefill when the sequence is watched.

Sliding-window layers under SnapKV: a sliding layer's candidates are the
entries :meth:`KVCache.num_tokens` counts for it (its newest ``window - 1``;
older ones are already dead and are dropped). If at most ``old - n_drop``
remain, all are kept; otherwise that layer runs SnapKV on its own scores
(computed with its sliding mask) down to ``old - n_drop``. So no layer keeps
more than a global one and the count is exact. When fewer than the window's
length may stay, the most recent ``old - n_drop`` entries are kept.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F  # noqa: N812

from duetime.engine.kv_cache import KVCache

__all__ = [
    "DEFAULT_KERNEL",
    "DEFAULT_SINKS",
    "DEFAULT_WINDOW",
    "EVICTION_METHODS",
    "snapkv_evict",
    "snapkv_scores",
    "streaming_llm_evict",
]

DEFAULT_SINKS = 4
DEFAULT_WINDOW = 32
DEFAULT_KERNEL = 7
EVICTION_METHODS: tuple[str, ...] = ("snapkv", "streaming")
Pooling = Literal["avg", "max"]


def streaming_llm_evict(kv: KVCache, slot: int, n_drop: int, sinks: int = DEFAULT_SINKS) -> None:
    """Drop ``n_drop`` middle positions of a sequence, keeping sinks and the recent tail."""
    if n_drop <= 0:
        return
    cfg = kv.config
    old = kv.num_tokens(slot)
    keep_total = old - n_drop
    if keep_total < 1:
        raise ValueError(f"cannot drop {n_drop} of {old} KV tokens: at least one must stay")
    s = min(sinks, keep_total)
    recent = keep_total - s
    for layer in range(cfg.num_layers):
        length = kv.positions(slot, layer).shape[1]
        # A layer's entries are the newest ``length`` of the ``old`` a global layer holds
        # (heads alike), so the sinks it still holds are its first ``s - (old - length)``.
        held_sinks = max(0, s - max(0, old - length))
        idx = torch.arange(length)
        keep = idx[(idx < held_sinks) | (idx >= length - recent)]
        if keep.numel() == length:
            continue  # nothing of this layer was dropped (a sliding layer's recent window)
        kv.retain(slot, layer, keep.expand(cfg.num_kv_heads, -1))


def snapkv_scores(kv: KVCache, slot: int, layer: int, window: int = DEFAULT_WINDOW) -> torch.Tensor:
    """Raw SnapKV scores of one layer's entries, ``[kv_heads, length]`` fp32.

    Attention weights of the newest ``window`` captured queries (softmax over
    every key the query may see: causal, and within the sliding window on a
    sliding layer), summed over those queries and over the query heads of each
    KV head's group. One ``[rep·w, d] × [d, L]`` matmul per KV head.
    """
    win = kv.obs_window(slot)
    if win is None:
        raise ValueError(f"slot {slot} has no observation window: watch it before prefill")
    cfg = kv.config
    q = win.queries(layer, window).float()  # [w, heads, d]
    qpos = win.positions(window)  # [w]
    keys = kv.keys(slot, layer).float()  # [kvh, L, d]
    kpos = kv.positions(slot, layer)  # [kvh, L]
    w, heads, d = q.shape
    kvh = keys.shape[0]
    rep = heads // kvh
    qf = q.view(w, kvh, rep, d).permute(1, 2, 0, 3).reshape(kvh, rep * w, d)
    logits = torch.bmm(qf, keys.transpose(1, 2)) * cfg.query_pre_attn_scalar**-0.5
    visible = kpos[:, None, :] <= qpos[None, :, None]  # [kvh, w, L]
    if cfg.sliding_layers[layer]:
        visible &= kpos[:, None, :] > qpos[None, :, None] - cfg.sliding_window
    vis = visible[:, None].expand(kvh, rep, w, keys.shape[1]).reshape(kvh, rep * w, -1)
    weights = torch.softmax(logits.masked_fill(~vis, float("-inf")), dim=-1)
    return weights.nan_to_num_(0.0).sum(dim=1)  # a query that sees no key adds nothing


def snapkv_evict(
    kv: KVCache,
    slot: int,
    n_drop: int,
    window: int = DEFAULT_WINDOW,
    kernel: int = DEFAULT_KERNEL,
    pooling: Pooling = "avg",
) -> None:
    """Drop ``n_drop`` of the sequence's KV tokens by SnapKV (see the module docstring).

    Needs the sequence's observation window (:meth:`KVCache.watch` before its
    prefill); uses its newest ``window`` queries (fewer if fewer were seen).
    """
    if window < 1:
        raise ValueError(f"SnapKV window must be >= 1, got {window}")
    if kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"SnapKV pooling kernel must be a positive odd number, got {kernel}")
    if pooling not in ("avg", "max"):
        raise ValueError(f"SnapKV pooling must be 'avg' or 'max', not {pooling!r}")
    if n_drop < 0:
        raise ValueError(f"cannot drop a negative number of KV tokens ({n_drop})")
    win = kv.obs_window(slot)
    if win is None:
        raise ValueError(f"slot {slot} has no observation window: watch it before prefill")
    if win.end_pos != kv.seq_len(slot):
        raise ValueError(f"slot {slot}: observation window is behind the cache")
    if n_drop == 0:
        return
    old = kv.num_tokens(slot)
    keep = old - n_drop
    if keep < 1:
        raise ValueError(f"cannot drop {n_drop} of {old} KV tokens: at least one must stay")
    cfg = kv.config
    obs_start = int(win.positions(window)[0]) if win.filled else win.end_pos
    for layer in range(cfg.num_layers):
        length = kv.positions(slot, layer).shape[1]
        first = max(0, length - (cfg.sliding_window - 1)) if cfg.sliding_layers[layer] else 0
        if length - first <= keep:
            if first:  # keep every live entry, drop the dead ones
                kv.retain(slot, layer, torch.arange(first, length).expand(cfg.num_kv_heads, -1))
            continue
        scores = snapkv_scores(kv, slot, layer, window)[:, first:]
        kpos = kv.positions(slot, layer)[:, first:]
        idx = _top_entries(scores, kpos, obs_start, keep, kernel, pooling) + first
        kv.retain(slot, layer, idx)


def _top_entries(
    scores: torch.Tensor,
    kpos: torch.Tensor,
    obs_start: int,
    keep: int,
    kernel: int,
    pooling: Pooling,
) -> torch.Tensor:
    """Sorted ``[kv_heads, keep]`` indices: the window's entries first (newest first if
    they alone exceed ``keep``), then the prefix entries with the highest pooled score."""
    in_window = kpos >= obs_start
    prefix = scores.masked_fill(in_window, 0.0)[:, None, :]  # window scores are not pooled
    pad = kernel // 2
    if pooling == "avg":
        pooled = F.avg_pool1d(prefix, kernel, stride=1, padding=pad)[:, 0]
    else:
        pooled = F.max_pool1d(prefix, kernel, stride=1, padding=pad)[:, 0]
    # No pooled score exceeds a head's total score, so ranking the window above the
    # largest total (newest first) always keeps it.
    ceiling = float(scores.sum(dim=-1).max()) + 1.0
    prio = torch.where(in_window, ceiling + kpos.double(), pooled.double())
    return prio.topk(keep, dim=-1).indices.sort(dim=-1).values
