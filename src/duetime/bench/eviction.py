"""`duetime bench eviction`: what SnapKV costs on the engine and what its output keeps.

Three figures per run, on one model:

* the observation window's cost on the serving path: prefill time of the same
  prompt with and without :meth:`KVCache.watch` (interleaved repetitions,
  medians), as ``prefill_overhead_pct``, and — because on a busy machine that
  difference drowns in noise — the copies alone (``capture_s``: every layer's
  :meth:`ObsWindow.capture` for one chunk, timed in isolation) as
  ``capture_pct_of_prefill``; decode steps never touch the window;
* the eviction itself: seconds for :func:`snapkv_evict` and
  :func:`streaming_llm_evict` to drop ⌊α·L⌋ of an L-token prompt's KV;
* what the output keeps: greedy continuation after evicting α of the prompt's
  KV (right after prefill, as TimeBill does) against the full-KV continuation —
  token F1, ROUGE-L (``duetime.metrics.quality``), the share of positions with
  the same token and the length of the identical prefix, averaged over prompts.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from duetime.engine.batch import SeqChunk
from duetime.engine.eviction import DEFAULT_WINDOW, snapkv_evict, streaming_llm_evict
from duetime.engine.gemma3 import Gemma3
from duetime.engine.obs_window import ObsWindow
from duetime.metrics.quality import rouge_l, token_f1

__all__ = [
    "capture_seconds",
    "continuation",
    "prefill_times",
    "run",
    "sharegpt_prompts",
    "table_rows",
]

METHODS = ("snapkv", "streaming")


def _prefill(model: Gemma3, prompt: Sequence[int], chunk: int, window: int | None) -> Any:
    kv = model.new_kv_cache()
    slot = kv.allocate(len(prompt) + 1)
    if window is not None:
        kv.watch(slot, window)
    picked = None
    for a in range(0, len(prompt), chunk):
        picked = model.greedy_step([SeqChunk(slot, prompt[a : a + chunk], a)], kv)
    assert picked is not None, "empty prompt"
    return kv, slot, int(picked[0])


def prefill_times(
    model: Gemma3, prompt: Sequence[int], chunk: int, window: int, repeats: int
) -> tuple[float, float]:
    """Median prefill seconds (plain, watched), the two runs alternating in order."""
    plain: list[float] = []
    watched: list[float] = []
    _prefill(model, prompt, chunk, None)  # warm-up: first calls pick kernels
    for r in range(repeats):
        for w in (None, window) if r % 2 == 0 else (window, None):
            t0 = time.perf_counter()
            _prefill(model, prompt, chunk, w)
            (plain if w is None else watched).append(time.perf_counter() - t0)
    return statistics.median(plain), statistics.median(watched)


def capture_seconds(model: Gemma3, n_tokens: int, window: int, repeats: int) -> float:
    """Median seconds to copy one ``n_tokens`` chunk's queries into a window, all layers.

    The queries are a strided slice of a wider tensor, as in ``Gemma3.step``.
    """
    cfg = model.config
    dt = model.compute_dtype
    win = ObsWindow(window, cfg.num_layers, cfg.num_heads, cfg.head_dim, dt)
    qk = torch.randn(n_tokens, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim).to(dt)
    q = qk[:, : cfg.num_heads]
    times = []
    for _ in range(repeats * 10):
        t0 = time.perf_counter()
        for layer in range(cfg.num_layers):
            win.capture(layer, q)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def continuation(
    model: Gemma3,
    prompt: Sequence[int],
    n_new: int,
    *,
    method: str | None,
    alpha: float,
    window: int = DEFAULT_WINDOW,
    chunk: int = 512,
) -> tuple[list[int], float]:
    """Greedy ``n_new`` tokens after evicting ⌊α·len(prompt)⌋ tokens with ``method``
    (None: full KV) right after prefill; also the eviction's seconds."""
    kv, slot, tok = _prefill(model, prompt, chunk, window if method == "snapkv" else None)
    n_drop = int(alpha * len(prompt))
    t0 = time.perf_counter()
    if method == "snapkv":
        snapkv_evict(kv, slot, n_drop, window=window)
        kv.unwatch(slot)
    elif method == "streaming":
        streaming_llm_evict(kv, slot, n_drop)
    elif method is not None:
        raise ValueError(f"method must be snapkv, streaming or None, not {method!r}")
    evict_s = time.perf_counter() - t0
    out = [tok]
    pos = len(prompt)
    while len(out) < n_new:
        out.append(int(model.greedy_step([SeqChunk(slot, [out[-1]], pos)], kv)[0]))
        pos += 1
    kv.free(slot)
    return out, evict_s


