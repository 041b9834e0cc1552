"""Reading each backend's published step-cost model (``GET /v1/profile``).

`duetime serve` publishes the cost model it fits online to its own steps
(:mod:`.published_profile`). The gateway reads it at start and every
``profile_interval_s`` after (default 10 s: the fit moves slowly), keeps it in
the backend's state, shows it in ``/health``, and prices a request on it while
the backend has answered nothing yet (:meth:`.Backend.estimates`): a model of the
backend's own steps beats a blind 50 ms + 20 ms a token.

Other servers do not publish one: a 404 is recorded as "not published", and
nothing else changes. Fit one with `duetime profile --url` instead and give it to
the gateway (``--profile URL=path``, :func:`give_profile`): it then prices that
backend as a published one would, and is not read from the backend. A read that fails
keeps the last good model: the cost of a step does not change because one read
timed out.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from duetime.core.cost import CostModelError, LinearStepCost
from duetime.server.gateway_poll import BackendPoller
from duetime.server.gateway_routing import Backend, PublishedCost
from duetime.server.gateway_wire import transport_words

__all__ = ["ProfileReader", "cost_of", "give_profile"]

log = logging.getLogger("duetime.gateway")


def cost_of(body: Any) -> LinearStepCost:
    """The cost model of a profile JSON object. Raises :class:`CostModelError`."""
    return LinearStepCost.from_dict(body, "not a usable profile", "published")


def give_profile(b: Backend, body: dict[str, Any]) -> None:
    """Price ``b`` on ``body``, a profile given at start, instead of reading its own.
    Raises :class:`CostModelError` for a body that is not a usable profile."""
    b.published = PublishedCost(cost_of(body), body, time.monotonic(), "given")


class ProfileReader(BackendPoller):
    """Reads the backends' published cost models on the gateway's client."""

    @property
    def interval_s(self) -> float:
        return self.gw.config.profile_interval_s

    async def poll(self, b: Backend) -> None:
        """Read ``b``'s ``/v1/profile`` once; whatever it answers, the loop goes on."""
        client = self.client
        p = b.published
        if p.status == "given":
            return
        try:
            r = await client.get(b.url + "/v1/profile", timeout=2.0)
            if r.status_code == 200:
                body = r.json()
                p.cost, p.body, p.at, p.status = cost_of(body), body, time.monotonic(), "ok"
            elif r.status_code in (404, 405):
                p.status = "not published"
            elif r.status_code == 503:
                p.status = "no model yet"
            else:
                p.status = f"/v1/profile answered HTTP {r.status_code}"
        except (CostModelError, ValueError) as e:
            if p.status != str(e):
                log.warning("backend %s: /v1/profile: %s", b.url, e)
            p.status = f"/v1/profile: {e}"
        except Exception as e:  # unreachable now: keep the last good model
            p.status = f"/v1/profile not reachable ({transport_words(e)})"

    def health(self, b: Backend) -> dict[str, Any]:
        """``b``'s entry under ``profile`` in the gateway's ``/health``."""
        p = b.published
        if not self.enabled and p.status != "given":
            return {"read": False}
        out: dict[str, Any] = {"read": True, "status": p.status}
        if p.body is not None and p.at is not None:
            out.update(
                age_s=round(time.monotonic() - p.at, 1),
                name=p.body.get("name"),
                origin=p.body.get("origin"),
                coefficients=p.body.get("coefficients"),
                in_use=not (b.observed or b.seeded),
            )
        return out
