"""KV eviction methods the executor applies when a policy asks for ratio α.

StreamingLLM (Xiao et al.): keep the first ``sinks`` positions (attention
sinks) and the most recent ones, drop the middle. The kept *positions* are
chosen on a global (full-attention) layer and then applied to every layer, so
sliding-window layers, which only hold recent entries, lose exactly the
entries whose positions were dropped. After eviction every global layer holds
``kept`` entries, which is what the executor's token accounting expects.

SnapKV (observation-window attention scores, per head) is not implemented
yet; :meth:`KVCache.retain` already takes per-head indices for it.
"""

from __future__ import annotations

import torch

from duetime.engine.kv_cache import KVCache

DEFAULT_SINKS = 4


def streaming_llm_evict(kv: KVCache, slot: int, n_drop: int, sinks: int = DEFAULT_SINKS) -> None:
    """Drop ``n_drop`` middle positions of a sequence, keeping sinks and the recent tail."""
    if n_drop <= 0:
        return
    cfg = kv.config
    glob = next(i for i, sliding in enumerate(cfg.sliding_layers) if not sliding)
    gpos = kv.positions(slot, glob)[0]  # StreamingLLM keeps the same positions for every head
    length = gpos.shape[0]
    keep_total = length - n_drop
    if keep_total < 1:
        raise ValueError(f"cannot drop {n_drop} of {length} KV tokens: at least one must stay")
    s = min(sinks, keep_total)
    recent = keep_total - s
    kept = torch.cat([gpos[:s], gpos[length - recent :]]) if recent else gpos[:s]
    for layer in range(cfg.num_layers):
        pos = kv.positions(slot, layer)
        mask = torch.isin(pos[0], kept)
        idx = mask.nonzero().flatten()
        if idx.numel() == pos.shape[1]:
            continue  # nothing of this layer was dropped (a sliding layer's recent window)
        kv.retain(slot, layer, idx.expand(cfg.num_kv_heads, -1))
