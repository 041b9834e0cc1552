"""Suite-wide settings.

Tiny test models are dominated by per-op overhead, and `make test` runs two
pytest workers on a 2-core machine: letting torch spawn its own threads on top
oversubscribes the cores and made the engine tests ~17x slower. One thread per
worker is the fast setting here (speed itself is measured by `duetime bench`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture
def native(monkeypatch) -> Callable[[bool], None]:
    """Set whether this 'CPU' computes bfloat16 natively (``duetime.predict.precision``)."""

    def set_native(value: bool) -> None:
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: value, raising=False)

    return set_native


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, Any]]:
    """A server of the tiny random-weight model in a thread: its URL and its state (one
    per test module that asks)."""
    from duetime.server.app import create_app
    from duetime.server.threaded import serve_in_thread
    from tests.served import tiny_state

    state = tiny_state()
    with serve_in_thread(create_app(state)) as url:
        yield url, state


@pytest.fixture(scope="module")
def client(served: tuple[str, Any]) -> Any:
    """An OpenAI client of :func:`served` (no retries: a failure shows as it is)."""
    import openai

    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0)
