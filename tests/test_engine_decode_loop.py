"""The C++ layer loop for steps of plain decodes (``engine/decode_loop.py``).

It calls the same ops as the Python path, so everything is compared bit for bit
with ``decode_loop = False`` on the same ``q8`` model: hidden states, the KV
cache's contents and positions, and an executor's answers under preemptions and
evictions. A spy on the op tells which steps it served. Skipped with a reason
where the int8 kernel or the loop cannot be built here.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest
import torch

from duetime.core.request import Job, Request
from duetime.engine import SeqChunk, decode_loop
from duetime.engine.decode_loop import decode_loop_ops
from duetime.engine.gemma3 import Gemma3
from duetime.engine.q8_kernel import q8_available
from duetime.engine.testing import engine_from_hf, tiny_hf_model

needs_loop = pytest.mark.skipif(
    not q8_available() or decode_loop_ops() is None,
    reason="the int8 kernel or the decode loop cannot be built here",
)


@pytest.fixture(scope="module")
def hf() -> Any:
    return tiny_hf_model(seed=3)  # sliding window 4: the sliding layers trim as they go


@pytest.fixture
def model(hf: Any) -> Gemma3:
    return engine_from_hf(hf, "q8")


@needs_loop
def test_the_cache_holds_bf16_where_the_many_row_products_are_bf16(model: Gemma3) -> None:
    """The loop then rounds each new key and value to bf16 itself: the bit-for-bit
    comparisons below check it rounds as ``Tensor.copy_`` does."""
    kv = model.new_kv_cache()
    assert kv.dtype == (torch.bfloat16 if model.bf16_rows else torch.float32)
    assert kv.query_dtype == torch.float32


class _Spy:
    """Counts the loop's calls and passes them on."""

    def __init__(self, ops: Any) -> None:
        self.ops = ops
        self.calls = 0  # whole decode steps
        self.layer_calls = 0  # one layer of a mixed step's plain decodes

    def decode_layers(self, *args: Any) -> torch.Tensor:
        self.calls += 1
        return self.ops.decode_layers(*args)

    def store_attend(self, *args: Any) -> torch.Tensor:
        self.layer_calls += 1
        return self.ops.store_attend(*args)


def _spy(model: Gemma3) -> _Spy:
    assert model._loop is not None
    spy = _Spy(model._loop.ops)
    model._loop.ops = spy
    return spy


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    r = random.Random(seed)
    return [[r.randrange(256) for _ in range(r.choice([1, 3, 17, 40]))] for _ in range(n)]


def _decode(
    model: Gemma3, prompts: list[list[int]], steps: int, loop: bool
) -> tuple[list[torch.Tensor], Any, list[int]]:
    """Prefill ``prompts`` together, then ``steps`` greedy single-token steps."""
    model.decode_loop = loop
    kv = model.new_kv_cache()
    slots = [kv.allocate() for _ in prompts]
    logits = model.step([SeqChunk(s, p, 0) for s, p in zip(slots, prompts, strict=True)], kv)
    toks = logits.argmax(-1).tolist()
    hidden = []
    for _ in range(steps):
        chunks = [SeqChunk(s, [t], kv.seq_len(s)) for s, t in zip(slots, toks, strict=True)]
        h, _ = model.hidden_states(chunks, kv)
        hidden.append(h)
        toks = model.logits(h, argmax_only=True).argmax(-1).tolist()
    return hidden, kv, slots


def _assert_same(
    model: Gemma3, got: list[torch.Tensor], want: list[torch.Tensor], kv_a: Any, kv_b: Any,
    slots: list[int],
) -> None:  # fmt: skip
    """Every step's hidden states, and each slot's cache entries and positions, equal to
    the last bit."""
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    for s in slots:
        assert kv_a.seq_len(s) == kv_b.seq_len(s)
        for layer in range(model.config.num_layers):
            assert torch.equal(kv_a.keys(s, layer), kv_b.keys(s, layer))
            assert torch.equal(kv_a.positions(s, layer), kv_b.positions(s, layer))


@needs_loop
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 24])
def test_the_loop_equals_the_python_path_bit_for_bit(model: Gemma3, rows: int) -> None:
    """40 steps: past the cache's first capacity (32 entries, so buffers grow) and far
    past the sliding window (4, so sliding layers trim); the hidden states of every
    step, the cache's entries and their positions are equal to the last bit. Over 8
    rows the products are packed bf16 ones, where the CPU computes bf16 natively."""
    assert model._loop is not None
    if rows > model._loop.few_rows and not model._loop.many:
        pytest.skip("no packed bf16 products here: the loop serves at most 8 rows")
    spy = _spy(model)
    prompts = _prompts(rows, seed=rows)
    got, kv_loop, slots = _decode(model, prompts, 40, loop=True)
    assert spy.calls == 40
    want, kv_py, _ = _decode(model, prompts, 40, loop=False)
    assert spy.calls == 40  # the Python path did not call it
    _assert_same(model, got, want, kv_loop, kv_py, slots)


