"""`duetime bench timebill` at toy scale: it writes what it promises."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from typer.testing import CliRunner

from duetime.bench.timebill import METHODS, STRATEGIES, periodic_jobs
from duetime.cli import app

PNG = b"\x89PNG\r\n\x1a\n"


def test_periodic_jobs_have_implicit_deadlines() -> None:
    jobs = periodic_jobs([(1500, 10, None)] * 6, 2.0, tasks=2)
    assert [j.request.arrival for j in jobs] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert all(j.request.deadline == j.request.arrival + 2.0 for j in jobs)
    assert [j.request.klass for j in jobs[:2]] == ["task0", "task1"]


def test_bench_timebill_small(tmp_path: Path) -> None:
    j, p = tmp_path / "t.json", tmp_path / "t.png"
    args = ["bench", "timebill", "--jobs", "30", "--budget", "2", "--budget", "3"]
    r = CliRunner().invoke(app, [*args, "--json", str(j), "--plot", str(p)])
    assert r.exit_code == 0, r.output
    assert p.read_bytes()[:8] == PNG
    fig = json.loads(j.read_text())
    rows = fig["rows"]
    assert len(rows) == len(STRATEGIES) * len(METHODS) * 2
    for row in rows:
        assert 0.0 <= row["completion_rate"] <= 1.0
        assert 0.0 <= row["mean_alpha"] <= 0.95 + 1e-9
        assert row["budget_s"] in (2.0, 3.0)
        assert row["kv_peak_tokens"] <= 111_000
    by = {(x["overrun"], x["method"], x["budget_s"]): x for x in rows}
    for o in STRATEGIES:
        for b in (2.0, 3.0):
            assert by[o, "vanilla", b]["mean_alpha"] == 0.0
    for b in (2.0, 3.0):
        # under Kill the jobs of one task are independent: more eviction, never fewer done
        k95, k0 = by["kill", "alpha=95%", b], by["kill", "vanilla", b]
        assert k95["completion_rate"] >= k0["completion_rate"]


def test_heldout_rows_are_the_length_predictors_test_rows_each_once(tmp_path: Path) -> None:
    from duetime import workloads as wl
    from duetime.bench.timebill import MIN_PROMPT, N_MAX, pairs
    from duetime.predict.length_data import heldout_rows
    from duetime.predict.length_features import sharegpt_prompts

    lengths = wl.load_sharegpt_lengths(progress=False)
    unseen = Counter(sharegpt_prompts(lengths, heldout_rows(lengths)))  # (a prompt may recur)
    drawn = pairs(10_000, seed=0, with_text=True, rows="heldout")  # more than there are
    assert 10 < len(drawn) < 200
    assert all(n <= unseen[text] for text, n in Counter(t for _, _, t in drawn).items())
    assert all(p >= MIN_PROMPT and o <= N_MAX for p, o, _ in drawn)
    assert pairs(len(drawn), 0, True, "heldout") == drawn  # seeded

    j = tmp_path / "t.json"
    args = ["bench", "timebill", "--jobs", "20", "--budget", "2", "--rows", "heldout"]
    r = CliRunner().invoke(app, [*args, "--json", str(j), "--plot", str(tmp_path / "t.png")])
    assert r.exit_code == 0, r.output
    w = json.loads(j.read_text())["workload"]
    assert (w["rows"], w["jobs"]) == ("heldout", 20)
    refusals = (
        (["--jobs", "5", "--rows", "test"], "--rows must be one of all, heldout"),
        (["--rows", "heldout", "--engine", "--model", "tiny"], "--rows is for the simulator"),
    )
    for bad, why in refusals:
        r = CliRunner().invoke(app, ["bench", "timebill", *bad])
        assert r.exit_code != 0
        assert why in r.output
