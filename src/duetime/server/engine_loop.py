"""The engine in its own thread, fed by the server's event loop.

A forward pass takes tens to hundreds of milliseconds on a CPU; run on the
event loop it would stall every other connection. So the executor lives on
one thread that owns it outright (nothing else touches its state): requests
and aborts reach it through an inbox, and tokens and outcomes go back to each
request's :class:`Stream` through ``loop.call_soon_threadsafe``. The thread
sleeps on an event when there is nothing to do, so an idle server costs no
CPU.

If a step raises (a bug in a policy, say), every live request fails with an
error, the executor is rebuilt with a fresh KV cache, and the server goes on:
one bad step must not leave memory held or the loop dead.

This module holds the loop (its inbox, its rounds, its thread); what a round hands
back (tokens, ends, outcomes, stats) is :mod:`~duetime.server.loop_outcomes`, and a
request's way in :mod:`~duetime.server.submissions`.
"""

from __future__ import annotations

import itertools
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from time import perf_counter
from typing import Any

import torch

from duetime.core.image import EngineImage
from duetime.core.request import Job
from duetime.core.sampling import SamplingParams
from duetime.engine.executor import EngineExecutor, StopRule
from duetime.engine.grammar import TokenGrammar
from duetime.engine.logprobs import LogprobLog
from duetime.engine.malloc_tuning import large_blocks_mapped
from duetime.engine.openmp_workers import own_workers, release_workers
from duetime.engine.sampling import Sampler
from duetime.engine.segment_stop import TextSegmenter
from duetime.server.loop_outcomes import EngineStats, LoopOutcomes, log
from duetime.server.step_log import StepLog, StepRow
from duetime.server.step_timer import StepTimer
from duetime.server.streams import Outcome, Stream
from duetime.server.submissions import LiveRequest, Submission

__all__ = ["EngineLoop", "EngineStats", "Outcome", "Stream", "Submission"]


