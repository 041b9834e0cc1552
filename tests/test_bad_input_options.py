"""Bad option values, profiles and predictor specs: exit 2 with a line naming what is wrong.

Every case here once crashed with a traceback, ran on with nan results, or
failed with a message that did not say which option was at fault. Each fails
before any workload is simulated at scale or any model loads.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

from duetime.cli import app
from tests.factories import cli_refused

runner = CliRunner()


def _invoke(*args: str) -> tuple[int, str]:
    res = runner.invoke(app, list(args))
    return res.exit_code, res.output


SIM = ("sim", "--workload", "synthetic", "--requests", "5")


# --- 1. gamma cv ------------------------------------------------------------------------
@pytest.mark.parametrize("cv", ["inf", "1e-200", "nan", "1e9"])
def test_gamma_cv_out_of_range_is_refused(cv: str) -> None:
    cli_refused(*SIM, "--arrival", "gamma", "--cv", cv, names="cv")


@pytest.mark.parametrize("cv", [math.inf, 1e-200, math.nan])
def test_gamma_cv_library_check(cv: float) -> None:
    from duetime.workloads import Gamma

    with pytest.raises(ValueError, match="cv must be > 0 and finite"):
        Gamma(rate=1.0, cv=cv)


def test_gamma_cv_in_range_still_works() -> None:
    import numpy as np

    from duetime.workloads import Gamma

    for cv in (1e-3, 0.25, 3.0, 1e3):
        t = Gamma(rate=2.0, cv=cv).times(50, np.random.default_rng(0))
        assert np.all(np.isfinite(t))


# --- 2. NaN / inf past `<=` checks ------------------------------------------------------
@pytest.mark.parametrize(
    ("scale", "shown"), [("nan", "nan"), ("inf", "inf"), ("1e300", "1e+300")]
)  # 1e300: it ran, then no saved trace could hold its deadlines
def test_sim_nan_deadline_scale_is_refused(scale: str, shown: str) -> None:
    cli_refused(*SIM, "--deadline-scale", scale, names="--deadline-scale", value=shown)


def test_assign_deadlines_refuses_nan() -> None:
    from duetime.core.cost import LinearStepCost
    from duetime.experiment import assign_deadlines

    with pytest.raises(ValueError, match="--deadline-scale"):
        assign_deadlines([], LinearStepCost(c0=1.0), math.nan)


def test_bench_sensitivity_nan_deadline_scale_is_refused() -> None:
    from duetime.bench import sensitivity

    with pytest.raises(ValueError, match="--deadline-scale"):
        sensitivity.run(["fcfs"], [0.0], requests=5, workload="synthetic", deadline_scale=math.nan)
    with pytest.raises(ValueError, match="--errors"):
        sensitivity.run(["fcfs"], [math.nan], requests=5, workload="synthetic")


@pytest.mark.parametrize("deadline", [math.nan, math.inf])
def test_advise_batch_nan_deadline_is_refused(deadline: float) -> None:
    from duetime.predict.ala_advise import advise_batch
    from duetime.predict.ala_model import ThroughputPrediction

    class Flat:
        def predict_throughput(self, ii: int, oo: int, bb: int) -> ThroughputPrediction:
            return ThroughputPrediction(10.0, 8.0, 12.0, confidence=1.0)

    with pytest.raises(ValueError, match="--deadline must be finite"):
        advise_batch(Flat(), ii=1, oo=1, deadline_s=deadline, max_batch=4)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("mean_output", "shown"),
    [("inf", "inf"), ("nan", "nan"), ("1e18", "1e+18"), ("1e300", "1e+300")],
)
def test_advise_deferred_prefill_names_mean_output(mean_output: str, shown: str) -> None:
    """1e18 printed a NaN throughput with numpy warnings, exit 0."""
    cli_refused(
        "advise", "deferred-prefill", "--capacity", "256", "--mean-output", mean_output,
        names="--mean-output", value=shown,
    )  # fmt: skip


def test_advise_deferred_prefill_caps_the_capacity() -> None:
    """The solve grows as C³: C = 8000 took 170 s and 1.5 GB."""
    cli_refused("advise", "deferred-prefill", "--capacity", "5000", "--mean-output", "100",
             names="--capacity")  # fmt: skip


def test_bench_deferred_prefill_engine_infinite_mean_output_is_refused(tmp_path: Path) -> None:
    cli_refused(
        "bench", "deferred-prefill", "--requests", "40", "--engine", "--model", "tiny",
        "--mean-output", "inf", "--plot", str(tmp_path / "d.png"),
        names="--mean-output", value="inf",
    )  # fmt: skip


@pytest.mark.parametrize("err", ["nan", "inf", "-1"])
def test_noisy_predictor_bad_error_names_the_spec(err: str) -> None:
    cli_refused(*SIM, "--predictor", f"noisy:{err}", names=f"'noisy:{err}'")


@pytest.mark.parametrize("spec", ["noisy0.9", "noisyfoo", "noisy=0.9"])
def test_a_mistyped_noisy_predictor_is_refused(spec: str) -> None:
    """These ran as noisy:0.3 and recorded the typo as the predictor's name."""
    cli_refused(*SIM, "--predictor", spec, names=f"unknown predictor '{spec}'")


