"""The number format a contextual RLP encoder runs in: float32, or bfloat16 where it pays.

A 6-layer MiniLM forward over a short prompt is bound by reading its 42 MB of
float32 linear weights; bfloat16 halves that, and on a CPU that computes
bfloat16 natively (AVX512-BF16) it cut the fine-tuned RLP's latency from p50
11.5 / p99 23.5 ms to 6.9 / 14.9 ms (docs/predictors.md, "Inference
precision"). Elsewhere torch emulates bfloat16, several times slower than
float32. So:

- training resolves ``auto`` per device (:func:`resolve_precision`);
- a model is calibrated in the precision it will run in, and its file records
  it (``infer_precision``, read back from the encoder identity by
  :func:`precision_of`);
- at inference a bfloat16 model on a CPU without native bfloat16 runs in
  float32 (:func:`runtime_precision`): features match to a cosine of 0.99998.

A bfloat16 encoder's identity (its embedding-cache key) ends in ``:bf16``;
float32 keeps the bare identity it always had, so old caches stay valid.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from typing import Any

from duetime.cpu import native_bf16

PRECISIONS = ("auto", "bf16", "fp32")  # what a user may ask for
INFER_PRECISIONS = ("fp32", "bf16")  # what an encoder runs in
BF16_SUFFIX = ":bf16"
log = logging.getLogger(__name__)


def resolve_precision(precision: str, device: str) -> str:
    """``auto``: bfloat16 on a GPU and on a CPU that computes it natively (there it also
    halves a fine-tuning step: 0.29 s vs 0.57 s for 32 prompts at 64 pieces on 2 EPYC
    cores), float32 elsewhere."""
    if precision not in PRECISIONS:
        raise ValueError(  # named as train-length's option, where it comes from
            f"precision (--precision) must be one of {', '.join(PRECISIONS)}, got {precision!r}"
        )
    if precision != "auto":
        return precision
    if device.startswith("cuda"):
        return "bf16"
    return "bf16" if device == "cpu" and native_bf16() else "fp32"


def check_infer_precision(precision: str) -> str:
    """``precision`` if an encoder can run in it, else a ``ValueError`` naming the choices."""
    if precision not in INFER_PRECISIONS:
        raise ValueError(f"precision must be one of {INFER_PRECISIONS}, got {precision!r}")
    return precision


def runtime_precision(calibrated: str) -> str:
    """The precision to run a model calibrated in ``calibrated`` on this CPU: the same,
    but float32 for a bfloat16 model where bfloat16 is not native."""
    if calibrated == "bf16" and not native_bf16():
        log.warning(
            "this length model was calibrated in bf16, which this CPU does not compute "
            "natively: running it in fp32 (points move by ~0.3 tokens, and a prompt takes "
            "about twice as long; docs/predictors.md, Inference precision)"
        )
        return "fp32"
    return calibrated


def identity_in(identity: str, precision: str) -> str:
    """An encoder identity for ``precision``: float32 keeps the bare one."""
    return identity + (BF16_SUFFIX if precision == "bf16" else "")


def precision_of(identity: str) -> str:
    """The precision an encoder of this identity ran in."""
    return "bf16" if identity.endswith(BF16_SUFFIX) else "fp32"


def weights_identity(identity: str) -> str:
    """An encoder identity without its precision: the same weights whatever they run in."""
    return identity.removesuffix(BF16_SUFFIX)


def cast_linears_bf16(model: Any) -> None:
    """Cast every linear layer's weights to bfloat16, once, in place.

    Under autocast the result is bit-identical to casting them on every call,
    which autocast would do (its cast cache serves only weights that need
    gradients); once saves ~1.4 ms a prompt for 6 layers. Norms and
    embeddings stay float32, as autocast runs them.
    """
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.to(torch.bfloat16)


def cpu_autocast(precision: str) -> AbstractContextManager[Any]:
    """CPU bfloat16 autocast for ``bf16``, a no-op context for ``fp32``."""
    import torch

    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
