"""Structured outputs: ``duetime bench grammar``, every kind timed beside the free run."""

from __future__ import annotations

import json
from typing import Any

# --- `duetime bench grammar` ---------------------------------------------------------


def test_bench_grammar_times_every_kind_beside_the_free_run(tmp_path: Any) -> None:
    from typer.testing import CliRunner

    from duetime.cli import app

    path = tmp_path / "grammar.json"
    args = ["bench", "grammar", "--model", "tiny", "--requests", "2", "--new-tokens", "12"]
    args += ["--admission-requests", "3", "--admission-burst", "2", "--admission-burst-rounds", "2"]
    res = CliRunner().invoke(app, [*args, "--repeats", "1", "--threads", "1", "--json", str(path)])
    assert res.exit_code == 0, res.output
    fig = json.loads(path.read_text())
    kinds = {"json_schema", "json_array", "regex", "lark"}
    assert set(fig["runs"]) == {"none", *kinds, *(k + ":whole" for k in kinds)}
    assert set(fig["gather_speedup"]) == kinds
    assert all(v > 0 for v in fig["gather_speedup"].values())
    assert "few allowed tokens' logits gathered, against whole rows masked: " in res.output
    for kind, run in fig["runs"].items():
        assert run["ms_per_token"] > 0
        if kind != "none":
            assert run["valid_pct"] == 100.0, kind  # every answer fits its grammar
            assert run["compile_ms"] >= 0
    assert fig["runs"]["none"]["overhead_pct"] == 0.0
    assert "a grammar costs at most" in res.output
    jump = fig["jump_forward"]
    assert jump["answers_identical"] is True
    assert jump["on"]["forced_tokens_jumped"] > 0 == jump["off"]["forced_tokens_jumped"]
    assert jump["on"]["engine_steps"] < jump["off"]["engine_steps"]
    # robot commands through a fresh server per arm (timing-bound: the tiny model's
    # figures are not compared, only accounted for)
    assert set(fig["admission"]) == {"grammar_steps", "step_per_token"}
    for arm in fig["admission"].values():
        assert arm["requests"] == 3
        assert 0 <= arm["met"] <= arm["accepted"] <= 3
        assert len(arm["e2e_ms"]) == arm["accepted"]
        ratio = arm["forecast_to_actual_e2e_median"]
        assert (ratio is None) == (arm["accepted"] == 0)
        assert ratio is None or ratio > 0
    # a fleet of two, rounds 2 s apart, companions expected or not: under ten times the
    # deadline, then under it
    assert set(fig["admission_bursts"]) == {"expected", "even"}
    for passes in fig["admission_bursts"].values():
        assert [passes[p]["deadline_ms"] for p in ("seen", "deadline")] == [5000.0, 500.0]
        for burst in passes.values():
            assert (burst["size"], burst["rounds"], burst["period_s"]) == (2, 2, 2.0)
            assert [len(r) for r in burst["e2e_ms"]] == [2, 2]
            kept = [e for r in burst["e2e_ms"] for e in r if e is not None]
            assert len(kept) == burst["accepted"] == sum(burst["accepted_per_round"])
            assert 0 <= burst["met"] <= burst["accepted"]
            firsts, lasts = burst["smallest_forecast_to_e2e"], burst["largest_forecast_to_e2e"]
            assert len(firsts) == len(lasts) <= 2
            assert all(r > 0 for r in firsts + lasts)
    assert "robot commands under 500 ms" in res.output
    assert "bursts of 2 every 2 s, companions expected: under 5000 ms" in res.output


def test_bench_grammar_refuses_an_unknown_kind() -> None:
    from tests.factories import cli_refused

    cli_refused("bench", "grammar", "--model", "tiny", "--kinds", "json,yaml", names="--kinds")
