"""A still image of an executor's state, to fork a simulator from.

Both executors keep their state in :class:`~duetime.core.executor.ExecutorCore`,
so one image type serves both: the real engine takes one after each round (a
tuple of plain rows, cheap enough to take every step), and a forecast replays
it in the simulator under the same policy (``sim/forecast.py``) to predict when
each request, and one that has just arrived, will finish. The image holds the
requests themselves (read-only to both sides) and copies of every count the
executor keeps per sequence; the KV it describes stays where it is.

The image also keeps the policy's private state, as a fork of the policy taken
with it (``QueuePolicy.fork``: Amin's raised bounds, A_ℓ's promoted requests,
deferred prefill's departure count), and each waiting request's queue key, so a
forecast decides as the engine would have. Not in the image: the prefix cache's
contents (a fork starts with an empty cache, which it then fills as the engine
would) and what a sequence's tokens are (the simulator needs only their number).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from duetime.core.request import Request
from duetime.core.sequence import SeqStatus

if TYPE_CHECKING:
    from duetime.core.policy import Policy
    from duetime.core.sequence import Seq

__all__ = ["EngineImage", "LiveSeq"]


@dataclass(slots=True, frozen=True)
class LiveSeq:
    """One request in the system, as the executor holds it (see :class:`Seq`)."""

    request: Request
    status: SeqStatus
    order: int
    prefill_target: int
    prefilled: int
    generated: int
    kv_evicted: int
    kv_offloaded: bool
    parked: bool  # suspended with its KV still on the device, off the policy's books
    ready_at: float
    segment_index: int
    segment_end: int
    first_token_time: float | None
    num_preemptions: int
    # The waiting queue's key (the policy's) of a WAITING sequence: a fork queues it
    # where it was, though the key depended on when it was computed (A_ℓ's tickets).
    # None: not recorded; the fork's policy computes it.
    queue_key: Any = None

    @classmethod
    def of(cls, seq: Seq, *, parked: bool, queue_key: Any) -> LiveSeq:
        """``seq`` as it stands now. Every field but ``request``, ``segment_end`` and the
        two given is the sequence's attribute of the same name, so a count the executor
        adds to both cannot be left out of the image."""
        copied = {name: getattr(seq, name) for name in _SEQ_FIELDS}
        return cls(
            request=seq.req,
            parked=parked,
            queue_key=queue_key,
            segment_end=seq._segment_end,  # the executor's own (policies do not read it)
            **copied,
        )


_SEQ_FIELDS = tuple(
    f.name
    for f in fields(LiveSeq)
    if f.name not in ("request", "parked", "queue_key", "segment_end")
)

#: The executor limits an image records, named as :class:`~duetime.sim.simulator.SimConfig`
#: names them: a fork enforces the same ones.
LIMITS = (
    "kv_capacity",
    "max_num_seqs",
    "max_batch_tokens",
    "prefix_cache_tokens",
    "prefix_compute_tail",
    "offload_suspended",
    "share_prefills",
)


@dataclass(slots=True, frozen=True)
class EngineImage:
    """Every request in the system at ``now``, in admission order, with the executor's
    limits: enough to rebuild its books in a simulator."""

    now: float
    seqs: tuple[LiveSeq, ...]
    kv_capacity: int
    max_num_seqs: int
    max_batch_tokens: int
    prefix_cache_tokens: int
    prefix_compute_tail: int
    offload_suspended: bool
    share_prefills: bool
    # The policy as it stood, forked (None: it has no ``fork``). Never run itself:
    # each forecast runs a fork of it (:meth:`fork_policy`), so all start alike.
    policy: Policy | None = None

    def limits(self) -> dict[str, Any]:
        """The executor's limits (:data:`LIMITS`) by name, to configure a fork with."""
        return {name: getattr(self, name) for name in LIMITS}

    def fork_policy(self) -> Policy | None:
        """A policy to play the image forward under, in the state the image records
        (None where it records none: a forecast then runs a fresh instance)."""
        return None if self.policy is None else self.policy.fork()  # type: ignore[attr-defined]
