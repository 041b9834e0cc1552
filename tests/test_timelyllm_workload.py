"""LRTrace generator: seeded, and its settings are TimelyLLM's Table 3."""

from __future__ import annotations

from collections import Counter

from duetime.workloads import LRTRACE_WORKLOADS, lrtrace_jobs
from duetime.workloads.lrtrace import READ_S_PER_TOKEN, TUF_URGENT


def test_settings_match_table3() -> None:
    rows = {
        w: (s.eps, s.max_tpe, s.trace_ids, s.agents, s.time_s) for w, s in LRTRACE_WORKLOADS.items()
    }
    assert rows == {
        1: (0.25, 8, tuple(range(1, 9)), 25, 260.0),
        2: (0.25, 16, tuple(range(1, 9)), 42, 300.0),
        3: (0.1, 8, (9, 10, 11), 40, 900.0),
    }


def test_seeded() -> None:
    a, b, c = lrtrace_jobs(1, seed=3), lrtrace_jobs(1, seed=3), lrtrace_jobs(1, seed=4)
    key = [(j.request.arrival, j.request.prompt_len, j.segments, j.segment_gaps) for j in a]
    assert key == [(j.request.arrival, j.request.prompt_len, j.segments, j.segment_gaps) for j in b]
    assert key != [(j.request.arrival, j.request.prompt_len, j.segments, j.segment_gaps) for j in c]


def test_structure_per_workload() -> None:
    for w, cfg in LRTRACE_WORKLOADS.items():
        jobs = lrtrace_jobs(w, seed=0)
        per_event = Counter(j.request.arrival for j in jobs)
        assert max(per_event.values()) <= cfg.max_tpe
        assert all(0 < t < cfg.time_s for t in per_event)
        # Poisson events: within a loose band of eps · time
        assert 0.5 * cfg.eps * cfg.time_s < len(per_event) < 1.6 * cfg.eps * cfg.time_s
        for j in jobs:
            assert len(j.segment_gaps) == len(j.segments) - 1
            assert j.request.deadline == j.request.arrival + j.request.tuf.ert  # type: ignore[union-attr]
        klasses = {j.request.klass for j in jobs}
        assert klasses == ({"arm"} if w == 3 else {"normal", "urgent"})
    urgent = [j for j in lrtrace_jobs(1, seed=0) if j.request.klass == "urgent"]
    assert all(j.request.tuf == TUF_URGENT for j in urgent)
    arm = lrtrace_jobs(3, seed=0)
    assert 80 <= sum(j.output_len for j in arm) / len(arm) <= 120  # ~100-token arm plans
    drone = lrtrace_jobs(1, seed=0)
    assert 10 <= sum(j.output_len for j in drone) / len(drone) <= 30  # ~20-token drone plans


def test_the_server_expects_the_minimum_of_a_search_and_the_truth_of_the_rest() -> None:
    """§4.3: a search's time depends on the scene, so the time model gives its minimum;
    moves, turns, checks and prints follow from the command and are known."""
    from duetime.workloads.lrtrace import SEARCH_MIN_S

    searched = 0
    for j in lrtrace_jobs(1, seed=0):
        if not j.segment_gap_estimates:  # no search before the last action: all known
            continue
        assert len(j.segment_gap_estimates) == len(j.segment_gaps)
        for est, true in zip(j.segment_gap_estimates, j.segment_gaps, strict=True):
            if est != true:  # a search: its minimum, below the sampled time
                assert est == SEARCH_MIN_S < true
                searched += 1
    assert searched > 0
    assert all(not j.segment_gap_estimates for j in lrtrace_jobs(3, seed=0))  # arm: no search


def test_chatbot_gaps_are_reading_time() -> None:
    jobs = lrtrace_jobs(1, seed=0, chatbot_share=1.0, time_s=60.0)
    assert {j.request.klass for j in jobs} == {"chatbot"}
    for j in jobs:
        assert j.segment_gaps == tuple(t * READ_S_PER_TOKEN for t in j.segments[:-1])
    assert READ_S_PER_TOKEN == 0.15


def test_trace_roundtrip(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from duetime.workloads import read_trace, write_trace

    jobs = lrtrace_jobs(3, seed=0, time_s=100.0)
    path = tmp_path / "wid3.jsonl"
    assert write_trace(path, jobs) == len(jobs)
    back = read_trace(path)
    assert back == jobs
    drone = lrtrace_jobs(2, seed=0, time_s=60.0)  # searches: estimates kept too
    assert any(j.segment_gap_estimates for j in drone)
    write_trace(path, drone)
    assert read_trace(path) == drone
