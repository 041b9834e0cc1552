"""Read a GGUF file's metadata and tensors, with errors that name the file and the problem.

Why not ``gguf.GGUFReader``: it builds one numpy view per array element while it
parses the header, and the Gemma 3 file carries three 262,144-entry tokenizer
arrays, so opening the 253 MB file took 21 s here. This parser walks the same
header in ~0.2 s, keeps string arrays as undecoded offsets until asked, and reuses
the ``gguf`` package for everything that is not header parsing: the type
enums, block sizes and ``gguf.quants.dequantize``. It only reads; it never writes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFValueType,
)
from gguf.quants import dequantize, quant_shape_to_byte_shape

__all__ = ["GGUFFile", "ModelFileError", "TensorInfo"]

VT = GGUFValueType

_SCALARS: dict[VT, tuple[str, int]] = {
    VT.UINT8: ("<B", 1),
    VT.INT8: ("<b", 1),
    VT.UINT16: ("<H", 2),
    VT.INT16: ("<h", 2),
    VT.UINT32: ("<I", 4),
    VT.INT32: ("<i", 4),
    VT.FLOAT32: ("<f", 4),
    VT.BOOL: ("<?", 1),
    VT.UINT64: ("<Q", 8),
    VT.INT64: ("<q", 8),
    VT.FLOAT64: ("<d", 8),
}
_NP_SCALARS: dict[VT, str] = {
    VT.UINT8: "<u1",
    VT.INT8: "<i1",
    VT.UINT16: "<u2",
    VT.INT16: "<i2",
    VT.UINT32: "<u4",
    VT.INT32: "<i4",
    VT.FLOAT32: "<f4",
    VT.BOOL: "?",
    VT.UINT64: "<u8",
    VT.INT64: "<i8",
    VT.FLOAT64: "<f8",
}
# No honest GGUF header comes near these; they stop a corrupt length from
# making us allocate or loop for ever.
_MAX_COUNT = 1 << 31
_MAX_DIMS = 8


class ModelFileError(ValueError):
    """A model file is missing, truncated, corrupt or not the model we expect.

    The message always names the path, so a user can tell which file to fetch again.
    A ValueError because it is bad input: the CLI reports those as one line, exit 2.
    """

    def __init__(self, path: str | Path, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{path}: {problem}")


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where one tensor lies in the file and how it is encoded.

    ``shape`` is in numpy/torch order (outermost first), i.e. GGUF's ``ne``
    reversed, so a linear layer's weight reads ``(out_features, in_features)``.
    """

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True, slots=True)
class _StringArray:
    """A string array left undecoded: decoding 262k tokens is only done on request."""

    offset: int
    count: int


