"""The one reading of a comma-separated option: ``--rates 1,2,4``, ``--policies fcfs,edf``.

Every command that takes a list reads it here, so that a stray comma, a blank item or
a word where a number belongs means the same everywhere, and the error names the
option and the item that is wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

__all__ = ["comma_list", "comma_numbers"]

T = TypeVar("T", int, float)


def comma_list(text: str) -> list[str]:
    """The items of a comma-separated option, stripped, empty ones dropped: ``"a, b,"``
    is ``["a", "b"]`` wherever a command takes a list of names."""
    return [item.strip() for item in text.split(",") if item.strip()]


def comma_numbers(
    option: str, text: str, kind: Callable[[str], T], what: str, *, allow_empty: bool = False
) -> list[T]:
    """The numbers of a comma-separated option (``kind``: int or float), blank items
    dropped as :func:`comma_list` drops them. The first item that is not one is named
    (``--rates must be comma-separated numbers (requests/s): 'abc' in '4,abc' is not``),
    and a list with none is refused unless ``allow_empty``: a command given ``""`` ran
    its defaults or nothing, in silence."""
    values = []
    for item in comma_list(text):
        try:
            values.append(kind(item))
        except ValueError:
            raise ValueError(
                f"{option} must be comma-separated {what}: {item!r} in {text!r} is not"
            ) from None
    if not values and not allow_empty:
        raise ValueError(f"{option} {text!r} is empty: give at least one number")
    return values
