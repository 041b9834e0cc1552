"""Every list option reads its commas alike: blank items dropped, a word where a number
belongs named with its option, and a list with no number refused."""

from __future__ import annotations

import pytest

from duetime.comma_lists import comma_list, comma_numbers
from tests.factories import cli_refused


def test_blank_items_are_dropped_as_for_names() -> None:
    assert comma_list(" a, b,,") == ["a", "b"]
    assert comma_numbers("--rates", "2, 4,", float, "numbers") == [2.0, 4.0]


def test_the_item_that_is_not_a_number_is_named() -> None:
    with pytest.raises(ValueError, match=r"--seeds must be comma-separated integers: '1\.5' in"):
        comma_numbers("--seeds", "0,1.5", int, "integers")


def test_a_list_with_no_number_is_refused_unless_allowed() -> None:
    with pytest.raises(ValueError, match=r"--ks ' , ' is empty: give at least one number"):
        comma_numbers("--ks", " , ", int, "integers")
    assert comma_numbers("--errors", "", float, "numbers", allow_empty=True) == []


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (("sweep", "--rates", "4,x"), "--rates must be comma-separated numbers (requests/s): 'x'"),
        (("sweep", "--rates", ","), "--rates ',' is empty"),
        (("bench", "deferred-prefill", "--engine", "--model", "tiny", "--ks", "1,x"),
         "--ks must be comma-separated integers: 'x'"),
        (("bench", "eviction", "--model", "tiny", "--alphas", "0.5,half"),
         "--alphas must be comma-separated numbers: 'half'"),
        (("bench", "serve-load", "--model", "tiny", "--requests", "10,ten"),
         "--requests must be comma-separated integers: 'ten'"),
        (("load", "--url", "http://127.0.0.1:9", "--rate", "1,fast"),
         "--rate must be comma-separated numbers (requests/s): 'fast'"),
    ],
)  # fmt: skip
def test_each_command_reads_its_list_the_one_way(args: tuple[str, ...], named: str) -> None:
    """Each of these had a parser of its own, with its own words for the same mistake."""
    cli_refused(*args, names=named)
