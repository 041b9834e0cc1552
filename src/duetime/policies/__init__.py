"""Scheduling policies. Build one by name with :func:`make_policy`."""

from duetime.policies.registry import available_policies, make_policy, register

__all__ = ["available_policies", "make_policy", "register"]
