"""The tree's layout rules: small files with one job, C++ in C++ files, test files that
hold tests alone.

- A Python file in src/ or tests/ is at most 400 lines, a doc at most 300: past that a
  file has more than one job, and a reader cannot find the one they came for.
- C++ lives in ``.cpp`` / ``.h`` files under ``engine/csrc/``, where a compiler,
  formatter and editor see it, never in a Python string.
- A test file that imports another (``from tests.test_server import _state``) ties the
  two together: the other cannot be split, renamed or trimmed without breaking it, and
  its private helpers become an API nobody declared. Shared code goes in a module whose
  name does not start with ``test_`` (``tests/served.py``, ``tests/factories.py``).
"""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
MAX_PY_LINES = 400
MAX_DOC_LINES = 300
IMPORTS_A_TEST = re.compile(r"^\s*(?:from|import)\s+tests\.test_\w+", re.MULTILINE)
# Lines only C++ source has: an include at the start of a line (a Python comment has a
# space after its '#'), an op registration, a function taking or returning a tensor.
CPP_LINE = re.compile(
    r'^\s*#include\s*[<"]|^\s*TORCH_LIBRARY(?:_IMPL)?\(|\bat::Tensor\s+\w+\(', re.MULTILINE
)


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def _importers(folder: Path) -> list[str]:
    return [
        p.name
        for p in sorted(folder.glob("*.py"))
        if IMPORTS_A_TEST.search(p.read_text(encoding="utf-8"))
    ]


def test_files_that_import_another_test_file(tmp_path: Path) -> None:
    (tmp_path / "test_a.py").write_text("    from tests.test_server import MODEL\n")
    (tmp_path / "test_b.py").write_text("from tests.served import MODEL  # tests.test_x\n")
    assert _importers(tmp_path) == ["test_a.py"]


def test_no_test_file_imports_another() -> None:
    assert _importers(TESTS) == [], "move what they share into a helper module"


def test_python_files_are_at_most_400_lines() -> None:
    long = [
        f"{p.relative_to(ROOT)}: {n}"
        for tree in ("src", "tests")
        for p in sorted((ROOT / tree).rglob("*.py"))
        if (n := _lines(p)) > MAX_PY_LINES
    ]
    assert not long, "split along the file's seams:\n" + "\n".join(long)


def test_docs_are_at_most_300_lines() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    long = [f"{p.relative_to(ROOT)}: {n}" for p in pages if (n := _lines(p)) > MAX_DOC_LINES]
    assert not long, "a reference page says what, how, its equations and limits:\n" + "\n".join(
        long
    )


def test_the_cpp_pattern_finds_source_and_spares_python() -> None:
    source = '_SRC = r"""\n#include <torch/extension.h>\nat::Tensor q8(at::Tensor x) {}\n"""'
    assert CPP_LINE.search(source)
    assert not CPP_LINE.search("# include the tail\nx = 1  # at::Tensor is C++'s type\n")
    assert not CPP_LINE.search('"""Ops register with ``TORCH_LIBRARY`` and ..."""')


def test_no_cpp_source_in_python_files() -> None:
    found = [
        str(p.relative_to(ROOT))
        for p in sorted((ROOT / "src").rglob("*.py"))
        if CPP_LINE.search(p.read_text(encoding="utf-8"))
    ]
    assert not found, "C++ belongs in src/duetime/engine/csrc/: " + ", ".join(found)
