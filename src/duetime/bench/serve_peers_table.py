"""One markdown table from the raw results of ``scripts/serve_peers.sh``.

The script serves duetime, vLLM CPU and llama-server one at a time and loads
each with two clients: vLLM's own ``vllm bench serve`` (so nobody can say the
figures favour duetime's client) and ``duetime load``. Both write their own JSON;
this module reads them as they are and puts the figures people compare
(output tok/s, TTFT p50/p99, TPOT p50) side by side, with the machine line,
since only ratios from one run on one machine mean anything.

Files read from the output directory (missing ones are skipped, so a partial
run still gives a table)::

    run.json                          {"command": str, "load": str, "servers": {name: cmdline}}
    <server>/vllm-bench-rate-<r>.json  vllm bench serve --save-result
    <server>/duetime-load-rate-<r>.json  duetime load --json

``python -m duetime.bench.serve_peers_table OUT_DIR`` prints the table and
writes it to ``OUT_DIR/table.md``.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from duetime.cpu import cpu_name

__all__ = ["Row", "machine_line", "main", "read_rows", "render"]

CLIENTS = ("vllm-bench", "duetime-load")


@dataclass(frozen=True, slots=True)
class Row:
    """One server under one client at one rate; times in ms, ``None`` when absent."""

    server: str
    client: str
    rate: str
    ok: int
    sent: int
    out_tok_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None


def _num(d: dict[str, Any], key: str, scale: float = 1.0) -> float | None:
    v = d.get(key)
    return None if v is None else float(v) * scale


def from_vllm_bench(server: str, rate: str, d: dict[str, Any]) -> Row:
    """vLLM 0.32's ``--save-result`` keys: ``output_throughput`` (tok/s over the
    benchmark's duration), ``median_ttft_ms``, ``p99_ttft_ms`` (present with
    ``--metric-percentiles 50,99``) and ``median_tpot_ms`` (per request, time
    after the first token over the tokens after it)."""
    return Row(
        server=server,
        client="vllm-bench",
        rate=rate,
        ok=int(d.get("completed", 0)),
        sent=int(d.get("num_prompts", d.get("completed", 0))),
        out_tok_s=float(d.get("output_throughput", 0.0)),
        ttft_p50_ms=_num(d, "median_ttft_ms"),
        ttft_p99_ms=_num(d, "p99_ttft_ms"),
        tpot_p50_ms=_num(d, "median_tpot_ms"),
    )


def from_duetime_load(server: str, rate: str, d: dict[str, Any]) -> Row:
    """``duetime load --json`` at one rate: ``rows[0]``, seconds turned into ms.
    Its ``tbt_p50_s`` is the same per-request figure as vLLM's TPOT."""
    rows = d.get("rows") or []
    if not rows:
        raise ValueError(f"{server} duetime-load rate {rate}: no rows in the JSON")
    r = rows[0]
    return Row(
        server=server,
        client="duetime-load",
        rate=rate,
        ok=int(r.get("ok", 0)),
        sent=int(r.get("sent", 0)),
        out_tok_s=float(r.get("throughput_tok_s", 0.0)),
        ttft_p50_ms=_num(r, "ttft_p50_s", 1000.0),
        ttft_p99_ms=_num(r, "ttft_p99_s", 1000.0),
        tpot_p50_ms=_num(r, "tbt_p50_s", 1000.0),
    )


def _rate_key(rate: str) -> float:
    """Rates in ascending order; ``inf`` and anything unreadable last."""
    try:
        return float(rate)
    except ValueError:
        return float("inf")


def read_rows(out_dir: Path, servers: list[str] | None = None) -> list[Row]:
    """Every result file under ``out_dir``, server by server in the given order
    (default: the subdirectories, sorted), then client, then rate."""
    if servers is None:
        servers = sorted(p.name for p in out_dir.iterdir() if p.is_dir())
    rows: list[Row] = []
    for server in servers:
        sdir = out_dir / server
        if not sdir.is_dir():
            continue
        for client in CLIENTS:
            prefix = f"{client}-rate-"
            found = [(p.name[len(prefix) : -5], p) for p in sdir.glob(f"{prefix}*.json")]
            for rate, p in sorted(found, key=lambda t: _rate_key(t[0])):
                try:
                    d = json.loads(p.read_text())
                except (OSError, json.JSONDecodeError) as e:
                    raise ValueError(f"{p}: not readable JSON ({e})") from e
                conv = from_vllm_bench if client == "vllm-bench" else from_duetime_load
                rows.append(conv(server, rate, d))
    return rows


def machine_line(today: dt.date | None = None) -> str:
    """CPU model, cores this process may use, and the date: the context every
    figure below needs, since absolute speeds move from one day to the next."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    day = (today or dt.date.today()).isoformat()
    return f"Machine: {cpu_name()}, {cores} cores, {day}."


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def render(rows: list[Row], machine: str, run: dict[str, Any] | None = None) -> str:
    """The markdown: machine line, the load and server command lines when known,
    then one row per server, client and rate."""
    lines = [machine, ""]
    if run:
        if run.get("command"):
            lines += [f"Command: `{run['command']}`", ""]
        if run.get("load"):
            lines += [f"Load: {run['load']}", ""]
        for name, cmd in (run.get("servers") or {}).items():
            lines.append(f"- {name}: `{cmd}`")
        if run.get("servers"):
            lines.append("")
    lines += [
        "| server | client | rate | ok / sent | out tok/s | TTFT p50 / p99 ms | TPOT p50 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.server} | {r.client} | {r.rate} | {r.ok} / {r.sent} | {r.out_tok_s:,.1f} "
            f"| {_ms(r.ttft_p50_ms)} / {_ms(r.ttft_p99_ms)} | {_ms(r.tpot_p50_ms)} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m duetime.bench.serve_peers_table OUT_DIR", file=sys.stderr)
        return 2
    out_dir = Path(args[0])
    if not out_dir.is_dir():
        print(f"serve-peers table: {out_dir} is not a directory", file=sys.stderr)
        return 2
    run_path = out_dir / "run.json"
    run: dict[str, Any] | None = json.loads(run_path.read_text()) if run_path.exists() else None
    servers = list((run or {}).get("servers") or {}) or None
    try:
        rows = read_rows(out_dir, servers)
    except ValueError as e:
        print(f"serve-peers table: {e}", file=sys.stderr)
        return 1
    if not rows:
        print(f"serve-peers table: no result files under {out_dir}", file=sys.stderr)
        return 1
    text = render(rows, machine_line(), run)
    (out_dir / "table.md").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
