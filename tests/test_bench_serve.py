"""`duetime bench serve` on the tiny model: structure and sanity, never speed."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from duetime.cli import app


def test_bench_serve_tiny_writes_per_policy_rows(tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    result = CliRunner().invoke(
        app,
        [
            "bench", "serve", "--model", "tiny", "--policies", "fcfs,edf", "--requests", "6",
            "--rate", "8", "--max-tokens", "4", "--overhead-requests", "10", "--json", str(out),
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    fig = json.loads(out.read_text())
    assert [r["policy"] for r in fig["policies"]] == ["fcfs", "edf"]
    for row in fig["policies"]:
        assert row["ok"] + row["rejected"] + row["errors"] + row["unfinished"] == 6
        assert row["errors"] == 0, row["top_errors"]  # every prompt fits the model
        assert row["ok"] >= 1
        assert 0.0 <= row["deadline_hit_rate"] <= 1.0
    o = fig["overhead"]
    assert o["added_latency_p50_ms"] > 0
    assert o["gateway_added_latency_p50_ms"] > 0  # a hop through the gateway costs something
    assert o["noop_req_s"] > 0


def test_bench_serve_rejects_unknown_policy() -> None:
    result = CliRunner().invoke(app, ["bench", "serve", "--model", "tiny", "--policies", "nope"])
    assert result.exit_code == 2
