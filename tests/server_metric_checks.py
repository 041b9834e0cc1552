"""What the server property test checks of ``/metrics`` after a scenario: gauges back
at zero, finish reasons, 429s by cause and tokens generated as the clients saw them,
every request that took an id counted once, and the HTTP responses counted per route.

Kept apart from ``tests/test_server_properties.py`` so that the test file holds the
property alone.
"""

from __future__ import annotations

from collections import Counter

import httpx

from tests.factories import prometheus_samples
from tests.server_calls import Call, Seen


def metrics(url: str) -> dict[str, float]:
    return prometheus_samples(httpx.get(url + "/metrics").text)


def check_metrics(
    calls: list[Call], seen: list[Seen], m: dict[str, float], issued: int
) -> list[str]:
    """/metrics agrees with the clients: what a client that stayed saw is counted as it saw
    it; a client that left may or may not have reached the engine. ``issued``: requests
    the server gave an id (past validation), each counted once: finished or refused."""
    bad = []
    for name in ("queue_length", "running", "suspended", "kv_used_tokens", "engine_errors_total"):
        if m[f"duetime_{name}"] != 0:
            bad.append(f"duetime_{name} = {m[f'duetime_{name}']}")
    reasons: Counter[str] = Counter()
    rejected: Counter[str] = Counter()
    tokens = 0
    unknown = 0  # clients whose request may have reached the engine without them seeing how
    exact_tokens = True
    for c, s in zip(calls, seen, strict=True):
        if c.expect is not None:
            continue
        if s.gone or s.status is None:
            unknown += 1
            exact_tokens = False
        elif s.status == 429:
            why = (s.error or {}).get("code")
            rejected["queue" if why == "queue_full" else "deadline"] += 1
        elif s.status == 504:  # aborted, unless the engine ended it as the time ran out
            unknown += 1
            exact_tokens = False
        elif s.answered:
            reason = s.final["choices"][0]["finish_reason"]
            reasons[reason] += 1
            tokens += s.final["duetime"]["completion_tokens"]
            if c.fields.get("stop") and reason == "stop":
                exact_tokens = False  # the engine may have made tokens past the stop string
    counted = {
        r: int(m.get(f'duetime_requests_total{{reason="{r}"}}', 0))
        for r in ("stop", "length", "abort", "error")
    }
    refused = {
        w: int(m.get(f'duetime_rejected_total{{why="{w}"}}', 0)) for w in ("queue", "deadline")
    }
    extra = (
        sum(counted.values())
        - sum(reasons.values())
        + sum(refused.values())
        - sum(rejected.values())
    )
    if any(counted[r] < reasons[r] for r in counted) or not 0 <= extra <= unknown:
        bad.append(f"requests_total {counted} but clients saw {dict(reasons)} ({unknown} left)")
    if sum(counted.values()) + sum(refused.values()) != issued:
        bad.append(f"{issued} requests took an id, but {counted} ended and {refused} refused")
    if any(refused[w] < rejected[w] for w in refused):
        bad.append(f"rejected_total {refused} but clients saw {dict(rejected)}")
    generated = m["duetime_generated_tokens_total"]
    if generated < tokens or (exact_tokens and generated != tokens):
        bad.append(f"generated_tokens_total {generated}, clients got {tokens}")
    return bad + _check_response_counts(calls, seen, m)


def _check_response_counts(calls: list[Call], seen: list[Seen], m: dict[str, float]) -> list[str]:
    """``duetime_http_responses_total`` holds each status a client saw on its route; a
    client that left was answered something or nothing, so it adds at most one."""
    saw: Counter[tuple[str, int]] = Counter()
    left: Counter[str] = Counter()
    for c, s in zip(calls, seen, strict=True):
        if s.status is None:
            left[c.route] += 1
        elif s.headers.get("content-type", "").startswith("text/event-stream"):
            saw[c.route, 200] += 1  # a stream's status line; a 504 came as an error event
        else:
            saw[c.route, s.status] += 1
    bad = []
    for (route, status), n in saw.items():
        got = m.get(f'duetime_http_responses_total{{route="{route}",status="{status}"}}', 0)
        if got < n:
            bad.append(f"{route} {status}: counted {got}, clients saw {n}")
    for route in {c.route for c in calls}:
        prefix = f'duetime_http_responses_total{{route="{route}",'
        total = sum(v for k, v in m.items() if k.startswith(prefix))
        seen_here = sum(n for (r, _), n in saw.items() if r == route)
        if not seen_here <= total <= seen_here + left[route]:
            bad.append(f"{route}: {total} responses counted, {seen_here} seen, {left[route]} left")
    return bad
