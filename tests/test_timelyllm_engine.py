"""Offload of suspended KV on the real executor (tiny random-weight Gemma 3), and its twin run
on the simulator: exact greedy continuations, no KV left behind, the same page-out decisions."""

from __future__ import annotations

import random
from typing import Any

import pytest

from duetime.core.executor import ExecutorCore
from duetime.core.request import Job, Request
from duetime.core.sequence import Seq
from duetime.engine import greedy_generate
from duetime.engine.executor import EngineExecutor
from duetime.engine.testing import engine_from_hf, tiny_hf_model
from duetime.policies import make_policy
from duetime.sim import SimConfig, Simulator
from tests.factories import SIMPLE_COST


@pytest.fixture(scope="module")
def model() -> Any:
    return engine_from_hf(tiny_hf_model(seed=1))


class _Log(ExecutorCore):
    """Logs (step, event, rid) for every page-out and swap-in, on whichever executor."""

    log: list[tuple[int, str, int]]

    def _on_swap_out(self, seq: Seq) -> None:
        self.log.append((self.engine_steps, "out", seq.rid))
        super()._on_swap_out(seq)

    def _on_swap_in(self, seq: Seq) -> None:
        self.log.append((self.engine_steps, "in", seq.rid))
        super()._on_swap_in(seq)


class LoggedEngine(_Log, EngineExecutor):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.log = []


class LoggedSim(_Log, Simulator):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.log = []


def _jobs(n: int, seed: int, gap: float) -> list[Job]:
    """Prompts of 20-40 tokens, three segments of 2-6 tokens each, all arriving at once."""
    r = random.Random(seed)
    jobs = []
    for i in range(n):
        p = r.randint(20, 40)
        ids = tuple(r.randrange(256) for _ in range(p))
        segs = tuple(r.randint(2, 6) for _ in range(3))
        gaps = (gap * (1 + i % 3), gap)
        req = Request(rid=i, arrival=0.0, prompt_len=p, prompt_token_ids=ids, max_tokens=64)
        jobs.append(Job(req, sum(segs), segs, gaps))
    return jobs


def _reference(model: Any, jobs: list[Job]) -> dict[int, list[int]]:
    longest = max(j.output_len for j in jobs)
    outs = greedy_generate(model, [list(j.request.prompt_token_ids or ()) for j in jobs], longest)
    return {j.request.rid: outs[k][: j.output_len] for k, j in enumerate(jobs)}


def test_offloaded_then_resumed_request_is_the_uninterrupted_greedy_answer(model: Any) -> None:
    # gaps of 0.2-0.6 s: a suspension must outlast a step even when other test workers
    # load the machine (at 0.02 s a slow step ended every gap before memory got tight)
    jobs = _jobs(8, seed=5, gap=0.2)
    ex = LoggedEngine(
        make_policy("fcfs"), model, kv_capacity=200, max_num_seqs=3, offload_suspended=True
    )
    res = ex.run(jobs)
    outs = [rid for _, e, rid in ex.log if e == "out"]
    back = [rid for _, e, rid in ex.log if e == "in"]
    assert outs, "memory was never tight enough to page a suspended sequence out"
    assert sorted(outs) == sorted(back)  # every page-out came back
    assert res.outputs == _reference(model, jobs)  # bit-for-bit KV: no token changed
    assert ex.prefill_tokens == sum(j.request.prompt_len for j in jobs)  # no re-prefill
    assert res.preemptions == 0
    assert res.kv_peak <= 200
    assert all(len(r.segment_done) == 3 for r in res.records)
    assert ex.kv.total_tokens == 0
    assert not ex.slots
    assert ex._spool is None


@pytest.mark.parametrize("policy", ["fcfs", "edf"])
def test_simulator_and_engine_page_out_the_same_sequences_at_the_same_steps(
    model: Any, policy: str
) -> None:
    # Gaps of 0 and one arrival time make these policies' decisions time-free, so the
    # two executors must agree step for step, page-outs and swap-ins included.
    jobs = _jobs(10, seed=7, gap=0.0)
    kw: dict[str, Any] = {"kv_capacity": 140, "max_num_seqs": 6, "max_batch_tokens": 48}
    eng = LoggedEngine(make_policy(policy), model, offload_suspended=True, **kw)
    eng_res = eng.run(jobs)
    sim = LoggedSim(make_policy(policy), SIMPLE_COST, SimConfig(**kw, offload_suspended=True))
    sim_res = sim.run(jobs)
    assert any(e == "out" for _, e, _ in eng.log)
    assert eng.log == sim.log
    assert eng_res.engine_steps == sim_res.engine_steps
    assert eng.prefill_tokens == sim.prefill_tokens
    assert [r.output_tokens for r in eng_res.records] == [r.output_tokens for r in sim_res.records]


