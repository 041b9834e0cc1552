"""Keep large freed blocks in the process: glibc's malloc, tuned once for the engine.

Why: a decode step of many sequences makes temporaries of tens of megabytes (the
output layer's ``[rows, 262,144]`` logits: 16 MiB at 16 rows, 64 MiB at 64), and
glibc serves a block over its mmap threshold (dynamic, at most 32 MiB) with a
fresh ``mmap`` and gives it back with ``munmap`` when freed; smaller ones come
from the heap, whose top it trims back to the OS past a threshold. Either way the
next step page-faults the same memory in again, a fault per 4 KiB page. On Gemma 3
270M (`q8`, 2 threads) that was a quarter of a 64-sequence decode step: 126-128 ms
against 92-96 ms with the settings below (separate processes, run alternately),
and it moved 16-sequence steps between 33 and 42 ms from run to run.

So once per process, before the engine runs, blocks up to :data:`MMAP_THRESHOLD`
come from the heap, the heap's top is trimmed only past :data:`TRIM_THRESHOLD`
free, and it grows by :data:`TOP_PAD` at a time (``mallopt``). Larger blocks (the
weights as they load) still map and unmap.

Every thread allocates from that one heap (:data:`ARENA_MAX` = 1). glibc gives
each new thread an arena of its own, and an arena other than the main one grows in
heaps of at most 64 MiB: a step's larger temporaries then fall back to a fresh
``mmap`` whatever the threshold says. The server steps the engine on a thread of
its own, and there a 64-sequence decode step (256-token prompts) took 433 / 401 ms
against 274 / 313 ms on the main thread, and 263 / 311 ms with one arena (same
executor, two rounds). The threads that allocate besides the engine (HTTP, the
length predictor) mostly make small Python objects, which never reach malloc's lock.

The cost: memory freed after a peak stays with the process for reuse instead of
going back to the OS, up to :data:`TRIM_THRESHOLD` of it at the heap's top.
``DUETIME_MALLOC=0`` leaves malloc as it is; other C libraries (musl, macOS) are
left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
import threading
from typing import Any

__all__ = [
    "ARENA_MAX",
    "MMAP_THRESHOLD",
    "TOP_PAD",
    "TRIM_THRESHOLD",
    "keep_large_blocks",
    "large_blocks_mapped",
]

log = logging.getLogger(__name__)

MMAP_THRESHOLD = 256 << 20  # blocks up to this come from the heap
TRIM_THRESHOLD = 512 << 20  # free heap top kept before it is given back
TOP_PAD = 64 << 20  # how much the heap grows by at a time
ARENA_MAX = 1  # every thread allocates from the main (tuned) heap

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -2, -3, -8

_lock = threading.Lock()
_done: dict[str, bool] = {}


def _glibc() -> Any | None:
    """The process's C library where it is glibc (it has ``gnu_get_libc_version``)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 (glibc only; AttributeError elsewhere)
    except (OSError, AttributeError):
        return None
    return libc


def keep_large_blocks(libc: Any | None = None) -> bool:
    """Tune malloc as the module says, once per process; whether it is tuned.

    ``libc``: the library to call (tests pass a stand-in); default the process's
    own, where it is glibc."""
    with _lock:
        if "tuned" in _done:
            return _done["tuned"]
        tuned = False
        if os.environ.get("DUETIME_MALLOC", "1") == "0":
            log.info("DUETIME_MALLOC=0: malloc left as it is")
        else:
            lib = libc if libc is not None else _glibc()
            if lib is not None:
                settings = (
                    (_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
                    (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
                    (_M_TOP_PAD, TOP_PAD),
                    (_M_ARENA_MAX, ARENA_MAX),
                )
                tuned = all(lib.mallopt(param, value) == 1 for param, value in settings)
                if not tuned:
                    log.warning("mallopt refused a setting; large blocks may fault in each step")
        _done["tuned"] = tuned
        return tuned


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in [
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        ]
    ]


def large_blocks_mapped(nbytes: int = 96 << 20) -> bool | None:
    """Whether a block of ``nbytes`` allocated on the calling thread is a fresh ``mmap``
    (True: every step of the engine on this thread would fault its temporaries in again);
    None where that cannot be told (not glibc 2.33+). The block is never touched, so the
    check costs no page faults."""
    lib = _glibc()
    if lib is None or not hasattr(lib, "mallinfo2"):
        return None
    lib.mallinfo2.restype = _MallInfo2
    lib.malloc.restype = ctypes.c_void_p
    lib.free.argtypes = [ctypes.c_void_p]
    before = lib.mallinfo2().hblkhd
    block = lib.malloc(nbytes)
    mapped = lib.mallinfo2().hblkhd - before >= nbytes
    lib.free(block)
    return bool(mapped)


def _reset() -> None:
    """Forget that malloc was tuned (tests)."""
    with _lock:
        _done.clear()
