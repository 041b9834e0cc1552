"""Test files hold tests; what several of them share lives in helper modules.

A test file that imports another (``from tests.test_server import _state``) ties the
two together: the other cannot be split, renamed or trimmed without breaking it, and
its private helpers become an API nobody declared. Shared code goes in a module whose
name does not start with ``test_`` (``tests/served.py``, ``tests/factories.py``).
"""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
IMPORTS_A_TEST = re.compile(r"^\s*(?:from|import)\s+tests\.test_\w+", re.MULTILINE)


def test_files_that_import_another_test_file(tmp_path: Path) -> None:
    (tmp_path / "test_a.py").write_text("    from tests.test_server import MODEL\n")
    (tmp_path / "test_b.py").write_text("from tests.served import MODEL  # tests.test_x\n")
    assert _importers(tmp_path) == ["test_a.py"]


def _importers(folder: Path) -> list[str]:
    return [
        p.name
        for p in sorted(folder.glob("*.py"))
        if IMPORTS_A_TEST.search(p.read_text(encoding="utf-8"))
    ]


def test_no_test_file_imports_another() -> None:
    assert _importers(TESTS) == [], "move what they share into a helper module"
