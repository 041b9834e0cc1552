"""summarize / summarize_by_class against hand-computed numbers."""

from __future__ import annotations

import pytest

from duetime.core.record import RequestRecord
from duetime.core.request import Request
from duetime.metrics import SLO, summarize, summarize_by_class


def rec(
    rid: int,
    arrival: float,
    first: float | None = None,
    finish: float | None = None,
    tokens: int = 1,
    *,
    deadline: float | None = None,
    cancelled_at: float | None = None,
    klass: str = "default",
    preemptions: int = 0,
) -> RequestRecord:
    req = Request(rid=rid, arrival=arrival, prompt_len=4, deadline=deadline, klass=klass)
    return RequestRecord(
        request=req,
        first_token=first,
        finish=finish,
        cancelled_at=cancelled_at,
        output_tokens=tokens,
        num_preemptions=preemptions,
    )


def three() -> list[RequestRecord]:
    """TTFT 1, 2, 3; E2E 2, 4, 6; TBT 0.1, 0.5, — (one token); 17 tokens over 0..8 s."""
    return [
        rec(0, 0.0, 1.0, 2.0, 11),
        rec(1, 1.0, 3.0, 5.0, 5),
        rec(2, 2.0, 5.0, 8.0, 1),
    ]


def test_three_requests_exact_latency_stats() -> None:
    s = summarize(three())
    assert (s["requests"], s["completed"], s["cancelled"], s["unfinished"]) == (3, 3, 0, 0)
    # numpy's linear interpolation: p90 of [2, 4, 6] is 4 + 0.8 * 2.
    assert s["e2e_mean_s"] == pytest.approx(4.0)
    assert s["e2e_p50_s"] == pytest.approx(4.0)
    assert s["e2e_p90_s"] == pytest.approx(5.6)
    assert s["e2e_p99_s"] == pytest.approx(5.96)
    assert s["ttft_mean_s"] == pytest.approx(2.0)
    assert s["ttft_p90_s"] == pytest.approx(2.8)
    assert s["tbt_mean_s"] == pytest.approx(0.3)
    assert s["tbt_p90_s"] == pytest.approx(0.46)
    assert s["tel_s"] == pytest.approx(12.0)


def test_default_span_is_first_arrival_to_last_finish() -> None:
    s = summarize(three())
    assert s["span_s"] == pytest.approx(8.0)
    assert s["throughput_req_s"] == pytest.approx(3 / 8)
    assert s["throughput_tok_s"] == pytest.approx(17 / 8)


def test_explicit_span_counts_only_completions_inside_it() -> None:
    s = summarize(three(), span=(1.0, 6.0))
    assert s["span_s"] == pytest.approx(5.0)
    assert s["throughput_req_s"] == pytest.approx(2 / 5)  # finishes at 2 and 5
    assert s["throughput_tok_s"] == pytest.approx(16 / 5)


def test_span_must_be_ordered() -> None:
    with pytest.raises(ValueError, match="span"):
        summarize(three(), span=(5.0, 1.0))


@pytest.mark.parametrize(
    ("slo", "good"),
    [
        (None, 3),
        (SLO(ttft_s=2.0), 2),  # TTFT 3 misses
        (SLO(tbt_s=0.2), 2),  # TBT 0.5 misses; the one-token request has no TBT to miss
        (SLO(e2e_s=4.0, tbt_s=0.2), 1),
        (SLO(ttft_s=0.5), 0),
    ],
)
def test_goodput_with_slo(slo: SLO | None, good: int) -> None:
    s = summarize(three(), slo=slo)
    assert s["goodput_req_s"] == pytest.approx(good / 8)
    assert s["slo_hit_rate"] == pytest.approx(good / 3)


def test_goodput_requires_deadline_and_counts_cancelled_as_miss() -> None:
    records = [*three(), rec(3, 0.0, 0.5, cancelled_at=1.0)]
    records[0] = rec(0, 0.0, 1.0, 2.0, 11, deadline=1.5)  # finishes late
    s = summarize(records, slo=SLO(e2e_s=10.0))
    assert s["goodput_req_s"] == pytest.approx(2 / 8)
    assert s["slo_hit_rate"] == pytest.approx(2 / 4)


