"""Two file-system guarantees the workload code relies on: atomic writes and a build lock."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: builds are then merely not deduplicated
    fcntl = None  # type: ignore[assignment]


@contextlib.contextmanager
def atomic_writer(path: Path, binary: bool = False) -> Iterator[IO[Any]]:
    """Write ``path`` all at once or not at all.

    Data goes to a hidden temporary file in the same directory (so the final
    rename cannot cross file systems), is flushed to disk, then renamed over
    ``path``. If the body raises, the temporary file is removed and ``path`` --
    old contents included -- is untouched.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") if binary else open(tmp, "x", encoding="utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


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
