"""Length predictions of requests that arrive together, made in one batch.

The learned predictor runs on one thread (its tokenizer is not safe to share)
and a fine-tuned encoder takes ~6 ms a prompt alone on this CPU, but ~1.7 ms
a prompt in a batch of 16 (the encoder's matrices are too small to keep the
cores busy one prompt at a time). Requests queued behind one another for that
thread therefore go through it together: the first prediction starts at once,
and every request that arrives while a batch runs joins the next one (no
waiting for a batch to fill, so a lone request is not delayed).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from duetime.core.request import Job, LengthPrediction

__all__ = ["PredictBatcher"]

PredictMany = Callable[[Sequence[Job]], Sequence[LengthPrediction | None]]


class PredictBatcher:
    """Hands ``predict_many`` the jobs waiting for a prediction, at most ``max_batch``
    at a time, on ``pool``; each caller awaits its own job's prediction."""

    def __init__(self, predict_many: PredictMany, pool: ThreadPoolExecutor, max_batch: int = 16):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.predict_many = predict_many
        self.pool = pool
        self.max_batch = max_batch
        self._pending: list[tuple[Job, asyncio.Future[LengthPrediction | None]]] = []
        self._draining = False
        self._task: asyncio.Task[None] | None = None  # held: an unreferenced task may vanish

    async def predict(self, job: Job) -> LengthPrediction | None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[LengthPrediction | None] = loop.create_future()
        self._pending.append((job, fut))
        if not self._draining:
            self._draining = True
            self._task = loop.create_task(self._drain())
        return await fut

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._pending:
                batch = self._pending[: self.max_batch]
                del self._pending[: self.max_batch]
                batch = [(j, f) for j, f in batch if not f.done()]  # callers gone: skip them
                if not batch:
                    continue
                jobs = [j for j, _ in batch]
                try:
                    preds = await loop.run_in_executor(self.pool, self.predict_many, jobs)
                    if len(preds) != len(jobs):
                        raise RuntimeError(f"{len(preds)} predictions for {len(jobs)} requests")
                except Exception as e:  # every caller of the batch hears of it
                    for _, f in batch:
                        if not f.done():
                            f.set_exception(e)
                    continue
                for (_, f), p in zip(batch, preds, strict=True):
                    if not f.done():
                        f.set_result(p)
        finally:
            self._draining = False
