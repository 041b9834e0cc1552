"""Routers: where each request of a fleet goes. Build one by name with :func:`make_router`."""

from duetime.routers.registry import available_routers, make_router, register

__all__ = ["available_routers", "make_router", "register"]
