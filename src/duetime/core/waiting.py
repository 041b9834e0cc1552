"""A waiting queue kept sorted by the policy's key: the part of policy that is an order."""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable, Iterator
from typing import Any, overload

from duetime.core.sequence import Seq


class WaitingQueue:
    """Sequences ordered by ``(key(seq), seq.order)``.

    A sorted Python list: inserts are a binary search plus a memmove, which at
    the queue sizes we meet (up to tens of thousands) is far cheaper than
    re-sorting on every scheduling call. Iteration yields sequences in order.

    :attr:`prefill_tokens` is the prompt work the queue holds, kept as a
    running sum because a server reports it after every engine step and
    summing the queue there would cost O(waiting) on the engine's hot path.
    A queued sequence's remaining prefill does not change while it waits (the
    executor sets it before :meth:`push`), so the sum stays exact.
    """

    __slots__ = ("_items", "_key", "_keys", "_tokens", "prefill_tokens")

    def __init__(self, key: Callable[[Seq], Any]) -> None:
        self._key = key
        self._items: list[tuple[Any, int, Seq]] = []
        self._keys: dict[int, tuple[Any, int]] = {}
        self._tokens: dict[int, int] = {}  # rid → prefill_remaining when pushed
        self.prefill_tokens = 0

    def push(self, seq: Seq, key: Any = None) -> None:
        """Queue ``seq`` under the policy's key for it, or under ``key`` where given (a
        fork restoring a queue: the key the original queue had it under)."""
        k = (self._key(seq) if key is None else key, seq.order)
        self._keys[seq.rid] = k
        insort(self._items, (*k, seq))
        self._tokens[seq.rid] = n = seq.prefill_remaining
        self.prefill_tokens += n

    def key_of(self, seq: Seq) -> Any:
        """The policy's key ``seq`` is queued under."""
        return self._keys[seq.rid][0]

    def remove(self, seq: Seq) -> None:
        k = self._keys.pop(seq.rid)
        i = bisect_left(self._items, k)
        assert self._items[i][2] is seq, "waiting queue out of order"
        del self._items[i]
        self.prefill_tokens -= self._tokens.pop(seq.rid)

    def __contains__(self, seq: object) -> bool:
        return isinstance(seq, Seq) and seq.rid in self._keys

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Seq]:
        for item in self._items:
            yield item[2]

    @overload
    def __getitem__(self, i: int) -> Seq: ...
    @overload
    def __getitem__(self, i: slice) -> list[Seq]: ...
    def __getitem__(self, i: int | slice) -> Seq | list[Seq]:
        """The sequence at ``i`` in queue order, or a list of them for a slice."""
        if isinstance(i, slice):
            return [item[2] for item in self._items[i]]
        return self._items[i][2]

    def __bool__(self) -> bool:
        return bool(self._items)
