"""The int4 ranking of the vocabulary (``q4_rank``) and the greedy steps that use it.

Kernel tests compare against a float64 product of the *same* quantised weights
and int8-quantised activations, so an error beyond summation rounding is a
kernel bug (nibble order, groups, padding, the −8 offset, threading), not
quantisation. They skip with a reason where the kernel cannot run here (no
compiler, or a CPU without AVX-512 VNNI); the fallback tests run either way.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from duetime.engine import SeqChunk, q4_rank
from duetime.engine.executor import EngineExecutor
from duetime.engine.linear import Q8Linear
from duetime.engine.q4_rank import GROUP, q4_available, q4_linear, quantize_q4
from duetime.engine.rescored_head import RescoredInt8Head
from duetime.engine.sampling import Sampler, SamplingParams
from duetime.engine.testing import engine_from_hf, tiny_hf_model
from tests.factories import on_threads

needs_q4 = pytest.mark.skipif(
    not q4_available(), reason="int4 kernel unavailable here (no g++/ninja or no AVX-512 VNNI)"
)

# odd sizes: inputs not a multiple of the 64-column group, one row, many rows
SHAPES = [(1, 1, 1), (1, 7, 13), (2, 5, 64), (3, 17, 65), (4, 64, 100), (6, 130, 7), (9, 33, 257)]


def _int8_rows(x: torch.Tensor) -> torch.Tensor:
    """The activations as the kernel quantises them: int8 per row, back in fp32."""
    most = x.abs().amax(dim=1, keepdim=True)
    scale = torch.where(most > 0, most / 127.0, torch.ones_like(most))
    return torch.round(x / scale) * scale


def test_quantize_round_trip_is_within_half_a_step_per_group() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(9, 150, generator=g) * torch.rand(9, 1, generator=g) * 3
    w[4] = 0.0  # an all-zero row (every group zero) must not divide by zero
    w[6, 64:128] = 0.0  # and so must one zero group in a row
    q = quantize_q4(w)
    assert q.packed.shape == (9, 3 * 32)  # 150 columns: 3 groups of 64, the last padded
    assert q.packed.dtype == torch.uint8
    assert q.scale.shape == (9, 3)
    assert q.scale.dtype == torch.float16
    v = q.int4()
    assert v.shape == (9, 150)
    assert int(v.min()) >= -8
    assert int(v.max()) <= 7
    assert int(v[0, :GROUP].abs().max()) == 7  # a group's largest entry maps to ±7
    step = q.scale.float().repeat_interleave(GROUP, dim=1)[:, :150]
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-6).all()
    assert torch.equal(q.dequantize()[4], torch.zeros(150))
    assert torch.equal(q.dequantize()[6, 64:128], torch.zeros(64))
    # the padded columns 150..191 hold the value 0 (nibble 8): they add nothing
    tail = q.packed.view(9, 3, 32)[:, 2].to(torch.int16)
    assert ((tail[:, 22:] & 15) == 8).all()
    assert ((tail >> 4) == 8).all()  # columns 160..191 of the last group


def test_quantize_rejects_non_matrices() -> None:
    with pytest.raises(ValueError, match="2-D"):
        quantize_q4(torch.randn(3, 4, 5))


@needs_q4
@pytest.mark.parametrize(("rows", "out", "inp"), SHAPES)
def test_kernel_matches_torch_on_the_same_quantised_operands(rows: int, out: int, inp: int) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + out + inp)
    w = torch.randn(out, inp, generator=g)
    x = torch.randn(rows, inp, generator=g) * 3
    q = quantize_q4(w)
    got = q4_linear(x, q)
    want = (_int8_rows(x).double() @ q.dequantize().double().T).float()
    assert got.shape == (rows, out)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@needs_q4
def test_kernel_takes_zero_rows_and_non_contiguous_inputs() -> None:
    g = torch.Generator().manual_seed(3)
    q = quantize_q4(torch.randn(40, 96, generator=g))
    x = torch.randn(96, 3, generator=g).T  # non-contiguous
    x[1] = 0.0  # an all-zero row: no division by zero, zero logits
    got = q4_linear(x, q)
    assert torch.equal(got[1], torch.zeros(40))
    assert torch.allclose(got, q4_linear(x.contiguous(), q))


@needs_q4
def test_kernel_result_does_not_depend_on_thread_count() -> None:
    g = torch.Generator().manual_seed(4)
    q = quantize_q4(torch.randn(5000, 640, generator=g))  # several tasks of 1,024 rows
    x = torch.randn(3, 640, generator=g)
    product = lambda: q4_linear(x, q)  # noqa: E731
    assert torch.equal(on_threads(1, product), on_threads(2, product))


@needs_q4
def test_kernel_rejects_mismatched_inputs() -> None:
    q = quantize_q4(torch.randn(8, 64))
    ops = q4_rank.q4_ops()
    with pytest.raises(RuntimeError, match="x has 65 columns"):
        ops.linear(torch.randn(1, 65), q.packed, q.scale)
    with pytest.raises(RuntimeError, match="scales must be"):
        ops.linear(torch.randn(1, 64), q.packed, q.scale.float())
    with pytest.raises(RuntimeError, match="2-D fp32"):
        ops.linear(torch.randn(1, 64).double(), q.packed, q.scale)


@needs_q4
def test_head_ranks_in_int4_only_for_argmax_steps_of_few_rows() -> None:
    """``argmax_only`` with at most ``coarse_rows`` rows: the int4 ranking, its top 64
    re-scored in fp32; otherwise (or with ``coarse_enabled`` off) the int8 ranking."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(1024, 128, generator=g)
    q = quantize_q4(w)
    head = RescoredInt8Head(w, coarse=q, coarse_rows=3)
    x = torch.randn(4, 128, generator=g)
    exact = x @ w.T
    coarse = head(x[:3], argmax_only=True)
    fine = head(x[:3])
    assert not torch.equal(coarse, fine)  # the int4 product really ran
    ranked = q4_linear(x[:3], q)
    top = ranked.topk(64, dim=-1).indices  # the int4 top 64: re-scored in fp32
    assert torch.allclose(coarse.gather(1, top), exact[:3].gather(1, top), atol=1e-4)
    rest = torch.ones_like(coarse, dtype=torch.bool).scatter_(1, top, False)
    assert torch.equal(coarse[rest], ranked[rest])  # the others: int4 values
    assert torch.equal(coarse.argmax(-1), exact[:3].argmax(-1))
    assert torch.equal(head(x, argmax_only=True), head(x))  # 4 rows > coarse_rows
    assert head.bytes_read(3, argmax_only=True) < head.bytes_read(3)
    head.coarse_enabled = False
    assert torch.equal(head(x[:3], argmax_only=True), fine)


