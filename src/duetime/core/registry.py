"""A one-decorator registry of named factories: adding a policy or a router touches one file.

Policies (:mod:`duetime.policies.registry`) and routers
(:mod:`duetime.routers.registry`) are each built by name from the CLI, the server
and the sweeps; both need the same three things: refuse a name registered twice,
name the known ones when asked for an unknown one, and import the built-in modules
(whose decorators fill the registry) before the first look-up.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

P = TypeVar("P")
F = TypeVar("F", bound=Callable[..., Any])


class Registry(Generic[P]):
    """Factories of ``P`` by name; ``kind`` and ``kinds`` name them in errors
    (``"policy"``, ``"policies"``), and the ``builtin`` modules of ``package`` are
    imported on the first look-up (their decorators register what they define)."""

    def __init__(self, kind: str, kinds: str, package: str, builtin: Sequence[str]) -> None:
        self.kind = kind
        self.kinds = kinds
        self._modules = [f"{package}.{m}" for m in builtin]
        self._factories: dict[str, Callable[..., P]] = {}

    def _load(self) -> None:
        for module in self._modules:
            importlib.import_module(module)

    def register(self, name: str) -> Callable[[F], F]:
        """Class decorator: make a factory constructible by ``name``, in this process.

        A factory defined outside the built-in modules loads them first, so a name
        they hold is refused at its own decorator, not at the next look-up. The same
        class registered again (a notebook cell run twice) replaces itself."""

        def deco(factory: F) -> F:
            if factory.__module__ not in self._modules:
                self._load()
            known = self._factories.get(name)
            if known is not None and _qualified(known) != _qualified(factory):
                builtin = " (a built-in)" if known.__module__ in self._modules else ""
                raise ValueError(
                    f"{self.kind} {name!r} is registered already{builtin}, by "
                    f"{_qualified(known)}: give {_qualified(factory)} another name"
                )
            self._factories[name] = factory
            return factory

        return deco

    def factory(self, name: str) -> Callable[..., P]:
        """The factory registered as ``name``; an unknown name lists the known ones."""
        self._load()
        try:
            return self._factories[name]
        except KeyError:
            known = ", ".join(sorted(self._factories))
            raise ValueError(f"unknown {self.kind} {name!r}; known {self.kinds}: {known}") from None

    def names(self) -> list[str]:
        """Every registered name, sorted."""
        self._load()
        return sorted(self._factories)

    def summary(self, name: str) -> str:
        """The first line of ``name``'s docstring: what the listing commands print."""
        doc = (self.factory(name).__doc__ or "").strip().replace("``", "")
        return doc.splitlines()[0] if doc else ""


def _qualified(factory: Callable[..., Any]) -> str:
    return f"{factory.__module__}.{getattr(factory, '__qualname__', repr(factory))}"
