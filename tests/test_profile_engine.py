"""A profile records the engine it timed (dtype, threads), and every command that runs the
real engine on a given profile refuses one timed on another engine, before the model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from duetime.core.cost import LinearStepCost
from duetime.predict.cost_report import check_profile_engine, engine_of, profile_payload
from duetime.predict.ete import StepSample
from tests.factories import cli_refused, forbid_model_loads


def _samples() -> list[StepSample]:
    out = []
    for p in (8, 16, 32, 64, 128):
        for _ in range(3):
            out.append(StepSample(p, float(p * p), 0, 0, 0.002 + 0.0001 * p, "prefill"))
    for d in (1, 2, 4, 8):
        for _ in range(3):
            out.append(StepSample(0, 0.0, d, 64 * d, 0.004 + 0.0005 * d, "decode"))
    return out


def _profile(tmp_path: Path, engine: dict[str, object] | None) -> Path:
    payload = profile_payload(
        _samples(), name="p", source="test", kv_capacity_tokens=4096, max_num_seqs=8,
        max_batch_tokens=256, engine=engine,
    )  # fmt: skip
    path = tmp_path / "p.json"
    path.write_text(json.dumps(payload))
    return path


@pytest.fixture
def no_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any model load fails loudly: the engine is checked before it."""
    forbid_model_loads(monkeypatch)


def test_the_profile_records_its_engine_and_the_check_reads_it(tmp_path: Path) -> None:
    meta = LinearStepCost.from_profile(_profile(tmp_path, engine_of("q8", 2))).meta
    assert meta["engine"] == {"dtype": "q8", "threads": 2}
    check_profile_engine(meta, "p.json", "q8", 2)  # the same engine: no error
    with pytest.raises(ValueError, match="timed on the q8 engine with 2 threads") as e:
        check_profile_engine(meta, "p.json", "fp32", 2)
    assert "--dtype q8 --threads 2" in str(e.value)
    assert "duetime profile --dtype fp32 --threads 2" in str(e.value)
    with pytest.raises(ValueError, match="this run is q8 with 1"):
        check_profile_engine(meta, "p.json", "q8", 1)


def test_a_profile_without_an_engine_is_taken_as_given(tmp_path: Path) -> None:
    meta = LinearStepCost.from_profile(_profile(tmp_path, None)).meta
    assert "engine" not in meta
    check_profile_engine(meta, "p.json", "fp32", 1)


@pytest.mark.parametrize(
    "command",
    [
        ("validate", "--dtype", "fp32"),
        ("validate", "--threads", "1"),
        ("serve", "--dtype", "fp32", "--max-num-seqs", "4", "--max-batch-tokens", "64"),
        ("bench", "timebill", "--engine", "--dtype", "fast", "--threads", "2"),
        ("bench", "timelyllm", "--engine", "--dtype", "q8", "--threads", "1"),
        ("bench", "amin", "--engine", "--model", "tiny", "--dtype", "fp32", "--clock", "wall"),
    ],
)
def test_a_profile_of_another_engine_is_refused_before_the_model_loads(
    no_load: None, tmp_path: Path, command: tuple[str, ...]
) -> None:
    prof = _profile(tmp_path, engine_of("q8", 2))
    cli_refused(*command, "--profile", str(prof), names="timed on the q8 engine with 2 threads")
