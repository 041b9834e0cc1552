"""Hypothesis settings and the strategy of jobs a JSONL trace can hold, shared by the
trace-file properties (tests/test_trace_file_properties.py) and the load generator
properties (tests/test_load_generator_properties.py).

``DUETIME_FUZZ_EXAMPLES=N`` deepens the search as it does for
tests/test_sim_invariants_all_policies.py, whose default is 25: each test using
:func:`fuzz_settings` runs N/25 times its own default number of examples (``=500``:
twenty times).
"""

from __future__ import annotations

import itertools
import os
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from duetime.core.request import MAX_TIME_S, Job, TimeUtility
from duetime.core.request import Request as CoreRequest

SCALE = int(os.environ.get("DUETIME_FUZZ_EXAMPLES", "25")) / 25


def fuzz_settings(examples: int) -> Any:
    return settings(
        max_examples=max(1, round(examples * SCALE)),
        deadline=None,
        derandomize=True,
        print_blob=True,
        report_multiple_bugs=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


# --- strategies: jobs a trace can hold ---------------------------------------------------------

SECONDS = st.floats(0, MAX_TIME_S, allow_nan=False, allow_infinity=False)
#: Numbers a caller may hand Request: ints too (``arrival=5``), which JSON spells without ".0".
REALS = st.one_of(SECONDS, st.integers(0, 10**6))
ANY_INT = st.integers()
NAMES = st.text(min_size=1, max_size=12)
PROMPT_LENS = st.integers(1, 10**6)
TUFS = st.one_of(
    st.none(),
    st.builds(TimeUtility, ert=REALS, beta=st.floats(-1e6, 1e6), alpha=st.floats(-1e6, 0)),
)


@st.composite
def _segments(draw: Any, output_len: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
    if output_len < 2 or not draw(st.booleans()):
        return (), ()
    cuts = draw(st.lists(st.integers(1, output_len - 1), max_size=4, unique=True))
    bounds = [0, *sorted(cuts), output_len]
    segments = tuple(b - a for a, b in itertools.pairwise(bounds))
    if draw(st.booleans()):
        return segments, ()
    gaps = draw(st.lists(REALS, min_size=len(segments) - 1, max_size=len(segments) - 1))
    return segments, tuple(gaps)


@st.composite
def trace_jobs(
    draw: Any,
    *,
    max_size: int = 6,
    arrivals: st.SearchStrategy[Any] = REALS,
    budgets: st.SearchStrategy[Any] = REALS,
    priorities: st.SearchStrategy[int] = ANY_INT,
    klasses: st.SearchStrategy[str] = NAMES,
    prompt_lens: st.SearchStrategy[int] = PROMPT_LENS,
    tufs: st.SearchStrategy[TimeUtility | None] = TUFS,
) -> list[Job]:
    """Jobs with distinct rids and any mix of optional fields (all within the format's rules)."""
    rids = draw(st.lists(st.integers(0, 2**70), max_size=max_size, unique=True))
    jobs = []
    for rid in rids:
        arrival = draw(arrivals)
        output_len = draw(st.integers(1, 300))
        segments, gaps = draw(_segments(output_len))
        tuf = draw(tufs)
        kv_eviction = draw(
            st.one_of(
                st.none(),
                st.sampled_from(["off", "auto"]),
                st.floats(0, 1, exclude_max=True),
            )
        )
        request = CoreRequest(
            rid=rid,
            arrival=arrival,
            prompt_len=draw(prompt_lens),
            max_tokens=draw(st.one_of(st.just(4096), st.integers(output_len, 10**6))),
            deadline=draw(
                st.one_of(st.none(), budgets.map(lambda b, a=arrival: min(a + b, MAX_TIME_S)))
            ),
            priority=draw(priorities),
            tuf=tuf,
            klass=draw(st.one_of(st.just("default"), klasses)),
            overrun=draw(st.sampled_from([None, "kill", "skip-next"])),
            kv_eviction=kv_eviction,
        )
        jobs.append(Job(request, output_len, segments, gaps))
    return jobs
