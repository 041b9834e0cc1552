"""The engine executor with TimeBill's deployment (arXiv 2512.21859, Sec. 5.2, Fig. 4).

On arrival the response-length predictor starts on a worker thread while the
engine runs the prompt's prefill; the policy first sees the request's
``predicted`` length at the scheduling point after the prefill, which is when
TimeBill fixes α*. If the predictor is still running then, the engine waits for
it (that wait is the ``t_Predict − t_prefill`` the paper's prompt compression is
there to remove) before asking the policy.

Two more things make a benchmark of periodic jobs affordable without changing
what is measured: an idle engine does not sleep until the next release, its
clock jumps there (every step is still timed on the wall clock), and per
request it records the predictor's time, the prefill's time and the wait.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from duetime.core.request import Job
from duetime.core.sequence import Seq
from duetime.engine.executor import EngineExecutor


@dataclass(slots=True)
class PredictTiming:
    """One request's predictor and prefill times, seconds."""

    predict_s: float | None = None
    prefill_s: float | None = None
    started_s: float | None = None  # executor clock when its prefill began
    wait_s: float = 0.0  # the engine idled for the predictor after the prefill


class ParallelPredictExecutor(EngineExecutor):
    """:class:`EngineExecutor` whose length predictor runs beside the prefill.

    ``predictor`` has ``predict_job(job) -> LengthPrediction`` (a request that
    already carries ``predicted`` is not predicted again). ``skip_idle`` makes
    the clock jump over idle gaps instead of sleeping through them.
    """

    def __init__(
        self, policy: Any, model: Any, *, predictor: Any = None, skip_idle: bool = True, **kw: Any
    ) -> None:
        super().__init__(policy, model, predictor=None, skip_idle=skip_idle, **kw)
        self.length_predictor = predictor
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlp")
        self._futures: dict[int, Future[Any]] = {}
        self._prefill_t0: dict[int, float] = {}
        self.timing: dict[int, PredictTiming] = {}

    def admit_arrival(self, job: Job) -> None:
        req = job.request
        if self.length_predictor is not None and req.predicted is None:
            self._futures[req.rid] = self._pool.submit(self._timed_predict, job)
        self.timing[req.rid] = PredictTiming()
        super().admit_arrival(job)

    def _timed_predict(self, job: Job) -> tuple[Any, float]:
        t0 = time.perf_counter()
        pred = self.length_predictor.predict_job(job)
        return pred, time.perf_counter() - t0

    def tick(self) -> float | None:
        # TimeBill decides α* right after the prefill: the prediction must be in by then.
        for seq in self.running.values():
            if seq.prefill_done and seq.rid in self._futures:
                self._join(seq)
        return super().tick()

    def _join(self, seq: Seq) -> None:
        fut = self._futures.pop(seq.rid)
        t0 = time.perf_counter()
        pred, predict_s = fut.result()
        self.timing[seq.rid].wait_s = time.perf_counter() - t0
        self.timing[seq.rid].predict_s = predict_s
        seq.req.predicted = pred

    def _run_step(self, chunks: list[tuple[Seq, int]], prefill_only: bool = False) -> float:
        now = self.clock_now()
        for seq, _ in chunks:
            if seq.prefilled == 0 and seq.rid not in self._prefill_t0:
                self._prefill_t0[seq.rid] = now
                if seq.rid in self.timing and self.timing[seq.rid].started_s is None:
                    self.timing[seq.rid].started_s = now
        dt = super()._run_step(chunks, prefill_only)
        end = self.clock_now()
        for seq, _ in chunks:
            t = self.timing.get(seq.rid)
            if t is not None and t.prefill_s is None and seq.prefilled >= seq.prefill_target:
                t.prefill_s = end - self._prefill_t0.pop(seq.rid)
        return dt

    def close(self) -> None:
        for rid, fut in list(self._futures.items()):
            # A request that ended before its prefill did (skipped, killed): still record
            # the predictor's time, which the paper's t_Predict is about.
            _, predict_s = fut.result()
            self.timing[rid].predict_s = predict_s
        self._futures.clear()
        self._pool.shutdown(wait=True)
        super().close()