@pytest.mark.parametrize("sigma", [1.0, 5.0, 400.0])
def test_noisy_predictions_stop_at_max_tokens(sigma: float) -> None:
    """At sigma = 5 the upper bound reached 1e9 tokens (Amax reserved KV for it and the
    run ran out of memory); at 400 it overflowed to inf."""
    from duetime.core.request import Job, Request
    from duetime.predict.oracle import NoisyOraclePredictor

    pred = NoisyOraclePredictor(rel_error=sigma, seed=1)
    jobs = [Job(Request(rid=i, arrival=0.0, prompt_len=8, max_tokens=512), 100) for i in range(200)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's "overflow encountered in exp"
        preds = [pred.predict_job(j) for j in jobs]
    assert all(1.0 <= p.lo <= p.point <= p.hi <= 512.0 for p in preds)
    assert max(p.hi for p in preds) == 512.0  # the cap binds at these sigmas


@pytest.mark.parametrize(
    ("args", "names"),
    [(("--policies", ",,"), "--policies"), (("--errors", "", "--learned", "none"), "--errors")],
)
def test_bench_sensitivity_with_nothing_to_run_is_refused(
    tmp_path: Path, args: tuple[str, ...], names: str
) -> None:
    """Both ran nothing and wrote an empty table and JSON, exit 0."""
    j = tmp_path / "s.json"
    cli_refused("bench", "sensitivity", *args, "--json", str(j), names=names)
    assert not j.exists()


# --- 3. engine limits -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("option", "value"), [("--kv-capacity", "-5"), ("--max-num-seqs", "0"), ("--kv-capacity", "0")]
)
def test_sim_non_positive_limits_are_refused(option: str, value: str) -> None:
    cli_refused(*SIM, option, value, names=option)


@pytest.mark.parametrize(
    "args", [("--kv-capacity", "-5"), ("--max-num-seqs", "0"), ("--max-batch-tokens", "0")]
)
def test_profile_refuses_non_positive_limits_before_loading(
    tmp_path: Path, args: tuple[str, str]
) -> None:
    out = str(tmp_path / "p.json")
    cli_refused("profile", "--quick", "--serve-requests", "0", "--out", out, *args, names=args[0])


@pytest.mark.parametrize("key", ["kv_capacity_tokens", "max_num_seqs", "max_batch_tokens"])
def test_profile_json_with_non_positive_limit_is_refused(tmp_path: Path, key: str) -> None:
    from duetime.sim.profiles import profile_path

    raw = json.loads(profile_path("a100-llama2-7b").read_text())
    raw[key] = -5
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(raw))
    cli_refused(*SIM, "--profile", str(path), names=key, value="-5")


@pytest.mark.parametrize("field", ["kv_capacity", "max_num_seqs", "max_batch_tokens"])
def test_simulator_refuses_non_positive_limits(field: str) -> None:
    from duetime.core.cost import LinearStepCost
    from duetime.policies import make_policy
    from duetime.sim import SimConfig, Simulator

    cfg = SimConfig()
    setattr(cfg, field, 0)
    with pytest.raises(ValueError, match=f"{field} must be >= 1"):
        Simulator(make_policy("fcfs"), LinearStepCost(c0=1.0), cfg)


