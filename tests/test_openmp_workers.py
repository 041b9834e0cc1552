"""Only the engine's thread computes on OpenMP workers (``engine/openmp_workers.py``).

Each check runs the thread-count changes on threads of its own (or restores the
main thread's count), so the rest of the suite keeps its threads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from duetime.engine.executor import EngineExecutor
from duetime.engine.openmp_workers import compute_on_one_thread, libgomp, release_workers
from duetime.engine.testing import engine_from_hf, tiny_hf_model
from duetime.policies import make_policy
from duetime.server import engine_loop
from duetime.server.codec import ByteCodec
from duetime.server.engine_loop import EngineLoop


def _on_thread(fn: Callable[[], Any]) -> Any:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_a_released_thread_computes_on_one_thread_and_gives_its_workers_back() -> None:
    def released() -> tuple[bool, int]:
        torch.set_num_threads(2)
        torch.ones(100_000).add_(1)  # a parallel region: this thread now has workers
        return release_workers(), torch.get_num_threads()

    gave_back, threads = _on_thread(released)
    assert threads == 1
    assert gave_back == (libgomp() is not None)


def test_compute_on_one_thread_holds_for_its_thread_only() -> None:
    before = torch.get_num_threads()

    def one() -> int:
        compute_on_one_thread()
        return torch.get_num_threads()

    assert _on_thread(one) == 1
    assert torch.get_num_threads() == before  # the caller's count is its own


@pytest.fixture
def main_threads() -> Any:
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def test_the_engine_thread_takes_the_builders_count_and_the_starter_gives_its_workers_back(
    main_threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.set_num_threads(2)
    model = engine_from_hf(tiny_hf_model(seed=0, vocab_size=ByteCodec.vocab_size))
    loop = EngineLoop(lambda: EngineExecutor(make_policy("fcfs"), model, kv_capacity=256))
    seen: dict[str, int] = {}

    def own(threads: int) -> None:
        engine_loop_own(threads)
        seen[threading.current_thread().name] = torch.get_num_threads()

    engine_loop_own = engine_loop.own_workers
    monkeypatch.setattr(engine_loop, "own_workers", own)
    loop.start()
    try:
        assert torch.get_num_threads() == 1  # the starter (here the main thread) released
        deadline = time.monotonic() + 30
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        loop.stop()
    assert seen == {"duetime-engine": 2}
