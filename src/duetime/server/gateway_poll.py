"""Polling every backend of the gateway, all at once, every so many seconds.

The gateway polls its backends three ways: a health probe
(:meth:`.Gateway.probe`), a scrape of ``/metrics`` (:mod:`.gateway_scrape`) and
a read of the published step-cost model (:mod:`.gateway_profiles`). All three
follow the same two rules, kept here so that they cannot drift apart:

* every backend is polled at the same time, so one slow or silent backend does
  not delay what the router learns of the others;
* a poll that raises is dropped, so one failure never stops the loop (each poll
  records its own failures in the backend's state).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING

import httpx

from duetime.server.gateway_routing import Backend

if TYPE_CHECKING:  # the gateway's state imports this module for its health loop
    from duetime.server.gateway_pool import Gateway

__all__ = ["BackendPoller", "poll_backends"]


async def poll_backends(
    backends: Iterable[Backend], poll: Callable[[Backend], Awaitable[None]]
) -> None:
    """Run ``poll`` on every backend at once; one that raises does not stop the others."""
    await asyncio.gather(*(poll(b) for b in backends), return_exceptions=True)


class BackendPoller(ABC):
    """A poll of every backend that a gateway option can turn off (an interval of 0).

    The gateway polls once before it serves (:meth:`poll_all`), so the first
    requests are routed on what it read, then every :attr:`interval_s` after
    (:meth:`loop`).
    """

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    @property
    @abstractmethod
    def interval_s(self) -> float:
        """Seconds between polls, from the gateway's config; 0 turns the poll off."""

    @abstractmethod
    async def poll(self, b: Backend) -> None:
        """Poll ``b`` once and record the outcome in its state; raises nothing it expects."""

    @property
    def client(self) -> httpx.AsyncClient:
        """The gateway's client: a poll runs only once the gateway has connected it."""
        client = self.gw.client
        assert client is not None
        return client

    @property
    def enabled(self) -> bool:
        return self.interval_s > 0

    async def poll_all(self) -> None:
        await poll_backends(self.gw.backends, self.poll)

    async def loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.poll_all()