@pytest.fixture(scope="module")
def hf() -> Any:
    return tiny_hf_model(seed=1)


@needs_q4
def test_q8_model_ranks_greedy_steps_in_int4_and_decodes_as_fp32(hf: Any) -> None:
    from duetime.engine import greedy_generate

    model = engine_from_hf(hf, "q8")
    assert isinstance(model.layers[0].qkv, Q8Linear)
    assert model.int4_ranking
    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(6)).tolist()
    kv = model.new_kv_cache()
    slot = kv.allocate()
    hidden, batch = model.hidden_states([SeqChunk(slot, ids, 0)], kv)
    last = hidden[batch.last_rows]
    assert not torch.equal(model.logits(last, argmax_only=True), model.logits(last))
    fp32 = engine_from_hf(hf, "fp32")
    assert greedy_generate(model, [ids], 16) == greedy_generate(fp32, [ids], 16)
    model.int4_ranking = False
    assert not model.int4_ranking
    assert torch.equal(model.logits(last, argmax_only=True), model.logits(last))
    assert not engine_from_hf(hf, "fast").int4_ranking  # q8 only


def test_without_the_kernel_q8_keeps_its_int8_ranking(hf: Any, monkeypatch, caplog) -> None:
    ext = q4_rank._EXT
    monkeypatch.setattr(ext, "_state", {})
    monkeypatch.setenv("DUETIME_Q4", "0")
    with caplog.at_level(logging.WARNING, logger="duetime.engine.q4_rank"):
        model = engine_from_hf(hf, "q8")
    assert not q4_available()
    assert not model.int4_ranking
    model.int4_ranking = True  # nothing to switch on
    assert not model.int4_ranking
    assert any("DUETIME_Q4=0" in r.getMessage() for r in caplog.records)
    x = torch.randn(2, hf.config.hidden_size)
    assert torch.equal(model.logits(x, argmax_only=True), model.logits(x))


@pytest.mark.parametrize(
    ("sampled", "argmax_only"),
    [(None, True), (SamplingParams(temperature=0.7, seed=1), False)],
)
def test_executor_asks_for_argmax_only_steps_unless_a_row_samples(
    hf: Any, sampled: SamplingParams | None, argmax_only: bool
) -> None:
    from duetime.core.request import Job, Request
    from duetime.policies import make_policy

    model = engine_from_hf(hf, "q8")
    seen: list[bool] = []  # per step: whether it read only each row's arg-max
    step, greedy_step = model.step, model.greedy_step

    def spy(chunks: Any, kv: Any, **kw: Any) -> torch.Tensor:
        seen.append(kw.get("argmax_only", False))
        return step(chunks, kv, **kw)

    def spy_greedy(chunks: Any, kv: Any) -> torch.Tensor:
        seen.append(True)
        return greedy_step(chunks, kv)

    model.step = spy  # type: ignore[method-assign]
    model.greedy_step = spy_greedy  # type: ignore[method-assign]
    ex = EngineExecutor(make_policy("fcfs"), model, kv_capacity=4096)
    req = Request(rid=0, arrival=0.0, prompt_len=5, prompt_token_ids=(5, 6, 7, 8, 9), max_tokens=6)
    greedy = Request(rid=1, arrival=0.0, prompt_len=3, prompt_token_ids=(4, 5, 6), max_tokens=6)
    if sampled is not None:
        ex.samplers[0] = Sampler(sampled)
    ex.run([Job(req, 6), Job(greedy, 6)])
    assert seen
    assert set(seen) == {argmax_only}
