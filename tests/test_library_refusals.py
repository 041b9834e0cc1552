"""Values the Python API took and ran with, where the command line refuses them."""

from __future__ import annotations

import re

import numpy as np
import pytest

from duetime.experiment import SimSpec, run_spec
from duetime.policies import make_policy
from duetime.workloads.builder import Deadlines


def test_an_unknown_preempt_mode_is_refused() -> None:
    # it ran as "recompute", 1,061 preemptions later
    with pytest.raises(ValueError, match="preempt_mode must be one of recompute, swap, restart"):
        make_policy("edf", preempt_mode="teleport")
    assert make_policy("edf", preempt_mode="swap").preempt_mode == "swap"  # type: ignore[attr-defined]


def test_an_unknown_deadline_basis_is_refused() -> None:
    # it priced every deadline by max_tokens
    with pytest.raises(ValueError, match="deadline basis must be output_len or max_tokens"):
        Deadlines(basis="oops")  # type: ignore[arg-type]


def test_a_spec_of_no_replicas_is_refused() -> None:
    # 0 is not a fleet (is_fleet is false for it): it ran one engine
    with pytest.raises(ValueError, match="--replicas must be >= 1, got 0"):
        run_spec(SimSpec(replicas=0, requests=10))


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("rate", "8", "SimSpec.rate must be a number, got '8' (str)"),
        ("requests", 10.5, "SimSpec.requests must be an int, got 10.5 (float)"),
        ("seed", True, "SimSpec.seed must be an int, got True (bool)"),
        ("deadline_scale", "x", "SimSpec.deadline_scale must be a number or None"),
        ("policy", 3, "SimSpec.policy must be a str, got 3 (int)"),
    ],
)
def test_a_spec_field_of_the_wrong_type_is_named(field: str, value: object, words: str) -> None:
    # each failed deep inside a run ("'>' not supported between 'str' and 'int'", ...)
    with pytest.raises(ValueError, match=re.escape(words)):
        SimSpec(**{field: value})  # type: ignore[arg-type]


def test_numpy_numbers_are_numbers_to_a_spec() -> None:
    spec = SimSpec(requests=np.int64(20), rate=np.float64(4.0), seed=np.int64(1))
    assert run_spec(spec)[1]["requests"] == 20