def test_slo_rejects_nonpositive_targets() -> None:
    with pytest.raises(ValueError, match="ttft_s"):
        SLO(ttft_s=0.0)


def test_deadline_rate_counts_cancelled_and_unfinished_as_missed() -> None:
    records = [
        rec(0, 0.0, 0.5, 1.0, 2, deadline=1.0),  # exactly on the deadline: a hit
        rec(1, 0.0, 0.5, 3.0, 2, deadline=2.0),  # late
        rec(2, 0.0, None, None, 0, deadline=5.0, cancelled_at=0.5),
        rec(3, 0.0, 0.5, None, 1, deadline=5.0),  # still running at the end
        rec(4, 0.0, 0.5, 4.0, 2),  # no deadline: not in the denominator
    ]
    s = summarize(records)
    assert (s["completed"], s["cancelled"], s["unfinished"]) == (3, 1, 1)
    assert s["deadline_requests"] == 4
    assert s["deadline_hit_rate"] == pytest.approx(1 / 4)


def test_deadline_rate_is_none_without_deadlines() -> None:
    assert summarize(three())["deadline_hit_rate"] is None


def test_cancelled_requests_stay_out_of_latency_and_tel() -> None:
    records = [*three(), rec(3, 0.0, 0.1, None, 7, cancelled_at=20.0)]
    s = summarize(records)
    assert s["ttft_mean_s"] == pytest.approx(2.0)
    assert s["tel_s"] == pytest.approx(12.0)
    # ...but the run lasted until the cancellation, and its tokens are not throughput.
    assert s["span_s"] == pytest.approx(20.0)
    assert s["throughput_tok_s"] == pytest.approx(17 / 20)


def test_preemptions_count_every_request() -> None:
    records = [rec(0, 0.0, 1.0, 2.0, preemptions=2), rec(1, 0.0, cancelled_at=1.0, preemptions=1)]
    s = summarize(records)
    assert s["preemptions_total"] == 3
    assert s["preemptions_mean"] == pytest.approx(1.5)


def test_empty_input_gives_zero_counts_and_none() -> None:
    s = summarize([])
    assert (s["requests"], s["completed"], s["cancelled"], s["preemptions_total"]) == (0, 0, 0, 0)
    assert s["e2e_p90_s"] is None
    assert s["throughput_tok_s"] is None
    assert s["tel_s"] is None
    assert s["time_utility_total"] is None
    assert summarize_by_class([]) == {}


def test_all_cancelled_gives_none_latencies_and_zero_throughput() -> None:
    s = summarize([rec(0, 0.0, cancelled_at=1.0), rec(1, 0.5, cancelled_at=2.0)])
    assert s["completed"] == 0
    assert s["e2e_mean_s"] is None
    assert s["throughput_req_s"] == 0.0


def test_values_are_plain_python_numbers() -> None:
    for v in summarize(three()).values():
        assert v is None or type(v) in (int, float)


def test_by_class_splits_counts_and_shares_the_run_span() -> None:
    records = [
        rec(0, 0.0, 1.0, 2.0, 4, klass="b"),
        rec(1, 0.0, 1.0, 4.0, 6, klass="a"),
        rec(2, 1.0, 2.0, 8.0, 10, klass="a"),
    ]
    by = summarize_by_class(records)
    assert list(by) == ["a", "b"]
    assert by["a"]["requests"] == 2
    assert by["a"]["e2e_mean_s"] == pytest.approx(5.5)
    per_class = [by[k]["throughput_tok_s"] for k in ("a", "b")]
    assert sum(v for v in per_class if v is not None) == pytest.approx(
        summarize(records)["throughput_tok_s"]
    )


def test_hundred_thousand_records_summarise_correctly() -> None:
    # Speed is measured by `duetime bench sim`, never asserted in a test (shared machine).
    records = [
        rec(i, i * 0.01, i * 0.01 + 0.2, i * 0.01 + 1.0, 20, deadline=i * 0.01 + 2.0)
        for i in range(100_000)
    ]
    s = summarize(records, slo=SLO(ttft_s=0.5))
    assert s["completed"] == 100_000
    assert s["e2e_p99_s"] == pytest.approx(1.0)
