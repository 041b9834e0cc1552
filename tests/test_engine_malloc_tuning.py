"""Malloc tuned once per process for the engine's large temporaries (or left alone)."""

from __future__ import annotations

import pytest

from duetime.engine import malloc_tuning
from duetime.engine.malloc_tuning import (
    MMAP_THRESHOLD,
    TOP_PAD,
    TRIM_THRESHOLD,
    keep_large_blocks,
)


class _Libc:
    def __init__(self, answer: int = 1) -> None:
        self.calls: list[tuple[int, int]] = []
        self.answer = answer

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return self.answer


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv("DUETIME_MALLOC", raising=False)
    state = dict(malloc_tuning._done)
    malloc_tuning._reset()
    yield
    malloc_tuning._done.clear()
    malloc_tuning._done.update(state)


def test_the_three_settings_are_made_once_per_process() -> None:
    libc = _Libc()
    assert keep_large_blocks(libc)
    assert libc.calls == [(-3, MMAP_THRESHOLD), (-1, TRIM_THRESHOLD), (-2, TOP_PAD)]
    assert keep_large_blocks(libc)  # a second model: nothing more
    assert len(libc.calls) == 3


def test_the_variable_leaves_malloc_alone(monkeypatch) -> None:
    monkeypatch.setenv("DUETIME_MALLOC", "0")
    libc = _Libc()
    assert not keep_large_blocks(libc)
    assert libc.calls == []


def test_a_refused_setting_is_reported(caplog) -> None:
    assert not keep_large_blocks(_Libc(answer=0))
    assert "mallopt refused" in caplog.text


def test_this_machines_glibc_takes_them() -> None:
    if malloc_tuning._glibc() is None:
        pytest.skip("not glibc")
    assert keep_large_blocks()
