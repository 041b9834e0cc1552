"""Gemma 3 text-model hyper-parameters, read from GGUF metadata or a transformers config.

A GGUF written by llama.cpp's converter leaves out four Gemma 3 settings that
llama.cpp itself hard-codes; we do the same, with each default named below and
overridden when a newer file carries the key:

* local/global layer pattern: every 6th layer is global (``set_swa_pattern(6)``);
* RoPE base of the sliding-window layers: 10,000;
* query scale: ``1/sqrt(head_dim)``, except the 27B model (62 layers) which uses
  ``1/sqrt(hidden/heads)`` (gemma_pytorch config, which llama.cpp follows);
* no final-logit soft-capping unless the file says so (Gemma 2 had it, Gemma 3
  dropped it). Attention soft-capping is not modelled at all: Gemma 3 has none
  and transformers' Gemma 3 ignores the setting.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from duetime.engine.gguf_file import GGUFFile, ModelFileError

__all__ = ["HF_NAMES", "Gemma3Config"]

_ARCH = "gemma3"
_SLIDING_PATTERN = 6
_LOCAL_ROPE_BASE = 10_000.0

#: Our name and ``transformers``' ``Gemma3TextConfig`` name of each field that maps one
#: to one; :meth:`Gemma3Config.from_hf` reads it one way and
#: :func:`duetime.bench.engine_peers.hf_config` the other, so the two cannot drift.
HF_NAMES: dict[str, str] = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "sliding_window": "sliding_window",
    "rms_norm_eps": "rms_norm_eps",
    "max_position_embeddings": "max_position_embeddings",
}


@dataclass(frozen=True, slots=True)
class Gemma3Config:
    """Everything the forward pass needs to know about the network's shape."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int
    """A sliding layer's query at position p sees keys at positions (p - window, p]."""
    sliding_layers: tuple[bool, ...]
    """Per layer: True for a local (sliding-window) layer, False for a global one."""
    rope_theta_global: float = 1_000_000.0
    rope_theta_local: float = _LOCAL_ROPE_BASE
    rope_scaling_factor: float = 1.0
    """Linear RoPE scaling of the global layers (8 for Gemma 3 4B+, 1 for 270M/1B)."""
    rms_norm_eps: float = 1e-6
    query_pre_attn_scalar: float = 256.0
    """Scores are q·k / sqrt(query_pre_attn_scalar)."""
    final_logit_softcapping: float | None = None
    max_position_embeddings: int = 32_768
    bos_token_id: int = 2
    eos_token_id: int = 1
    pad_token_id: int = 0
    add_bos_token: bool = True

    def __post_init__(self) -> None:
        assert len(self.sliding_layers) == self.num_layers, "one layer type per layer"
        assert self.num_heads % self.num_kv_heads == 0, "GQA needs heads divisible by kv heads"
        assert self.sliding_window >= 1

    @property
    def num_params(self) -> int:
        """Parameter count with the tied embedding counted once."""
        h, hd, i = self.hidden_size, self.head_dim, self.intermediate_size
        attn = h * hd * (2 * self.num_heads + 2 * self.num_kv_heads) + 2 * hd
        layer = attn + 3 * h * i + 4 * h
        return self.vocab_size * h + self.num_layers * layer + h

    def to_json(self) -> str:
        """Serialise for the weight cache's metadata."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Gemma3Config:
        data = json.loads(text)
        data["sliding_layers"] = tuple(data["sliding_layers"])
        return cls(**data)

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> Gemma3Config:
        """Read the config from a llama.cpp Gemma 3 GGUF (see the module docstring for gaps)."""
        arch = gguf.get("general.architecture")
        if arch != _ARCH:
            raise ModelFileError(gguf.path, f"architecture is {arch!r}, expected {_ARCH!r}")

        def need(key: str) -> Any:
            value = gguf.get(f"{_ARCH}.{key}")
            if value is None:
                raise ModelFileError(gguf.path, f"metadata key {_ARCH}.{key} is missing")
            return value

        n_layers = int(need("block_count"))
        hidden = int(need("embedding_length"))
        n_heads = int(need("attention.head_count"))
        head_dim = int(need("attention.key_length"))
        if int(gguf.get(f"{_ARCH}.attention.value_length", head_dim)) != head_dim:
            raise ModelFileError(gguf.path, "key_length != value_length is not Gemma 3")
        pattern = gguf.get(f"{_ARCH}.attention.sliding_window_pattern")
        if pattern is None or isinstance(pattern, int):
            every = int(pattern or _SLIDING_PATTERN)
            sliding = tuple(bool((i + 1) % every) for i in range(n_layers))
        else:
            sliding = tuple(bool(x) for x in pattern)
        scaling_type = gguf.get(f"{_ARCH}.rope.scaling.type", "none")
        factor = float(gguf.get(f"{_ARCH}.rope.scaling.factor", 1.0))
        if scaling_type not in ("none", "linear"):
            raise ModelFileError(gguf.path, f"RoPE scaling {scaling_type!r} is not supported")
        embd = gguf.tensors.get("token_embd.weight")
        if embd is None:
            raise ModelFileError(gguf.path, "tensor token_embd.weight is missing")
        qscale = hidden / n_heads if n_layers == 62 else head_dim
        return cls(
            vocab_size=embd.shape[0],
            hidden_size=hidden,
            intermediate_size=int(need("feed_forward_length")),
            num_layers=n_layers,
            num_heads=n_heads,
            num_kv_heads=int(need("attention.head_count_kv")),
            head_dim=head_dim,
            sliding_window=int(need("attention.sliding_window")),
            sliding_layers=sliding,
            rope_theta_global=float(need("rope.freq_base")),
            rope_theta_local=float(gguf.get(f"{_ARCH}.rope.freq_base_swa", _LOCAL_ROPE_BASE)),
            rope_scaling_factor=factor if scaling_type == "linear" else 1.0,
            rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
            query_pre_attn_scalar=float(qscale),
            final_logit_softcapping=_opt_float(gguf.get(f"{_ARCH}.final_logit_softcapping")),
            max_position_embeddings=int(gguf.get(f"{_ARCH}.context_length", 32_768)),
            bos_token_id=int(gguf.get("tokenizer.ggml.bos_token_id", 2)),
            eos_token_id=int(gguf.get("tokenizer.ggml.eos_token_id", 1)),
            pad_token_id=int(gguf.get("tokenizer.ggml.padding_token_id", 0)),
            add_bos_token=bool(gguf.get("tokenizer.ggml.add_bos_token", True)),
        )

    @classmethod
    def from_hf(cls, hf: Any) -> Gemma3Config:
        """Map a ``transformers`` ``Gemma3TextConfig`` (duck-typed: no import needed)."""
        if getattr(hf, "hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(f"unsupported activation {hf.hidden_activation}")
        rope = getattr(hf, "rope_parameters", None) or {}
        full = rope.get("full_attention", {})
        local = rope.get("sliding_attention", {})
        if full.get("rope_type", "default") not in ("default", "linear"):
            raise ValueError(f"unsupported RoPE type {full.get('rope_type')}")
        eos = hf.eos_token_id[0] if isinstance(hf.eos_token_id, list) else hf.eos_token_id
        return cls(
            **{ours: getattr(hf, theirs) for ours, theirs in HF_NAMES.items()},
            sliding_layers=tuple(t == "sliding_attention" for t in hf.layer_types),
            rope_theta_global=float(full.get("rope_theta", 1_000_000.0)),
            rope_theta_local=float(local.get("rope_theta", _LOCAL_ROPE_BASE)),
            rope_scaling_factor=float(full.get("factor", 1.0)),
            query_pre_attn_scalar=float(hf.query_pre_attn_scalar),
            final_logit_softcapping=_opt_float(hf.final_logit_softcapping),
            bos_token_id=hf.bos_token_id if hf.bos_token_id is not None else 2,
            eos_token_id=eos if eos is not None else 1,
            pad_token_id=hf.pad_token_id if hf.pad_token_id is not None else 0,
        )


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)
