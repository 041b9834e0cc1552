"""Replace a file in one step, so a reader sees the old content or the new, never half."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def atomic_path(target: Path, mode: int = 0o644) -> Iterator[str]:
    """Yield a temporary path beside ``target``; on success rename it over ``target``.

    The temporary file lives in the same directory so that ``os.replace`` is a
    rename within one filesystem (atomic on POSIX and Windows). If the body
    raises, the temporary file is removed and ``target`` is left as it was.
    Parent directories are created. ``mode`` replaces mkstemp's private 0600:
    results are meant to be read by others.

    A ``target`` that exists and is not a regular file (``/dev/stdout``, a
    FIFO, ``/dev/null``) is yielded itself and written in place: renaming over
    it would put a regular file where the device or pipe was (as root, that
    replaced ``/dev/null``), and atomicity means nothing for a stream. A pipe whose
    reader has gone ends the write quietly, as the consoles fall silent
    (:mod:`duetime.cli.console`): what the reader left unread was its choice.
    """
    if is_stream(target):
        try:
            yield str(target)
        except BrokenPipeError:  # `--json /dev/stdout | head -1`: the reader took its part
            return
        except OSError as e:  # /dev/full: "No space left on device" named no file
            raise named_error(e, target, str(target)) from None
        return
    try:
        prepare_parent(target)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as e:  # name the file the caller asked for, not our temporary one
        raise type(e)(e.errno, e.strerror, str(target)) from None
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())  # the bytes must be on disk before the name points at them
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(e, OSError):  # a full disk while writing named no file, or the temporary
            raise named_error(e, target, tmp) from None
        raise


def named_error(e: OSError, target: Path, written: str) -> OSError:
    """``e`` naming ``target`` where it named no file or ``written`` (what was being
    written), so that the one-line error says which output failed; ``e`` itself otherwise."""
    if e.filename is not None and e.filename != written:
        return e
    try:
        return type(e)(e.errno, e.strerror or str(e), str(target))
    except Exception:  # a subclass with a constructor of its own: as raised
        return e


def is_stream(target: Path) -> bool:
    """Whether ``target`` exists as something other than a regular file or a directory."""
    try:
        mode = target.stat().st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def prepare_parent(target: Path, *, create: bool = True) -> Path:
    """Create ``target``'s parent directories, or raise an OSError that says why not.

    Checked first: ``target`` being a directory, or a file where a parent
    directory should be (mkdir would only say "File exists"). With ``create``
    false nothing is made: the nearest existing ancestor is returned, for a
    check that must leave no trace (an output option checked before a run
    that then fails left an empty ``out/`` behind).
    """
    if target.is_dir():
        raise IsADirectoryError(errno.EISDIR, "is a directory, not a file", str(target))
    home = next(p for p in target.parents if p.exists())
    if not home.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, f"{home} is not a directory", str(target))
    if create:
        target.parent.mkdir(parents=True, exist_ok=True)
    return home


def save_png(fig: Any, path: str | os.PathLike[str], dpi: int = 110) -> Path:
    """Write a matplotlib figure atomically (a reader never sees half a file) in the
    format its name's suffix asks for where matplotlib writes it (``.pdf``, ``.svg``),
    else PNG.

    Works for pyplot figures and bare ``matplotlib.figure.Figure`` objects, and
    closes pyplot figures afterwards so long sweeps do not accumulate them.
    """
    target = Path(path)
    fmt = target.suffix.lower().lstrip(".")
    if fmt not in fig.canvas.get_supported_filetypes():
        fmt = "png"
    with atomic_path(target) as tmp:
        fig.savefig(tmp, format=fmt, dpi=dpi)
    import matplotlib.pyplot as plt

    if plt.fignum_exists(getattr(fig, "number", -1)):
        plt.close(fig)
    return target


def save_titled_png(fig: Any, path: str | os.PathLike[str], title: str) -> Path:
    """A benchmark figure's finish: ``title`` above its panels (small, as the panels'
    titles), a tight layout, then :func:`save_png`; one place for the benches' look."""
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return save_png(fig, path)
