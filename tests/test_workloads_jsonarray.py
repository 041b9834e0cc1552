"""Recovering complete elements from truncated or damaged JSON arrays."""

from __future__ import annotations

import json

import pytest

from duetime.workloads.jsonarray import RecoveryReport, iter_array


def _recover(text: str) -> tuple[list[object], RecoveryReport]:
    report = RecoveryReport()
    return [element for element, _, _ in iter_array(text, report)], report


def test_valid_array_is_read_whole_and_marked_closed() -> None:
    elements, report = _recover(json.dumps([{"a": 1}, [2], "x", 3], indent=2))
    assert elements == [{"a": 1}, [2], "x", 3]
    assert (report.complete, report.closed, report.truncated) == (4, True, False)


def test_truncated_tail_keeps_every_complete_element() -> None:
    text = json.dumps([{"id": i, "v": "é" * i} for i in range(5)], indent=2)
    cut = text[: text.index('"id": 4') + 3]  # inside the last element
    elements, report = _recover(cut)
    assert [e["id"] for e in elements] == [0, 1, 2, 3]  # type: ignore[index]
    assert report.truncated
    assert not report.closed
    assert report.damaged_regions == 0


def test_offsets_slice_back_to_the_element() -> None:
    text = json.dumps([{"id": 1}, {"id": 2, "s": "a,b]"}], indent=2)
    for element, start, end in iter_array(text):
        assert json.loads(text[start:end]) == element


def test_damaged_middle_element_costs_only_itself() -> None:
    text = json.dumps([{"id": 0}, {"id": 1}, {"id": 2}, {"id": 3}], indent=2)
    # break element 1: its closing brace is replaced, so it swallows nothing else validly
    start = text.index('"id": 1')
    damaged = text[:start] + '"id": 1, "oops": [' + text[start + len('"id": 1') :]
    elements, report = _recover(damaged)
    assert [e["id"] for e in elements] == [0, 2, 3]  # type: ignore[index]
    assert report.damaged_regions == 1
    assert report.closed


def test_number_cut_at_end_of_file_is_not_trusted() -> None:
    elements, report = _recover("[1, 2, 34")  # "34" may have been "345"
    assert elements == [1, 2]
    assert report.truncated


def test_trailing_comma_and_empty_array() -> None:
    assert _recover("[1, 2,]")[0] == [1, 2]
    elements, report = _recover("  [ ]  ")
    assert elements == []
    assert report.closed


def test_not_an_array_is_an_error() -> None:
    with pytest.raises(ValueError, match="not a JSON array"):
        list(iter_array('{"a": 1}'))
