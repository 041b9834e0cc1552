"""The peers `duetime bench engine` times beside our engine: transformers and llama.cpp.

transformers runs ``generate`` (greedy, SDPA attention) on a
``Gemma3ForCausalLM`` holding the very tensors our engine loaded, in fp32 and
bf16. One ``generate`` call gives both figures: a logits processor stamps the
clock each time a token is chosen, so the first stamp closes the prefill and
the gaps between later stamps are decode steps. llama.cpp (the Q4_K_M GGUF
itself, through ``llama_cpp``) is timed only when that package is importable:
``pip install llama-cpp-python`` enables it.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any, cast

import torch

from duetime.engine.config import Gemma3Config

__all__ = ["HFRunner", "LlamaCppRunner", "hf_config", "llama_cpp_available"]


def hf_config(cfg: Gemma3Config, dtype: torch.dtype) -> Any:
    """A transformers ``Gemma3TextConfig`` for our config (the inverse of ``from_hf``)."""
    from transformers import Gemma3TextConfig

    full: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta_global}
    if cfg.rope_scaling_factor != 1.0:
        full = {**full, "rope_type": "linear", "factor": cfg.rope_scaling_factor}
    hf = Gemma3TextConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        sliding_window=cfg.sliding_window,
        layer_types=["sliding_attention" if s else "full_attention" for s in cfg.sliding_layers],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_theta_local},
            "full_attention": full,
        },
        rms_norm_eps=cfg.rms_norm_eps,
        query_pre_attn_scalar=int(cfg.query_pre_attn_scalar),
        final_logit_softcapping=cfg.final_logit_softcapping,
        max_position_embeddings=cfg.max_position_embeddings,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id,
        dtype=dtype,
    )
    hf._attn_implementation = "sdpa"
    return hf


class _Stamps:
    """A logits processor that only records when it is called (once per new token)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


class HFRunner:
    """transformers ``generate`` on our weights; ``dtype`` is torch.float32 or bfloat16."""

    def __init__(self, cfg: Gemma3Config, weights: dict[str, torch.Tensor], dtype: torch.dtype):
        from transformers import Gemma3ForCausalLM
        from transformers.initialization import no_init_weights

        with no_init_weights():
            model = Gemma3ForCausalLM(hf_config(cfg, dtype))
        state = {k: v.to(dtype) for k, v in weights.items() if k != "lm_head.weight"}
        model.load_state_dict(state, strict=False)
        model.tie_weights()
        self.model = cast(Any, model).to(dtype).eval()
        self.pad = cfg.pad_token_id
        self.nbytes = sum(p.nbytes for p in self.model.parameters())  # tied: counted once

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor, new_tokens: int) -> tuple[float, list[float]]:
        """Greedy ``generate``: (prefill seconds, per-decode-step seconds)."""
        from transformers import LogitsProcessorList

        stamps = _Stamps()
        start = time.perf_counter()
        self.model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            top_k=None,
            top_p=None,
            pad_token_id=self.pad,
            logits_processor=LogitsProcessorList([stamps]),
        )
        t = stamps.times
        return t[0] - start, [b - a for a, b in itertools.pairwise(t)]


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


class LlamaCppRunner:
    """llama.cpp on the GGUF itself (batch 1 only: llama-cpp-python's high-level API)."""

    def __init__(self, gguf_path: Path, threads: int, n_ctx: int) -> None:
        import llama_cpp

        self.llm = llama_cpp.Llama(
            model_path=str(gguf_path),
            n_threads=threads,
            n_threads_batch=threads,
            n_ctx=n_ctx,
            n_batch=min(n_ctx, 2048),
            verbose=False,
        )
        self.nbytes = Path(gguf_path).stat().st_size

    def prefill_s(self, ids: list[int]) -> float:
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(ids)
        return time.perf_counter() - start

    def decode_steps_s(self, ids: list[int], steps: int) -> list[float]:
        self.llm.reset()
        self.llm.eval(ids)
        out = []
        for _ in range(steps):
            start = time.perf_counter()
            self.llm.eval([100])
            out.append(time.perf_counter() - start)
        return out
