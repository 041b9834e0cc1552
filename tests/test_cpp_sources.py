"""The C++ kernels live in ``engine/csrc/`` as files, ship as package data, and build from there.

No compiler runs here: these check where the sources are and what ``CppOps``
would compile and key its cache on (the kernel tests build and run them).
"""

from __future__ import annotations

import fnmatch
import importlib
import logging
import pkgutil
import re
import tomllib
from pathlib import Path

import pytest

import duetime.engine
from duetime.engine.cpp_ext import CSRC, CppOps, read_source

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "duetime"


def _extensions() -> list[CppOps]:
    """Every CppOps a module of duetime.engine builds."""
    found = []
    for info in pkgutil.iter_modules(duetime.engine.__path__, "duetime.engine."):
        module = importlib.import_module(info.name)
        found += [v for v in vars(module).values() if isinstance(v, CppOps)]
    return found


def test_no_cpp_inside_python() -> None:
    cpp = re.compile(r"^\s*(#include [<\"]|TORCH_LIBRARY(_IMPL)?\()", re.MULTILINE)
    hits = [str(p.relative_to(ROOT)) for p in SRC.rglob("*.py") if cpp.search(p.read_text())]
    assert not hits, f"C++ source inside Python (move it to engine/csrc/): {hits}"


def test_every_extension_builds_from_a_shipped_file() -> None:
    exts = _extensions()
    assert {e.name for e in exts} >= {
        "duetime_q8",
        "duetime_q4",
        "duetime_attn",
        "duetime_norm",
        "duetime_loop",
    }
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["duetime"]
    shipped = [str(p.relative_to(SRC)) for p in CSRC.iterdir()]
    assert all(any(fnmatch.fnmatch(f, g) for g in globs) for f in shipped), shipped
    for ext in exts:
        assert (CSRC / ext.file).is_file()
        source = ext.source
        assert f"TORCH_LIBRARY({ext.name}," in source  # the namespace torch.ops looks up
        assert '#include "' not in source  # local headers inlined: one self-contained file
        assert source.count("inline float hsum(") == 1


def test_local_headers_are_inlined_and_keyed(tmp_path: Path) -> None:
    (tmp_path / "h.h").write_text("int f();\n")
    (tmp_path / "a.cpp").write_text('#include "h.h"\n#include <cmath>\nint g();\n')
    assert read_source("a.cpp", tmp_path) == "int f();\n#include <cmath>\nint g();\n"

    same = CppOps("duetime_q8", "q8_kernel.cpp", what="x", env="X", logger=logging.getLogger())
    other = CppOps("duetime_q8", "q4_rank.cpp", what="x", env="X", logger=logging.getLogger())
    ext = next(e for e in _extensions() if e.name == "duetime_q8")
    assert same.build_dir() == ext.build_dir()  # the key is the text, not the object
    assert other.build_dir() != ext.build_dir()


def test_a_missing_source_falls_back_with_one_warning(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DUETIME_NOPE", raising=False)
    log = logging.getLogger("duetime.test_cpp_sources")
    ext = CppOps("duetime_nope", "nope.cpp", what="missing kernel", env="DUETIME_NOPE", logger=log)
    with caplog.at_level(logging.WARNING, logger=log.name):
        assert ext.ops() is None
        assert ext.ops() is None
    warnings = [r for r in caplog.records if "missing kernel" in r.getMessage()]
    assert len(warnings) == 1
