"""A backend's own load, read from its Prometheus ``/metrics`` text.

The gateway counts only what it sent; a backend also serves other clients, queues
what it cannot batch and fills its KV cache at its own pace. Two formats are read,
each by the names its server registers (the text is parsed by
``prometheus_client.parser``, never by hand):

* ``duetime serve`` (:mod:`duetime.server.metrics`): the gauges
  ``duetime_running``, ``duetime_queue_length`` + ``duetime_suspended`` (waiting),
  ``duetime_kv_used_tokens``, ``duetime_kv_capacity_tokens`` and the counters
  ``duetime_prefix_cache_hits`` / ``duetime_prefix_cache_queries`` (prompt tokens).
* vLLM 0.32 (``vllm/v1/metrics/loggers.py``, ``PrometheusStatLogger``): the gauges
  ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc`` (a fraction 0-1 despite its name: it is
  ``BlockPool.get_usage()``), the counters ``vllm:prefix_cache_hits`` /
  ``vllm:prefix_cache_queries`` (tokens), and the KV capacity in tokens from the
  ``kv_cache_size_tokens`` label of the info gauge ``vllm:cache_config_info``
  (``num_gpu_blocks`` x ``block_size`` where that label is missing).

Every sample is labelled ``model_name`` and ``engine`` in vLLM; a data-parallel
server has one ``engine`` per rank, so counts are summed over labels and the KV
fraction is the engines' mean. A counter appears as
``NAME_total`` from ``prometheus_client`` (its ``_created`` twin is skipped) and
as ``NAME`` from some exporters: both are read.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["DUETIME", "VLLM", "BackendLoad", "MetricsFormatError", "parse_metrics"]

DUETIME = "duetime"
VLLM = "vllm"

#: The gauge whose presence names each format.
_MARKERS = {DUETIME: "duetime_running", VLLM: "vllm:num_requests_running"}


class MetricsFormatError(ValueError):
    """A backend's ``/metrics`` is not Prometheus text, or neither format the gateway reads."""


@dataclass(slots=True, frozen=True)
class BackendLoad:
    """One scrape of a backend: what it runs and queues, its KV use, its prefix cache.

    ``kv_used`` / ``kv_capacity`` are tokens; ``kv_capacity`` is None when the
    backend does not publish it (then only ``kv_usage``, the fraction, is known).
    The prefix counters are cumulative prompt tokens (None: not published).
    """

    kind: str
    running: int
    waiting: int
    kv_usage: float
    kv_used: int | None
    kv_capacity: int | None
    prefix_hits: float | None = None
    prefix_queries: float | None = None


def _samples(text: str, url: str) -> tuple[dict[str, float], dict[str, int], list[dict[str, str]]]:
    """Sums of sample values by sample name, how many samples each sum has, and
    vLLM's cache-config label sets."""
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    cache_info: list[dict[str, str]] = []
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.endswith("_created") or not math.isfinite(s.value):
                    continue
                sums[s.name] += s.value
                counts[s.name] += 1
                if s.name == "vllm:cache_config_info":
                    cache_info.append(dict(s.labels))
    except ValueError as e:
        raise MetricsFormatError(
            f"{url}/metrics is not Prometheus text ({str(e)[:80]}); "
            "pass --scrape-interval-ms 0 to route without backend metrics"
        ) from None
    return sums, counts, cache_info


def _get(sums: dict[str, float], name: str) -> float | None:
    """A gauge, or a counter as ``NAME_total`` or plain ``NAME``."""
    for key in (name, name + "_total"):
        if key in sums:
            return sums[key]
    return None


def _count(v: float | None) -> int:
    return max(0, round(v or 0.0))


def _vllm_capacity(info: list[dict[str, str]]) -> int | None:
    """KV tokens over all engines: ``kv_cache_size_tokens``, else blocks x block size."""

    def num(labels: dict[str, str], key: str) -> int | None:
        try:
            v = int(labels.get(key, ""))
        except ValueError:
            return None
        return v if v > 0 else None

    total = 0
    for labels in info:
        size = num(labels, "kv_cache_size_tokens")
        blocks, block = num(labels, "num_gpu_blocks"), num(labels, "block_size")
        if size is None and blocks is not None and block is not None:
            size = blocks * block
        if size is None:
            return None
        total += size
    return total or None


def parse_metrics(text: str, url: str) -> BackendLoad:
    """The load in ``text`` (a ``/metrics`` answer of ``url``). Raises
    :class:`MetricsFormatError`, naming ``url``, for text of neither format."""
    sums, counts, info = _samples(text, url)
    if _MARKERS[DUETIME] in sums:
        used = _count(sums.get("duetime_kv_used_tokens"))
        cap = _count(sums.get("duetime_kv_capacity_tokens")) or None
        return BackendLoad(
            kind=DUETIME,
            running=_count(sums["duetime_running"]),
            waiting=_count(sums.get("duetime_queue_length"))
            + _count(sums.get("duetime_suspended")),
            kv_usage=min(1.0, used / cap) if cap else 0.0,
            kv_used=used,
            kv_capacity=cap,
            prefix_hits=_get(sums, "duetime_prefix_cache_hits"),
            prefix_queries=_get(sums, "duetime_prefix_cache_queries"),
        )
    if _MARKERS[VLLM] in sums:
        cap = _vllm_capacity(info)
        engines = max(1, counts.get("vllm:kv_cache_usage_perc", 0))
        usage = min(1.0, max(0.0, (sums.get("vllm:kv_cache_usage_perc") or 0.0) / engines))
        return BackendLoad(
            kind=VLLM,
            running=_count(sums["vllm:num_requests_running"]),
            waiting=_count(_get(sums, "vllm:num_requests_waiting")),
            kv_usage=usage,
            kv_used=None if cap is None else round(usage * cap),
            kv_capacity=cap,
            prefix_hits=_get(sums, "vllm:prefix_cache_hits"),
            prefix_queries=_get(sums, "vllm:prefix_cache_queries"),
        )
    seen = sorted({n.removesuffix("_total") for n in sums})[:5]
    raise MetricsFormatError(
        f"{url}/metrics has neither duetime serve's metrics ({_MARKERS[DUETIME]}) nor "
        f"vLLM's ({_MARKERS[VLLM]}); it has "
        + (", ".join(seen) + (", ..." if len(sums) > 5 else "") if seen else "no metric")
        + "; pass --scrape-interval-ms 0 to route without backend metrics"
    )
