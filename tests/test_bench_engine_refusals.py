"""Real-engine commands refuse bad input before the model loads.

Each case here once crashed with a traceback after the load (or after minutes of
work), ran nothing with exit 0, or silently ignored an option. The ``no_load``
fixture makes any model load fail the test, so a check that only fires after the
load does not pass. The numbered sections continue in
tests/test_bench_engine_printed_output.py (8, 9 and 12), which checks what these
commands print.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from tests.bench_checks_commands import AMIN, DP, EVICT, TB
from tests.factories import cli_refused, forbid_model_loads


@pytest.fixture
def no_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any model load (real, GGUF, tiny, served) fails loudly."""
    forbid_model_loads(monkeypatch)


# --- 1. deferred-prefill --engine: --mean-output past the model's context ----------------
@pytest.mark.parametrize(("mean", "shown"), [("1e18", "1e+18"), ("1e6", "1e+06"), ("600", "600")])
def test_deferred_prefill_mean_output_past_the_context_is_refused(
    no_load: None, tmp_path: Path, mean: str, shown: str
) -> None:
    """1e18: "Storage size calculation overflowed"; 1e6: a torch allocation traceback.
    600: the mean fits 1,024 positions, but the longest drawn output does not."""
    out = cli_refused(*DP, "--mean-output", mean, "--plot", str(tmp_path / "d.png"),
                   names="--mean-output", value=shown)  # fmt: skip
    assert "context of 1,024" in out


def test_deferred_prefill_engine_checks_the_same_bound_as_the_cli() -> None:
    from duetime.bench.deferred_prefill_engine import check_options

    kw: dict[str, Any] = {"capacity": 2, "prompt_len": 4, "requests": 6, "ks": None,
                          "reps": 1, "seed": 0, "context": 1024}  # fmt: skip
    check_options(mean_output=100, **kw)
    with pytest.raises(ValueError, match="--mean-output"):
        check_options(mean_output=1e18, **kw)


# --- 2. eviction: an empty --alphas ----------------------------------------------------
@pytest.mark.parametrize("alphas", [",", "", " , "])
def test_eviction_empty_alphas_is_refused_before_loading(no_load: None, alphas: str) -> None:
    """Ran every prompt, then IndexError on the empty table."""
    cli_refused(*EVICT, "--alphas", alphas, names="--alphas")


def test_eviction_alpha_out_of_range_is_refused_before_loading(no_load: None) -> None:
    cli_refused(*EVICT, "--alphas", "0.5,nan", names="--alphas")


def test_eviction_run_refuses_no_alphas() -> None:
    from duetime.bench.eviction import run

    with pytest.raises(ValueError, match="α"):
        run(None, [[1, 2, 3]], alphas=())  # type: ignore[arg-type]


# --- 3. timelyllm --engine: a KV capacity no task fits -----------------------------------
def test_timelyllm_engine_kv_capacity_too_small_is_refused_before_loading(no_load: None) -> None:
    """Loaded, calibrated, then "AssertionError: task 0 did not finish"."""
    out = cli_refused("bench", "timelyllm", "--engine", "--requests", "2", "--kv-capacity", "1",
                   names="--kv-capacity 1")  # fmt: skip
    assert "never finish" in out


def test_timelyllm_engine_check_fits_uses_the_scaled_prompts() -> None:
    from duetime.bench.timelyllm_engine import EngineScale, check_fits
    from duetime.workloads.lrtrace import lrtrace_jobs

    j = lrtrace_jobs(2, seed=0)[0]
    scale = EngineScale(time_x=10.0, prompt_x=0.1, decode_step_s=0.2, prefill_scaled_prompt_s=1.0)
    need = max(2, round(j.request.prompt_len * 0.1)) + j.output_len
    check_fits((2,), 1, 0, need, scale)
    with pytest.raises(ValueError, match=f"needs {need} KV tokens"):
        check_fits((2,), 1, 0, need - 1, scale)
    check_fits((2,), 1, 0, 2 + j.output_len, None)  # before calibrating: the shortest prompt


# --- 4. timebill: a budget too large to plot ----------------------------------------------
@pytest.mark.parametrize("budget", ["1e308", "2e6"])
def test_timebill_engine_huge_budget_is_refused_before_loading(
    no_load: None, tmp_path: Path, budget: str
) -> None:
    """1e308 ran, printed, then failed in matplotlib ("arange: cannot compute length")
    and wrote no JSON."""
    cli_refused(*TB, "--budget", budget, "--json", str(tmp_path / "x.json"),
             "--plot", str(tmp_path / "x.png"), names="--budget")  # fmt: skip
    assert not (tmp_path / "x.json").exists()


def test_timebill_simulated_huge_budget_is_refused(tmp_path: Path) -> None:
    cli_refused("bench", "timebill", "--jobs", "5", "--budget", "1e308",
             "--plot", str(tmp_path / "t.png"), names="--budget")  # fmt: skip


