"""Metrics over :class:`~duetime.core.record.RequestRecord` lists, and ways to show them.

Every executor reports one record per request; this package turns a run's
records into flat ``{metric_name_with_unit: number}`` dicts
(:func:`summarize`, :func:`summarize_by_class`), writes them atomically
(:func:`write_json`), shows them in a terminal (:func:`render_table`) and
plots sweeps (:func:`plot_sweep`). Definitions and sources: docs/metrics.md.
"""

from duetime.metrics.output import to_jsonable, write_json
from duetime.metrics.plot import plot_sweep
from duetime.metrics.slo import SLO
from duetime.metrics.summary import Summary, cached_prompt_pct, summarize, summarize_by_class
from duetime.metrics.table import DEFAULT_KEYS, render_table

__all__ = [
    "DEFAULT_KEYS",
    "SLO",
    "Summary",
    "cached_prompt_pct",
    "plot_sweep",
    "render_table",
    "summarize",
    "summarize_by_class",
    "to_jsonable",
    "write_json",
]
