"""Deferred prefill on the real executor (tiny model) and `bench deferred-prefill --engine`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from duetime.bench.deferred_prefill import geometric_jobs
from duetime.bench.engine_fit import with_synthetic_ids
from duetime.cli import app
from duetime.engine.executor import EngineExecutor
from duetime.engine.testing import engine_from_hf, tiny_hf_model
from duetime.policies import make_policy

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def model() -> Any:
    return engine_from_hf(tiny_hf_model(seed=3))


@pytest.mark.parametrize("k", [1, 3])
def test_engine_prefills_only_after_k_departures_and_stalls_decode(
    model: Any, k: int, tmp_path: Path
) -> None:
    c, n = 4, 20
    jobs = with_synthetic_ids(geometric_jobs(n, 0.2, 5, seed=1), 256, 2, seed=1)
    tel = tmp_path / "steps.jsonl"
    ex = EngineExecutor(
        make_policy("deferred-prefill", k=k),
        model,
        kv_capacity=1 << 20,
        max_num_seqs=c,
        max_batch_tokens=1 << 20,
        telemetry=tel,
    )
    res = ex.run(jobs)
    steps = [json.loads(line) for line in tel.read_text().splitlines()]
    assert all(r.completed for r in res.records)
    assert ex.kv.total_tokens == 0
    phases = [s for s in steps if s["prefill_tokens"] > 0]
    assert all(s["decode_seqs"] == 0 for s in phases)  # a prefill phase stalls the batch
    admitted = [s["prefill_tokens"] // 5 for s in phases]
    assert admitted[0] == c
    assert sum(admitted) == n
    # Every later phase refills >= K slots, unless the queue ran short (the last one).
    assert all(a >= k for a in admitted[1:-1])
    assert max(s["decode_seqs"] for s in steps) <= c


def test_bench_deferred_prefill_engine_tiny(tmp_path: Path) -> None:
    j, p = tmp_path / "d.json", tmp_path / "d.png"
    r = CliRunner().invoke(
        app,
        ["bench", "deferred-prefill", "--engine", "--model", "tiny", "--capacity", "4",
         "--requests", "16", "--prompt-len", "6", "--mean-output", "5", "--ks", "1,2,4",
         "--json", str(j), "--plot", str(p)],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert p.read_bytes()[:8] == PNG
    # what a bench saved is named (whitespace dropped: a console folds a long path mid-name)
    assert f"wrote{p},{j}" in "".join(r.output.split())
    fig = json.loads(j.read_text())
    assert fig["mode"] == "engine"
    assert fig["capacity"] == 4
    assert [x["k"] for x in fig["real"]] == [1, 2, 4]
    assert [x["k"] for x in fig["simulated"]] == [1, 2, 4]
    assert {x["curve"] for x in fig["simulated"]} == {"sim-engine"}
    assert [x["k"] for x in fig["analytic"]] == [1, 2, 3, 4]
    for row in fig["real"]:
        assert row["throughput_req_s"] > 0
        assert row["completion_mean_s"] > 0
        assert row["completion_p95_s"] >= row["completion_mean_s"] * 0.5
        assert row["kv_left_tokens"] == 0
        assert row["prefill_phases"] >= 16 // 4
    for curve in ("sim-engine", "real"):
        s = fig["summary"][curve]
        assert s["k_best"] in (1, 2, 4)
        assert s["gain_best_vs_k1_pct"] >= 0
        assert "completion_change_best_vs_k1_pct" in s
    # the model is this engine's: read off the fitted cost, the same one the simulator used
    assert fig["cost"]["name"] == "engine-fitted"
    assert fig["cost_fit"]["timed_steps"] >= 6
    assert fig["advice"]["model_capacity"] == 4
    assert "real" in r.output
    assert "+13.5 %" in r.output  # the paper's figure is printed beside ours


def test_reps_interleave_and_report_medians(model: Any) -> None:
    from duetime.bench import deferred_prefill_engine as dpe

    fig = dpe.run(
        model, model_name="tiny", capacity=3, prompt_len=4, mean_output=4.0, requests=9,
        ks=(1, 3), reps=3, clock="cpu",
    )  # fmt: skip
    for row in fig["real"]:
        assert row["reps"] == 3
        assert len(row["throughput_reps_req_s"]) == 3
        assert row["throughput_req_s"] == sorted(row["throughput_reps_req_s"])[1]  # the median
        assert isinstance(row["k"], int)
    assert fig["summary"]["real"]["k_best"] in (1, 3)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--engine", "--model", "tiny", "--capacity", "4", "--ks", "0,9"], "every K must be"),
        (["--engine", "--model", "tiny", "--capacity", "4", "--ks", "a"], "comma-separated"),
        (["--engine", "--model", "tiny", "--capacity", "8", "--requests", "10"], "too few"),
        (["--engine", "--model", "tiny", "--mean-output", "1"], "--mean-output"),
        (["--engine", "--model", "tiny", "--mean-output", "1.5"], "(--mean-output) must be >= 2"),
        (["--engine", "--model", "nope.gguf"], "not 'gemma', 'tiny'"),
        (["--engine", "--model", "tiny", "--profile", "nope"], "unknown profile"),
        (["--prompt-len", "8"], "only with --engine"),
        (["--reps", "2"], "only with --engine"),
        (["--engine", "--model", "tiny", "--threads", "2"], "--clock cpu needs --threads 1"),
        (["--engine", "--model", "tiny", "--clock", "sun"], "--clock must be cpu or wall"),
    ],
)
def test_bench_deferred_prefill_engine_bad_options(args: list[str], message: str) -> None:
    r = CliRunner().invoke(app, ["bench", "deferred-prefill", *args])
    assert r.exit_code == 2, r.output
    assert message in r.output
    assert "Traceback" not in r.output


def test_advise_accepts_a_profile_fitted_on_this_machine(model: Any, tmp_path: Path) -> None:
    """`advise deferred-prefill --profile` reads what `duetime profile` writes."""
    from duetime.engine.profile import ProfileGrid, measure_steps
    from duetime.metrics import write_json
    from duetime.predict.cost_report import profile_payload

    samples = measure_steps(model, ProfileGrid.quick())
    payload = profile_payload(
        samples, name="tiny-cpu", source="test", kv_capacity_tokens=4096, max_num_seqs=16,
        max_batch_tokens=512,
    )  # fmt: skip
    prof, out = tmp_path / "p.json", tmp_path / "advice.json"
    write_json(prof, payload)
    r = CliRunner().invoke(
        app,
        ["advise", "deferred-prefill", "--capacity", "16", "--mean-output", "9",
         "--prompt-len", "16", "--profile", str(prof), "--json", str(out)],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    adv = json.loads(out.read_text())
    c = payload["coefficients"]
    assert isinstance(c, dict)
    assert adv["model_c_d_s"] == pytest.approx(c["c0"])
    assert adv["model_c_p_s"] == pytest.approx(c["c0"] + c["c_prefill"])
    assert 1 <= adv["k_star"] <= 16
