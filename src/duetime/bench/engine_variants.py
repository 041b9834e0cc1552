"""The engine variants ``bench engine`` can time, each by what it is.

A variant is a dtype plus switches. Most switches turn one optimisation off, so
that its gain is measured against the same build with it on (``q8`` against
``q8-int8rank``, say); the constructor takes some, and the rest
(:data:`MODEL_SWITCHES`) are attributes set on the built model.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ENGINE_VARIANTS", "MODEL_SWITCHES"]

ENGINE_VARIANTS: dict[str, dict[str, Any]] = {
    "fp32": {"dtype": "fp32"},
    "fast": {"dtype": "fast"},
    "q8": {"dtype": "q8"},  # bf16 many-row steps where the CPU computes bf16 natively
    "q8-fp32rows": {"dtype": "q8", "bf16_rows": False},  # many-row steps in fp32 everywhere
    "q8-fp32kv": {"dtype": "q8", "bf16_kv": False},  # the KV cache in fp32, not bf16
    # a prefill chunk's attention in one masked call over every key, not in blocks
    "q8-oneattn": {"dtype": "q8", "blocked_prefill_attention": False},
    # the norms as plain torch ops, not the fused C++ ones
    "q8-unfused": {"dtype": "q8", "fused_norms": False},
    # greedy steps rank the vocabulary in int8, not int4
    "q8-int8rank": {"dtype": "q8", "int4_ranking": False},
    # a plain decode step's layers in Python, not the C++ loop
    "q8-pyloop": {"dtype": "q8", "decode_loop": False},
    "fp32-mkl": {"dtype": "fp32", "packed": False, "batched_decode_attention": False},
    "bf16": {"dtype": "bf16"},
    "int8": {"dtype": "int8"},
}
# Variant keys that are attributes of a built Gemma3, not arguments of its constructor.
MODEL_SWITCHES = (
    "batched_decode_attention",
    "blocked_prefill_attention",
    "decode_loop",
    "fused_norms",
    "int4_ranking",
)
