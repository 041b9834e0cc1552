"""Range of the workload shapes ALA answers for (imported by the CLI: no heavy imports).

- ``MAX_TOKENS`` (10,000,000) bounds ``ii`` and ``oo``: as long as the longest
  advertised context window (10M tokens) and past the end of the confidence
  histograms' log2 grid (4M), so a larger length can only be a typo; it also
  keeps every length inside int64.
- ``MAX_BATCH`` (1,000,000) bounds ``bb``: engines cap running sequences in the
  hundreds or thousands (vLLM's default ``max_num_seqs`` is 256), and far beyond
  it the histogram kernel underflowed to zero (a NaN confidence at ~5e10).
"""

from __future__ import annotations

MAX_TOKENS = 10_000_000
"""Largest ``ii`` (prompt tokens) and ``oo`` (output tokens) a query may ask for."""
MAX_BATCH = 1_000_000
"""Largest ``bb`` (concurrent requests) a query may ask for."""


def check_shape(ii: int, oo: int, bb: int) -> None:
    """Raise ValueError naming the first of ``ii``, ``oo``, ``bb`` out of range."""
    for name, opt, v, hi in (
        ("ii", "--input-len", ii, MAX_TOKENS),
        ("oo", "--output-len", oo, MAX_TOKENS),
        ("bb", "--batch", bb, MAX_BATCH),
    ):
        if not 1 <= v <= hi:
            raise ValueError(f"{name} ({opt}) must be in [1, {hi:,}], got {v}")
