"""The server's length predictions: requests waiting together are predicted in one batch."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest

from duetime.core.request import Job, LengthPrediction, Request
from duetime.server.predict_batcher import PredictBatcher


def _job(rid: int) -> Job:
    return Job(Request(rid=rid, arrival=0.0, prompt_len=5), 4)


class _Slow:
    """A predictor that takes ``delay`` a batch and answers rid × 10 for each job."""

    def __init__(self, delay: float = 0.05, fail_on: int | None = None) -> None:
        self.delay = delay
        self.fail_on = fail_on
        self.batches: list[list[int]] = []
        self.threads: set[str] = set()

    def __call__(self, jobs: Sequence[Job]) -> list[LengthPrediction | None]:
        rids = [j.request.rid for j in jobs]
        self.batches.append(rids)
        self.threads.add(threading.current_thread().name)
        time.sleep(self.delay)
        if self.fail_on in rids:
            raise ValueError(f"no prediction for {self.fail_on}")
        return [LengthPrediction.exact(10.0 * r) for r in rids]


def _run(batcher: PredictBatcher, rids: list[int], gap: float = 0.0) -> list[object]:
    async def main() -> list[object]:
        tasks = []
        for rid in rids:
            tasks.append(asyncio.ensure_future(batcher.predict(_job(rid))))
            await asyncio.sleep(gap)
        return await asyncio.gather(*tasks, return_exceptions=True)

    return asyncio.run(main())


def test_requests_that_wait_together_are_one_batch_and_each_gets_its_own() -> None:
    """The first goes alone at once; the nine that came meanwhile go together, at most
    four at a time; answers map back to their own jobs."""
    slow = _Slow()
    with ThreadPoolExecutor(1, "predict") as pool:
        got = _run(PredictBatcher(slow, pool, max_batch=4), list(range(10)))
    assert [p.point for p in got] == [10.0 * r for r in range(10)]  # type: ignore[union-attr]
    assert slow.batches == [[0], [1, 2, 3, 4], [5, 6, 7, 8], [9]]
    assert slow.threads == {"predict_0"}  # never on the event loop's thread


def test_a_lone_request_is_not_held_back() -> None:
    """Requests far apart each run alone, without waiting for a batch to fill."""
    slow = _Slow(delay=0.0)
    with ThreadPoolExecutor(1) as pool:
        batcher = PredictBatcher(slow, pool)
        t = time.perf_counter()
        _run(batcher, [0, 1, 2], gap=0.02)
    assert slow.batches == [[0], [1], [2]]
    assert time.perf_counter() - t < 1.0


def test_a_failed_batch_fails_its_callers_and_not_the_next_batch() -> None:
    slow = _Slow(fail_on=2)
    with ThreadPoolExecutor(1) as pool:
        got = _run(PredictBatcher(slow, pool, max_batch=2), [0, 1, 2, 3, 4])
    assert slow.batches == [[0], [1, 2], [3, 4]]
    assert [type(g).__name__ for g in got] == [
        "LengthPrediction",
        "ValueError",
        "ValueError",
        "LengthPrediction",
        "LengthPrediction",
    ]


def test_a_caller_that_leaves_costs_the_others_nothing() -> None:
    """A request cancelled while it waits (its client left) is dropped from its batch."""
    slow = _Slow()

    async def main() -> list[object]:
        batcher = PredictBatcher(slow, pool)
        first = asyncio.ensure_future(batcher.predict(_job(0)))
        await asyncio.sleep(0.01)  # the first batch is running
        waiting = [asyncio.ensure_future(batcher.predict(_job(r))) for r in (1, 2, 3)]
        await asyncio.sleep(0)
        waiting[1].cancel()
        return await asyncio.gather(first, *waiting, return_exceptions=True)

    with ThreadPoolExecutor(1) as pool:
        got = asyncio.run(main())
    assert slow.batches == [[0], [1, 3]]
    assert isinstance(got[2], asyncio.CancelledError)
    assert [g.point for g in (got[0], got[1], got[3])] == [0.0, 10.0, 30.0]  # type: ignore[union-attr]


def test_a_wrong_count_of_predictions_is_an_error_not_a_misfiled_answer() -> None:
    with ThreadPoolExecutor(1) as pool:
        batcher = PredictBatcher(lambda jobs: [None], pool)
        got = _run(batcher, [0, 1, 2])
    assert isinstance(got[1], RuntimeError)
    assert "1 predictions for 2 requests" in str(got[1])
    with pytest.raises(ValueError, match="max_batch"):
        PredictBatcher(lambda jobs: [], pool, max_batch=0)


def test_the_server_predicts_concurrent_requests_together_and_caps_them() -> None:
    """Through HTTP: a predictor that takes batches gets them, and each answer's
    ``predicted_tokens`` is its own prediction capped at its ``max_tokens``."""
    import httpx

    from duetime.server.app import create_app
    from duetime.server.threaded import serve_in_thread
    from tests.served import MODEL, tiny_state, wait_idle

    class Batched:
        name = "batched"

        def __init__(self) -> None:
            self.sizes: list[int] = []

        def predict_requests(self, requests: Sequence[Request]) -> list[LengthPrediction]:
            self.sizes.append(len(requests))
            time.sleep(0.2)  # long enough for the other requests to queue behind it
            return [LengthPrediction.exact(float(r.prompt_len)) for r in requests]

        def predict_job(self, job: Job) -> LengthPrediction:  # (the protocol's; unused)
            raise AssertionError("one at a time")

    state = tiny_state()
    state.predictor = fake = Batched()
    bodies = [{"model": MODEL, "prompt": "x" * k, "max_tokens": 6} for k in range(1, 13)]
    with serve_in_thread(create_app(state)) as url:

        def post(body: dict[str, object]) -> dict[str, object]:
            return httpx.post(url + "/v1/completions", json=body, timeout=60).json()

        with ThreadPoolExecutor(len(bodies)) as clients:
            answers = list(clients.map(post, bodies))
        wait_idle(state)
    prompt_lens = [len(state.codec.encode(str(b["prompt"]))) for b in bodies]
    got = [a["duetime"]["predicted_tokens"] for a in answers]  # type: ignore[index]
    assert got == [min(6.0, n) for n in prompt_lens]
    assert sum(fake.sizes) == len(bodies)
    assert max(fake.sizes) > 1
