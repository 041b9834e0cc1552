"""One-decorator policy registry: adding a policy touches one file."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from duetime.core.policy import Policy

_REGISTRY: dict[str, Callable[..., Policy]] = {}
T = TypeVar("T", bound=Callable[..., Policy])


def register(name: str) -> Callable[[T], T]:
    """Class decorator: make a policy constructible by name (CLI, server, sweeps)."""

    def deco(factory: T) -> T:
        if name in _REGISTRY:
            raise ValueError(f"policy {name!r} registered twice")
        _REGISTRY[name] = factory
        return factory

    return deco


def make_policy(name: str, **kwargs: Any) -> Policy:
    """Build a registered policy; unknown names list the known ones."""
    _load_builtin()
    try:
        factory = _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise ValueError(f"unknown policy {name!r}; known policies: {known}") from None
    try:
        return factory(**kwargs)
    except TypeError as e:  # policies pass **kwargs up to their base: only the call can tell
        if "keyword argument" not in str(e):
            raise
        raise ValueError(f"policy {name!r}: {e}") from None


def available_policies() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def _load_builtin() -> None:
    # Importing the modules runs their @register decorators.
    from duetime.policies import (  # noqa: F401
        aell,
        amax,
        amin,
        deferred_prefill,
        edf,
        fcfs,
        hsf,
        pud,
        sjf,
        timebill,
    )
