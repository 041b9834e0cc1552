"""Running a gateway in process in front of fake backends (``tests/gateway_fakes.py``),
and reading its /metrics: what the gateway tests without subprocesses share."""

from __future__ import annotations

import json
from typing import Any

from duetime.server.gateway import Gateway, GatewayConfig, create_gateway_app
from tests.factories import prometheus_samples
from tests.gateway_fakes import MODEL, FakeBackend, FakeFleet


def metrics(gw: Gateway) -> dict[str, float]:
    from prometheus_client import generate_latest

    return prometheus_samples(generate_latest(gw.registry).decode())


def outcome(gw: Gateway, name: str) -> float:
    """How many requests ``gw`` counted with this outcome."""
    return metrics(gw).get(f'duetime_gateway_requests_total{{outcome="{name}"}}', 0.0)


async def with_fakes(backends: list[FakeBackend], config: GatewayConfig, scenario: Any) -> Any:
    """Run ``scenario(app, gateway)`` with the gateway in front of fake backends."""
    app = create_gateway_app([b.url for b in backends], config, transport=FakeFleet(backends))
    async with app.router.lifespan_context(app):
        return await scenario(app, app.state.gateway)


def request_body(stream: bool = False, **extra: Any) -> bytes:
    """A completions body for the fake backends' model."""
    return json.dumps({"model": MODEL, "prompt": "hi", "stream": stream, **extra}).encode()
