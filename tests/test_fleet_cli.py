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
        (["--replicas", "2", "--fail", "1@1e20"], "the time in [0, 1e+09] s"),
        # it said "(--profile)", an option not given
        (["--replica-profile", "nope"], "unknown profile (--replica-profile) 'nope'"),
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
    for slowdown in (1e308, float("nan"), 0):  # 1e308 ran, its sums overflowing to inf
        bad.write_text(
            json.dumps({"replicas": [{"profile": "a100-llama2-7b", "slowdown": slowdown}]})
        )
        with pytest.raises(ValueError, match="slowdown must be > 0 and <= 1000"):
            read_fleet(bad)
    assert parse_failure("3@12.5") == (3, 12.5)


def test_the_runs_limits_reach_every_replica_that_sets_none(tmp_path: Path) -> None:
    """--kv-capacity and --max-num-seqs were dropped for each replica profile's under
    --fleet and --replica-profile, while the JSON recorded them; a replica's own stand."""
    fleet = tmp_path / "fleet.json"
    groups = [{"profile": "a100-llama2-7b"}, {"profile": "a100-llama2-7b", "max_num_seqs": 3}]
    fleet.write_text(json.dumps({"replicas": groups}))
    specs = read_fleet(fleet, limits={"kv_capacity": 700, "max_num_seqs": 1})
    assert [s.config.kv_capacity for s in specs] == [700, 700]
    assert [s.config.max_num_seqs for s in specs] == [1, 3]
    by_file = tmp_path / "by-file.json"
    by_replicas = tmp_path / "by-replicas.json"
    for how, out in ((["--fleet", str(fleet)], by_file), (["--replicas", "2"], by_replicas)):
        args = ["sim", "--requests", "50", "--max-num-seqs", "1", *how, "--json", str(out)]
        res = runner.invoke(app, args)
        assert res.exit_code == 0, res.output
    one = json.loads(by_file.read_text())["replicas"][0]
    assert one["sim_time_s"] == pytest.approx(
        json.loads(by_replicas.read_text())["replicas"][0]["sim_time_s"]
    )


@pytest.mark.parametrize("fleet_option", ["--fleet", "--replica-profile"])
def test_a_profile_beside_replicas_that_name_theirs_is_refused(
    tmp_path: Path, fleet_option: str
) -> None:
    fleet = tmp_path / "fleet.json"
    fleet.write_text(json.dumps({"replicas": [{"profile": "a100-llama2-7b", "count": 2}]}))
    value = str(fleet) if fleet_option == "--fleet" else "a100-llama2-7b"
    for command in (["sim"], ["sweep", "--policies", "fcfs", "--rates", "2"]):
        args = [*command, "--requests", "20", fleet_option, value, "--profile", "a100-llama2-7b"]
        res = runner.invoke(app, args)
        assert res.exit_code == 2, res.output
        assert f"--profile: each replica names its own profile in {fleet_option}" in res.output


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


def test_a_fleet_row_counts_the_replicas_refusals_and_policy_calls(tmp_path: Path) -> None:
    """A prompt no replica's KV holds was counted `rejected` on one engine, and nowhere
    in a fleet's row (the eight it cancelled showed no cause)."""
    rows = {}
    for n in ("1", "2"):
        out = tmp_path / f"r{n}.json"
        args = ["sim", "--requests", "100", "--kv-capacity", "1000", "--replicas", n]
        res = runner.invoke(app, [*args, "--json", str(out)])
        assert res.exit_code == 0, res.output
        rows[n] = json.loads(out.read_text())
    fleet = rows["2"]
    assert fleet["summary"]["rejected"] == rows["1"]["summary"]["rejected"] > 0
    assert fleet["summary"]["rejected"] == sum(r["rejected"] for r in fleet["replicas"])
    assert fleet["summary"]["policy_calls"] == sum(r["policy_calls"] for r in fleet["replicas"])


def test_a_fleet_row_has_the_running_sequences_of_all_its_replicas(tmp_path: Path) -> None:
    """Each replica's mean is over its own span; the fleet's counts every replica's
    sequences over the fleet's span, as one engine's `mean_running` does."""
    out = tmp_path / "f.json"
    args = ["sim", "--requests", "300", "--rate", "8", "--replicas", "3", "--json", str(out)]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    fleet = json.loads(out.read_text())
    row, reps = fleet["summary"], fleet["replicas"]
    area = sum(r["mean_running"] * r["sim_time_s"] for r in reps)
    assert row["mean_running"] == pytest.approx(area / row["sim_time_s"])
    assert max(r["mean_running"] for r in reps) < row["mean_running"]


@pytest.mark.parametrize(
    ("predictor", "noted"), [([], True), (["--predictor", "noisy:0.3"], False)]
)
def test_the_forecast_router_without_a_predictor_says_why_it_refuses(
    predictor: list[str], noted: bool
) -> None:
    args = ["sim", "--replicas", "4", "--router", "forecast", "--deadline-scale", "5"]
    res = runner.invoke(app, [*args, "--requests", "200", "--rate", "20", *predictor])
    assert res.exit_code == 0, res.output
    assert ("without a length predictor the forecast router" in res.output) is noted
