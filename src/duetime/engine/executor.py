"""The real executor: the shared state machine driving one batched Gemma 3 forward per step.

It is :class:`~duetime.core.executor.ExecutorCore` (the very code the
simulator runs) plus four things only a real engine has: token ids, KV-cache
slots that mirror the core's token accounting, the wall clock, and a model
forward in place of a cost model. Policies see the identical snapshot.

The engine asks the policy every step (nano-vllm's loop: schedule → run →
post-process); it cannot jump over steps the way the simulator does.

Its layers, one module each: ``executor_state`` (state, clock, telemetry),
``executor_kv`` (the KV cache beside the books: slots, eviction, spooling, restarts),
``executor_forced`` (grammars' forced runs), ``executor_logits`` (what rows read of
their logits, sampling, prompt scores), ``executor_step`` (one step); this module has
the executor, its run loop and its result.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from duetime.core.executor import ExecutorError
from duetime.core.record import RequestRecord
from duetime.core.request import Job
from duetime.engine.executor_state import GRAMMAR_GATHER_MAX, StopRule, rss_bytes
from duetime.engine.executor_step import EngineStep

__all__ = ["GRAMMAR_GATHER_MAX", "EngineExecutor", "EngineResult", "StopRule", "rss_bytes"]


@dataclass(slots=True)
class EngineResult:
    """Records, generated ids and counters of one engine run."""

    records: list[RequestRecord]
    outputs: dict[int, list[int]]
    wall_s: float
    engine_steps: int
    policy_calls: int
    preemptions: int
    kv_peak: int
    tokens_generated: int
    counters: dict[str, int] = field(default_factory=dict)


class EngineExecutor(EngineStep):
    """Serves jobs on a :class:`Gemma3` model under a policy, in real time.

    ``kv_capacity`` is the KV budget M in tokens, enforced by the same
    accounting the simulator uses and checked against the cache after every
    step (``check_accounting``). ``segmenters[rid]`` (a
    :class:`~duetime.engine.segment_stop.TextSegmenter`) ends that request's
    segments where its generated text says, for jobs without trace-given
    segments. ``samplers[rid]`` (a :class:`~duetime.engine.sampling.Sampler`)
    draws that request's tokens; every other request takes the arg-max.
    ``logprob_logs[rid]`` (a :class:`~duetime.engine.logprobs.LogprobLog`)
    receives the log-probabilities of that request's tokens. ``grammars[rid]`` (a
    :class:`~duetime.engine.grammar.TokenGrammar`) masks that request's tokens to what
    its grammar allows and ends its answer where the grammar is complete; tokens the
    grammar forces come without the model and ride along in the next step as one
    chunk where memory allows (``jump_forward``, on by default). With
    ``offload_suspended`` a suspended sequence's KV is spooled to disk when a
    step needs its room (see ``core/executor.py``). ``cost`` is the fitted
    profile handed to policies as ``snapshot.cost`` (None until `duetime
    profile` has run).
    ``telemetry`` receives one JSON line per step.

    ``eviction`` is how KV is dropped when a policy asks for ratio α:
    ``"snapkv"`` (default; SnapKV, what TimeBill uses) or ``"streaming"``
    (StreamingLLM sinks + recent window). Under SnapKV every sequence's last
    ``snapkv_window`` prefill queries are kept from admission until its first
    decode or eviction (2.4 MB per prefilling sequence on Gemma 3 270M at
    w = 32, fp32); a sequence evicted after its first decode no longer has them
    and falls back to StreamingLLM (counted in ``counters["snapkv_fallbacks"]``).

    ``prefix_cache_tokens`` > 0 keeps the KV of that many prompt tokens, in blocks,
    for later prompts that begin the same way (:mod:`~duetime.core.prefix_cache`):
    a request admitted with a cached beginning copies its KV and prefills the rest
    (``prefill_cached_tokens`` counts them). Its own budget, off the policy's books.
    A hit leaves the last token to compute (its logits give the first answer token),
    and under SnapKV the last ``snapkv_window``, whose queries SnapKV scores keys by.

    ``share_prefills`` (default on): prefill chunks of one step that start with the
    same tokens (``n`` > 1 choices, a burst behind one system prompt) compute them
    once; the others copy those rows' keys and values from the first
    (``ExecutorCore._share_prefills``; ``prefill_shared_tokens`` counts them).

    Each step tells the model what its rows read of their logits
    (:meth:`_logit_needs`): a plain greedy row only its arg-max (the vocabulary
    may be ranked in int4), a grammar row whose next tokens are at most
    ``grammar_gather_max`` only theirs (exact, from a gather of their output rows;
    0 turns that off), a sampler's or a logprob log's row every logit.

    ``skip_idle`` is for benchmarks that replay a trace: when nothing can run
    until the next arrival or ready time, the run's clock jumps there instead
    of sleeping (:attr:`idle_skipped_s` adds up the jumps). Every step is still
    timed on the wall clock, so a run costs its compute time, not the trace's
    length. A server never sets it.
    """

    def run(self, jobs: Iterable[Job], *, max_wall_s: float = float("inf")) -> EngineResult:
        """Serve ``jobs`` (arrival times are seconds from now) until all are done."""
        pending = sorted(jobs, key=lambda j: (j.request.arrival, j.request.rid))
        n_jobs, i = len(pending), 0
        self._t0 = self._clock()
        self.now = 0.0
        idle_calls = 0
        try:
            while True:
                self.now = self._clock() - self._t0
                while i < n_jobs and pending[i].request.arrival <= self.now:
                    self.admit_arrival(pending[i])
                    i += 1
                if not self.in_system:
                    if i >= n_jobs:
                        break
                    self._sleep_until(pending[i].request.arrival)
                    continue
                if self.now > max_wall_s:
                    break
                nxt = self.tick()
                if nxt is None:
                    idle_calls = 0
                    continue
                if nxt < 0:
                    idle_calls += 1
                    if idle_calls > 10_000:
                        raise ExecutorError(
                            f"policy {self.policy.name!r} changed state 10,000 times "
                            "without letting the engine run a step"
                        )
                    continue
                nxt = min(nxt, pending[i].request.arrival if i < n_jobs else float("inf"))
                if nxt == float("inf"):
                    raise ExecutorError(
                        f"policy {self.policy.name!r} scheduled nothing with "
                        f"{len(self.waiting)} waiting and {len(self.suspended)} suspended "
                        "requests and no future event: the run would never end"
                    )
                self._sleep_until(nxt)
        finally:
            self.close()
        return EngineResult(
            records=[self.records[j.request.rid] for j in pending if j.request.rid in self.records],
            outputs={
                rid: toks[self.seqs[rid].req.prompt_len :] for rid, toks in self.tokens.items()
            },
            wall_s=self.now,
            **self.run_counts(),
        )

    def tick(self) -> float | None:
        """One scheduling round: ask the policy, apply its decision, run a step if any.

        Returns None when a step ran, -1.0 when the decision changed state but
        ran nothing (ask again at once), else the time of the next event the
        executor knows of (a suspended segment's ready time, the policy's
        ``wake_at``; ``inf`` if none) — the caller adds arrivals it knows of.
        """
        # Time moves while nothing runs (a server waiting for a segment's ready time).
        self.now = self._clock() - self._t0
        dec = self.policy.schedule(self.snapshot())
        self.policy_calls += 1
        chunks = self._apply(dec)
        self._check_limits(chunks, dec.prefill_only)
        if chunks or self._n_dec:
            self._run_step(chunks, dec.prefill_only)
            return None
        if not dec.is_empty():
            return -1.0
        # a wake-up that is not in the future is no event, as in the simulator: asked
        # again at once, such a policy spun the engine until its wall-time limit
        wake = dec.wake_at if dec.wake_at is not None and dec.wake_at > self.now else None
        return min(
            min((s.ready_at for s in self.suspended.values()), default=float("inf")),
            float("inf") if wake is None else wake,
        )
