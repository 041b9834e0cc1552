"""Live per-request state that both executors keep and every policy reads.

A :class:`Seq` is owned by an executor and handed to policies read-only inside
an :class:`~duetime.core.snapshot.EngineSnapshot`. To keep a simulator step in
the tens of microseconds, a decoding sequence is *not* touched every step: it
records the executor's decode-step counter when it joined the batch, and its
token counts are derived on read (``generated``, ``kv_tokens``). Both executors
tick the same :class:`DecodeClock`, so the arithmetic is identical for both.
"""

from __future__ import annotations

from enum import IntEnum

from duetime.core.request import Request


class SeqStatus(IntEnum):
    """Where a sequence is.

    WAITING: holds no KV (new, or preempted by recompute / swapped out).
    RUNNING: holds KV; decodes one token every step once its prefill is done.
    SUSPENDED: holds KV (on device, or offloaded when ``kv_offloaded``) but is
    not decoded (TimelyLLM segment boundaries, policy-chosen pauses).
    FINISHED / CANCELLED: terminal.
    """

    WAITING = 0
    RUNNING = 1
    SUSPENDED = 2
    FINISHED = 3
    CANCELLED = 4


class DecodeClock:
    """Counts decode steps; the one number that lazily advances every decoder."""

    __slots__ = ("steps",)

    def __init__(self) -> None:
        self.steps = 0


class Seq:
    """One request's execution state.

    Invariant while it holds KV and has produced its first token:
    ``kv_tokens == prompt_len + generated - 1 - kv_evicted`` (the newest token
    is produced but not yet fed back). During prefill ``prefilled`` counts the
    tokens of ``prefill_target`` already computed, or found in the prefix
    cache at admission (so it need not start at 0).
    """

    __slots__ = (
        "_clock",
        "_decoding",
        "_epoch",
        "_gen_base",
        "_segment_end",
        "_step_base",
        "first_token_time",
        "kv_evicted",
        "kv_offloaded",
        "num_preemptions",
        "order",
        "prefill_target",
        "prefilled",
        "ready_at",
        "req",
        "rid",
        "segment_index",
        "status",
    )

    def __init__(self, req: Request, clock: DecodeClock, order: int) -> None:
        self.req = req
        self.rid = req.rid
        self._clock = clock
        self.order = order  # admission tie-breaker and "newest" for victims
        self.status = SeqStatus.WAITING
        self._decoding = False
        self._epoch = 0  # bumped whenever decoding (re)starts; lets executors drop stale timers
        self._gen_base = 0
        self._step_base = 0
        self.prefill_target = req.prompt_len
        self.prefilled = 0
        self.kv_evicted = 0
        self.kv_offloaded = False
        self.num_preemptions = 0
        self.first_token_time: float | None = None
        self.segment_index = 0
        # Generated-token count at which the current segment (or the answer) ends: the
        # executor's, from the job's hidden truth, so not for policies to read.
        self._segment_end = 0
        self.ready_at = req.arrival

    # --- derived counts -------------------------------------------------
    @property
    def generated(self) -> int:
        """Output tokens produced so far (the first comes from the prefill)."""
        if self._decoding:
            return self._gen_base + (self._clock.steps - self._step_base)
        return self._gen_base

    @property
    def decoding(self) -> bool:
        """True when the executor decodes this sequence every step."""
        return self._decoding

    @property
    def prefill_done(self) -> bool:
        return self.prefilled >= self.prefill_target

    @property
    def prefill_remaining(self) -> int:
        return self.prefill_target - self.prefilled

    @property
    def kv_tokens(self) -> int:
        """KV-cache tokens this sequence holds (0 when waiting)."""
        if self.status is SeqStatus.WAITING or self.status >= SeqStatus.FINISHED:
            return 0
        if not self.prefill_done:
            return self.prefilled - self.kv_evicted
        return self.req.prompt_len + self.generated - 1 - self.kv_evicted

    @property
    def resume_tokens(self) -> int:
        """KV tokens the step that resumes this suspended sequence adds: its next token,
        plus all of its KV when that was paged out (swapped, or offloaded while parked)."""
        return 1 + (self.kv_tokens if self.kv_offloaded else 0)

    @property
    def context_len(self) -> int:
        """Tokens in the sequence (prompt + generated), whatever the cache keeps."""
        return self.req.prompt_len + self.generated

    # --- executor-side mutators (policies must not call these) ------------
    def _start_decoding(self) -> None:
        self._step_base = self._clock.steps
        self._decoding = True
        self._epoch += 1

    def _stop_decoding(self) -> None:
        if self._decoding:
            self._gen_base = self.generated
            self._decoding = False

    def _set_generated(self, n: int) -> None:
        self._gen_base = n
        self._step_base = self._clock.steps

    def __repr__(self) -> str:
        return (
            f"Seq(rid={self.rid}, {self.status.name}, prefilled={self.prefilled}/"
            f"{self.prefill_target}, generated={self.generated}, kv={self.kv_tokens})"
        )
