"""Where `duetime load` may send requests, and how it finds the model to ask for.

A load generator is a small denial-of-service tool, so by default it only talks
to this machine: the target's host must resolve to loopback addresses only
(127.0.0.0/8, ::1, and 0.0.0.0 / ::, which reach this host too; ``localhost``
is fine). Anything else needs
``--allow-remote``. Every address the name resolves to is checked, so a name
with one loopback and one public address is refused too.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

import httpx


class TargetRefusedError(ValueError):
    """The target is not on this machine and ``--allow-remote`` was not given."""


def base_url(url: str, option: str = "--url") -> str:
    """``http://host:port[/prefix]`` without a trailing ``/`` or ``/v1``: the OpenAI root.

    A malformed URL raises ``ValueError`` naming ``option`` (the command's flag).
    """
    form = f"{option} must be http://HOST:PORT or https://HOST:PORT, got {url!r}"
    try:
        parsed = httpx.URL(url.strip())
    except httpx.InvalidURL as e:  # "http://[::1", "http://h:abc": a traceback before
        raise ValueError(f"{form} ({e})") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(form)
    if parsed.port is not None and not 1 <= parsed.port <= 65535:  # every request failed
        raise ValueError(f"{form} (port {parsed.port} is not in 1..65535)")
    text = str(parsed.copy_with(query=None, fragment=None)).rstrip("/")
    return text[: -len("/v1")] if text.endswith("/v1") else text


def resolve(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (an IP literal resolves to itself)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"cannot resolve host {host!r}: {e.strerror}") from None
    return sorted({str(info[4][0]) for info in infos})


def is_loopback(address: str) -> bool:
    """Loopback, or the unspecified address (``0.0.0.0``, ``::``), which connects to this host."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback or ip.is_unspecified


def check_target(url: str, *, allow_remote: bool) -> str:
    """The base URL of ``url``; raises :class:`TargetRefusedError` if it is not loopback-only."""
    base = base_url(url)
    if allow_remote:
        return base
    parsed = httpx.URL(base)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    remote = [a for a in resolve(parsed.host, port) if not is_loopback(a)]
    if remote:
        raise TargetRefusedError(
            f"refusing to send load to {parsed.host} ({', '.join(remote)}): not a loopback "
            "address. Pass --allow-remote to load a server on another machine that you run "
            "or may test."
        )
    return base


def resolve_model(
    base: str, model: str | None, *, api_key: str | None = None
) -> tuple[str, int | None]:
    """The model to send (``model``, else the first ``GET {base}/v1/models`` lists) and the
    ``max_model_len`` the list gives it (vLLM's and duetime serve's field; None where it
    gives none), from one read of the list. A ``model`` the list does not name is
    refused (every request would be a 404); a server whose list cannot be read is taken
    at its word about a ``model`` given."""
    try:
        cards = _model_cards(base, api_key=api_key)
    except ValueError:
        if model is None:
            raise
        return model, None
    ids = [card["id"] for card in cards]
    if model is None:
        model = ids[0]
    elif model not in ids:
        raise ValueError(f"--model {model!r}: {base}/v1/models lists {', '.join(ids)}")
    n = cards[ids.index(model)].get("max_model_len")
    return model, n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def discover_model(base: str, *, api_key: str | None = None, timeout_s: float = 10.0) -> str:
    """The first model ``GET {base}/v1/models`` lists (what ``--model`` defaults to)."""
    return discover_models(base, api_key=api_key, timeout_s=timeout_s)[0]


def discover_models(base: str, *, api_key: str | None = None, timeout_s: float = 10.0) -> list[str]:
    """The models ``GET {base}/v1/models`` lists, at least one; ValueError otherwise."""
    return [card["id"] for card in _model_cards(base, api_key=api_key, timeout_s=timeout_s)]


def _model_cards(
    base: str, *, api_key: str | None = None, timeout_s: float = 10.0
) -> list[dict[str, Any]]:
    """The entries of ``GET {base}/v1/models`` (each with its ``id`` as a string), at least
    one; ValueError otherwise."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(f"{base}/v1/models", headers=headers, timeout=timeout_s, trust_env=False)
        resp.raise_for_status()
        cards = [{**m, "id": str(m["id"])} for m in resp.json().get("data") or []]
    except httpx.HTTPError as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__  # httpx adds a docs link
        raise ValueError(f"cannot list models at {base}/v1/models ({why}); pass --model") from None
    except (ValueError, KeyError, TypeError, AttributeError):
        cards = []
    if not cards:
        raise ValueError(f"{base}/v1/models lists no model; pass --model")
    return cards
