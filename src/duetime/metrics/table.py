"""A terminal table of one or more summaries: metrics as rows, runs (policies) as columns.

Metrics-as-rows reads well because there are many more metrics than
policies in a comparison, the metric names are long and the policy names
short, and a row lets the eye compare policies on one metric side by side.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rich.markup import escape
from rich.table import Table

Value = float | int | None
SummaryLike = Mapping[str, Value]

DEFAULT_KEYS: tuple[str, ...] = (
    "requests",
    "completed",
    "cancelled",
    "ttft_p90_s",
    "tbt_p90_s",
    "e2e_p50_s",
    "e2e_p90_s",
    "throughput_tok_s",
    "goodput_req_s",
    "deadline_hit_rate",
    "tel_s",
    "time_utility_mean",
)


def render_table(
    summaries: SummaryLike | Mapping[str, SummaryLike] | Sequence[tuple[str, SummaryLike]],
    *,
    keys: Sequence[str] | None = None,
    title: str | None = None,
) -> Table:
    """Build a :class:`rich.table.Table`; print it with ``rich.console.Console().print``.

    ``summaries`` is one summary, a ``{label: summary}`` mapping (e.g. the
    output of :func:`summarize_by_class`) or a list of ``(label, summary)``
    pairs. ``keys`` picks and orders the rows (default :data:`DEFAULT_KEYS`);
    a key a summary lacks, or whose value is None, shows as an em dash.
    """
    columns = _as_columns(summaries)
    table = Table(title=title)
    # "fold" here too: a sweep's six columns cut names to "through…" and "deadlin…"
    table.add_column("metric", style="bold", overflow="fold")
    # Labels are data, not markup: "deadline_hit_rate[batch]" must print as written.
    for label, _ in columns:
        # "fold", never "…": a narrow terminal must not hide digits of a figure.
        table.add_column(escape(label), justify="right", overflow="fold")
    for key in keys if keys is not None else DEFAULT_KEYS:
        table.add_row(escape(key), *(escape(format_value(s.get(key))) for _, s in columns))
    return table


def format_value(v: object) -> str:
    """Four significant digits for floats (large ones as grouped integers, not
    ``2.881e+04``), integers in full, ``—`` for missing."""
    if v is None:
        return "—"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return f"{v:d}"
    if isinstance(v, float):
        if 1e4 <= abs(v) < 1e15:
            return f"{v:,.0f}"
        return f"{v:.4g}"
    return str(v)


def _as_columns(
    summaries: SummaryLike | Mapping[str, SummaryLike] | Sequence[tuple[str, SummaryLike]],
) -> list[tuple[str, SummaryLike]]:
    if isinstance(summaries, Mapping):
        values = list(summaries.values())
        if values and all(isinstance(v, Mapping) for v in values):
            return [(str(k), v) for k, v in summaries.items()]  # type: ignore[misc]
        return [("value", summaries)]  # type: ignore[list-item]
    pairs = list(summaries)
    if not all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[1], Mapping) for p in pairs):
        raise TypeError(
            "render_table takes one summary, a {label: summary} mapping or a list of "
            "(label, summary) pairs; a list of bare summaries needs labels"
        )
    return [(str(label), s) for label, s in pairs]
