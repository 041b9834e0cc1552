"""Two file-system guarantees the workload code relies on: atomic writes and a build lock."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from duetime.metrics.atomic import atomic_path

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: builds are then merely not deduplicated
    fcntl = None  # type: ignore[assignment]


@contextlib.contextmanager
def atomic_writer(path: Path, binary: bool = False) -> Iterator[IO[Any]]:
    """Write ``path`` all at once or not at all: an open file on :func:`atomic_path`.

    If the body raises, ``path`` -- old contents included -- is untouched.
    """
    with (
        atomic_path(Path(path)) as tmp,
        open(tmp, "wb") if binary else open(tmp, "w", encoding="utf-8") as f,
    ):
        yield f


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``path`` (created if missing).

    Used so that two processes (pytest-xdist workers, a benchmark and a test)
    wanting the same cache build it once: the second waits, then finds the file.
    """
    if fcntl is None:  # pragma: no cover
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
