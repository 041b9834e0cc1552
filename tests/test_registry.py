"""The named-factory registry behind `make_policy` and `make_router`."""

from __future__ import annotations

import pytest

from duetime.core.registry import Registry
from duetime.policies.registry import available_policies, make_policy
from duetime.routers.registry import available_routers, make_router


def test_registry_refuses_a_name_twice_and_lists_the_known_ones() -> None:
    reg: Registry[object] = Registry("thing", "things", "duetime.policies", ())
    reg.register("a")(object)
    with pytest.raises(ValueError, match="thing 'a' registered twice"):
        reg.register("a")(object)
    with pytest.raises(ValueError, match="unknown thing 'b'; known things: a"):
        reg.factory("b")
    assert reg.names() == ["a"]


def test_every_builtin_policy_and_router_is_built_by_name() -> None:
    assert "edf" in available_policies()
    assert "round-robin" in available_routers()
    for name in available_policies():
        assert make_policy(name) is not None
    for name in available_routers():
        assert make_router(name) is not None
    with pytest.raises(ValueError, match="unknown policy 'nope'; known policies: "):
        make_policy("nope")
    with pytest.raises(ValueError, match="unknown router 'nope'; known routers: "):
        make_router("nope")
