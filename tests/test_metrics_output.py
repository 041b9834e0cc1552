"""write_json atomicity and conversions; render_table contents."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from duetime.metrics import render_table, write_json


def test_write_json_converts_numpy_and_creates_parents(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "run.json"
    payload = {
        "p90": np.float64(1.25),
        "n": np.int64(3),
        "ok": np.bool_(True),
        "xs": np.arange(3),
        "undefined": float("nan"),
        "seeds": (0, 1),
        1: "int key",
    }
    assert write_json(target, payload) == target
    assert json.loads(target.read_text()) == {
        "p90": 1.25,
        "n": 3,
        "ok": True,
        "xs": [0, 1, 2],
        "undefined": None,
        "seeds": [0, 1],
        "1": "int key",
    }


def test_write_json_accepts_dataclasses_and_paths(tmp_path: Path) -> None:
    @dataclass
    class Cfg:
        rate: float
        out: Path

    write_json(tmp_path / "c.json", Cfg(rate=np.float32(2.0), out=Path("/x/y")))  # type: ignore[arg-type]
    assert json.loads((tmp_path / "c.json").read_text()) == {"rate": 2.0, "out": "/x/y"}


def test_unserialisable_payload_leaves_no_file(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="object"):
        write_json(tmp_path / "new.json", {"bad": object()})
    assert list(tmp_path.iterdir()) == []


def test_unserialisable_payload_keeps_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "run.json"
    write_json(target, {"version": 1})
    with pytest.raises(TypeError):
        write_json(target, {"version": 2, "bad": {1, 2}})
    assert json.loads(target.read_text()) == {"version": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]


def test_failure_during_replace_keeps_old_file_and_cleans_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "run.json"
    write_json(target, {"version": 1})

    def boom(src: str, dst: str) -> None:
        raise OSError("disk went away")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk went away"):
        write_json(target, {"version": 2})
    assert json.loads(target.read_text()) == {"version": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]


def _text(table: object) -> str:
    console = Console(record=True, width=200)
    console.print(table)
    return console.export_text()


def test_table_shows_policies_as_columns_and_metrics_as_rows() -> None:
    edf = {"requests": 10, "e2e_p90_s": 1.23456, "tel_s": None}
    fcfs = {"requests": 10, "e2e_p90_s": 2.5, "tel_s": 40.0}
    text = _text(render_table([("edf", edf), ("fcfs", fcfs)], title="rate 4"))
    for label in ("rate 4", "metric", "edf", "fcfs", "requests", "e2e_p90_s", "tel_s"):
        assert label in text
    assert "1.235" in text  # four significant digits
    assert "—" in text  # None (and keys a summary lacks)
    e2e_row = next(line for line in text.splitlines() if "e2e_p90_s" in line)
    assert e2e_row.index("1.235") < e2e_row.index("2.5")


def test_table_keys_choose_and_order_rows() -> None:
    text = _text(render_table({"a": 1, "b": 2.0, "c": 3}, keys=["c", "a"]))
    assert "value" in text
    assert " b " not in text
    assert text.index(" c ") < text.index(" a ")


def test_table_accepts_by_class_mapping() -> None:
    text = _text(render_table({"urgent": {"requests": 3}, "normal": {"requests": 5}}))
    assert "urgent" in text
    assert "normal" in text


def test_table_never_hides_digits_in_a_narrow_terminal() -> None:
    cols = [(f"σ={i}", {"tel_s": 28_810.4 + i, "deadline_hit_rate": 0.3825}) for i in range(7)]
    console = Console(width=80, record=True)
    console.print(render_table(cols, keys=["tel_s", "deadline_hit_rate"]))  # nor a metric name
    text = console.export_text()
    assert "…" not in text
    assert "e+" not in text  # large figures as grouped integers, not 2.881e+04
    assert "28,810" in text.replace("\n", "").replace(" ", "").replace("│", "")


def test_a_list_of_unlabelled_summaries_is_refused_in_words() -> None:
    # it was "too many values to unpack (expected 2)"
    with pytest.raises(TypeError, match="list of \\(label, summary\\) pairs"):
        render_table([{"requests": 1}, {"requests": 2}])  # type: ignore[list-item]
