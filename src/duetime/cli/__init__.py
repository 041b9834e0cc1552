"""The `duetime` command line. Each module registers its commands on the shared app."""

from __future__ import annotations

from duetime.cli import (  # noqa: F401  (registers commands)
    advise,
    bench,
    engine,
    gateway,
    load,
    predict,
    serve,
    sim,
)
from duetime.cli.common import app

__all__ = ["app", "main"]


def main() -> None:  # pragma: no cover - console entry point
    app()
