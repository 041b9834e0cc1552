"""Benchmark commands (`duetime bench ...`): speed and reproduced results.

One module per command, each holding its typer command and, where it has one,
its ``--engine`` mode; importing them registers the commands on ``bench_app``
in the order `duetime bench --help` lists them. Shared options live in
:mod:`.options`, the engine-model loader in :mod:`.model`, the ``--plot`` /
``--json`` tail in :mod:`.save`.
"""

# ruff: noqa: I001  (the import order below is the order `duetime bench --help` lists)
from __future__ import annotations

from duetime.cli.bench import (  # noqa: F401  (registers the commands)
    sim,
    fleet,
    fleet_real,
    engine,
    predict_length,
    amin,
    deferred_prefill,
    timelyllm,
    timebill,
    ala,
    serve,
    serve_load,
    admission,
    sensitivity,
    eviction,
    prefix_cache,
    shared_prefill,
    grammar,
)
