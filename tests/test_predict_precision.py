"""The RLP encoders' number format: what ``auto`` picks, what a model runs in, cache identities."""

from __future__ import annotations

import logging

import pytest

from duetime.predict.precision import (
    identity_in,
    precision_of,
    resolve_precision,
    runtime_precision,
    weights_identity,
)


def test_precision_auto_takes_bf16_only_where_it_is_native(native):
    assert resolve_precision("auto", "cuda") == "bf16"
    assert resolve_precision("fp32", "cuda") == "fp32"
    assert resolve_precision("bf16", "cpu") == "bf16"
    native(False)
    assert resolve_precision("auto", "cpu") == "fp32"
    native(True)
    assert resolve_precision("auto", "cpu") == "bf16"
    with pytest.raises(ValueError, match=r"precision \(--precision\) must be one of"):
        resolve_precision("fp16", "cpu")


def test_a_bf16_model_runs_in_fp32_only_where_bf16_is_emulated(native, caplog):
    native(True)
    assert runtime_precision("bf16") == "bf16"
    assert runtime_precision("fp32") == "fp32"
    native(False)
    with caplog.at_level(logging.WARNING):
        assert runtime_precision("bf16") == "fp32"
    assert "does not compute natively" in caplog.text
    assert runtime_precision("fp32") == "fp32"


def test_identities_carry_the_precision_and_float32_keeps_the_old_one():
    base = "all-minilm-l6-v2:ctx:t64:v1"
    assert identity_in(base, "fp32") == base  # caches built before bf16 stay valid
    bf16 = identity_in(base, "bf16")
    assert bf16 != base
    assert precision_of(bf16) == "bf16"
    assert precision_of(base) == "fp32"
    assert weights_identity(bf16) == weights_identity(base) == base
