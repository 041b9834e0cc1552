"""What the engine thread hands back: each round's tokens and ends to the requests'
streams (one hand-over to the event loop a round), how each request ended, and the
stats and image the event loop reads; a failed step fails every live request and
starts over on a fresh executor.

:class:`LoopOutcomes` is the layer of :class:`~duetime.server.engine_loop.EngineLoop`
that keeps these books; the loop itself (inbox, rounds, thread) builds on it.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter

from duetime.core.image import EngineImage
from duetime.core.request import Job
from duetime.core.sequence import SeqStatus
from duetime.engine.executor import EngineExecutor
from duetime.server.step_timer import StepTimer
from duetime.server.streams import FinishReason, Outcome, Stream
from duetime.server.submissions import LiveRequest

__all__ = ["EngineStats", "LoopOutcomes"]

log = logging.getLogger("duetime.server")


@dataclass(slots=True, frozen=True)
class EngineStats:
    """A consistent copy of the engine's state, replaced whole after every round: the
    server's admission, /health and /metrics read it without a lock on the engine."""

    now: float = 0.0
    waiting: int = 0
    waiting_prefill_tokens: int = 0
    running: int = 0
    suspended: int = 0
    kv_used: int = 0
    kv_capacity: int = 0
    prefix_cache_tokens: int = 0  # tokens of prompt KV the prefix cache holds
    engine_steps: int = 0
    engine_errors: int = 0
    alive: bool = False


