"""Suite-wide settings.

Tiny test models are dominated by per-op overhead, and `make test` runs two
pytest workers on a 2-core machine: letting torch spawn its own threads on top
oversubscribes the cores and made the engine tests ~17x slower. One thread per
worker is the fast setting here (speed itself is measured by `duetime bench`).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture
def native(monkeypatch) -> Callable[[bool], None]:
    """Set whether this 'CPU' computes bfloat16 natively (``duetime.predict.precision``)."""

    def set_native(value: bool) -> None:
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: value, raising=False)

    return set_native
