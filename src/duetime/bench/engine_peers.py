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

from duetime.engine.config import HF_NAMES, Gemma3Config

__all__ = ["HFRunner", "LlamaCppRunner", "hf_config", "llama_cpp_available"]


def hf_config(cfg: Gemma3Config, dtype: torch.dtype) -> Any:
    """A transformers ``Gemma3TextConfig`` for our config (the inverse of ``from_hf``)."""
    from transformers import Gemma3TextConfig

    full: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta_global}
    if cfg.rope_scaling_factor != 1.0:
        full = {**full, "rope_type": "linear", "factor": cfg.rope_scaling_factor}
    hf = Gemma3TextConfig(
        **{theirs: getattr(cfg, ours) for ours, theirs in HF_NAMES.items()},
        layer_types=["sliding_attention" if s else "full_attention" for s in cfg.sliding_layers],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_theta_local},
            "full_attention": full,
        },
        query_pre_attn_scalar=int(cfg.query_pre_attn_scalar),
        final_logit_softcapping=cfg.final_logit_softcapping,
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


_QUIET_LOG: Any = None  # the no-op callback must outlive every llama.cpp call


def _silence_llama_cpp(lib: Any) -> None:
    """Route llama.cpp's own log lines (model loading, KV set-up) to nowhere."""
    global _QUIET_LOG
    if _QUIET_LOG is None:
        import ctypes

        _QUIET_LOG = lib.llama_log_callback(lambda level, text, data: None)
        lib.llama_log_set(_QUIET_LOG, ctypes.c_void_p(0))


class LlamaCppRunner:
    """llama.cpp on the GGUF itself, through ``llama_cpp``'s low-level (C) API.

    The high-level ``llama_cpp.Llama`` runs one sequence, so batched decode is
    driven here the way llama.cpp's own ``llama-batched-bench`` does it: one
    context with ``n_seq_max = max_batch`` sequences, each with its own KV
    stream (``kv_unified`` off: with one unified buffer every token attended
    over every sequence's cells, masked, and batch 64 ran at 82 tok/s against
    222 without), and
    each decode step one ``llama_decode`` over a batch holding one token of every
    sequence (each with its own ``seq_id`` and position, logits requested for
    all). That is the same work our engine's decode step does: B rows in, B rows
    of logits out. ``llama_synchronize`` closes every timed call.
    """

    def __init__(self, gguf_path: Path, threads: int, n_ctx: int, max_batch: int = 1) -> None:
        import llama_cpp

        _silence_llama_cpp(llama_cpp)
        self._lib: Any = llama_cpp
        llama_cpp.llama_backend_init()
        mparams = llama_cpp.llama_model_default_params()
        self._model = llama_cpp.llama_model_load_from_file(str(gguf_path).encode(), mparams)
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path}")
        cparams = llama_cpp.llama_context_default_params()
        self.max_batch = max(1, max_batch)
        self.n_ctx = n_ctx * self.max_batch
        cparams.n_ctx = self.n_ctx
        cparams.n_batch = cparams.n_ubatch = min(self.n_ctx, 2048)
        cparams.n_seq_max = self.max_batch
        cparams.kv_unified = False
        cparams.n_threads = cparams.n_threads_batch = threads
        self._ctx = llama_cpp.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            llama_cpp.llama_model_free(self._model)
            raise RuntimeError("llama.cpp could not create a context")
        self._n_batch = int(cparams.n_batch)
        self._batch = llama_cpp.llama_batch_init(self._n_batch, 0, 1)
        self.nbytes = Path(gguf_path).stat().st_size

    def close(self) -> None:
        """Free the C objects (also done when the runner is garbage collected)."""
        lib = getattr(self, "_lib", None)
        if lib is None:
            return
        lib.llama_batch_free(self._batch)
        lib.llama_free(self._ctx)
        lib.llama_model_free(self._model)
        self._lib = None

    def __del__(self) -> None:
        self.close()

    def _decode(self, tokens: list[tuple[int, int, int]], logits_from: int = 0) -> None:
        """One ``llama_decode`` of ``(token, seq, pos)`` rows; logits for rows ``logits_from:``."""
        b = self._batch
        for i, (tok, seq, pos) in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
            b.logits[i] = int(i >= logits_from)
            b.seq_id[i][0] = seq
        b.n_tokens = len(tokens)
        rc = self._lib.llama_decode(self._ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        self._lib.llama_synchronize(self._ctx)

    def _feed(self, seq: int, ids: list[int]) -> None:
        """Prefill ``ids`` into sequence ``seq`` in chunks of the context's batch size.

        Logits only for the prompt's last token, as our engine's prefill step
        (the 262k-row output layer over every prompt token would cost ~4x the
        rest of the prefill).
        """
        for at in range(0, len(ids), self._n_batch):
            chunk = ids[at : at + self._n_batch]
            last = len(chunk) - 1 if at + len(chunk) == len(ids) else len(chunk)
            self._decode([(t, seq, at + i) for i, t in enumerate(chunk)], logits_from=last)

    def _clear(self) -> None:
        self._lib.llama_memory_clear(self._lib.llama_get_memory(self._ctx), True)

    def prefill_s(self, ids: list[int]) -> float:
        """Seconds to prefill one prompt from an empty cache."""
        self._clear()
        start = time.perf_counter()
        self._feed(0, ids)
        return time.perf_counter() - start

    def decode_steps_s(self, prompts: list[list[int]], steps: int) -> list[float]:
        """Prefill every prompt (untimed), then time ``steps`` batched decode steps."""
        if len(prompts) > self.max_batch:
            raise ValueError(f"batch {len(prompts)} > this context's {self.max_batch} sequences")
        self._clear()
        for seq, ids in enumerate(prompts):
            self._feed(seq, ids)
        out = []
        for step in range(steps):
            rows = [(100, seq, len(ids) + step) for seq, ids in enumerate(prompts)]
            start = time.perf_counter()
            self._decode(rows)
            out.append(time.perf_counter() - start)
        return out
