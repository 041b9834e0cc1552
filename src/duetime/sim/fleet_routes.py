"""Where each request of a fleet run was sent, kept as one integer per request.

A fleet of a million requests routes almost every request once. A list per
request (``{rid: [replica]}``) would be a million small objects that the run
never reads; :class:`RouteLog` keeps the first replica in a dict of ints and
lists only for the few requests sent again after a failure, and reads as the
mapping ``rid → [replica, ...]`` (every replica it was sent to, in order).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping


class RouteLog(Mapping[int, list[int]]):
    """``rid → the replicas a request was sent to, in order``; built by :meth:`first`
    and :meth:`again`, read as a mapping (each read builds a fresh list)."""

    __slots__ = ("_again", "_first")

    def __init__(self) -> None:
        self._first: dict[int, int] = {}
        self._again: dict[int, list[int]] = {}  # replicas after the first (reroutes)

    def first(self, rid: int, replica: int) -> None:
        """``rid`` is routed for the first time, to ``replica``."""
        self._first[rid] = replica

    def again(self, rid: int, replica: int) -> None:
        """``rid``, routed before (its replica failed), is sent to ``replica``."""
        self._again.setdefault(rid, []).append(replica)

    def last(self, rid: int) -> int | None:
        """The replica ``rid`` was last sent to (None: never routed)."""
        again = self._again.get(rid)
        return again[-1] if again else self._first.get(rid)

    def last_replicas(self) -> dict[int, int]:
        """``rid → the replica it was last sent to``, for every request routed (one
        copy of the first routes, then the few reroutes over it)."""
        last = dict(self._first)
        for rid, again in self._again.items():
            last[rid] = again[-1]
        return last

    def __getitem__(self, rid: int) -> list[int]:
        return [self._first[rid], *self._again.get(rid, ())]

    def __iter__(self) -> Iterator[int]:
        return iter(self._first)

    def __len__(self) -> int:
        return len(self._first)
