"""`duetime sim` with a fleet, `bench fleet`, and bad fleet input named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from duetime.bench import fleet as bench_fleet
from duetime.cli import app
from duetime.sim.fleet_build import parse_failure, read_fleet

runner = CliRunner()


def test_sim_with_replicas_writes_fleet_and_replica_figures(tmp_path: Path) -> None:
    out = tmp_path / "f.json"
    png = tmp_path / "f.png"
    res = runner.invoke(
        app,
        [
            "sim", "--requests", "300", "--rate", "10", "--replicas", "3", "--router", "lor",
            "--fail", "1@5", "--deadline-scale", "5", "--json", str(out), "--plot", str(png),
        ],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["summary"]["replicas"] == 3
    assert data["summary"]["router"] == "lor"
    assert data["summary"]["requests"] == 300
    assert [r["up"] for r in data["replicas"]] == [True, False, True]
    assert data["summary"]["rerouted"] + data["summary"]["failed"] > 0
    assert png.stat().st_size > 0


def test_sim_one_engine_row_is_unchanged_without_fleet_options(tmp_path: Path) -> None:
    out = tmp_path / "one.json"
    res = runner.invoke(app, ["sim", "--requests", "100", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "router" not in json.loads(out.read_text())["summary"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--router", "nope"], "unknown router 'nope'"),
        (["--fail", "2-30"], "REPLICA@SECONDS"),
        (["--replicas", "2", "--fail", "5@1"], "replica 5"),
        (["--replicas", "3", "--replica-profile", "a100-llama2-7b"], "must agree"),
    ],
)
def test_bad_fleet_options_are_named(args: list[str], message: str) -> None:
    res = runner.invoke(app, ["sim", "--requests", "20", *args])
    assert res.exit_code != 0
    assert message in res.output


def test_fleet_json_mixes_profiles_and_names_unknown_keys(tmp_path: Path) -> None:
    good = tmp_path / "fleet.json"
    good.write_text(
        json.dumps(
            {
                "replicas": [
                    {"profile": "a100-llama2-7b", "count": 2},
                    {"profile": "a100-llama2-7b", "slowdown": 2.0, "kv_capacity": 5000},
                ]
            }
        )
    )
    specs = read_fleet(good)
    assert len(specs) == 3
    assert specs[2].config.kv_capacity == 5000
    assert specs[2].cost.c0 == pytest.approx(2 * specs[0].cost.c0)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"replicas": [{"profile": "a100-llama2-7b", "slowdwn": 2}]}))
    with pytest.raises(ValueError, match="unknown keys \\['slowdwn'\\]"):
        read_fleet(bad)
    assert parse_failure("3@12.5") == (3, 12.5)


def test_bench_fleet_compares_routers_on_both_fleets(tmp_path: Path) -> None:
    fig = bench_fleet.run(replicas=2, requests=200, routers=["lor", "forecast"], loads=[0.85])
    rows = fig["rows"]
    assert {(r["fleet"], r["router"]) for r in rows} == {
        (f, r) for f in ("homogeneous", "mixed") for r in ("lor", "forecast")
    }
    assert fig["capacity_req_s"]["mixed"] < fig["capacity_req_s"]["homogeneous"]
    for r in rows:
        assert 0.0 <= r["deadline_hit_rate"] <= 1.0
        assert r["load_pct"] == 85
    assert all(r["refused"] == 0 for r in rows if r["router"] == "lor")  # lor never refuses
    png = tmp_path / "bench.png"
    bench_fleet.plot(fig, png)
    assert png.stat().st_size > 0