def test_sim_spec_refuses_non_positive_overrides() -> None:
    from duetime.experiment import SimSpec, sim_config

    with pytest.raises(ValueError, match="--kv-capacity"):
        sim_config(SimSpec(kv_capacity=-5))
    with pytest.raises(ValueError, match="--max-num-seqs"):
        sim_config(SimSpec(max_num_seqs=0))


# --- 4. bench sim --target-running ------------------------------------------------------
@pytest.mark.parametrize("target", ["-1", "0", "nan", "inf"])
def test_bench_sim_names_target_running(target: str) -> None:
    cli_refused("bench", "sim", "--requests", "50", "--target-running", target,
             names="--target-running")  # fmt: skip


# --- 5. bench deferred-prefill: too few requests ----------------------------------------
def test_bench_deferred_prefill_too_few_requests_is_refused(tmp_path: Path) -> None:
    png = str(tmp_path / "d.png")
    out = cli_refused("bench", "deferred-prefill", "--requests", "20", "--plot", png,
                   names="--requests 20")  # fmt: skip
    assert "too few" in out
    assert "nan" not in out


# --- 6. bench timebill --budget ---------------------------------------------------------
@pytest.mark.parametrize("budget", ["0", "-1", "nan", "inf"])
def test_bench_timebill_bad_budget_is_refused(tmp_path: Path, budget: str) -> None:
    png = str(tmp_path / "t.png")
    cli_refused("bench", "timebill", "--jobs", "5", "--budget", budget, "--plot", png,
             names="--budget")  # fmt: skip


def test_timebill_engine_refuses_bad_budget_before_loading(tmp_path: Path) -> None:
    png = str(tmp_path / "t.png")
    cli_refused("bench", "timebill", "--engine", "--model", "tiny", "--budget", "0", "--plot", png,
             names="--budget")  # fmt: skip


# --- 7. bench engine list options -------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "names"),
    [
        (("--transformers", "nope"), "--transformers"),
        (("--prefill", "0"), "--prefill"),
        (("--batch", "-1"), "--batch"),
        (("--prefill", "abc"), "--prefill"),
        (("--batch", "1,x"), "--batch"),
    ],
)
def test_bench_engine_bad_lists_fail_before_loading(args: tuple[str, str], names: str) -> None:
    cli_refused("bench", "engine", "--quick", *args, names=names)


# --- 8. seeds ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "names"),
    [
        (("sim", "--seed", "-1"), "--seed"),
        (("sweep", "--seeds", "-1"), "--seeds"),
        (("sweep", "--seeds", "0,-2"), "--seeds"),
        (("bench", "sim", "--seed", "-1"), "--seed"),
    ],
)
def test_negative_seeds_name_the_option(args: tuple[str, ...], names: str) -> None:
    cli_refused(*args, names=names)


def test_bench_amin_refuses_a_memory_no_request_fits() -> None:
    """--kv-capacity 1 completed nothing and ended in a ZeroDivisionError traceback."""
    cli_refused("bench", "amin", "--requests", "50", "--kv-capacity", "1", "--learned", "",
                "--workers", "1", names="--kv-capacity 1: a request needs")  # fmt: skip


@pytest.mark.parametrize("bench", ["serve-load", "admission"])
def test_a_served_bench_checks_its_dtype_first(bench: str) -> None:
    """--dtype bogus ran in full, exit 0, and the JSON recorded "bogus"."""
    cli_refused("bench", bench, "--model", "tiny", "--dtype", "bogus",
                names="--dtype must be one of")  # fmt: skip


def test_bench_fleet_refuses_a_learned_predictor_in_its_own_words() -> None:
    """It ended in 'set Request.prompt_text or prompt_token_ids (build_jobs(...))'."""
    out = cli_refused("bench", "fleet", "--predictor", "learned", "--requests", "50",
                      names="--predictor learned reads each request's prompt")  # fmt: skip
    assert "Request.prompt_text" not in out