class _Cursor:
    """Bounds-checked little-endian reads over a memory map."""

    def __init__(self, path: Path, buf: np.memmap) -> None:
        self.path = path
        self.buf = buf
        self.mv = memoryview(buf.data)
        self.pos = 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise ModelFileError(
                self.path,
                f"file ends at byte {len(self.buf)} while reading {what} "
                f"(needs {self.pos + n}); it is truncated or corrupt",
            )

    def scalar(self, vtype: VT, what: str) -> Any:
        fmt, size = _SCALARS[vtype]
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.mv, self.pos)
        self.pos += size
        return value

    def u32(self, what: str) -> int:
        return int(self.scalar(VT.UINT32, what))

    def u64(self, what: str) -> int:
        return int(self.scalar(VT.UINT64, what))

    def string(self, what: str) -> str:
        n = self.u64(what)
        if n > _MAX_COUNT:
            raise ModelFileError(self.path, f"implausible string length {n} in {what}")
        self.need(n, what)
        raw = bytes(self.mv[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ModelFileError(self.path, f"{what} is not valid UTF-8") from err

    def skip_strings(self, count: int, what: str) -> None:
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            self.need(8, what)
            (n,) = unpack(self.mv, self.pos)
            self.pos += 8
            self.need(n, what)
            self.pos += n


class GGUFFile:
    """Metadata and tensor directory of a GGUF v2/v3 file, with lazy tensor reads.

    ``metadata`` maps keys to Python scalars, strings or numpy arrays; string
    arrays are decoded by :meth:`strings`. :meth:`read` dequantizes one tensor
    to float32 with ``gguf.quants.dequantize``.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise ModelFileError(self.path, "file does not exist")
        if not self.path.is_file():
            raise ModelFileError(self.path, "not a regular file")
        size = self.path.stat().st_size
        if size < 24:
            raise ModelFileError(self.path, f"only {size} bytes; too short to be a GGUF file")
        try:
            self._buf = np.memmap(self.path, mode="r", dtype=np.uint8)
        except (OSError, ValueError) as err:
            raise ModelFileError(self.path, f"cannot be read: {err}") from err
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._parse()

    def _parse(self) -> None:
        cur = _Cursor(self.path, self._buf)
        if cur.u32("magic") != GGUF_MAGIC:
            raise ModelFileError(self.path, "not a GGUF file (bad magic number)")
        self.version = cur.u32("version")
        if self.version not in (2, 3):
            raise ModelFileError(self.path, f"unsupported GGUF version {self.version}")
        n_tensors = cur.u64("tensor count")
        n_kv = cur.u64("metadata count")
        if n_tensors > _MAX_COUNT or n_kv > _MAX_COUNT:
            raise ModelFileError(self.path, "implausible tensor or metadata count; corrupt header")
        for _ in range(n_kv):
            key = cur.string("metadata key")
            self.metadata[key] = self._value(cur, self._vtype(cur.u32(key), key), key)
        infos: list[tuple[str, tuple[int, ...], GGMLQuantizationType, int]] = []
        for _ in range(n_tensors):
            name = cur.string("tensor name")
            n_dims = cur.u32(name)
            if not 0 < n_dims <= _MAX_DIMS:
                raise ModelFileError(self.path, f"tensor {name} has {n_dims} dimensions")
            ne = [cur.u64(name) for _ in range(n_dims)]
            raw_type = cur.u32(name)
            try:
                qtype = GGMLQuantizationType(raw_type)
            except ValueError as err:
                problem = f"tensor {name} has unknown type {raw_type}"
                raise ModelFileError(self.path, problem) from err
            infos.append((name, tuple(reversed(ne)), qtype, cur.u64(name)))
        align = int(self.metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
        if align <= 0 or align & (align - 1):
            raise ModelFileError(self.path, f"invalid alignment {align}")
        data_start = -(-cur.pos // align) * align
        file_size = len(self._buf)
        for name, shape, qtype, rel in infos:
            block, type_size = GGML_QUANT_SIZES[qtype]
            n_elem = int(np.prod(shape))
            if shape[-1] % block:
                problem = f"tensor {name} row is not whole {qtype.name} blocks"
                raise ModelFileError(self.path, problem)
            nbytes = n_elem // block * type_size
            start = data_start + rel
            if start + nbytes > file_size:
                raise ModelFileError(
                    self.path,
                    f"truncated: tensor {name} needs bytes up to {start + nbytes} "
                    f"but the file has {file_size}",
                )
            if name in self.tensors:
                raise ModelFileError(self.path, f"duplicate tensor {name}")
            self.tensors[name] = TensorInfo(name, shape, qtype, start, nbytes)

    def _vtype(self, raw: int, key: str) -> VT:
        try:
            return VT(raw)
        except ValueError as err:
            raise ModelFileError(self.path, f"metadata {key} has unknown type {raw}") from err

    def _value(self, cur: _Cursor, vtype: VT, key: str) -> Any:
        if vtype == VT.STRING:
            return cur.string(key)
        if vtype != VT.ARRAY:
            return cur.scalar(vtype, key)
        itype = self._vtype(cur.u32(key), key)
        count = cur.u64(key)
        if count > _MAX_COUNT:
            raise ModelFileError(self.path, f"implausible array length {count} in {key}")
        if itype == VT.STRING:
            arr = _StringArray(cur.pos, count)
            cur.skip_strings(count, key)
            return arr
        if itype == VT.ARRAY:
            return [self._value(cur, VT.ARRAY, key) for _ in range(count)]
        dtype = np.dtype(_NP_SCALARS[itype])
        cur.need(count * dtype.itemsize, key)
        out = np.frombuffer(self._buf, dtype=dtype, count=count, offset=cur.pos).copy()
        cur.pos += count * dtype.itemsize
        return out

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value; string arrays come back decoded as ``list[str]``."""
        value = self.metadata.get(key, default)
        return self.strings(key) if isinstance(value, _StringArray) else value

    def strings(self, key: str) -> list[str]:
        """Decode a string-array metadata value (e.g. ``tokenizer.ggml.tokens``)."""
        ref = self.metadata[key]
        if not isinstance(ref, _StringArray):
            raise TypeError(f"{key} is not a string array")
        cur = _Cursor(self.path, self._buf)
        cur.pos = ref.offset
        return [cur.string(key) for _ in range(ref.count)]

    def read(self, name: str) -> np.ndarray:
        """Dequantize one tensor to a float32 array in numpy/torch shape order."""
        info = self.tensors[name]
        raw = self._buf[info.offset : info.offset + info.nbytes]
        if info.qtype == GGMLQuantizationType.F32:
            return np.array(raw.view(np.float32).reshape(info.shape))
        if info.qtype == GGMLQuantizationType.F16:
            return raw.view(np.float16).astype(np.float32).reshape(info.shape)
        try:
            data = np.asarray(raw).reshape(quant_shape_to_byte_shape(info.shape, info.qtype))
            out = dequantize(data, info.qtype)
        except NotImplementedError as err:
            problem = f"tensor {name}: {info.qtype.name} is not supported"
            raise ModelFileError(self.path, problem) from err
        return np.ascontiguousarray(out, dtype=np.float32).reshape(info.shape)
