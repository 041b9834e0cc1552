"""What this CPU is and computes natively: the engine and the length predictor pick
precisions by it, and the benchmarks name it beside their figures."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo; elsewhere what ``platform`` says)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16); elsewhere torch emulates
    it, several times slower than float32 for matrix products."""
    import torch

    return bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())
