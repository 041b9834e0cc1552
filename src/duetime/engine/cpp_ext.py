"""Build-on-first-use C++ ops for the engine's hot spots (int8 GEMV, decode attention).

Each extension is one C++ file in ``csrc/`` (package data; its local headers
are inlined, see :func:`read_source`), named by the module that uses it. It is
compiled with ``torch.utils.cpp_extension.load`` (g++ and ninja) into
``${DUETIME_CACHE:-~/.cache/duetime}/torch_ext/<name>-<hash>/``, keyed by a hash
of the source, the flags and the torch version, so later processes only load
the ``.so``. Ops register with ``TORCH_LIBRARY`` and use torch's own OpenMP
runtime and thread setting. When the CPU lacks AVX2, the build fails (no
compiler) or ``DUETIME_<NAME>=0`` is set, :meth:`CppOps.ops` logs one warning
and returns ``None`` for the life of the process, and callers keep their
plain-torch path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

__all__ = ["CppOps"]

FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]

# Where the sources live (package data). A line ``#include "x.h"`` names a header
# here and is replaced by its text, so the build folder gets one self-contained
# file and the cache key covers every line compiled.
CSRC = Path(__file__).resolve().parent / "csrc"
_LOCAL_INCLUDE = re.compile(r'^#include "([^"]+)"$', re.MULTILINE)


def read_source(file: str, root: Path = CSRC) -> str:
    """The text of ``root/file`` with its local ``#include "..."`` lines inlined."""
    text = (root / file).read_text()
    return _LOCAL_INCLUDE.sub(lambda m: read_source(m.group(1), root).rstrip("\n"), text)


class CppOps:
    """One C++ extension: ``torch.ops.<library>`` once built, else ``None``.

    ``name``: the extension's name (also the ``TORCH_LIBRARY`` namespace the
    source registers); ``file``: its source in ``csrc/``, read on first use (a
    missing file is a failed build: logged, then the torch path); ``what``: how
    the warning names it; ``env``: the variable that disables it when set to
    ``0``; ``logger``: where the one warning goes (the owning module's, so its
    tests can capture it).
    """

    def __init__(
        self, name: str, file: str, *, what: str, env: str, logger: logging.Logger
    ) -> None:
        self.name = name
        self.file = file
        self.what = what
        self.env = env
        self.log = logger
        self._lock = threading.Lock()
        self._state: dict[str, Any] = {}

    @cached_property
    def source(self) -> str:
        """The C++ compiled: ``csrc/<file>`` with its local headers inlined."""
        return read_source(self.file)

    def build_dir(self) -> Path:
        """Where the compiled op lives: one folder per (source, flags, torch version)."""
        key = hashlib.sha256((self.source + torch.__version__ + " ".join(FLAGS)).encode())
        root = Path(os.environ.get("DUETIME_CACHE") or Path.home() / ".cache" / "duetime")
        return root / "torch_ext" / f"{self.name}-{key.hexdigest()[:16]}"

    def build(self) -> Any:
        """Compile (or load the cached build of) the source; ``torch.ops.<name>``."""
        if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
            raise RuntimeError(
                f"CPU capability is {torch.backends.cpu.get_cpu_capability()}, "
                "the kernel needs AVX2"
            )
        from torch.utils.cpp_extension import load

        where = self.build_dir()
        where.mkdir(parents=True, exist_ok=True)
        src = where / f"{self.name}.cpp"
        if not src.exists() or src.read_text() != self.source:
            tmp = src.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(self.source)
            tmp.replace(src)
        load(
            name=self.name,
            sources=[str(src)],
            extra_cflags=FLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(where),
            is_python_module=False,
            verbose=False,
        )
        return getattr(torch.ops, self.name)

    def reset(self) -> None:
        """Forget the outcome of the last build attempt (tests)."""
        with self._lock:
            self._state.clear()

    def ops(self) -> Any | None:
        """The built ops, or ``None`` once a build has failed or the op is disabled.

        The first call compiles (seconds) or loads the cached build; a failure
        is logged once as a warning and remembered for the life of the process.
        """
        with self._lock:
            if "ops" not in self._state:
                self._state["ops"] = self._first_build()
            return self._state["ops"]

    def _first_build(self) -> Any | None:
        if os.environ.get(self.env, "1") == "0":
            self.log.warning("%s disabled by %s=0; using the plain torch path", self.what, self.env)
            return None
        try:
            return self.build()
        except Exception as exc:  # any build/load failure: keep serving on plain torch
            lines = str(exc).strip().splitlines()
            self.log.warning(
                "could not build the %s (%s: %s); falling back to the plain torch path",
                self.what,
                type(exc).__name__,
                lines[-1] if lines else "",
            )
            return None