def test_timebill_budget_bound_is_inclusive() -> None:
    from duetime.bench.timebill import MAX_BUDGET_S, check_budgets

    check_budgets([0.004, MAX_BUDGET_S])
    with pytest.raises(ValueError, match="--budget"):
        check_budgets([MAX_BUDGET_S * 1.5])


# --- 5. empty or part-bad lists: bench serve --policies, bench engine --prefill/--batch -
@pytest.mark.parametrize(
    ("policies", "names"),
    [(",", "--policies is empty"), ("fcfs,edf,nope", "'nope'"), ("", "--policies is empty")],
)
def test_bench_serve_policies_are_all_checked_before_anything_runs(
    no_load: None, policies: str, names: str
) -> None:
    """',' ran nothing with exit 0; 'fcfs,edf,nope' served fcfs and edf before failing."""
    cli_refused("bench", "serve", "--model", "tiny", "--policies", policies, names=names)


@pytest.mark.parametrize("args", [("--prefill", ","), ("--batch", ","), ("--prefill", "")])
def test_bench_engine_empty_size_list_is_refused_before_loading(
    no_load: None, args: tuple[str, str]
) -> None:
    """An explicitly empty list silently ran the default grid."""
    cli_refused("bench", "engine", "--quick", "--transformers", "", "--engine", "fp32", *args,
             names=f"{args[0]} ", value="empty")  # fmt: skip


def test_engine_speed_run_refuses_an_empty_grid() -> None:
    from duetime.bench import engine_speed

    with pytest.raises(ValueError, match="--batch is empty"):
        engine_speed.run(quick=True, batch_sizes=(), transformers=(), progress=False)


# --- 6. timelyllm: engine-only options without --engine; --profile with it --------------
@pytest.mark.parametrize(
    "args",
    [("--calibration", "x.json"), ("--requests", "4"), ("--dtype", "fast"), ("--threads", "1")],
)
def test_timelyllm_engine_only_options_need_engine(args: tuple[str, str]) -> None:
    cli_refused("bench", "timelyllm", *args, names=args[0], value="only with --engine")


def test_timelyllm_engine_profile_is_used_not_ignored(no_load: None) -> None:
    """--profile nope with --engine was silently ignored (the run timed its own costs)."""
    cli_refused("bench", "timelyllm", "--engine", "--profile", "nope", names="'nope'")


def test_timelyllm_engine_profile_and_calibration_conflict(no_load: None, tmp_path: Path) -> None:
    cli_refused("bench", "timelyllm", "--engine", "--profile", "a100-llama2-7b",
             "--calibration", str(tmp_path / "c.json"),
             names="--calibration and --profile")  # fmt: skip


def test_timelyllm_engine_scale_from_a_profile_matches_its_cost() -> None:
    from duetime.bench.timelyllm import paper_rtx4090
    from duetime.bench.timelyllm_engine import calibration_from_profile, scale_for

    cost, scale = calibration_from_profile("a100-llama2-7b")
    assert scale == scale_for(cost)
    paper, _ = paper_rtx4090()
    assert scale.time_x == pytest.approx(
        cost.step_time(0, 0.0, 1, 64) / paper.step_time(0, 0.0, 1, 64)
    )
    assert 0 < scale.prompt_x <= 1


# --- 7. a prompt longer than the model's context ------------------------------------------
def test_eviction_prompt_past_the_context_is_refused_before_loading(no_load: None) -> None:
    """100,000-token prompts on the tiny model (1,024 positions) ran for minutes."""
    cli_refused(*EVICT, "--min-prompt", "100000", "--max-prompt", "100000",
             names="--max-prompt 100000", value="context of 1,024")  # fmt: skip


def test_bench_engine_prefill_past_the_context_is_refused_before_loading(no_load: None) -> None:
    """--prefill 40000 on Gemma (32,768 positions) ended in a torch OOM traceback; the
    context comes from the shipped GGUF's header, not its weights."""
    cli_refused("bench", "engine", "--quick", "--transformers", "", "--engine", "fp32",
             "--prefill", "40000", names="--prefill 40000", value="32,768")  # fmt: skip


def test_engine_speed_checks_the_context_of_a_given_model() -> None:
    from duetime.bench import engine_speed
    from duetime.engine.config import Gemma3Config
    from duetime.engine.testing import tiny_hf_model

    hf = tiny_hf_model()
    source = (Gemma3Config.from_hf(hf.config), dict(hf.state_dict()))
    with pytest.raises(ValueError, match="--prefill 2000"):
        engine_speed.run(source, quick=True, prefill_tokens=(2000,), transformers=(),
                         llama_cpp=False, progress=False)  # fmt: skip
    with pytest.raises(ValueError, match="--context 1020"):
        engine_speed.run(source, quick=True, context=1020, transformers=(), llama_cpp=False,
                         progress=False)  # fmt: skip


def test_amin_engine_request_past_the_context_is_refused_before_loading(
    no_load: None, tmp_path: Path
) -> None:
    cli_refused(*AMIN, "--max-prompt", "100000", "--kv-capacity", "100000",
             "--plot", str(tmp_path / "a.png"), names="--max-prompt", value="context")  # fmt: skip


