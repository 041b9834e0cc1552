"""Test helpers: tiny random-weight Gemma 3 models built in transformers, and references.

Lives in the package (like ``numpy.testing``) so every engine test file can use
it; transformers is imported lazily because inference never needs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from duetime.engine.config import Gemma3Config
from duetime.engine.gemma3 import Dtype, Gemma3

__all__ = ["engine_from_hf", "hf_greedy", "tiny_hf_model", "write_tiny_gguf"]


def tiny_hf_model(seed: int = 0, **overrides: Any) -> Any:
    """A small ``Gemma3ForCausalLM`` with every weight random, norms included.

    Defaults: 4 layers (sliding, global, sliding, global), window 4 so it matters
    for short prompts, 4 query heads over 2 KV heads, vocab 256. transformers
    initialises norm weights to 0 (scale 1), which would hide a ``1 + w`` bug, and
    uses std 0.02, which gives near-tied logits; both are replaced here.
    """
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    kwargs: dict[str, Any] = {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "sliding_window": 4,
        "query_pre_attn_scalar": 24,
        "max_position_embeddings": 1024,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        },
    }
    kwargs.update(overrides)
    config = Gemma3TextConfig(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.5 if "norm" in name else 0.15)
    return model


def engine_from_hf(hf: Any, dtype: Dtype = "fp32", **kwargs: Any) -> Gemma3:
    """Our model with the same weights as a transformers ``Gemma3ForCausalLM``."""
    return Gemma3(Gemma3Config.from_hf(hf.config), dict(hf.state_dict()), dtype, **kwargs)


@torch.no_grad()
def hf_greedy(hf: Any, prompt: Sequence[int], n: int) -> list[int]:
    """Greedy continuation by full recomputation each token: no KV cache involved,
    so the reference shares no caching logic with what it checks."""
    ids = torch.tensor([list(prompt)])
    out: list[int] = []
    for _ in range(n):
        tok = int(hf(ids).logits[0, -1].argmax())
        out.append(tok)
        ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
    return out


def write_tiny_gguf(hf: Any, path: Path, *, extra_q8_tensor: bool = False) -> Path:
    """Write ``hf`` as a llama.cpp-style Gemma 3 GGUF (F32, norms stored as ``1 + w``).

    Only the metadata llama.cpp writes is included, so loading it exercises the
    same defaults (layer pattern, local RoPE base, query scale) as the real file.
    """
    import gguf

    cfg = hf.config
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
    w.add_sliding_window(cfg.sliding_window)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_add_bos_token(True)
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    from duetime.engine.weights import gguf_to_hf_names

    hf_to_gguf = {h: g for g, h in gguf_to_hf_names(cfg.num_hidden_layers).items()}
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied: llama.cpp writes only token_embd
        data = t.detach().float().numpy()
        if name.endswith("norm.weight"):
            data = data + 1.0
        w.add_tensor(hf_to_gguf[name], np.ascontiguousarray(data))
    if extra_q8_tensor:
        rng = np.random.default_rng(0)
        q8 = gguf.quants.quantize(
            rng.standard_normal((8, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0
        )
        w.add_tensor("extra.q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
