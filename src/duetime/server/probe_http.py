"""The requests `duetime profile --url` sends: what any OpenAI-compatible server answers.

A black box shows its step times only through the timing of its streamed
tokens, so every probe is a streamed ``/v1/completions`` whose events are
timed as they arrive (:class:`StreamTiming`). The body asks for exactly
``max_tokens`` tokens where the server allows it (vLLM's and duetime's
``ignore_eos``), and for the usage block at the end (``stream_options``), whose
``prompt_tokens`` / ``completion_tokens`` say how long the prompt and the answer
really were: the prober never sees the server's tokenizer. A server that refuses
one of these fields with a 4xx is asked again without it (:func:`negotiate`),
so the same probe runs against vLLM, SGLang, llama.cpp's server or duetime.

Prompts are random words behind a unique number (:func:`probe_prompt`): a
repeated prompt would be served from a prefix cache and time as a near-free
prefill.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

__all__ = [
    "ProbeError",
    "ServerInfo",
    "StreamTiming",
    "discover",
    "negotiate",
    "probe_prompt",
    "stream_completion",
]

#: Common English words: one to two tokens each under most tokenizers.
_WORDS: tuple[str, ...] = (
    "time", "year", "people", "way", "day", "man", "thing", "woman", "life", "child", "world",
    "school", "state", "family", "student", "group", "country", "problem", "hand", "part",
    "place", "case", "week", "company", "system", "program", "question", "work", "government",
    "number", "night", "point", "home", "water", "room", "mother", "area", "money", "story",
    "fact", "month", "lot", "right", "study", "book", "eye", "job", "word", "business",
    "issue", "side", "kind", "head", "house", "service", "friend", "father", "power", "hour",
    "game", "line", "end", "member", "law", "car", "city", "name",
)  # fmt: skip


class ProbeError(RuntimeError):
    """The server cannot be profiled: unreachable, not OpenAI-compatible, or failing."""


@dataclass(slots=True, frozen=True)
class ServerInfo:
    """What the prober learns of the server before it times anything."""

    base: str  # scheme://host:port (and any path prefix), without /v1
    model: str
    max_model_len: int | None
    #: Body fields the server accepted (``ignore_eos``, ``stream_options``).
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class StreamTiming:
    """One streamed answer: when it was sent, when each event with tokens arrived, and the
    lengths the server reported (None where it reported none)."""

    sent: float
    events: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.events[0] - self.sent if self.events else None

    def tokens(self, max_tokens: int, exact: bool) -> int:
        """Tokens the answer had: the server's count, else ``max_tokens`` when the
        server was told to ignore EOS, else one per event (how vLLM streams)."""
        if self.completion_tokens is not None:
            return self.completion_tokens
        return max_tokens if exact else len(self.events)


def base_url(url: str) -> str:
    """``url`` without a trailing ``/`` or ``/v1``: both forms are what users paste."""
    base = url.strip().rstrip("/")
    return base.removesuffix("/v1") if base.endswith("/v1") else base


def discover(client: httpx.Client, url: str, model: str | None = None) -> ServerInfo:
    """The served model (``model`` if given, else the first listed) and its context,
    from ``GET /v1/models``. Raises :class:`ProbeError` naming ``url``."""
    base = base_url(url)
    if not base.startswith(("http://", "https://")):
        raise ProbeError(f"--url must be http://HOST:PORT or https://HOST:PORT, got {url!r}")
    try:
        r = client.get(base + "/v1/models")
    except httpx.HTTPError as e:
        raise ProbeError(f"{url}: cannot reach the server ({type(e).__name__}: {e})") from None
    try:
        data = r.json().get("data") if r.status_code == 200 else None
    except (json.JSONDecodeError, AttributeError):
        data = None
    entries = [d for d in data or [] if isinstance(d, dict) and isinstance(d.get("id"), str)]
    if not entries:
        raise ProbeError(
            f"{url} is not an OpenAI-compatible server: GET {base}/v1/models answered "
            f"HTTP {r.status_code} without a model list"
        )
    if model is None:
        entry = entries[0]
    else:
        found = [d for d in entries if d["id"] == model]
        if not found:
            listed = ", ".join(d["id"] for d in entries)
            raise ProbeError(f"{url} does not serve model {model!r}; it lists {listed}")
        entry = found[0]
    mml = entry.get("max_model_len")
    usable = isinstance(mml, int) and not isinstance(mml, bool) and mml > 0
    return ServerInfo(base, entry["id"], mml if usable else None)


def probe_prompt(rng: np.random.Generator, words: int, tag: int) -> str:
    """``words`` random words behind the number ``tag``: no two probes share a prefix."""
    picked = rng.choice(len(_WORDS), size=max(0, words))
    return f"{tag} " + " ".join(_WORDS[i] for i in picked)


def _body(info: ServerInfo, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": info.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        **info.extras,
    }


def _refusal_text(r: httpx.Response) -> str:
    try:
        err = r.json().get("error")
        msg = err.get("message") if isinstance(err, dict) else err
        return str(msg or r.text)[:300]
    except (json.JSONDecodeError, AttributeError):
        return r.text[:300]


def negotiate(client: httpx.Client, info: ServerInfo, prompt: str) -> ServerInfo:
    """``info`` with the optional body fields the server takes: ``ignore_eos`` and
    ``stream_options``, then each alone, then neither, until a probe is answered.

    Why: ``ignore_eos`` is vLLM's and duetime's, not OpenAI's; a strict server answers
    400 (or 422) to a field it does not know. Raises :class:`ProbeError` when even the
    plain request fails.
    """
    usage = {"stream_options": {"include_usage": True}}
    ladder: tuple[dict[str, Any], ...] = (
        {"ignore_eos": True, **usage},
        usage,
        {"ignore_eos": True},
        {},
    )
    last = ""
    for extras in ladder:
        trial = ServerInfo(info.base, info.model, info.max_model_len, dict(extras))
        try:
            with client.stream(
                "POST", info.base + "/v1/completions", json=_body(trial, prompt, 2)
            ) as r:
                r.read()
        except httpx.HTTPError as e:
            raise ProbeError(
                f"{info.base}: a probe request failed ({type(e).__name__}: {e})"
            ) from None
        if r.status_code == 200:
            return trial
        if r.status_code not in (400, 422):
            raise ProbeError(
                f"{info.base}/v1/completions answered HTTP {r.status_code}: {_refusal_text(r)}"
            )
        last = f"HTTP {r.status_code}: {_refusal_text(r)}"
    raise ProbeError(f"{info.base}/v1/completions refuses a plain streamed completion ({last})")


async def stream_completion(
    client: httpx.AsyncClient, info: ServerInfo, prompt: str, max_tokens: int
) -> StreamTiming:
    """Send one streamed completion and time its events. Raises :class:`ProbeError`."""
    timing = StreamTiming(sent=time.perf_counter())
    url = info.base + "/v1/completions"
    try:
        async with client.stream("POST", url, json=_body(info, prompt, max_tokens)) as r:
            if r.status_code != 200:
                await r.aread()
                raise ProbeError(f"{url} answered HTTP {r.status_code}: {_refusal_text(r)}")
            async for line in r.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                _read_event(json.loads(data), now, timing, url)
    except httpx.HTTPError as e:
        raise ProbeError(f"{url}: the probe failed ({type(e).__name__}: {e})") from None
    return timing


def _read_event(event: Any, now: float, timing: StreamTiming, url: str) -> None:
    """Record one SSE event: its time if it carries text, the usage if it has one."""
    if not isinstance(event, dict):
        return
    if "error" in event:
        raise ProbeError(f"{url} failed mid-stream: {event['error']}")
    usage = event.get("usage")
    if isinstance(usage, dict):
        pt, ct = usage.get("prompt_tokens"), usage.get("completion_tokens")
        timing.prompt_tokens = pt if isinstance(pt, int) else timing.prompt_tokens
        timing.completion_tokens = ct if isinstance(ct, int) else timing.completion_tokens
    choices = event.get("choices")
    if isinstance(choices, list) and any(isinstance(c, dict) and c.get("text") for c in choices):
        timing.events.append(now)