def test_timebill_engine_prompt_past_the_context_is_refused_before_loading(
    no_load: None, tmp_path: Path
) -> None:
    cli_refused(*TB, "--max-prompt", "2000", "--plot", str(tmp_path / "x.png"),
             names="--max-prompt 2000", value="context")  # fmt: skip


# --- 10. hsf without a length predictor -------------------------------------------------------
def test_validate_hsf_without_predictor_is_refused_before_loading(
    no_load: None, tmp_path: Path
) -> None:
    """Said "run it with --predictor oracle", after the load, though validate had none."""
    prof = tmp_path / "p.json"
    prof.write_text("{}")
    cli_refused("validate", "--profile", str(prof), "--policy", "hsf", names="--predictor oracle")
    cli_refused("validate", "--profile", str(prof), "--policy", "nope", names="--policy")
    cli_refused("validate", "--profile", str(prof), "--predictor", "nope", names="--predictor")


def test_validate_runs_hsf_with_the_oracle_on_both_sides(tmp_path: Path) -> None:
    from duetime.bench import validate
    from duetime.core.request import Job, Request
    from duetime.engine.testing import engine_from_hf, tiny_hf_model

    r = random.Random(5)
    jobs = []
    for i in range(5):
        p = r.randint(2, 20)
        req = Request(rid=i, arrival=0.01 * i, prompt_len=p, max_tokens=32,
                      prompt_token_ids=tuple(r.randrange(256) for _ in range(p)))  # fmt: skip
        jobs.append(Job(req, r.randint(1, 12)))
    fig = validate.run(
        model=engine_from_hf(tiny_hf_model()), profile="a100-llama2-7b", policy="hsf",
        predictor="oracle", requests=5, jobs=jobs, kv_capacity=2_000, max_num_seqs=4,
        max_batch_tokens=64,
    )  # fmt: skip
    assert fig["requests_compared"] == 5
    assert fig["predictor"] == "oracle"


def test_bench_serve_hsf_is_refused_before_loading(no_load: None) -> None:
    """Said "serve it with --predictor learned", which bench serve does not take."""
    out = cli_refused("bench", "serve", "--model", "tiny", "--policies", "fcfs,hsf",
                   names="--policies hsf")  # fmt: skip
    assert "duetime serve --policy hsf --predictor learned" in out


# --- 11. bad names: --intervals overlap-nan, --model nope ---------------------------------------
@pytest.mark.parametrize("intervals", ["overlap-nan", "overlap-1.5", "nope", "rough,overlap-x"])
def test_amin_engine_bad_intervals_are_refused_before_loading(
    no_load: None, tmp_path: Path, intervals: str
) -> None:
    """overlap-nan failed with "bad predictor 'interval:overlap:nan'" after the load."""
    cli_refused(*AMIN, "--intervals", intervals, "--plot", str(tmp_path / "a.png"),
             names="--intervals")  # fmt: skip


@pytest.mark.parametrize("command", [DP, AMIN])
def test_a_bad_profile_is_refused_before_loading(
    no_load: None, tmp_path: Path, command: tuple[str, ...]
) -> None:
    """It was read after the model had loaded (and timed nothing, as a profile skips that)."""
    cli_refused(*command, "--profile", "nope", "--plot", str(tmp_path / "p.png"),
                names="unknown profile (--profile) 'nope'")  # fmt: skip


@pytest.mark.parametrize(
    ("command", "plot"), [(EVICT, False), (("bench", "serve"), False), (DP, True), (AMIN, True)]
)
def test_a_bad_model_name_names_model_and_the_choices(
    no_load: None, tmp_path: Path, command: tuple[str, ...], plot: bool
) -> None:
    """Was "nope: file does not exist"."""
    extra = ("--plot", str(tmp_path / "p.png")) if plot else ()
    cli_refused(
        *command, "--model", "nope", *extra, names="--model 'nope'", value="'gemma', 'tiny'"
    )


# --- 13. --requests on the real-engine commands ------------------------------------------------
def test_validate_caps_requests(tmp_path: Path) -> None:
    """10^8 grew memory drawing the workload."""
    prof = tmp_path / "p.json"
    prof.write_text("{}")
    cli_refused("validate", "--profile", str(prof), "--requests", "100000000", names="--requests")


@pytest.mark.parametrize("command", [AMIN, DP])
def test_engine_benches_cap_requests_before_loading(
    no_load: None, tmp_path: Path, command: tuple[str, ...]
) -> None:
    cli_refused(*command, "--requests", "100000000", "--plot", str(tmp_path / "p.png"),
             names="--requests 100,000,000", value="100,000")  # fmt: skip


def test_simulated_amin_takes_more_than_the_engine_cap() -> None:
    from duetime.bench.limits import MAX_ENGINE_REQUESTS, check_engine_requests

    check_engine_requests(MAX_ENGINE_REQUESTS)
    with pytest.raises(ValueError, match="--requests"):
        check_engine_requests(MAX_ENGINE_REQUESTS + 1)