class LoopOutcomes:
    """Tokens, ends, outcomes and stats of the requests on the engine (the engine
    thread's side; :class:`~duetime.server.engine_loop.EngineLoop` sets the state)."""

    executor: EngineExecutor
    timer: StepTimer
    stats: EngineStats
    image: EngineImage | None
    _make_executor: Callable[[], EngineExecutor]
    _fixed_cost: bool
    _images: bool
    _live: dict[int, LiveRequest]
    _outbox: list[tuple[Stream, list[int] | Outcome]]
    _deliver_s: float
    _errors: int

    def _send(self, stream: Stream, item: list[int] | Outcome) -> None:
        """Queue ``item`` for ``stream`` until the round's :meth:`_flush`."""
        self._outbox.append((stream, item))

    def _flush(self) -> None:
        if self._outbox:
            items, self._outbox = self._outbox, []
            Stream.put_many(items)

    def _publish_tokens(self, produced: list[tuple[int, int]]) -> None:
        t0 = perf_counter()
        try:
            self._queue_tokens(produced)
        finally:
            self._deliver_s += perf_counter() - t0

    def _queue_tokens(self, produced: list[tuple[int, int]]) -> None:
        ex = self.executor
        batches: dict[int, list[int]] = {}
        # a step can add several tokens to one answer (a grammar's forced run): the i-th
        # of its k tokens here is the answer's len - k + i-th
        left = Counter(rid for rid, _ in produced)
        for rid, tok in produced:
            live = self._live.get(rid)
            if live is None:
                continue
            left[rid] -= 1
            position = len(ex.tokens[rid]) - live.job.request.prompt_len - left[rid]
            if position <= live.emitted:
                continue  # re-generated after a restart: the client has it already
            live.emitted = position
            if live.first_sent is None:
                live.first_sent = ex.now
            batches.setdefault(rid, []).append(tok)
        for rid, toks in batches.items():
            self._send(self._live[rid].stream, toks)

    def _publish_ends(self) -> None:
        ex = self.executor
        ended = [rid for rid in self._live if ex.seqs[rid].status >= SeqStatus.FINISHED]
        for rid in ended:
            seq = ex.seqs[rid]
            if seq.status is SeqStatus.CANCELLED:
                self._finish(rid, "abort")
            else:
                rec = ex.records[rid]
                short = rec.output_tokens < min(
                    self._live[rid].job.output_len, rec.request.max_tokens
                )
                self._finish(rid, "stop" if short or self._ended_on_stop_token(rid) else "length")

    def _ended_on_stop_token(self, rid: int) -> bool:
        """Whether the answer's last token is one that ends it (EOS, a stop id, the last
        its grammar takes). One that is also the ``max_tokens``-th token leaves the answer
        no shorter than the limit, but the model finished it: "stop", as vLLM and OpenAI
        say, not "length"."""
        ex = self.executor
        if ex.grammar_complete(rid):
            return True
        rule = ex.stop_tokens.get(rid)
        toks = ex.tokens.get(rid)
        n = ex.records[rid].output_tokens
        if rule is None or not toks or n < 1:
            return False
        return rule.ends(toks[-1], n)

    def _finish(self, rid: int, reason: FinishReason) -> None:
        live = self._live.pop(rid, None)
        if live is None:
            return
        outcome = self._outcome(live.job, reason, live=live)
        self._send(live.stream, outcome)
        self.executor.forget(rid)

    def _outcome(
        self,
        job: Job,
        reason: FinishReason,
        error: str | None = None,
        live: LiveRequest | None = None,
    ) -> Outcome:
        """How ``job`` ended; ``live`` (a request that reached the engine) says when its
        client got the first token and how many it got, which the executor's books forget
        at a restart."""
        ex = self.executor
        req = job.request
        rec = ex.records.get(req.rid)
        pred = req.predicted
        first_sent, sent = (live.first_sent, live.emitted) if live is not None else (None, 0)
        first = first_sent if first_sent is not None else (rec.first_token if rec else None)
        return Outcome(
            finish_reason=reason,
            arrival=req.arrival,
            first_token=first,
            end=ex.clock_now(),
            output_tokens=max(rec.output_tokens if rec else 0, sent),
            kv_evicted_ratio=rec.kv_evicted_ratio if rec else 0.0,
            predicted_tokens=pred.point if pred is not None else None,
            forecast_finish=req.forecast_finish,
            deadline=req.deadline,
            preemptions=ex.seqs[req.rid].num_preemptions if req.rid in ex.seqs else 0,
            error=error,
            prompt_tokens=req.prompt_len,
            cached_tokens=rec.cached_prompt_tokens if rec else None,
            jumped_tokens=ex.jumped.get(req.rid, 0),
            rode_tokens=ex.rode.get(req.rid, 0),
        )

    def _fail_all(self, why: str, *, log_it: bool = True) -> None:
        """Fail every live request and start over with a fresh executor (and KV cache)."""
        if log_it:
            log.error("engine step failed; failing %d requests:\n%s", len(self._live), why)
            self._errors += 1
        message = why.strip().splitlines()[-1] if why.strip() else "engine error"
        for live in list(self._live.values()):
            outcome = self._outcome(live.job, "error", error=message, live=live)
            self._send(live.stream, outcome)
        self._live.clear()
        self._flush()
        old = self.executor
        old.close()
        if log_it:
            self.executor = self._make_executor()
            self.executor.start_clock(old.clock_origin)  # one clock: arrival times stay valid
            self.executor.on_tokens = self._publish_tokens
            if not self._fixed_cost:
                self.executor.cost = self.timer.as_cost()
        self._refresh_stats()

    def _refresh_stats(self) -> None:
        ex = self.executor
        self.stats = EngineStats(
            now=ex.clock_now(),
            waiting=len(ex.waiting),
            waiting_prefill_tokens=ex.waiting.prefill_tokens,
            running=len(ex.running),
            suspended=len(ex.suspended),
            kv_used=ex.kv_used,
            kv_capacity=ex.kv_capacity,
            prefix_cache_tokens=ex.prefix_cache.num_tokens if ex.prefix_cache else 0,
            engine_steps=ex.engine_steps,
            engine_errors=self._errors,
            alive=True,
        )
        if self._images:
            self.image = ex.image(now=self.stats.now)
