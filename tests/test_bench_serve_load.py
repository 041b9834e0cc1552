"""`duetime bench serve-load` on the tiny model: the served run, the offline replay, the
round log and its summaries."""

from __future__ import annotations

import math

import pytest
from typer.testing import CliRunner

from duetime.bench.serve_load import ServeLoadConfig, run_serve_load
from duetime.bench.serve_load_steps import band_of, served_summary, steps_by_band
from duetime.cli import app
from duetime.server.step_log import PARTS, StepLog, StepRow


def test_bands_are_powers_of_two() -> None:
    assert [band_of(d) for d in (1, 2, 3, 4, 7, 8, 100)] == [
        "1",
        "2-3",
        "2-3",
        "4-7",
        "4-7",
        "8-15",
        "64-127",
    ]
    with pytest.raises(ValueError, match="at least one"):
        band_of(0)


def _row(start: float, forward: float, decoders: int, prefill: int = 0, idle: float = 0.0):
    return StepRow(start, 0.001, 0.002, forward, 0.001, 0.0005, idle, decoders, prefill, 0)


def test_the_summary_counts_the_busy_span_only() -> None:
    rows = [
        _row(0.0, 0.0, 0, idle=0.5),  # idle before the load: not part of it
        _row(0.5, 0.100, 0, prefill=64),
        _row(0.6, 0.020, 4),
        _row(0.7, 0.040, 8),
        _row(0.8, 0.0, 0, idle=0.5),  # after
    ]
    s = served_summary(rows)
    assert s["steps"] == 3
    assert s["prefill_steps"] == 1
    assert s["forward_s"] == pytest.approx(0.16)
    assert s["idle_s"] == 0.0
    assert sum(s[f"{p}_share"] for p in PARTS) == pytest.approx(1.0)
    # the running batch averaged over forward time: (0*0.1 + 4*0.02 + 8*0.04) / 0.16
    assert s["mean_running_batch"] == pytest.approx(2.5)


def test_bands_set_served_beside_offline_steps() -> None:
    served = [_row(0.0, 0.010, 4), _row(0.1, 0.030, 5), _row(0.2, 0.050, 9, prefill=32)]
    offline = [
        {"step_s": 0.010, "prefill_tokens": 0, "decode_seqs": 4},
        {"step_s": 0.014, "prefill_tokens": 0, "decode_seqs": 6},
        {"step_s": 0.500, "prefill_tokens": 256, "decode_seqs": 6},  # a prefill: left out
    ]
    (band,) = steps_by_band(served, offline)
    assert band["band"] == "4-7"
    assert band["served_steps"] == 2
    assert band["offline_steps"] == 2
    assert band["served_forward_ms"] == pytest.approx(20.0)
    assert band["offline_forward_ms"] == pytest.approx(12.0)
    assert band["served_over_offline_forward"] == pytest.approx(20 / 12)


def test_the_log_is_a_ring() -> None:
    log = StepLog(capacity=2)
    for i in range(3):
        log.add(_row(float(i), 0.01, 1))
    assert [r.start for r in log.rows()] == [1.0, 2.0]
    with pytest.raises(ValueError, match="capacity"):
        StepLog(capacity=0)


@pytest.mark.slow
def test_a_tiny_run_served_and_replayed() -> None:
    cfg = ServeLoadConfig(
        model="tiny", rates=(math.inf,), requests=(6,), prompt_len=16, output_len=8
    )
    fig = run_serve_load(cfg)
    (run,) = fig["runs"]
    assert run["ok"] == 6
    assert run["errors"] == 0
    steps = run["served_steps"]
    assert steps["steps"] >= 8  # at least one step per answer token
    assert steps["forward_s"] > 0
    assert sum(steps[f"{p}_share"] for p in PARTS) == pytest.approx(1.0)
    assert run["offline_output_tok_s"] > 0
    assert run["served_output_tok_s"] > 0
    assert run["cpu_s"]["client"] > 0  # the client ran in its own process
    assert "duetime-engine" in run["cpu_s"]
    bands = run["bands"]
    assert bands
    assert sum(b["served_steps"] for b in bands) <= steps["steps"]
    assert all(b["offline_steps"] > 0 for b in bands if b["served_steps"] >= 3)


def test_the_command_refuses_a_mismatched_request_list() -> None:
    result = CliRunner().invoke(
        app, ["bench", "serve-load", "--model", "tiny", "--rates", "1,2,4", "--requests", "5,6"]
    )
    assert result.exit_code != 0
    assert "--requests gives 2 numbers for 3 rates" in result.output


def test_the_command_refuses_requests_the_server_would_refuse() -> None:
    result = CliRunner().invoke(
        app, ["bench", "serve-load", "--model", "tiny", "--prompt-len", "100000"]
    )
    assert result.exit_code == 2
    assert "--prompt-len 100000 + --output-len 128 exceeds the served context" in result.output
    assert "Traceback" not in result.output


def test_a_failed_load_client_is_one_line_naming_it(tmp_path) -> None:
    from duetime.bench.serve_load import _client

    cfg = ServeLoadConfig(model="tiny", client_timeout_s=5.0)
    with pytest.raises(ValueError, match=r"load client \(duetime load\) failed, exit \d+: \S"):
        _client(cfg, "http://127.0.0.1:9", 1.0, 1, tmp_path / "load.json")
