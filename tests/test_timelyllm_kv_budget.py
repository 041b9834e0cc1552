"""`duetime bench timelyllm`: a KV budget some task cannot fit is one line and exit 2,
before any run, naming the smallest budget that works; that budget runs every task."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from duetime.bench import timelyllm as bench
from duetime.cli import app
from duetime.workloads.lrtrace import lrtrace_jobs


def test_smallest_budget_is_the_largest_task_less_its_last_token() -> None:
    need, wid, job = bench.kv_needed((1, 2, 3), 0)
    peaks = [j.request.prompt_len + j.output_len - 1 for w in (1, 2, 3) for j in lrtrace_jobs(w)]
    assert need == max(peaks)
    assert need == job.request.prompt_len + job.output_len - 1
    assert job.request == lrtrace_jobs(wid)[job.request.rid].request  # rids count from 0


@pytest.mark.parametrize("kv", ["1", "100", "500"])
def test_too_small_kv_capacity_is_one_line_and_exit_2(kv: str) -> None:
    need, wid, job = bench.kv_needed((1, 2, 3), 0)
    res = CliRunner().invoke(app, ["bench", "timelyllm", "--kv-capacity", kv])
    assert res.exit_code == 2, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)
    assert "did not finish" not in res.output
    assert len(res.output.strip().splitlines()) == 1, res.output
    text = res.output.strip()
    assert f"--kv-capacity {kv} is too small" in text
    assert f"the smallest that works is {need:,} KV tokens" in text
    assert f"task {job.request.rid} of WID{wid}" in text


def test_the_named_budget_runs_and_one_less_is_refused_before_any_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    need, _, _ = bench.kv_needed((1,), 0)
    row = bench.run_system("timelyllm", 1, 0, "paper-rtx4090", need)
    assert row["tasks"] == len(lrtrace_jobs(1, seed=0))
    assert row["kv_peak_tokens"] <= need

    def no_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("a run started before the budget was checked")

    monkeypatch.setattr(bench, "run_system", no_run)
    with pytest.raises(ValueError, match=f"smallest that works is {need:,} KV tokens"):
        bench.run((1,), 0, "paper-rtx4090", need - 1)
