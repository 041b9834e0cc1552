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
    """Class decorator: make a policy constructible by name in this process (the
    built-in ones also from the command line and the server)."""
    return _POLICIES.register(name)


def make_policy(name: str, **kwargs: Any) -> Policy:
    """Build a registered policy; unknown names list the known ones."""
    factory = _POLICIES.factory(name)
    try:
        return factory(**kwargs)
    except TypeError as e:  # policies pass **kwargs up to their base: only the call can tell
        if "keyword argument" not in str(e):
            raise
        known = policy_arguments(factory)
        unknown = sorted(set(kwargs) - set(known))
        if not unknown:
            raise ValueError(f"policy {name!r}: {e}") from None
        raise ValueError(
            f"policy {name!r} takes no argument {', '.join(map(repr, unknown))}; its "
            f"arguments: {', '.join(known)}"
        ) from None


def policy_arguments(factory: Callable[..., Policy]) -> list[str]:
    """The keyword arguments a policy class takes, its own and those its ``**kwargs``
    pass up to its bases (``__init__`` by ``__init__`` along the class's MRO)."""
    import inspect

    names: list[str] = []
    for klass in getattr(factory, "__mro__", (factory,)):
        init = klass.__dict__.get("__init__") if isinstance(klass, type) else klass
        if init is None:
            continue
        params = inspect.signature(init).parameters.values()
        named = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        names += [p.name for p in params if p.kind in named and p.name not in (*names, "self")]
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            break  # passes nothing further up
    return names


def available_policies() -> list[str]:
    return _POLICIES.names()


def policy_summaries() -> dict[str, str]:
    """Each policy's name and what it does (its docstring's first line)."""
    return {name: _POLICIES.summary(name) for name in _POLICIES.names()}
