"""Malloc tuned once per process for the engine's large temporaries (or left alone)."""

from __future__ import annotations

import pytest

from duetime.engine import malloc_tuning
from duetime.engine.malloc_tuning import (
    ARENA_MAX,
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


def test_the_four_settings_are_made_once_per_process() -> None:
    libc = _Libc()
    assert keep_large_blocks(libc)
    assert libc.calls == [
        (-3, MMAP_THRESHOLD),
        (-1, TRIM_THRESHOLD),
        (-2, TOP_PAD),
        (-8, ARENA_MAX),
    ]
    assert keep_large_blocks(libc)  # a second model: nothing more
    assert len(libc.calls) == 4


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


_THREAD_BLOCK = """
import threading
from duetime.engine.malloc_tuning import keep_large_blocks, large_blocks_mapped

assert keep_large_blocks()
tuned = []
for _ in range(2):
    t = threading.Thread(target=lambda: tuned.append(large_blocks_mapped()))
    t.start()
    t.join()
print(tuned, large_blocks_mapped())
"""


def test_a_threads_large_temporaries_come_from_the_tuned_heap() -> None:
    """The server steps the engine on a thread of its own: its ~100 MiB temporaries
    must come from the heap, not a fresh mmap each step (a thread's own arena maps
    anything over 64 MiB, whatever the threshold)."""
    import subprocess
    import sys

    if malloc_tuning.large_blocks_mapped() is None:
        pytest.skip("not glibc >= 2.33")
    out = subprocess.run(
        [sys.executable, "-c", _THREAD_BLOCK], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[False, False] False"
