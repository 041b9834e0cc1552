"""Versioned ``.npz`` files with a JSON header: the RLP's model file and its token bundle.

Both are arrays plus a header naming their ``format`` and ``version``. They are
written atomically (a half-written file never replaces a good one) and read
without pickles; a file of another format or version is refused with an error
that names the file, what it is, and how to make a readable one, instead of
being misread.
"""

from __future__ import annotations

import json
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


def save_npz(path: str | Path, header: dict[str, Any], arrays: dict[str, np.ndarray]) -> Path:
    """Write ``arrays`` and ``header`` (JSON, under the key ``header``), compressed, atomically."""
    from duetime.workloads._files import atomic_writer

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload: dict[str, Any] = {"header": np.asarray(json.dumps(header, sort_keys=True)), **arrays}
    with atomic_writer(path, binary=True) as f:
        np.savez_compressed(f, **payload)
    return path


def load_npz(
    path: str | Path,
    *,
    fmt: str,
    version: int,
    what: str,
    fix: str,
    error: type[Exception] = ValueError,
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``(header, arrays)`` of a file of format ``fmt`` and version ``version``.

    Anything else raises ``error``: "<path>: not a <what> (...)" for a file
    that is not one, "<path>: <what> version N, but this duetime reads version
    M; <fix>" for another version. A missing file raises FileNotFoundError.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"PK\x03\x04":  # a zip: np.load read text as a pickle and
                raise ValueError("not an .npz archive")  # advised allow_pickle=True
        data = np.load(path, allow_pickle=False)  # a zip: an NpzFile
        with data:
            raw = str(data["header"]) if "header" in data.files else None
            arrays = {k: data[k] for k in data.files if k != "header"}
    # A truncated or corrupt zip fails in zipfile or zlib, on opening or on reading a member
    # (members are read lazily), with errors that name no file: all become "not a <what>".
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise error(f"{path}: not a {what} ({e})") from None
    if raw is None:
        raise error(f"{path}: not a {what} (no header)")
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise error(f"{path}: not a {what} (its header is not JSON: {e})") from None
    if not isinstance(header, dict):
        raise error(f"{path}: not a {what} (its header is a JSON {type(header).__name__})")
    if header.get("format") != fmt:
        raise error(f"{path}: not a {what} (format {header.get('format')!r}, expected {fmt!r})")
    if header.get("version") != version:
        raise error(
            f"{path}: {what} version {header.get('version')}, but this duetime reads "
            f"version {version}; {fix}"
        )
    return header, arrays


@dataclass(slots=True, frozen=True)
class NpzKind:
    """One kind of file: the ``format`` and ``version`` its header names, and how a
    refusal reads (:func:`load_npz`). Its :meth:`save` writes the two header keys
    that its :meth:`load` checks, so a file kind states them once."""

    fmt: str
    version: int
    what: str  # the refusals' name for it: "<path>: not a <what> (...)"
    fix: str  # how to make a readable one, said of a file of another version
    error: type[Exception] = ValueError

    def save(self, path: str | Path, header: dict[str, Any], arrays: dict[str, np.ndarray]) -> Path:
        """:func:`save_npz`, with this kind's ``format`` and ``version`` in ``header``."""
        return save_npz(path, {"format": self.fmt, "version": self.version, **header}, arrays)

    def load(self, path: str | Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """:func:`load_npz` of a file of this kind: ``(header, arrays)``, or ``error``."""
        return load_npz(
            path, fmt=self.fmt, version=self.version, what=self.what, fix=self.fix, error=self.error
        )
