"""Per-sequence KV storage: slots, growth, sliding-window trimming, accounting.

The layout and its invariants are described in :mod:`duetime.engine.kv_cache`,
whose :class:`~duetime.engine.kv_cache.KVCache` adds moving a sequence's KV out
and back in (offload, prefix-cache blocks) on top of this store.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from duetime.engine.config import Gemma3Config
from duetime.engine.obs_window import ObsWindow

__all__ = ["KVStore", "KVView"]

_MIN_CAPACITY = 32
#: Free entries a sliding layer must have after it trims, else it grows as well. Why: a
#: buffer that trimmed down to one entry under its capacity trimmed again at the next
#: token, copying its whole window every step; a Gemma sequence held at 512 entries
#: decoded at 4 sequences in 21.3 ms a step against 18.6 with room to spare.
_TRIM_HEADROOM = 64


class _LayerKV:
    """Keys and values of one sequence in one layer."""

    __slots__ = ("base", "buf", "length", "pos")

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf  # [2, kv_heads, capacity, head_dim]; [0] keys, [1] values
        self.length = 0
        self.base = 0
        self.pos: torch.Tensor | None = None  # [kv_heads, capacity] int64 once evicted

    @property
    def capacity(self) -> int:
        return self.buf.shape[2]


class _Seq:
    __slots__ = ("layers", "next_pos")

    def __init__(self, layers: list[_LayerKV]) -> None:
        self.layers = layers
        self.next_pos = 0  # positions seen so far = position of the next token


@dataclass(frozen=True, slots=True)
class KVView:
    """The keys/values one step's queries of a sequence may attend to in one layer.

    ``keys``/``values`` are ``[kv_heads, S, head_dim]`` views (no copy).
    Key positions are ``first_pos + arange(S)`` when ``positions`` is None,
    else ``positions`` (``[kv_heads, S]``, after eviction).
    ``needs_mask`` is False when every key is visible to every query (a
    single-token decode over a contiguous window), so attention can skip the mask.
    """

    keys: torch.Tensor
    values: torch.Tensor
    first_pos: int
    positions: torch.Tensor | None
    needs_mask: bool


class KVStore:
    """KV storage for many sequences, addressed by integer slots.

    Paired verbs: :meth:`can_allocate` / :meth:`allocate`, :meth:`reserve`,
    :meth:`free`. The model calls :meth:`store` and :meth:`view` per layer and
    :meth:`advance` once per step; a scheduler only needs the first group and
    the accounting (:meth:`num_tokens`, :attr:`total_tokens`, :meth:`seq_len`).
    """

    def __init__(
        self,
        config: Gemma3Config,
        dtype: torch.dtype = torch.float32,
        max_tokens: int | None = None,
        query_dtype: torch.dtype | None = None,
    ) -> None:
        self.config = config
        self.dtype = dtype  # of the keys and values
        # of the queries an observation window keeps (the model's compute dtype)
        self.query_dtype = query_dtype or dtype
        self.max_tokens = max_tokens
        self._seqs: dict[int, _Seq] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._window_keep = config.sliding_window - 1
        # Entries a sliding layer keeps beyond its window when it trims: the prefix
        # cache reads a block that began in an earlier chunk (block_size - 1 of them).
        self.keep_extra = 0
        self._watched: dict[int, ObsWindow] = {}  # slots whose last queries are kept

    # ----------------------------------------------------------------- allocation
    def can_allocate(self, num_tokens: int) -> bool:
        """Whether ``num_tokens`` more tokens fit under ``max_tokens`` (always, if unset)."""
        return self.max_tokens is None or self.total_tokens + num_tokens <= self.max_tokens

    def allocate(self, reserve_tokens: int = 0) -> int:
        """Open a sequence and return its slot (small ints, reused after :meth:`free`)."""
        slot = self._free_slots.pop() if self._free_slots else self._next_slot
        if slot == self._next_slot:
            self._next_slot += 1
        assert slot not in self._seqs, "slot handed out twice"
        c = self.config
        empty = (2, c.num_kv_heads, 0, c.head_dim)
        self._seqs[slot] = _Seq(
            [_LayerKV(torch.empty(empty, dtype=self.dtype)) for _ in range(c.num_layers)]
        )
        if reserve_tokens:
            self.reserve(slot, reserve_tokens)
        return slot

    def reserve(self, slot: int, num_tokens: int) -> None:
        """Pre-size a sequence for ``num_tokens`` total positions (avoids regrowth copies)."""
        seq = self._seqs[slot]
        for i, layer in enumerate(seq.layers):
            want = num_tokens
            if self.config.sliding_layers[i]:
                want = min(num_tokens, 2 * self.config.sliding_window)
            if want > layer.capacity:
                self._resize(layer, want)

    def free(self, slot: int) -> None:
        """Release a sequence's KV at once (cancel, finish, or preemption by recompute)."""
        del self._seqs[slot]
        self._watched.pop(slot, None)
        self._free_slots.append(slot)

    # ----------------------------------------------------------- observation window
    def watch(self, slot: int, window: int) -> None:
        """Keep the last ``window`` queries of every layer from now on (for SnapKV)."""
        c = self.config
        win = ObsWindow(window, c.num_layers, c.num_heads, c.head_dim, self.query_dtype)
        win.end_pos = self._seqs[slot].next_pos
        self._watched[slot] = win

    def unwatch(self, slot: int) -> None:
        """Drop a sequence's observation window (first decode, eviction); no-op if none."""
        self._watched.pop(slot, None)

    def obs_window(self, slot: int) -> ObsWindow | None:
        """The sequence's observation window, or None when it is not watched."""
        return self._watched.get(slot)

    @property
    def watching(self) -> bool:
        """Whether any sequence is watched (the model's one check per step)."""
        return bool(self._watched)

    # ----------------------------------------------------------------- accounting
    def __contains__(self, slot: int) -> bool:
        return slot in self._seqs

    @property
    def slots(self) -> list[int]:
        """Live slots, in allocation order."""
        return list(self._seqs)

    def seq_len(self, slot: int) -> int:
        """Positions processed so far: the start position of the sequence's next chunk."""
        return self._seqs[slot].next_pos

    def num_tokens(self, slot: int) -> int:
        """Tokens of KV the sequence keeps: the most any layer keeps, where a sliding
        layer counts at most ``window - 1`` (older entries wait for lazy trimming but
        are already dead). With a global layer and no eviction this is ``seq_len``."""
        keep = self._window_keep
        sliding = self.config.sliding_layers
        return max(
            (
                min(layer.length, keep) if sliding[i] else layer.length
                for i, layer in enumerate(self._seqs[slot].layers)
            ),
            default=0,
        )

    @property
    def total_tokens(self) -> int:
        """Tokens of KV held by all live sequences."""
        return sum(self.num_tokens(s) for s in self._seqs)

    def nbytes(self, slot: int) -> int:
        """Bytes allocated for the sequence (capacity, including growth headroom, and
        the observation window while watched)."""
        obs = self._watched.get(slot)
        return sum(
            layer.buf.nbytes + (layer.pos.nbytes if layer.pos is not None else 0)
            for layer in self._seqs[slot].layers
        ) + (obs.nbytes if obs is not None else 0)

    @property
    def total_bytes(self) -> int:
        return sum(self.nbytes(s) for s in self._seqs)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token costs if every layer keeps it (the global-layer upper bound)."""
        c = self.config
        return c.num_layers * 2 * c.num_kv_heads * c.head_dim * self.dtype.itemsize

    # ----------------------------------------------------------------- model side
    def store(self, slot: int, layer_idx: int, kv: torch.Tensor) -> None:
        """Append this step's keys/values ``[n, 2, kv_heads, head_dim]`` (positions
        ``seq_len(slot) ..``) to one layer."""
        seq = self._seqs[slot]
        layer = seq.layers[layer_idx]
        n = kv.shape[0]
        self._make_room(slot, layer, n, self.config.sliding_layers[layer_idx])
        end = layer.length + n
        layer.buf[:, :, layer.length : end].copy_(kv.permute(1, 2, 0, 3))
        if layer.pos is not None:
            new = torch.arange(seq.next_pos, seq.next_pos + n)
            layer.pos[:, layer.length : end] = new
        else:
            assert layer.base + layer.length == seq.next_pos, "contiguous layer out of step"
        layer.length = end

    def plain(self, slot: int) -> bool:
        """Whether a sequence's layers hold consecutive positions with no SnapKV window
        kept: what :meth:`decode_room` serves."""
        seq = self._seqs[slot]
        return slot not in self._watched and all(layer.pos is None for layer in seq.layers)

    def decode_room(
        self, slots: list[int]
    ) -> tuple[list[torch.Tensor], list[int], list[int]] | None:
        """Room for one more entry in every layer of each of ``slots``, for a step of
        plain single-token decodes written by the C++ layer loop
        (:mod:`~duetime.engine.decode_loop`): per layer, then per slot, its buffer, the
        entry the new key and value go to, and the first entry the query sees (what
        :meth:`store` and :meth:`view` would do). None where a slot was evicted or is
        watched (the general path serves it); :meth:`decoded` completes the step."""
        if not all(self.plain(s) for s in slots):
            return None
        seqs = [self._seqs[s] for s in slots]
        bufs: list[torch.Tensor] = []
        ends: list[int] = []
        firsts: list[int] = []
        for i, sliding in enumerate(self.config.sliding_layers):
            for s, seq in zip(slots, seqs, strict=True):
                layer = seq.layers[i]
                self._make_room(s, layer, 1, sliding)
                bufs.append(layer.buf)
                ends.append(layer.length)
                firsts.append(self._first_visible(layer.length + 1, 1, sliding))
        return bufs, ends, firsts

    def decoded(self, slots: list[int]) -> None:
        """After :meth:`decode_room`'s step: every layer of ``slots`` holds one entry
        more, and each slot has processed one more position."""
        for s in slots:
            seq = self._seqs[s]
            for layer in seq.layers:
                layer.length += 1
            seq.next_pos += 1

    def view(self, slot: int, layer_idx: int, n_new: int) -> KVView:
        """Keys/values visible to the ``n_new`` tokens just stored in ``layer_idx``."""
        seq = self._seqs[slot]
        layer = seq.layers[layer_idx]
        sliding = self.config.sliding_layers[layer_idx]
        lo = self._first_visible(layer.length, n_new, sliding)
        buf = layer.buf
        keys = buf[0, :, lo : layer.length]
        values = buf[1, :, lo : layer.length]
        if layer.pos is not None:
            pos = layer.pos[:, lo : layer.length]
            return KVView(keys, values, -1, pos, needs_mask=sliding or n_new > 1)
        return KVView(keys, values, layer.base + lo, None, needs_mask=n_new > 1)

    def advance(self, slot: int, n: int) -> None:
        """Mark ``n`` more positions processed (after every layer stored them)."""
        seq = self._seqs[slot]
        seq.next_pos += n
        assert all(layer.length <= layer.capacity for layer in seq.layers)

    def retain(self, slot: int, layer_idx: int, keep: torch.Tensor) -> None:
        """Keep only entries ``keep`` (``[kv_heads, k]`` sorted indices into the current
        entries, possibly different per head) in one layer: the eviction primitive."""
        layer = self._seqs[slot].layers[layer_idx]
        c = self.config
        assert keep.dim() == 2, "keep is [kv_heads, k]"
        assert keep.shape[0] == c.num_kv_heads, "one index row per KV head"
        k = keep.shape[1]
        if k:
            assert int(keep.min()) >= 0, "index out of range"
            assert int(keep.max()) < layer.length, "index out of range"
            assert bool((keep[:, 1:] > keep[:, :-1]).all()), "indices must increase"
        pos = self._positions(layer)
        idx = keep.to(torch.int64)
        cap = max(k, _MIN_CAPACITY)
        new_buf = torch.empty((2, c.num_kv_heads, cap, c.head_dim), dtype=self.dtype)
        gather_idx = idx[None, :, :, None].expand(2, -1, -1, c.head_dim)
        new_buf[:, :, :k] = layer.buf[:, :, : layer.length].gather(2, gather_idx)
        new_pos = torch.zeros((c.num_kv_heads, new_buf.shape[2]), dtype=torch.int64)
        new_pos[:, :k] = pos.gather(1, idx)
        layer.buf, layer.pos, layer.length = new_buf, new_pos, k

    def positions(self, slot: int, layer_idx: int) -> torch.Tensor:
        """Positions of one layer's entries, ``[kv_heads, length]`` (for eviction policies)."""
        return self._positions(self._seqs[slot].layers[layer_idx])

    def keys(self, slot: int, layer_idx: int) -> torch.Tensor:
        """One layer's stored keys, ``[kv_heads, length, head_dim]`` (a view; for scoring)."""
        layer = self._seqs[slot].layers[layer_idx]
        return layer.buf[0, :, : layer.length]

    # ----------------------------------------------------------------- internals
    def _first_visible(self, length: int, n_new: int, sliding: bool) -> int:
        """The first of a layer's ``length`` entries (the last ``n_new`` just stored)
        that those new tokens' queries may see: a sliding layer's window, else 0."""
        return max(0, length - (self._window_keep + n_new)) if sliding else 0

    def _positions(self, layer: _LayerKV) -> torch.Tensor:
        if layer.pos is not None:
            return layer.pos[:, : layer.length]
        row = torch.arange(layer.base, layer.base + layer.length)
        return row.expand(self.config.num_kv_heads, -1)

    def _make_room(self, slot: int, layer: _LayerKV, n: int, sliding: bool) -> None:
        need = layer.length + n
        if need <= layer.capacity:
            return
        keep_n = self._window_keep + self.keep_extra
        win = self._watched.get(slot)
        if win is not None:
            # SnapKV's window queries saw keys up to window - 1 before themselves: keep
            # those too, so their attention weights can be recomputed exactly
            keep_n += win.filled
        drop = 0
        if sliding and layer.length > keep_n:
            drop = layer.length - keep_n  # entries out of the window: dead
            need = keep_n + n
            if need + _TRIM_HEADROOM <= layer.capacity:
                keep = slice(drop, layer.length)
                layer.buf[:, :, :keep_n] = layer.buf[:, :, keep].clone()
                if layer.pos is not None:
                    layer.pos[:, :keep_n] = layer.pos[:, keep].clone()
                _dropped(layer, drop)
                return
        # grow, copying only the live entries: a trim that leaves too little room copies once
        self._resize(layer, max(need, layer.capacity + layer.capacity // 2, _MIN_CAPACITY), drop)

    def _resize(self, layer: _LayerKV, capacity: int, drop: int = 0) -> None:
        """A buffer of ``capacity`` entries holding the layer's entries past its first ``drop``."""
        live = layer.length - drop
        assert capacity >= live
        c = self.config
        buf = torch.empty((2, c.num_kv_heads, capacity, c.head_dim), dtype=self.dtype)
        buf[:, :, :live] = layer.buf[:, :, drop : layer.length]
        layer.buf = buf
        if layer.pos is not None:
            pos = torch.zeros((c.num_kv_heads, capacity), dtype=torch.int64)
            pos[:, :live] = layer.pos[:, drop : layer.length]
            layer.pos = pos
        _dropped(layer, drop)


def _dropped(layer: _LayerKV, drop: int) -> None:
    """``drop`` leading entries of ``layer`` are gone: its positions are stored with its
    entries, or counted from ``base``."""
    if layer.pos is None:
        layer.base += drop
    layer.length -= drop
