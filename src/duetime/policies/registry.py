"""One-decorator policy registry: adding a policy touches one file."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from duetime.core.policy import Policy
from duetime.core.registry import Registry

T = TypeVar("T", bound=Callable[..., Policy])

#: The modules whose @register decorators define the built-in policies.
_BUILTIN = ("aell", "amax", "amin", "deferred_prefill", "edf", "fcfs", "hsf", "pud", "sjf",
            "timebill")  # fmt: skip
_POLICIES: Registry[Policy] = Registry("policy", "policies", "duetime.policies", _BUILTIN)


def register(name: str) -> Callable[[T], T]:
    """Class decorator: make a policy constructible by name (CLI, server, sweeps)."""
    return _POLICIES.register(name)


def make_policy(name: str, **kwargs: Any) -> Policy:
    """Build a registered policy; unknown names list the known ones."""
    factory = _POLICIES.factory(name)
    try:
        return factory(**kwargs)
    except TypeError as e:  # policies pass **kwargs up to their base: only the call can tell
        if "keyword argument" not in str(e):
            raise
        raise ValueError(f"policy {name!r}: {e}") from None


def available_policies() -> list[str]:
    return _POLICIES.names()