def _same_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def check_alphas(alphas: Sequence[float], name: str = "α") -> None:
    """At least one eviction ratio, each in [0, 1); ``name`` is how messages call them."""
    if not alphas:
        raise ValueError(f"{name}: no eviction ratio to run; give at least one, e.g. 0.5")
    if any(not 0.0 <= a < 1.0 for a in alphas):
        raise ValueError(f"{name}: every α must be in [0, 1), got {list(alphas)}")


def run(
    model: Gemma3,
    prompts: Sequence[Sequence[int]],
    *,
    alphas: Sequence[float] = (0.5,),
    new_tokens: int = 32,
    window: int = DEFAULT_WINDOW,
    chunk: int = 512,
    repeats: int = 3,
) -> dict[str, Any]:
    """All figures (see the module docstring) as one JSON-ready dict."""
    if not prompts:
        raise ValueError("no prompts to run")
    check_alphas(alphas)
    if new_tokens < 1 or chunk < 1 or repeats < 1:
        raise ValueError("new_tokens, chunk and repeats must be >= 1")
    t_start = time.perf_counter()
    longest = max(prompts, key=len)
    plain_s, watched_s = prefill_times(model, longest, chunk, window, repeats)
    capture_s = capture_seconds(model, min(chunk, len(longest)), window, repeats)
    full = [continuation(model, p, new_tokens, method=None, alpha=0.0)[0] for p in prompts]
    rows: list[dict[str, Any]] = []
    for alpha in alphas:
        for method in METHODS:
            f1, rl, same, prefix, evict = [], [], [], [], []
            for p, ref in zip(prompts, full, strict=True):
                ids, s = continuation(
                    model, p, new_tokens, method=method, alpha=alpha, window=window, chunk=chunk
                )
                f1.append(token_f1(ids, ref))
                rl.append(rouge_l(ids, ref))
                same.append(sum(x == y for x, y in zip(ids, ref, strict=True)) / len(ref))
                prefix.append(_same_prefix(ids, ref))
                evict.append(s)
            rows.append(
                {
                    "method": method,
                    "alpha": alpha,
                    "token_f1_vs_full": statistics.fmean(f1),
                    "rouge_l_vs_full": statistics.fmean(rl),
                    "same_token_pct": 100 * statistics.fmean(same),
                    "same_prefix_tokens_mean": statistics.fmean(prefix),
                    "evict_s_median": statistics.median(evict),
                }
            )
    return {
        "prompts": len(prompts),
        "prompt_tokens_mean": statistics.fmean(len(p) for p in prompts),
        "prompt_tokens_max": len(longest),
        "new_tokens": new_tokens,
        "window": window,
        "chunk": chunk,
        "threads": torch.get_num_threads(),
        "prefill_plain_s": plain_s,
        "prefill_watched_s": watched_s,
        "prefill_overhead_pct": 100 * (watched_s - plain_s) / plain_s,
        "capture_s": capture_s,
        "capture_pct_of_prefill": 100 * capture_s / plain_s,
        "rows": rows,
        "wall_s": time.perf_counter() - t_start,
    }


def table_rows(fig: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(label, figures) rows for :func:`duetime.metrics.render_table`."""
    return [(f"{r['method']} α={r['alpha']:g}", r) for r in fig["rows"]]


def sharegpt_prompts(n: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    """``n`` ShareGPT prompts of ``min_len..max_len`` Gemma tokens (BOS included)."""
    import numpy as np

    from duetime.tokenizer import encode
    from duetime.workloads.sharegpt import load_sharegpt_lengths, read_pairs

    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    lengths = load_sharegpt_lengths(progress=False)
    rows = np.flatnonzero((lengths.prompt_len >= min_len) & (lengths.prompt_len <= max_len))
    if len(rows) < n:
        raise ValueError(f"only {len(rows)} ShareGPT prompts have {min_len}-{max_len} tokens")
    pick = np.random.default_rng(seed).choice(rows, size=n, replace=False)
    return [encode(text)[:max_len] for text, _ in read_pairs(lengths, pick)]