class EngineLoop(LoopOutcomes):
    """Owns an :class:`EngineExecutor` on a background thread."""

    def __init__(
        self,
        make_executor: Callable[[], EngineExecutor],
        *,
        timer: StepTimer | None = None,
        fixed_cost: bool = False,
        idle_wait_s: float = 0.5,
        images: bool = True,
        step_log: StepLog | None = None,
    ) -> None:
        """``fixed_cost``: the executor's cost model is a given profile; otherwise policies
        are handed the timer's online fit as ``snapshot.cost`` as it improves.
        ``images``: keep :attr:`image` (admission by forecast reads it; it costs about
        1.4 us a request each round)."""
        self._make_executor = make_executor
        self.executor = make_executor()
        self.timer = timer or StepTimer()
        self._idle_wait_s = idle_wait_s
        self._fixed_cost = fixed_cost
        self._images = images
        self._inbox: list[tuple[str, Any]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        # torch threads the engine thread computes on: the count of the thread that built
        # the loop (start may be called on another: an HTTP server's lifespan)
        self._threads = torch.get_num_threads()
        self._draining: list[Job] = []  # taken from the inbox, not yet in the image
        self._live: dict[int, LiveRequest] = {}
        #: What this round has for the streams, handed to the event loop in one call.
        self._outbox: list[tuple[Stream, list[int] | Outcome]] = []
        #: Where each round's time went (None: not kept; `duetime bench serve-load`).
        self.step_log = step_log
        self._deliver_s = 0.0  # this round's token bookkeeping, inside the tick
        self._t_origin = perf_counter()
        self._rids = itertools.count(1)
        self._errors = 0
        self._beat = time.monotonic()  # when the engine thread last began a round
        self.stats = EngineStats(kv_capacity=self.executor.kv_capacity)
        #: The requests on the engine after its last round (admission forecasts from it).
        self.image: EngineImage | None = None

    # --- called from any thread ----------------------------------------------------
    def cached_prefix_len(self, ids: Sequence[int]) -> int:
        """Prompt tokens the prefix cache holds for ``ids`` now (an estimate: the engine
        thread may change the cache before the request is admitted)."""
        return self.executor.cached_prefix_len(ids)

    def next_rid(self) -> int:
        return next(self._rids)

    def now(self) -> float:
        """Seconds on the engine clock (request arrival and deadline times use it)."""
        return self.executor.clock_now()

    def submission(
        self,
        job: Job,
        stream: Stream,
        *,
        stop_on_eos: bool,
        min_tokens: int = 0,
        stop_token_ids: Sequence[int] = (),
        segmenter: TextSegmenter | None = None,
        sampling: SamplingParams | None = None,
        logprobs: LogprobLog | None = None,
        grammar: TokenGrammar | None = None,
    ) -> Submission:
        """A request ready for :meth:`submit`; ``segmenter`` suspends it at each text
        segment end (TimelyLLM); ``sampling`` picks its tokens (None or plain greedy
        params: the batch's arg-max); ``logprobs`` receives their log-probabilities (the
        caller reads it as tokens come); ``grammar`` allows only the tokens it takes
        (structured outputs). The answer ends at its end-of-sequence (with
        ``stop_on_eos``) or any of ``stop_token_ids``, once it holds ``min_tokens``
        tokens, or where ``grammar`` is complete."""
        sampler = None if sampling is None or sampling.plain else Sampler(sampling)
        ids = set(stop_token_ids)
        eos = self.executor.eos_token_id
        if stop_on_eos and eos is not None:
            ids.add(eos)
        stop = StopRule(frozenset(ids), min_tokens) if ids else None
        return Submission(job, stream, stop, segmenter, sampler, logprobs, grammar)

    def submit(self, *items: Submission) -> None:
        """Queue requests. Those given in one call reach the engine in the same round,
        so a policy can admit them in one step: ``n`` > 1 choices of a prompt then
        compute it once (the executor's shared prefills), where one handed over a round
        later would compute it again."""
        with self._lock:
            self._inbox.extend(("submit", item) for item in items)
        self._wake.set()

    def abort(self, rid: int) -> None:
        """End a request the client gave up on (outcome "abort")."""
        with self._lock:
            self._inbox.append(("abort", rid))
        self._wake.set()

    def finish(self, rid: int) -> None:
        """End a request whose answer is complete (a stop string): outcome "stop"."""
        with self._lock:
            self._inbox.append(("finish", rid))
        self._wake.set()

    @property
    def inbox_size(self) -> int:
        return len(self._inbox)

    def pending_jobs(self) -> list[Job]:
        """Requests submitted but not yet in :attr:`image` (a job being handed over may
        be in both)."""
        with self._lock:
            jobs = [p.job for kind, p in self._inbox if kind == "submit"]
            return self._draining + jobs

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("engine loop already started")
        self.executor.start_clock()
        # stats and image before the first request: one that arrives before the thread's
        # first round is forecast against the empty engine, not judged by the estimate
        self._refresh_stats()
        # the engine thread alone computes on OpenMP's workers: this thread (which loaded
        # and timed the model) gives its own back (engine/openmp_workers.py)
        release_workers()
        self._thread = threading.Thread(target=self._main, name="duetime-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.timer.close()
        self.executor.close()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stalled_s(self) -> float:
        """Seconds the engine has held work without starting a new round (0 while idle).

        A round waits at most ``idle_wait_s`` between steps, so a large value means
        a step that does not return: a hung engine whose thread is still alive.
        """
        busy = self.executor.in_system or self._inbox
        if not busy or not self.alive:
            return 0.0
        return max(0.0, time.monotonic() - self._beat)

    # --- the engine thread ---------------------------------------------------------
    def _main(self) -> None:
        own_workers(self._threads)
        if large_blocks_mapped():
            log.warning(
                "the engine thread's large temporaries are fresh mmaps, faulted in again "
                "every step (a thread made a malloc arena before the engine's tuning; "
                "engine/malloc_tuning.py): decode steps of many sequences run slower"
            )
        ex = self.executor
        ex.on_tokens = self._publish_tokens
        while not self._stopping.is_set():
            self._round(perf_counter())
        self._fail_all("server shutting down", log_it=False)

    def _round(self, t0: float) -> None:
        """Take the inbox, run one step if there is work (else sleep), hand out its
        tokens and ends; timed part by part into :attr:`step_log` where one is kept."""
        self._beat = time.monotonic()
        self._drain_inbox()
        t_drain = perf_counter()
        ex = self.executor
        if not ex.in_system:
            self._refresh_stats()
            t_refresh = perf_counter()
            self._wait(self._idle_wait_s)
            idle = perf_counter() - t_refresh
            self._log(t0, None, drain=t_drain - t0, refresh=t_refresh - t_drain, idle=idle)
            return
        done_before = ex.n_done
        self._deliver_s = 0.0
        try:
            nxt = ex.tick()
        except Exception:  # the server must survive a bad step
            self._fail_all(traceback.format_exc())
            return
        t_tick = perf_counter()
        shape = ex.last_step if nxt is None else None  # (seconds, P, D, KV, attn) of its step
        # the image without the ended ones before their clients hear: a request sent
        # right after an answer must not be forecast behind it
        self._refresh_stats()
        t_refresh = perf_counter()
        if ex.n_done != done_before:
            self._publish_ends()
        self._flush()  # the step's tokens and ends, every stream's, in one hand-over
        t_deliver = perf_counter()
        # the step-time fit after the tokens are out (the server's timer fits on a
        # thread of its own; this takes its new model once it is in). It learns the
        # round, not the forward pass alone: admitting, scheduling and handing out the
        # tokens are part of each step's pace as a request lives it: a two-backend
        # fleet simulated on forward times alone ran 11-18 % faster than the real one,
        # on the rounds 6-15 %, on rounds summed to their total -2 to +5 % (the fit's
        # sum_calibrated; docs/fleet-real.md).
        if shape is not None:
            _, prefill, decoders, kv, attn = shape
            if (
                self.timer.observe(t_deliver - t0, prefill, decoders, kv, attn)
                and not self._fixed_cost
            ):
                ex.cost = self.timer.as_cost()
        t_fit = perf_counter()
        if nxt is not None and nxt >= 0:
            self._wait(min(self._idle_wait_s, max(0.0, nxt - ex.clock_now())))
        forward = shape[0] if shape is not None else 0.0
        self._log(
            t0,
            shape,
            drain=t_drain - t0,
            schedule=max(0.0, t_tick - t_drain - forward - self._deliver_s),
            forward=forward,
            refresh=t_refresh - t_tick + t_fit - t_deliver,
            deliver=self._deliver_s + t_deliver - t_refresh,
            idle=perf_counter() - t_fit,
        )

    def _log(
        self, t0: float, shape: tuple[float, int, int, int, float] | None, **parts: float
    ) -> None:
        """One :class:`StepRow` into :attr:`step_log`, if one is kept: the round's
        ``parts`` (seconds; the rest 0) and its step's shape."""
        if self.step_log is None:
            return
        _, prefill, decoders, kv, _ = shape if shape is not None else (0.0, 0, 0, 0, 0)
        self.step_log.add(
            StepRow(
                start=t0 - self._t_origin,
                decoders=decoders,
                prefill_tokens=prefill,
                kv_tokens=kv,
                **parts,
            )
        )

    def _wait(self, seconds: float) -> None:
        if seconds > 0:
            self._wake.wait(seconds)
        self._wake.clear()

    def _drain_inbox(self) -> None:
        with self._lock:
            items, self._inbox = self._inbox, []
            self._draining = [p.job for kind, p in items if kind == "submit"]
        if not items:
            return
        ex = self.executor
        ex.now = ex.clock_now()
        done_before = ex.n_done
        try:
            for kind, payload in items:
                self._take(kind, payload)
            if ex.n_done != done_before:  # a prompt that can never fit is refused at once
                self._publish_ends()
        finally:
            self._refresh_stats()  # the image holds them now: off the hand-over list
            with self._lock:
                self._draining = []
            self._flush()

    def _take(self, kind: str, payload: Any) -> None:
        """One inbox item onto the executor: a submission, or the end of a request."""
        ex = self.executor
        if kind != "submit":
            if ex.abort(payload):
                self._finish(payload, "abort" if kind == "abort" else "stop")
            return
        sub: Submission = payload
        rid = sub.job.request.rid
        try:
            ex.admit_arrival(sub.job)
        except Exception as e:  # one bad request must not stop the loop
            self._send(sub.stream, self._outcome(sub.job, "error", error=str(e)))
            return
        self._live[rid] = LiveRequest(sub.job, sub.stream)
        if sub.stop is not None:
            ex.stop_tokens[rid] = sub.stop
        if sub.segmenter is not None:
            ex.segmenters[rid] = sub.segmenter
        if sub.sampler is not None:
            ex.samplers[rid] = sub.sampler
        if sub.logprobs is not None:
            ex.logprob_logs[rid] = sub.logprobs
        if sub.grammar is not None:
            ex.grammars[rid] = sub.grammar
