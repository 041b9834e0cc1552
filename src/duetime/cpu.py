"""What this CPU computes natively: the engine and the length predictor pick precisions by it."""

from __future__ import annotations


def native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16); elsewhere torch emulates
    it, several times slower than float32 for matrix products."""
    import torch

    return bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())
