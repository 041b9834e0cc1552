"""A file of int8 weights beside the fp32 weight cache, so ``q8`` starts without quantising.

Quantising Gemma 3 270M to the kernel's layout costs ~2.3 s of CPU (1.5 s of it
the 262,144 × 640 output layer) at every start; reading the 0.27 GB of int8
weights back from a safetensors file costs a fraction of that. The file is
keyed like the fp32 cache (GGUF stem, size, mtime) plus its own format version,
written atomically, and a file that is unreadable, of another version, or whose
shapes do not match the weights asked for is ignored and rewritten — a cache
can cost time, never correctness.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from duetime.engine.q8_kernel import Q8Weight, quantize_q8

__all__ = ["Q8Store", "q8_cache_path"]

log = logging.getLogger(__name__)

_FORMAT = "duetime-q8-v1"  # bump when quantize_q8's rounding or packed layout changes
_NAME = re.compile(r"(.+)-\d+-\d+-v\d+\.q8-v\d+\.safetensors")


def q8_cache_path(weight_cache: Path) -> Path:
    """``<stem>-<size>-<mtime>-v2.safetensors`` → ``<stem>-<size>-<mtime>-v2.q8-v1.safetensors``."""
    return weight_cache.with_name(weight_cache.stem + f".{_FORMAT.split('-', 1)[1]}.safetensors")


class Q8Store:
    """Quantised weights by name: read from ``path`` when valid, new ones added on demand.

    ``path=None``: a store that only quantises (nothing read or written).
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._have: dict[str, Q8Weight] = {}
        self.dirty = False
        if path is not None and path.is_file():
            self._have = self._read(path)

    def quantize(self, name: str, weight: torch.Tensor) -> Q8Weight:
        """The cached int8 form of ``weight`` (checked by shape), else a fresh one."""
        q = self._have.get(name)
        if q is not None and (q.out_features, q.in_features) == tuple(weight.shape):
            return q
        q = quantize_q8(weight)
        self._have[name] = q
        self.dirty = True
        return q

    def save(self) -> None:
        """Write the file (atomically) if anything was quantised since it was read."""
        if self.path is None or not self.dirty:
            return
        tensors: dict[str, torch.Tensor] = {}
        meta: dict[str, str] = {"format": _FORMAT}
        for name, q in self._have.items():
            tensors[f"{name}.packed"] = q.packed
            tensors[f"{name}.scale"] = q.scale
            meta[name] = f"{q.out_features},{q.in_features}"
        tmp: str | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
            os.close(fd)
            save_file(tensors, tmp, metadata=meta)
            os.replace(tmp, self.path)
            self.dirty = False
            # drop the int8 files of older versions/mtimes of the same GGUF
            if m := _NAME.fullmatch(self.path.name):
                for old in self.path.parent.glob(f"{m[1]}-*.safetensors"):
                    other = _NAME.fullmatch(old.name)
                    if old != self.path and other and other[1] == m[1]:
                        old.unlink(missing_ok=True)
        except OSError as err:  # a read-only cache dir must not stop the engine
            log.warning("could not write int8 weight cache %s: %s", self.path, err)
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)

    @staticmethod
    def _read(path: Path) -> dict[str, Q8Weight]:
        out: dict[str, Q8Weight] = {}
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                if meta.get("format") != _FORMAT:
                    return {}
                for name, shape in meta.items():
                    if name == "format":
                        continue
                    n, k = (int(v) for v in shape.split(","))
                    packed, scale = f.get_tensor(f"{name}.packed"), f.get_tensor(f"{name}.scale")
                    n4, k8 = -(-n // 4) * 4, -(-k // 8) * 8
                    if packed.shape != (n4 // 4, k8 // 8, 4, 8) or scale.shape != (n4,):
                        raise ValueError(f"{name}: shapes do not match {n}x{k}")
                    if packed.dtype != torch.int8 or scale.dtype != torch.float32:
                        raise ValueError(f"{name}: wrong dtypes")
                    out[name] = Q8Weight(packed, scale, n, k)
        except (SafetensorError, OSError, KeyError, ValueError, TypeError) as err:
            log.warning(
                "ignoring unreadable int8 weight cache %s (%s); quantising again", path, err
            )
            return {}
        return out
