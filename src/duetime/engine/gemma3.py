"""Gemma 3 text forward in plain torch: one batched call per engine step.

Follows transformers' ``Gemma3ForCausalLM`` operation for operation (so the
fp32 path matches it to ~1e-5): embedding × sqrt(hidden) rounded to the compute
dtype; RMSNorm in fp32 with ``(1 + w)``; q/k RMSNorm per head; NeoX RoPE with
base 10k on sliding layers and 1M (optionally linearly scaled) on global ones;
scores scaled by ``query_pre_attn_scalar ** -0.5``; post-attention and
pre/post-feed-forward norms; GELU-tanh gated MLP; tied output layer; optional
final soft-capping.

Step layout: all tokens of all chunks go through the dense layers as one
``[T, hidden]`` matrix; only attention loops over the chunks, each against its
own KV (see kv_cache.py for why). q and k share one RMSNorm and one RoPE call by
stacking their heads, and q/k/v and gate/up are fused matmuls, to keep the
number of small ops per layer low — on 2 CPU cores op overhead is a real cost.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Literal

import torch
import torch.nn.functional as F  # noqa: N812

from duetime.cpu import native_bf16
from duetime.engine.attention import MaskCache
from duetime.engine.attention_kernel import decode_attention_ops
from duetime.engine.batch import SeqChunk, StepBatch
from duetime.engine.config import Gemma3Config
from duetime.engine.decode_loop import DecodeLoop, PlainDecodes
from duetime.engine.kv_cache import KVCache
from duetime.engine.layer_weights import LayerWeights, Quantize, Weights, quantize_now
from duetime.engine.linear import (
    Q8_HEAD_MAX_ROWS,
    DenseLinear,
    Int8Linear,
    Linear,
    PackedLinear,
    packed_available,
    q8_or,
)
from duetime.engine.malloc_tuning import keep_large_blocks
from duetime.engine.norm_kernel import make_norms
from duetime.engine.obs_window import watched_rows
from duetime.engine.onednn_int8 import int8_rank
from duetime.engine.q4_rank import q4_available, quantize_q4
from duetime.engine.rescored_head import RescoredInt8Head
from duetime.engine.step_attention import attend_layer

__all__ = ["DTYPES", "Dtype", "Gemma3"]

Dtype = Literal["fp32", "fast", "q8", "bf16", "int8"]
DTYPES: tuple[str, ...] = ("fp32", "fast", "q8", "bf16", "int8")


class Gemma3:
    """The model half of the engine: weights plus :meth:`step`.

    ``dtype``: ``"fp32"`` (exact reference; oneDNN-packed weights), ``"fast"``
    (fp32 layers, int8 output layer whose top-32 logits per row are recomputed
    in fp32: same arg-max as fp32 on the real model, ~2x faster batch-1 decode),
    ``"q8"`` (``fast`` plus weight-only int8 layer and output-layer products
    for steps of ≤ 8 rows through our AVX2 kernel, fp32 activations; multi-row
    steps keep the fp32 path, or a bf16 one: ``bf16_rows``; falls back to ``fast``
    when the kernel cannot be built), ``"bf16"`` (bf16 weights, activations
    and KV; norms and softmax in fp32 as in transformers) or ``"int8"``
    (experimental: dynamic int8 for every linear, fp32 activations and KV, bf16
    embedding table; top-1 agrees with fp32 only ~77 % of the time).
    ``int8_output`` swaps only the output layer to int8 (default: on for
    ``"int8"`` only; ~91 % agreement, about 2x faster decode than fp32).
    ``packed=False`` keeps fp32 weights for MKL's ``F.linear`` instead of
    oneDNN-packed ones (for benchmarks and comparisons).
    ``q8_quantize``: where ``q8`` gets its int8 weights (default: quantise now).
    ``bf16_rows`` (``q8`` only): steps of more than 8 rows multiply the layer weights
    in bf16 (:class:`~duetime.engine.linear.Bf16Linear`) instead of fp32: prefill
    ~1.3x faster where the CPU computes bf16 natively, whose default it is (None).

    On an AVX2 CPU without native bf16, bf16 GEMMs with more than one row are
    3-10x slower than fp32, so bf16 only pays for batch-1 decode; see
    docs/engine-model.md, "dtypes".
    """

    def __init__(
        self,
        config: Gemma3Config,
        weights: Weights,
        dtype: Dtype = "bf16",
        *,
        int8_output: bool | None = None,
        packed: bool | None = None,
        q8_quantize: Quantize = quantize_now,
        bf16_rows: bool | None = None,
        bf16_kv: bool | None = None,
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
        keep_large_blocks()  # a step's large temporaries reuse memory, once per process
        self.config = config
        self.dtype_name = dtype
        self.compute_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        cd = self.compute_dtype
        if packed is None:
            packed = packed_available()
        packed = packed and dtype in ("fp32", "fast", "q8")
        kind = "int8" if dtype == "int8" else "packed" if packed else "dense"
        if dtype == "q8":
            if bf16_rows is None:
                bf16_rows = native_bf16()
            kind = "q8-bf16" if bf16_rows else "q8" if packed else "q8-dense"
        self.bf16_rows = kind == "q8-bf16"
        # prompt chunks attend in bf16 where the many-row products are bf16 (attention.py)
        self.prefill_attention_dtype = torch.bfloat16 if self.bf16_rows else None
        # and the KV cache holds bf16 there (``bf16_kv``, default: where the rows are bf16):
        # a large decode step reads every sequence's keys and values from DRAM each layer
        # (48 % of a 90-decoder step at 320 tokens in fp32); in bf16 a layer of 90
        # sequences x 320 keys took 1.7-2.1 ms against 3.2 ms on the 2-core AMD EPYC
        if bf16_kv is None:
            bf16_kv = self.bf16_rows
        self.kv_dtype = torch.bfloat16 if bf16_kv and dtype == "q8" else self.compute_dtype
        self.layers = [
            LayerWeights(weights, f"model.layers.{i}", config, kind, cd, q8_quantize)
            for i in range(config.num_layers)
        ]
        embed = weights["model.embed_tokens.weight"]
        table_dtype = torch.bfloat16 if dtype == "int8" else cd
        self.embed = embed.to(table_dtype).contiguous()
        head = weights.get("lm_head.weight", embed)
        tied = head is embed or torch.equal(head, embed)
        # the output rows gathered for a grammar's few allowed tokens (``logits``' allowed)
        self.head_weight = self.embed if tied else head
        if dtype in ("fast", "q8") and int8_output is None:
            src = self.embed if tied else head
            quant_head = partial(q8_quantize, "lm_head")
            rank: Linear = int8_rank(src)
            coarse = None
            if dtype == "q8":  # the int8 kernel for 1-2 rows, int8 GEMMs beyond
                rank = q8_or(src, rank, Q8_HEAD_MAX_ROWS, quantize=quant_head)
                # greedy steps of few rows rank in int4 where the CPU has VNNI (q4_rank.py)
                coarse = quantize_q4(src) if q4_available() else None
            self.lm_head: Linear = RescoredInt8Head(src, rank=rank, coarse=coarse)
        elif int8_output if int8_output is not None else dtype == "int8":
            self.lm_head = Int8Linear(head)
        elif packed:
            self.lm_head = PackedLinear(head, plain=self.embed if tied else None)
        elif tied and self.embed.dtype == cd:
            self.lm_head = DenseLinear(self.embed, cd)  # shares the embedding tensor
        else:
            self.lm_head = DenseLinear(head, cd)
        # one SDPA call for all plain decodes of a step (False: one per sequence, as before)
        self.batched_decode_attention = True
        # a long prefill chunk attends in blocks of queries, each over the keys it may see
        # (attention.attend_prefill; False: one masked call over every key, as before)
        self.blocked_prefill_attention = True
        # the C++ decode attention op (fp32 only), built (once per machine, seconds) or loaded
        # now, as q8's kernel is, so that a server's first request does not pay for it
        self.decode_kernel = self.compute_dtype == torch.float32 and (
            decode_attention_ops() is not None
        )
        self.final_norm = 1.0 + weights["model.norm.weight"].float()
        # a step of plain decodes runs its layers in one C++ call (decode_loop.py) where
        # the model is fp32 q8 on the int8 kernel; ``decode_loop = False`` turns it off
        self.decode_loop = True
        # the RMS norms (and q/k norm + RoPE) as one C++ op each where the model computes
        # in fp32 (norm_kernel.py); plain torch otherwise. ``fused_norms = False`` turns it off.
        self.norms = make_norms(config.rms_norm_eps, self.compute_dtype)
        self.embed_scale = torch.tensor(config.hidden_size**0.5).to(cd)
        self.scale = config.query_pre_attn_scalar**-0.5
        hd = config.head_dim
        exponent = torch.arange(0, hd, 2, dtype=torch.int64).float() / hd
        self.inv_freq_local = 1.0 / (config.rope_theta_local**exponent)
        inv_global = 1.0 / (config.rope_theta_global**exponent)
        self.inv_freq_global = inv_global / config.rope_scaling_factor
        self._loop = DecodeLoop.of(self.layers, config, self.compute_dtype, self.scale)

    @property
    def fused_norms(self) -> bool:
        """Whether the norms run as the C++ ops (fp32 models where they build)."""
        return self.norms.fused

    @fused_norms.setter
    def fused_norms(self, on: bool) -> None:
        self.norms = make_norms(self.config.rms_norm_eps, self.compute_dtype, fused=on)

    @property
    def int4_ranking(self) -> bool:
        """Whether greedy steps of few rows rank the vocabulary in int4 (``q8`` on a CPU
        with AVX-512 VNNI; :mod:`~duetime.engine.q4_rank`)."""
        head = self.lm_head
        return isinstance(head, RescoredInt8Head) and head.coarse_enabled

    @int4_ranking.setter
    def int4_ranking(self, on: bool) -> None:
        head = self.lm_head
        if isinstance(head, RescoredInt8Head):
            head.coarse_enabled = on and head.coarse is not None

    def new_kv_cache(self, max_tokens: int | None = None) -> KVCache:
        """A KV cache in the model's KV dtype (:attr:`kv_dtype`)."""
        return KVCache(self.config, self.kv_dtype, max_tokens, query_dtype=self.compute_dtype)

    @torch.no_grad()
    def step(
        self,
        chunks: Sequence[SeqChunk],
        kv: KVCache,
        *,
        all_logits: bool = False,
        argmax_only: bool = False,
        allowed: Sequence[torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        """Run one varlen step and return fp32 logits.

        Appends every chunk's keys/values to ``kv`` and advances its positions.
        Returns ``[len(chunks), vocab]`` (each chunk's last token), or with
        ``all_logits`` ``[total_tokens, vocab]`` in chunk order. ``argmax_only`` and
        ``allowed`` (one entry a returned row): see :meth:`logits`.
        """
        hidden, batch = self.hidden_states(chunks, kv)
        rows = hidden if all_logits else hidden[batch.last_rows]
        return self.logits(rows, argmax_only=argmax_only, allowed=allowed)

    @torch.no_grad()
    def hidden_states(
        self, chunks: Sequence[SeqChunk], kv: KVCache
    ) -> tuple[torch.Tensor, StepBatch]:
        """Run one varlen step (as :meth:`step`) and return every token's last hidden
        state, ``[total_tokens, hidden]`` in chunk order, with the flattened batch.

        For callers that want logits of more rows than each chunk's last (a prompt's
        log-probabilities): :meth:`logits` turns any rows of it into logits, in as
        many pieces as memory likes (a row of logits is the vocabulary, 1 MiB in fp32).
        """
        assert kv.dtype == self.kv_dtype, "KV cache dtype differs from the model's"
        batch = StepBatch.build(chunks)
        for c in batch.chunks:
            assert c.slot in kv, f"slot {c.slot} is not allocated"
            assert c.start_pos == kv.seq_len(c.slot), (
                f"slot {c.slot}: chunk starts at {c.start_pos}, cache is at {kv.seq_len(c.slot)}"
            )
        cfg = self.config
        x = F.embedding(batch.ids, self.embed).to(self.compute_dtype) * self.embed_scale
        rope_local = self._rope(batch.positions, self.inv_freq_local)
        rope_global = self._rope(batch.positions, self.inv_freq_global)
        loop = self._loop if self.decode_loop else None
        # the loop calls the fused norms and the decode kernel: only where they serve
        plain: PlainDecodes | None = None
        if loop is not None and self.norms.fused and self.decode_kernel:
            out = loop.run(batch, kv, x, rope_local, rope_global)
            if out is not None:
                return out, batch
            # a mixed step: its plain decodes store and attend in one C++ call a layer
            plain = loop.plain_decodes(batch, kv)
        masks = MaskCache(cfg.sliding_window)
        n_qk = cfg.num_heads + cfg.num_kv_heads
        # SnapKV's observation window: only watched sequences (prefilling, eviction pending)
        watched = watched_rows(batch, kv) if kv.watching else []
        norms = self.norms
        layers = self.layers
        h = norms.rms(x, layers[0].in_norm) if layers else x
        for i, layer in enumerate(layers):
            sliding = cfg.sliding_layers[i]
            cos, sin = rope_local if sliding else rope_global
            qkv = layer.qkv(h)
            t = qkv.shape[0]
            qk = norms.qk_rope(qkv, n_qk, layer.qk_norm, cos, sin)
            v = qkv[:, n_qk * cfg.head_dim :].view(t, cfg.num_kv_heads, cfg.head_dim)
            new_kv = torch.stack((qk[:, cfg.num_heads :], v), dim=1).to(kv.dtype)
            q = qk[:, : cfg.num_heads]
            for win, rows, _ in watched:
                win.capture(i, q[rows])
            plain_out = None
            if plain is not None and loop is not None:
                plain_out = loop.store_attend(qk, qkv, plain, i)
            attn = attend_layer(self, batch, kv, i, q, new_kv, masks, sliding, plain, plain_out)
            h = layer.o(attn.to(layer.o.dtype)).to(x.dtype)
            x, h = norms.add_rms(x, h, layer.post_attn, layer.pre_ffw)
            h = layer.down(norms.gelu_mul(layer.gate_up(h))).to(x.dtype)
            if i + 1 < len(layers):  # the residual step and the next layer's input norm
                x, h = norms.add_rms(x, h, layer.post_ffw, layers[i + 1].in_norm)
            else:
                x = x + norms.rms(h, layer.post_ffw)
        done = plain.chunks if plain is not None else frozenset()
        for k, c in enumerate(batch.chunks):
            if k not in done:
                kv.advance(c.slot, c.shared + len(c))
        if plain is not None:
            kv.decoded(plain.slots)
        for win, _, n in watched:
            win.advance(n, win.end_pos + n)
        return x, batch

    @torch.no_grad()
    def logits(
        self,
        hidden: torch.Tensor,
        *,
        argmax_only: bool = False,
        allowed: Sequence[torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        """fp32 logits of rows of :meth:`hidden_states` (final norm, output layer, soft cap).

        ``argmax_only``: the caller reads only each row's arg-max (plain greedy
        decoding), so the vocabulary may be ranked coarsely (:attr:`int4_ranking`): each
        row's top candidates are still exact fp32, the other logits approximations.

        ``allowed``: per row, ``None`` or the only token ids the caller will read (a
        grammar's next tokens): those come back exact in fp32 from a gather of their
        output rows, every other logit of the row as −∞, and the output layer's
        product over the whole vocabulary is skipped for the row. ``argmax_only``
        concerns the other rows.
        """
        x = self.norms.rms(hidden, self.final_norm).to(self.lm_head.dtype)
        if allowed is None or all(ids is None for ids in allowed):
            return self._capped(self._head(x, argmax_only))
        if len(allowed) != x.shape[0]:
            raise ValueError(f"allowed has {len(allowed)} entries for {x.shape[0]} rows")
        out = torch.full((x.shape[0], self.config.vocab_size), -torch.inf)
        full = [i for i, ids in enumerate(allowed) if ids is None]
        if full:
            out[full] = self._capped(self._head(x[full], argmax_only))
        for i, ids in enumerate(allowed):
            if ids is not None:
                exact = self.head_weight[ids].float() @ x[i].float()
                out[i, ids] = self._capped(exact)
        return out

    @torch.no_grad()
    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each row's arg-max token, ``[rows]`` int64, as ``logits(hidden,
        argmax_only=True).argmax(-1)`` picks it, without a ``[rows, vocab]`` row of logits
        where the output layer ranks and re-scores: there the best exactly scored
        candidate (:meth:`~duetime.engine.rescored_head.RescoredInt8Head.best`, which
        says where the two may differ; the soft cap is monotone and changes no arg-max).
        Rows a grammar narrows to a few tokens take :meth:`logits` with ``allowed``."""
        head = self.lm_head
        if not isinstance(head, RescoredInt8Head):
            return self.logits(hidden, argmax_only=True).argmax(-1)
        return head.best(self.norms.rms(hidden, self.final_norm))

    @torch.no_grad()
    def greedy_step(self, chunks: Sequence[SeqChunk], kv: KVCache) -> torch.Tensor:
        """:meth:`step` for plain greedy decoding: each chunk's next token, ``[chunks]``
        int64 (:meth:`greedy`)."""
        hidden, batch = self.hidden_states(chunks, kv)
        return self.greedy(hidden[batch.last_rows])

    def _head(self, x: torch.Tensor, argmax_only: bool) -> torch.Tensor:
        head = self.lm_head
        if argmax_only and isinstance(head, RescoredInt8Head):
            return head(x, argmax_only=True)
        return head(x).float()

    def _capped(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _rope(self, positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """cos/sin ``[T, 1, head_dim]`` computed in fp32 then cast, as transformers does."""
        freqs = positions[:, None].float() * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(self.compute_dtype), emb.sin().to(self.compute_dtype)
