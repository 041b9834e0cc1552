"""Per-sequence KV cache: one growable ``[2, kv_heads, capacity, head_dim]`` tensor per layer.

Why per-sequence tensors and not a paged pool (see docs/engine-model.md for the long
form): on a CPU there is no paged-attention kernel, so a pool would have to be
gathered into a contiguous tensor each step (a copy of every live key, ~15 ms
per step at batch 16 here), while a per-sequence tensor is already the
contiguous operand ``scaled_dot_product_attention`` wants. It also makes
per-request eviction simple: SnapKV keeps *different* positions per KV
head and StreamingLLM keeps sinks + a recent window, and both are one
``gather`` along the token axis (:meth:`KVCache.retain`). Suspend/resume is
"keep the slot"; cancel is :meth:`KVCache.free`, which drops the tensors at once.

Layout and invariants (checked by asserts):

* entries ``[0, length)`` of a layer are valid and in increasing position
  order per head; ``length <= capacity``;
* until a layer is evicted, entry ``i`` holds position ``base + i`` (``pos`` is
  None); after eviction ``pos[h, i]`` records it, per KV head;
* a sliding-window layer only needs the last ``window - 1`` entries before a
  step, so when it would grow it first drops older ones (amortised: at most one
  copy of ``window`` entries per ``capacity - window`` appended tokens);
* a *watched* sequence (:meth:`KVCache.watch`, for SnapKV) also keeps its last
  ``w`` queries per layer (:class:`~duetime.engine.obs_window.ObsWindow`), and
  its sliding layers trim to ``window - 1 + w`` entries instead of ``window - 1``
  so those queries' attention weights can be recomputed exactly at eviction;
* accounting is in tokens: :meth:`num_tokens` is the most entries any layer of
  the sequence keeps (the global layers' count, i.e. the context kept), and
  :attr:`total_tokens` sums it over live sequences. Bytes actually allocated
  (capacity, not length) are in :meth:`nbytes`.
"""

from __future__ import annotations

import torch

from duetime.engine.kv_store import _MIN_CAPACITY, KVStore, KVView
from duetime.engine.obs_window import ObsWindow

__all__ = ["KVCache", "KVView"]


class KVCache(KVStore):
    """KV storage for many sequences (:class:`~duetime.engine.kv_store.KVStore`), plus
    a sequence's KV taken out as plain tensors and put back (:meth:`export`,
    :meth:`restore`), and prefix-cache blocks read and loaded (:meth:`read_positions`,
    :meth:`load_prefix`)."""

    def export(self, slot: int) -> dict[str, object]:
        """Take a sequence's KV out of the cache as plain tensors (for offloading).

        The slot is freed; :meth:`restore` puts the state back, bit for bit,
        under a new slot. The dict holds only tensors and ints, so ``torch.save``
        can spool it to disk.
        """
        seq = self._seqs[slot]
        state: dict[str, object] = {
            "next_pos": seq.next_pos,
            "layers": [
                {
                    "kv": layer.buf[:, :, : layer.length].clone(),
                    "base": layer.base,
                    "pos": None if layer.pos is None else layer.pos[:, : layer.length].clone(),
                }
                for layer in seq.layers
            ],
        }
        obs = self._watched.get(slot)
        if obs is not None:
            state["obs"] = obs.state()
        self.free(slot)
        return state

    def restore(self, state: dict[str, object]) -> int:
        """Re-open a sequence from :meth:`export`'s state; returns its new slot."""
        slot = self.allocate()
        seq = self._seqs[slot]
        layers = state["layers"]
        assert isinstance(layers, list), "not a KV state"
        assert len(layers) == len(seq.layers), "KV state of another model"
        for layer, saved in zip(seq.layers, layers, strict=True):
            kv = saved["kv"]
            n = kv.shape[2]
            self._resize(layer, max(n + 16, _MIN_CAPACITY))
            layer.buf[:, :, :n] = kv.to(self.dtype)
            layer.length = n
            layer.base = int(saved["base"])
            if saved["pos"] is not None:
                pos = torch.zeros((self.config.num_kv_heads, layer.capacity), dtype=torch.int64)
                pos[:, :n] = saved["pos"]
                layer.pos = pos
        next_pos = state["next_pos"]
        assert isinstance(next_pos, int)
        seq.next_pos = next_pos
        obs = state.get("obs")
        if obs is not None:
            assert isinstance(obs, dict), "not an observation-window state"
            self._watched[slot] = ObsWindow.from_state(obs, self.query_dtype)
        return slot

    # ------------------------------------------------------------------ prefix cache
    def read_positions(self, slot: int, start: int, end: int) -> torch.Tensor:
        """A copy of positions ``[start, end)`` of every layer, ``[layers, 2, kv_heads,
        end - start, head_dim]``: a block for the prefix cache. Every layer must still
        hold them in order (computed by a prefill chunk or a decode step, before any
        eviction)."""
        layers = self._seqs[slot].layers
        c = self.config
        out = torch.empty(
            (len(layers), 2, c.num_kv_heads, end - start, c.head_dim), dtype=self.dtype
        )
        for i, layer in enumerate(layers):
            lo = start - layer.base
            assert layer.pos is None, "positions of an evicted layer"
            assert lo >= 0, "positions no longer held (trimmed)"
            assert end - layer.base <= layer.length, "positions not computed yet"
            out[i] = layer.buf[:, :, lo : end - layer.base]
        return out

    def load_prefix(self, slot: int, blocks: list[torch.Tensor]) -> int:
        """Fill an empty sequence with the positions ``blocks`` (from
        :meth:`read_positions`, consecutive from position 0) hold; returns their count.
        A sliding layer takes only the blocks its window still sees."""
        seq = self._seqs[slot]
        assert seq.next_pos == 0, "a prefix goes into an empty sequence"
        if not blocks:
            return 0
        size = blocks[0].shape[3]
        n = size * len(blocks)
        for i, layer in enumerate(seq.layers):
            first = 0
            if self.config.sliding_layers[i]:
                first = max(0, n - self._window_keep) // size
            length = n - first * size
            if length > layer.capacity:
                self._resize(layer, length)
            for j, block in enumerate(blocks[first:]):
                layer.buf[:, :, j * size : (j + 1) * size] = block[i]
            layer.base, layer.length = first * size, length
        seq.next_pos = n
        return n
