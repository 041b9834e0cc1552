"""SnapKV's observation window: the last ``size`` queries of a sequence, per layer.

SnapKV scores each prompt position by the attention the last prompt queries pay
to it. ``scaled_dot_product_attention`` does not return attention weights, so
instead of changing the hot attention path the model copies the post-norm,
post-RoPE queries of a *watched* sequence into this small rolling buffer as its
prefill chunks go by, and eviction recomputes the window's weights with one
extra ``[w, L]`` matmul per layer (:func:`duetime.engine.eviction.snapkv_scores`).

The buffer holds the last ``size`` queries whatever the chunking: a chunk of at
least ``size`` tokens overwrites it, a shorter one shifts it. Only sequences
that ask (``KVCache.watch``) pay the copy, and the executor drops the buffer at
the first decode or eviction, so decode steps never touch it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from duetime.engine.batch import StepBatch
    from duetime.engine.kv_cache import KVCache

__all__ = ["ObsWindow", "watched_rows"]


class ObsWindow:
    """Rolling ``[layers, size, heads, head_dim]`` buffer of one sequence's last queries."""

    __slots__ = ("end_pos", "filled", "q")

    def __init__(
        self, size: int, layers: int, heads: int, head_dim: int, dtype: torch.dtype
    ) -> None:
        if size < 1:
            raise ValueError(f"observation window size must be >= 1, got {size}")
        self.q = torch.zeros((layers, size, heads, head_dim), dtype=dtype)
        self.filled = 0  # valid rows, the newest ``filled`` of ``size`` (right-aligned)
        self.end_pos = 0  # position after the newest captured query

    @property
    def size(self) -> int:
        return self.q.shape[1]

    def capture(self, layer: int, q: torch.Tensor) -> None:
        """Append one chunk's queries ``[n, heads, head_dim]`` of ``layer`` (call per layer)."""
        n, w = q.shape[0], self.size
        buf = self.q[layer]
        if n >= w:
            buf.copy_(q[n - w :])
        else:
            buf[: w - n] = buf[n:].clone()
            buf[w - n :] = q

    def advance(self, n: int, end_pos: int) -> None:
        """Every layer captured ``n`` more queries; the next position is ``end_pos``."""
        self.filled = min(self.size, self.filled + n)
        self.end_pos = end_pos

    def queries(self, layer: int, n: int | None = None) -> torch.Tensor:
        """The newest ``n`` (default: all captured) queries of ``layer``, ``[n, heads, hd]``."""
        n = self.filled if n is None else min(n, self.filled)
        return self.q[layer, self.size - n :]

    def positions(self, n: int | None = None) -> torch.Tensor:
        """Positions of :meth:`queries`' rows, ``[n]``."""
        n = self.filled if n is None else min(n, self.filled)
        return torch.arange(self.end_pos - n, self.end_pos)

    def state(self) -> dict[str, object]:
        """Plain tensors and ints for :meth:`KVCache.export` (swap keeps the window)."""
        return {"q": self.q.clone(), "filled": self.filled, "end_pos": self.end_pos}

    @classmethod
    def from_state(cls, state: dict[str, object], dtype: torch.dtype) -> ObsWindow:
        q = state["q"]
        assert isinstance(q, torch.Tensor), "not an observation-window state"
        win = cls(q.shape[1], q.shape[0], q.shape[2], q.shape[3], dtype)
        win.q.copy_(q)
        filled, end_pos = state["filled"], state["end_pos"]
        assert isinstance(filled, int), "observation-window fill is not an int"
        assert isinstance(end_pos, int), "observation-window position is not an int"
        win.filled, win.end_pos = filled, end_pos
        return win

    @property
    def nbytes(self) -> int:
        return self.q.nbytes


def watched_rows(
    batch: StepBatch, kv: KVCache
) -> list[tuple[ObsWindow, slice | torch.Tensor, int]]:
    """(observation window, the step's rows of the queries it captures, positions the
    chunk covers) of every watched chunk in the step. A chunk that borrows rows takes
    the leader's queries for them (same tokens, same positions, same past): as many
    of the newest as the window still needs besides its own."""
    out: list[tuple[ObsWindow, slice | torch.Tensor, int]] = []
    offsets = batch.offsets
    for c, a, b in zip(batch.chunks, offsets, offsets[1:], strict=False):
        win = kv.obs_window(c.slot)
        if win is None:
            continue
        assert win.end_pos == c.start_pos, "observation window out of step with the cache"
        if not c.shared:
            out.append((win, slice(a, b), b - a))
            continue
        lead_end = offsets[c.leader] + c.shared
        k = min(c.shared, max(0, win.size - (b - a)))
        rows = torch.cat((torch.arange(lead_end - k, lead_end), torch.arange(a, b)))
        out.append((win, rows, c.shared + b - a))
    return out