def test_scaled_jobs_keep_utility_per_scaled_second() -> None:
    from duetime.bench.timelyllm_engine import EngineScale, scaled_jobs
    from duetime.workloads.lrtrace import lrtrace_jobs

    scale = EngineScale(time_x=2.5, prompt_x=0.1, decode_step_s=0.05, prefill_scaled_prompt_s=0.1)
    src = lrtrace_jobs(2, seed=0)[:10]
    jobs = scaled_jobs(2, 10, 0, scale, bos_id=2, vocab=256)
    t0 = src[0].request.arrival
    for s, j in zip(src, jobs, strict=True):
        r = j.request
        assert r.arrival == pytest.approx((s.request.arrival - t0) * 2.5)
        assert j.segments == s.segments  # token counts are kept
        assert j.segment_gaps == pytest.approx([g * 2.5 for g in s.segment_gaps])
        assert r.prompt_token_ids is not None
        assert r.prompt_token_ids[0] == 2
        assert len(r.prompt_token_ids) == r.prompt_len == max(2, round(s.request.prompt_len * 0.1))
        assert r.tuf is not None
        assert s.request.tuf is not None
        for t in (0.1, 0.5, 1.3):
            assert r.tuf(2.5 * t) == pytest.approx(s.request.tuf(t))


def test_engine_bench_runs_all_five_systems_under_tight_memory(model: Any) -> None:
    from duetime.bench.timelyllm import SYSTEMS
    from duetime.bench.timelyllm_engine import EngineScale, run

    scale = EngineScale(time_x=1.0, prompt_x=0.1, decode_step_s=0.01, prefill_scaled_prompt_s=0.05)
    fig = run(
        model,
        requests=6,
        kv_capacity=160,
        max_num_seqs=4,
        calibration=(SIMPLE_COST, scale),
    )
    assert [r["system"] for r in fig["rows"]] == list(SYSTEMS)
    assert [r["system"] for r in fig["simulated_same_jobs"]["rows"]] == list(SYSTEMS)
    for r in fig["rows"]:
        assert r["kv_peak_tokens"] <= 160
        assert r["tasks"] == 6
        assert set(r["classes"]) <= {"normal", "urgent"}
        assert r["response_time_mean_s"] > 0
    seg = [r for r in fig["rows"] if r["system"] in ("fcfs-seg", "edf-seg", "timelyllm")]
    assert any(r["offloads"] > 0 for r in seg)  # memory was tight enough to page out
    assert set(fig["summary"]) == {"wid2"}


def test_cli_offload_flag_and_bad_engine_dtype(tmp_path: Any) -> None:
    import json

    from typer.testing import CliRunner

    from duetime.cli import app

    runner = CliRunner()
    totals = {}
    for flag in ("--offload", "--no-offload"):
        path = tmp_path / f"{flag}.json"
        res = runner.invoke(
            app, ["bench", "timelyllm", "--wid", "1", "--kv-capacity", "2000", flag,
                  "--json", str(path)],
        )  # fmt: skip
        assert res.exit_code == 0, res.output
        fig = json.loads(path.read_text())
        assert fig["offload_suspended"] is (flag == "--offload")
        rows = {r["system"]: r for r in fig["rows"]}
        totals[flag] = rows["timelyllm"]["time_utility_total"]
        assert (rows["timelyllm"]["offloads"] > 0) is (flag == "--offload")
    assert totals["--offload"] > totals["--no-offload"]  # the small-memory collapse is gone
    res = runner.invoke(app, ["bench", "timelyllm", "--engine", "--dtype", "fp64"])
    assert res.exit_code == 2
    assert "--dtype must be one of" in res.output


def test_calibration_round_trips_through_the_json_and_bad_files_are_clear(tmp_path: Any) -> None:
    import json

    from duetime.bench.timelyllm_engine import EngineScale, calibration_from_json

    scale = EngineScale(time_x=3.0, prompt_x=0.2, decode_step_s=0.06, prefill_scaled_prompt_s=0.2)
    fig = {
        "scale": {
            "time_x": 3.0,
            "prompt_x": 0.2,
            "decode_step_s": 0.06,
            "prefill_scaled_prompt_s": 0.2,
        },
        "cost": SIMPLE_COST.to_profile(),
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps(fig))
    cost, back = calibration_from_json(path)
    assert back == scale
    assert cost.step_time(3, 9.0, 2, 50) == pytest.approx(SIMPLE_COST.step_time(3, 9.0, 2, 50))
    path.write_text("{}")
    with pytest.raises(ValueError, match="not the JSON of"):
        calibration_from_json(path)
    with pytest.raises(ValueError, match="not found"):
        calibration_from_json(tmp_path / "missing.json")
