"""KV memory of a set of sequences over the coming steps: the check of Eq. 3 (Chen, Ye, Zhou 2025).

A sequence that is assumed to run ``r`` more steps and uses ``c`` KV tokens
during the next one uses ``c + k`` tokens during step ``k`` (``0 <= k < r``)
and nothing after. ``c`` is ``kv_tokens + 1`` for a decoding sequence and the
prefill length for one about to be admitted (see ``core/sequence.py``: the
newest token is fed back in the next step). Summed over a set,

    U(k) = static + Σ_{i: r_i > k} (c_i + k)

grows between departures, so its maximum over a window is reached either just
before a departure (``k = r_i − 1``) or at the window's end. Admitting a
sequence is safe for its whole assumed life iff ``U(k) + c + k <= M`` for
every ``k < r``; that is the paper's "memory constraint (3) for all t' ≥ t".
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

_MASK = (1 << 64) - 1


@lru_cache(maxsize=1 << 16)
def tiebreak(*xs: int) -> int:
    """A seeded pseudo-random 64-bit key (splitmix64): "break ties uniformly at random".

    Deterministic in its arguments, so a policy's order is reproducible and can
    be evaluated once, when a sequence enters the waiting queue.
    """
    h = 0x9E3779B97F4A7C15
    for x in xs:
        h = (h ^ (x & _MASK)) + 0x9E3779B97F4A7C15 & _MASK
        h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _MASK
        h ^= h >> 31
    return h


def _window_max(v: np.ndarray, w: int) -> np.ndarray:
    """``out[j] = max(v[j : j + w])`` for every full window (doubling; O(n log w))."""
    out = v
    span = 1
    while span * 2 <= w:
        out = np.maximum(out[:-span], out[span:])
        span *= 2
    rest = w - span
    if rest:
        out = np.maximum(out[:-rest], out[rest:])
    return out


class FutureMemory:
    """The KV a batch will need, step by step: ``U(k)`` for the steps until its last member leaves.

    Dense: ``U`` is an array over the coming steps, so "does a member
    ``(r, c)`` fit?" is one lookup in the running maximum of ``U(k) + k``
    (:meth:`allowance`), and adding a member is one vector update.
    """

    __slots__ = ("_pm", "_u", "capacity", "members", "static")

    def __init__(self, capacity: int, static: int = 0) -> None:
        self.capacity = capacity
        self.static = static  # KV held by sequences that neither grow nor leave (suspended)
        self.members = 0
        self._u = np.zeros(0, dtype=np.int64)  # U(k) − static
        self._pm: np.ndarray | None = None  # running max of U(k) + k, rebuilt lazily

    def __len__(self) -> int:
        return self.members

    def _grow(self, n: int) -> None:
        if n > len(self._u):
            self._u = np.concatenate([self._u, np.zeros(n - len(self._u), dtype=np.int64)])

    def add(self, r: int, c: int) -> None:
        """A member that runs ``r >= 1`` more steps using ``c + k`` tokens in step ``k``."""
        r = max(int(r), 1)
        self._grow(r)
        self._u[:r] += int(c) + np.arange(r, dtype=np.int64)
        self.members += 1
        self._pm = None

    def extend(self, rs: list[int], cs: list[int]) -> None:
        """Add many members at once."""
        if not rs:
            return
        r = np.maximum(np.asarray(rs, dtype=np.int64), 1)
        c = np.asarray(cs, dtype=np.int64)
        n = int(r.max())
        self._grow(n)
        k = np.arange(n, dtype=np.int64)
        # #{r_i > k} and Σ_{r_i > k} c_i, from counts by r.
        le = np.cumsum(np.bincount(r, minlength=n + 1))[:n]
        cle = np.cumsum(np.bincount(r, weights=c, minlength=n + 1))[:n].astype(np.int64)
        self._u[:n] += (int(c.sum()) - cle) + (len(r) - le) * k
        self.members += len(r)
        self._pm = None

    def peak(self) -> int:
        """Largest KV use over all coming steps."""
        return self.static + (int(self._u.max()) if len(self._u) else 0)

    def allowance(self, r: int) -> int:
        """Largest ``c`` a member living ``r`` steps could start with and still fit."""
        r = max(int(r), 1)
        if self._pm is None:
            self._pm = np.maximum.accumulate(self._u + np.arange(len(self._u)))
        n = len(self._pm)
        worst = max(int(self._pm[min(r, n) - 1]) if n else 0, r - 1)  # U = 0 past the horizon
        return self.capacity - self.static - worst

    def fits(self, r: int, c: int) -> bool:
        """Would a member admitted now keep every step of its assumed life within capacity?"""
        return int(c) <= self.allowance(r)

    def earliest_start(self, r: int, c: int) -> int | None:
        """Fewest steps ``j >= 1`` to wait before ``(r, c)`` fits, if nothing else changes.

        None when it fits only once every member has left (a departure, which
        executors report anyway) or never.
        """
        r = max(int(r), 1)
        horizon = len(self._u)
        if horizon < 2:
            return None
        k = np.arange(horizon + r, dtype=np.int64)
        v = np.concatenate([self._u, np.zeros(r, dtype=np.int64)]) + k  # U(k) + k − static
        w = _window_max(v, r)  # w[j] = worst step of a start at j
        j = np.arange(1, horizon)
        ok = np.flatnonzero(w[1:horizon] <= self.capacity - self.static - int(c) + j)
        return int(ok[0]) + 1 if len(ok) else None
