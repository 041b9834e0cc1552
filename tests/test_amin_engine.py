"""H-SF, Amax and Amin on the real executor (tiny random-weight model) and `bench amin --engine`.

The simulator-side tests are in test_amin_policies.py / test_amin_memory.py;
here the same policies drive :class:`EngineExecutor` under a KV budget that
binds, and must keep every step within it, free every token (restarts
included) and leave the greedy answers unchanged.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from duetime.cli import app
from duetime.core.request import Job, Request
from duetime.engine import greedy_generate
from duetime.engine.executor import EngineExecutor
from duetime.engine.testing import engine_from_hf, tiny_hf_model
from duetime.policies import make_policy
from duetime.predict.oracle import make_job_predictor

M = 96  # tokens: about three of these requests at their peak
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def model() -> Any:
    return engine_from_hf(tiny_hf_model(seed=2))


def _jobs(n: int = 10, seed: int = 5) -> list[Job]:
    r = random.Random(seed)
    jobs = []
    for i in range(n):
        p, o = r.randint(4, 16), r.randint(4, 24)
        ids = (2, *(r.randrange(3, 256) for _ in range(p - 1)))
        req = Request(rid=i, arrival=0.0, prompt_len=p, prompt_token_ids=ids, max_tokens=o)
        jobs.append(Job(req, o))
    return jobs


def _run(model: Any, policy: str, predictor: str, tmp_path: Path) -> tuple[Any, Any, list[dict]]:
    tel = tmp_path / f"{policy}.jsonl"
    ex = EngineExecutor(
        make_policy(policy, seed=0),
        model,
        kv_capacity=M,
        max_num_seqs=1 << 20,
        max_batch_tokens=1 << 20,
        predictor=make_job_predictor(predictor),
        telemetry=tel,
    )
    res = ex.run(_jobs())
    return ex, res, [json.loads(line) for line in tel.read_text().splitlines()]


@pytest.mark.parametrize(
    ("policy", "predictor"),
    [("hsf", "oracle"), ("amax", "interval:overlap:0.5"), ("amin", "interval:rough:1:24")],
)
def test_policy_on_engine_stays_within_m_and_frees_every_token(
    model: Any, policy: str, predictor: str, tmp_path: Path
) -> None:
    jobs = _jobs()
    assert sum(j.request.prompt_len + j.output_len for j in jobs) > 2 * M  # memory binds
    ex, res, steps = _run(model, policy, predictor, tmp_path)
    assert all(r.completed for r in res.records)
    assert res.kv_peak <= M
    assert max(s["kv_used_tokens"] for s in steps) <= M  # checked against the cache every step
    assert max(s["decode_seqs"] for s in steps) < len(jobs)  # M held requests back
    assert ex.kv.total_tokens == 0
    assert not ex.slots
    ref = greedy_generate(model, [list(j.request.prompt_token_ids or ()) for j in jobs], 24)
    assert res.outputs == {j.request.rid: ref[i][: j.output_len] for i, j in enumerate(jobs)}
    restarts = res.counters.get("restarts", 0)
    if policy == "amin":
        # lower bound 1: Amin over-admits, runs out of memory and restarts requests from scratch
        assert restarts > 0
        assert res.tokens_generated > sum(j.output_len for j in jobs)  # restarted work is redone
    else:
        assert restarts == 0


def test_bench_amin_engine_tiny(tmp_path: Path) -> None:
    j, p = tmp_path / "a.json", tmp_path / "a.png"
    r = CliRunner().invoke(
        app,
        ["bench", "amin", "--engine", "--model", "tiny", "--requests", "6",
         "--kv-capacity", "160", "--max-prompt", "64", "--max-output", "24",
         "--intervals", "overlap-0.95,rough", "--json", str(j), "--plot", str(p)],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    fig = json.loads(j.read_text())
    assert p.read_bytes()[:8] == PNG
    assert fig["mode"] == "engine"
    assert fig["kv_capacity_tokens"] == 160
    assert [(x["policy"], x["construction"]) for x in fig["rows"]] == [
        ("hsf", "oracle"),
        ("amax", "overlap-0.95"),
        ("amin", "overlap-0.95"),
        ("amax", "rough"),
        ("amin", "rough"),
    ]
    assert fig["rows"][3]["predictor"] == "interval:rough:1:24"  # scaled to the output cap
    for row in fig["rows"]:
        for side in ("real", "sim"):
            s = row[side]
            assert s["completed"] == 6
            assert s["tel_s"] > 0
            assert s["kv_peak_tokens"] <= 160
        assert row["real"]["kv_left_tokens"] == 0
        assert row["tel_sim_vs_real_pct"] == pytest.approx(
            100 * (row["sim"]["tel_s"] / row["real"]["tel_s"] - 1)
        )
    assert fig["rows"][0]["real"]["tel_ratio_vs_hsf"] == 1.0
    assert fig["cost_fit"]["timed_steps"] > 6
    assert "TEL" in r.output


def test_reps_give_medians(model: Any) -> None:
    from duetime.bench import amin_engine

    fig = amin_engine.run(
        model, model_name="tiny", requests=4, kv_capacity=160, max_prompt=48, max_output=16,
        constructions=("rough",), reps=3, clock="cpu",
    )  # fmt: skip
    for row in fig["rows"]:
        real = row["real"]
        assert real["reps"] == 3
        assert real["tel_s"] == sorted(real["tel_reps_s"])[1]
        assert len(real["restarts_reps"]) == 3
        assert real["kv_left_tokens"] == 0
    assert fig["rows"][0]["real"]["tel_ratio_vs_hsf"] == 1.0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--engine", "--model", "tiny", "--intervals", "bins7"], "unknown interval construction"),
        (["--engine", "--model", "tiny", "--kv-capacity", "40"], "--kv-capacity 40"),
        (["--engine", "--model", "/nonexistent.gguf"], "not 'gemma', 'tiny'"),
        (["--engine", "--model", "tiny", "--dtype", "fp8"], "--dtype must be"),
        (["--max-output", "24"], "only with --engine"),
        (["--reps", "2"], "only with --engine"),
    ],
)
def test_bench_amin_engine_bad_options(args: list[str], message: str) -> None:
    r = CliRunner().invoke(app, ["bench", "amin", *args, "--requests", "4"])
    assert r.exit_code == 2, r.output
    assert message in r.output
    assert "Traceback" not in r.output