def _mixed(model: Gemma3, decoders: int, loop: bool) -> tuple[list[torch.Tensor], Any, list[int]]:
    """``decoders`` sequences decode while new prompts arrive beside them (a prompt chunk
    in every step; one sequence watched for SnapKV, one evicted: they take the general
    path inside the same steps)."""
    model.decode_loop = loop
    kv = model.new_kv_cache()
    r = random.Random(decoders)
    prompts = [[r.randrange(256) for _ in range(r.choice([3, 17, 40]))] for _ in range(decoders)]
    slots = [kv.allocate() for _ in prompts]
    model.step([SeqChunk(s, p, 0) for s, p in zip(slots, prompts, strict=True)], kv)
    kv.watch(slots[0], 2)
    keep = torch.tensor([[0, 1]] * model.config.num_kv_heads)
    for layer in range(model.config.num_layers):
        kv.retain(slots[1], layer, keep)
    hidden = []
    for step in range(12):
        late = kv.allocate()
        prompt = [r.randrange(256) for _ in range(1 + step % 5)]
        chunks = [SeqChunk(s, [r.randrange(256)], kv.seq_len(s)) for s in slots]
        at = step % (len(chunks) + 1)  # the prompt among the decodes: rows not consecutive
        h, _ = model.hidden_states([*chunks[:at], SeqChunk(late, prompt, 0), *chunks[at:]], kv)
        hidden.append(h)
        slots.append(late) if step % 3 == 0 else kv.free(late)
    return hidden, kv, slots


@needs_loop
@pytest.mark.parametrize("decoders", [3, 12])
def test_a_mixed_steps_plain_decodes_equal_the_python_path_bit_for_bit(
    model: Gemma3, decoders: int
) -> None:
    """Beside a prompt chunk, the plain decodes are stored and attended by the loop's
    op one layer at a time: hidden states and the cache equal the Python path's."""
    spy = _spy(model)
    got, kv_a, slots = _mixed(model, decoders, loop=True)
    assert spy.calls == 0
    assert spy.layer_calls == 12 * model.config.num_layers  # every layer of every step
    want, kv_b, _ = _mixed(model, decoders, loop=False)
    assert spy.layer_calls == 12 * model.config.num_layers
    _assert_same(model, got, want, kv_a, kv_b, slots)


@needs_loop
def test_steps_the_loop_cannot_serve_take_the_python_path(model: Gemma3) -> None:
    spy = _spy(model)
    kv = model.new_kv_cache()
    slots = [kv.allocate() for _ in range(10)]
    model.step([SeqChunk(s, [5, 6, 7], 0) for s in slots], kv)

    def decode(some: list[int]) -> None:
        model.hidden_states([SeqChunk(s, [9], kv.seq_len(s)) for s in some], kv)

    assert model._loop is not None
    model._loop.many = []  # the loop without packed bf16 products: at most 8 rows
    model._loop.max_rows = model._loop.few_rows
    decode(slots[:9])  # 9 rows: over the int8 kernel's 8
    late = kv.allocate()
    model.hidden_states(
        [SeqChunk(late, [1, 2, 3], 0), *(SeqChunk(s, [9], kv.seq_len(s)) for s in slots[:2])], kv
    )  # a prefill chunk beside the decodes
    kv.watch(slots[0], 2)  # a SnapKV window kept
    decode(slots[:2])
    kv.unwatch(slots[0])
    keep = torch.tensor([[0, 2]] * model.config.num_kv_heads)
    for layer in range(model.config.num_layers):
        kv.retain(slots[1], layer, keep)  # an evicted sequence
    decode(slots[:2])
    model.fused_norms = False
    decode(slots[2:4])
    model.fused_norms = True
    model.decode_loop = False
    decode(slots[2:4])
    assert spy.calls == 0
    model.decode_loop = True
    decode(slots[2:4])  # and a plain step again
    assert spy.calls == 1


def test_models_the_loop_does_not_serve_have_none(hf: Any, monkeypatch, caplog) -> None:
    assert engine_from_hf(hf, "fp32")._loop is None
    assert engine_from_hf(hf, "fast")._loop is None
    ext = decode_loop._EXT
    monkeypatch.setattr(ext, "_state", {})
    monkeypatch.setenv("DUETIME_LOOP", "0")
    with caplog.at_level(logging.WARNING, logger="duetime.engine.decode_loop"):
        model = engine_from_hf(hf, "q8")
    assert model._loop is None
    assert any("DUETIME_LOOP=0" in r.getMessage() for r in caplog.records)
    kv = model.new_kv_cache()
    slot = kv.allocate()
    model.step([SeqChunk(slot, [4, 5], 0)], kv)
    assert model.step([SeqChunk(slot, [6], 2)], kv, argmax_only=True).shape[0] == 1


@needs_loop
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_an_executor_answers_the_same_with_and_without_the_loop(hf: Any, seed: int) -> None:
    """Tight memory (preemptions), random evictions and suspensions: the answers and
    the cache's books are the same whether plain decode steps run in the loop."""
    from tests.engine_checks import CheckedEngine, EngineChaos

    r = random.Random(seed)
    jobs = []
    for rid in range(8):
        prompt = tuple(r.randrange(256) for _ in range(r.randint(1, 30)))
        req = Request(rid=rid, arrival=0.0, prompt_len=len(prompt), prompt_token_ids=prompt)
        jobs.append(Job(req, r.randint(1, 24)))

    def run(loop: bool) -> tuple[dict[int, list[int]], int]:
        model = engine_from_hf(hf, "q8")
        spy = _spy(model)
        model.decode_loop = loop
        ex = CheckedEngine(
            EngineChaos(seed, "recompute", 0.1), model, kv_capacity=120, max_num_seqs=4,
            max_batch_tokens=32, eviction="streaming", skip_idle=True,
        )  # fmt: skip
        res = ex.run([Job(j.request, j.output_len) for j in jobs], max_wall_s=30.0)
        assert not ex.kv.slots
        return res.outputs, spy.calls

    with_loop, calls = run(True)
    without, no_calls = run(False)
    assert calls > 0
    assert no_calls == 0
    assert with_loop == without
