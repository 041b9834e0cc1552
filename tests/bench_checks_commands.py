"""Command lines of the real-engine benches that the bench-engine check tests share.

Each is a short, cheap run on the tiny model that a test extends with the options
it checks: ``DP`` (bench deferred-prefill --engine), ``EVICT`` (bench eviction),
``AMIN`` (bench amin --engine) and ``TB`` (bench timebill --engine).
"""

from __future__ import annotations

DP = ("bench", "deferred-prefill", "--engine", "--model", "tiny", "--requests", "6",
      "--capacity", "2", "--prompt-len", "4", "--threads", "1")  # fmt: skip
EVICT = ("bench", "eviction", "--model", "tiny", "--prompts", "1", "--min-prompt", "8",
         "--max-prompt", "16", "--new-tokens", "2", "--repeats", "1")  # fmt: skip
AMIN = ("bench", "amin", "--engine", "--model", "tiny")
TB = ("bench", "timebill", "--engine", "--model", "tiny", "--prompts", "1", "--n-max", "2",
      "--min-prompt", "8", "--max-prompt", "16", "--predictor", "oracle",
      "--method", "vanilla")  # fmt: skip
