"""One Gemma 3 decoder layer's weights, prepared for the dtype a model runs in.

q/k/v and gate/up are fused into one matrix each (fewer, larger products: on
2 CPU cores op overhead is a real cost), and every norm weight is stored as
``1 + w``, the form Gemma's RMSNorm multiplies by.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from duetime.engine.config import Gemma3Config
from duetime.engine.linear import (
    Bf16Linear,
    DenseLinear,
    Int8Linear,
    Linear,
    PackedLinear,
    q8_or,
)
from duetime.engine.q8_kernel import Q8Weight, quantize_q8

__all__ = ["LayerWeights", "Quantize", "Weights", "quantize_now"]

Weights = dict[str, torch.Tensor]
Quantize = Callable[[str, torch.Tensor], Q8Weight]
"""``(name, fp32 weight) -> int8 weight`` for ``q8`` (``load_model`` passes a cache)."""


def quantize_now(name: str, weight: torch.Tensor) -> Q8Weight:
    """The default :data:`Quantize`: quantise now, keyed by nothing."""
    return quantize_q8(weight)


class LayerWeights:
    """One decoder layer's prepared weights."""

    __slots__ = (
        "down",
        "gate_up",
        "in_norm",
        "o",
        "post_attn",
        "post_ffw",
        "pre_ffw",
        "qk_norm",
        "qkv",
    )

    def __init__(
        self,
        w: Weights,
        p: str,
        cfg: Gemma3Config,
        kind: str,
        dt: torch.dtype,
        quantize: Quantize = quantize_now,
    ) -> None:
        def lin(*names: str) -> Linear:
            weight = torch.cat([w[f"{p}.{n}.weight"] for n in names], 0)
            if kind == "int8":
                return Int8Linear(weight)
            if kind.startswith("q8"):  # int8 kernel for few rows, fp32 (or bf16) for more
                many: Linear
                if kind == "q8":
                    many = PackedLinear(weight)
                elif kind == "q8-bf16":
                    many = Bf16Linear(weight)
                else:
                    many = DenseLinear(weight, dt)
                key = f"{p}.{'+'.join(names)}"
                return q8_or(weight, many, quantize=partial(quantize, key))
            if kind == "packed":
                return PackedLinear(weight)
            return DenseLinear(weight, dt)

        def one_plus(name: str) -> torch.Tensor:
            return 1.0 + w[f"{p}.{name}.weight"].float()

        self.qkv = lin("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        self.o = lin("self_attn.o_proj")
        self.gate_up = lin("mlp.gate_proj", "mlp.up_proj")
        self.down = lin("mlp.down_proj")
        self.in_norm = one_plus("input_layernorm")
        self.post_attn = one_plus("post_attention_layernorm")
        self.pre_ffw = one_plus("pre_feedforward_layernorm")
        self.post_ffw = one_plus("post_feedforward_layernorm")
        q, k = one_plus("self_attn.q_norm"), one_plus("self_attn.k_norm")
        # per-head scale for q and k stacked as [heads + kv_heads, head_dim]
        self.qk_norm = torch.cat(
            [q.expand(cfg.num_heads, -1), k.expand(cfg.num_kv_heads, -1)], 0
        ).contiguous()
