"""Write metrics to disk so that a reader never sees half a file.

Sweeps run for hours and are killed, and dashboards poll result files while
they are being written; so :func:`write_json` serialises fully in memory
first, then writes through :func:`duetime.metrics.atomic.atomic_path`
(temporary file beside the target, fsync, ``os.replace``). A payload
that fails to serialise raises before any file is touched.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from duetime.metrics.atomic import atomic_path


def write_json(path: str | os.PathLike[str], payload: Any, *, indent: int | None = 2) -> Path:
    """Atomically write ``payload`` as strict JSON to ``path``; returns the path.

    Parent directories are created. numpy scalars and arrays become Python
    numbers and lists, dataclasses become dicts, paths become strings, and
    NaN/±inf become ``null`` (strict JSON has no spelling for them; in our
    metrics they mean "undefined"). Anything else that ``json`` cannot encode
    raises :class:`TypeError`, leaving any existing file untouched.
    """
    target = Path(path)
    text = json.dumps(to_jsonable(payload), indent=indent, allow_nan=False) + "\n"
    with atomic_path(target) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    return target


def to_jsonable(obj: Any) -> Any:
    """A copy of ``obj`` made only of JSON types; raises TypeError on anything unknown."""
    if obj is None or isinstance(obj, str | bool | int):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, np.generic):
        return to_jsonable(obj.item())
    if isinstance(obj, np.ndarray):
        return to_jsonable(obj.tolist())
    if isinstance(obj, Mapping):
        return {_key(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_jsonable(v) for v in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return to_jsonable(dataclasses.asdict(obj))
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    raise TypeError(f"cannot write {type(obj).__name__} as JSON: {obj!r:.80}")


def _key(k: Any) -> str:
    if isinstance(k, str):
        return k
    if isinstance(k, np.generic):
        k = k.item()
    if k is None or isinstance(k, bool | int | float):
        return json.dumps(k)
    raise TypeError(f"cannot use {type(k).__name__} as a JSON key: {k!r:.80}")
