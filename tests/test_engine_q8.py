"""The ``q8`` dtype on the tiny random-weight Gemma 3: decode close to fp32, the output
layer's ranking by row count, prefill equal to ``fast``, bf16 rows, the fallback without
a compiler, the stored weights, the bench and the CLI, and the real Gemma 3 close to
fp32. The kernel itself: ``test_q8_kernel.py``.
"""

from __future__ import annotations

import logging

import pytest
import torch

from duetime.engine import SeqChunk, q8_kernel
from duetime.engine.linear import DenseLinear, Q8Linear, q8_or
from duetime.engine.q4_rank import q4_available
from duetime.engine.q8_kernel import q8_available
from duetime.engine.testing import engine_from_hf, tiny_hf_model

needs_kernel = pytest.mark.skipif(
    not q8_available(), reason="int8 kernel could not be built here (no g++/ninja or no AVX2)"
)


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model(seed=0)


def _prefill_logits(model, ids: list[int]) -> torch.Tensor:
    kv = model.new_kv_cache()
    return model.step([SeqChunk(kv.allocate(), ids, 0)], kv, all_logits=True)


def _decode_logits(model, ids: list[int]) -> torch.Tensor:
    """Feed ``ids`` one token per step: every product has one row (the kernel's case)."""
    kv = model.new_kv_cache()
    slot = kv.allocate()
    rows = [model.step([SeqChunk(slot, [t], i)], kv)[0] for i, t in enumerate(ids)]
    return torch.stack(rows)


@needs_kernel
def test_q8_decode_stays_close_to_fp32(hf) -> None:
    ids = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(9)).tolist()
    ref = _decode_logits(engine_from_hf(hf, "fp32"), ids)
    model = engine_from_hf(hf, "q8")
    assert isinstance(model.layers[0].qkv, Q8Linear)
    got = _decode_logits(model, ids)
    assert not torch.equal(got, ref)  # the int8 path really ran
    cosine = torch.nn.functional.cosine_similarity(got, ref, dim=-1).min()
    assert cosine > 0.999
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()


@needs_kernel
def test_q8_output_layer_ranks_with_the_kernel_for_two_rows_and_int8_gemms_beyond(hf) -> None:
    """The output layer's ranking product: the int8 kernel for 1-2 rows, fbgemm's int8
    GEMM from 3 (faster there on the real 262,144-row weight) and, where the CPU has
    AMX or VNNI, oneDNN's from 12; the layers keep 8."""
    from duetime.engine.linear import Q8_HEAD_MAX_ROWS, ByRows, Int8Linear
    from duetime.engine.onednn_int8 import (
        ONEDNN_HEAD_MIN_ROWS,
        OneDnnInt8Linear,
        onednn_int8_available,
    )
    from duetime.engine.rescored_head import RescoredInt8Head

    model = engine_from_hf(hf, "q8")
    head = model.lm_head
    assert isinstance(head, RescoredInt8Head)
    rank = head._int8
    assert isinstance(rank, Q8Linear)
    assert rank.max_rows == Q8_HEAD_MAX_ROWS == 2
    assert model.layers[0].qkv.max_rows == 8
    gemm = rank.fallback
    x = torch.randn(ONEDNN_HEAD_MIN_ROWS, rank.q.in_features)
    assert torch.equal(rank(x[:3]), gemm(x[:3]))  # 3 rows: the GEMM's product
    assert not torch.equal(rank(x[:2]), gemm(x[:2]))  # 2: the kernel's
    if not onednn_int8_available():
        assert isinstance(gemm, Int8Linear)
        return
    assert isinstance(gemm, ByRows)
    assert isinstance(gemm.few, Int8Linear)
    assert isinstance(gemm.many, OneDnnInt8Linear)
    few, many = x[: ONEDNN_HEAD_MIN_ROWS - 1], x[:ONEDNN_HEAD_MIN_ROWS]
    assert torch.equal(gemm(few), gemm.few(few))
    assert torch.equal(gemm(many), gemm.many(many))
    assert not torch.equal(gemm.few(many), gemm.many(many))  # two different kernels


def test_q8_prefill_equals_fast(hf) -> None:
    # a 40-row step exceeds the kernel's row limit: without bf16 rows, layers and output
    # layer take the same fp32 / fbgemm path as `fast`, bit for bit (kernel built or not)
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    fast = _prefill_logits(engine_from_hf(hf, "fast"), ids)
    assert torch.equal(_prefill_logits(engine_from_hf(hf, "q8", bf16_rows=False), ids), fast)


def test_q8_bf16_rows_take_many_row_steps_only(hf, native) -> None:
    """With ``bf16_rows`` a 40-row prefill multiplies in bf16: close to fp32, not equal;
    one-row steps still take the int8 kernel (or fp32) exactly as without it."""
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    fast = engine_from_hf(hf, "fast")
    model = engine_from_hf(hf, "q8", bf16_rows=True)
    assert model.bf16_rows
    ref, got = _prefill_logits(fast, ids), _prefill_logits(model, ids)
    assert not torch.equal(got, ref)  # the bf16 path really ran
    assert torch.nn.functional.cosine_similarity(got, ref, dim=-1).min() > 0.999
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
    # its prompt chunks attend in bf16 too: the logits move, and stay as close
    assert model.prefill_attention_dtype == torch.bfloat16
    model.prefill_attention_dtype = None
    fp32_attention = _prefill_logits(model, ids)
    assert not torch.equal(fp32_attention, got)
    assert torch.nn.functional.cosine_similarity(fp32_attention, ref, dim=-1).min() > 0.999
    model.prefill_attention_dtype = torch.bfloat16
    plain = engine_from_hf(hf, "q8", bf16_rows=False)
    assert plain.prefill_attention_dtype is None
    # the KV cache follows the rows (bf16 with them, fp32 without); with the cache's
    # dtype the same, one-row steps are the same
    assert (model.kv_dtype, plain.kv_dtype) == (torch.bfloat16, torch.float32)
    plain = engine_from_hf(hf, "q8", bf16_rows=False, bf16_kv=True)
    one = list(range(3, 9))
    assert torch.equal(_decode_logits(model, one), _decode_logits(plain, one))
    # the default follows the CPU: bf16 rows where it computes bf16 natively
    native(True)
    assert engine_from_hf(hf, "q8").bf16_rows
    native(False)
    assert not engine_from_hf(hf, "q8").bf16_rows
    assert not engine_from_hf(hf, "fast", bf16_rows=True).bf16_rows  # q8 only


def test_without_a_compiler_q8_warns_once_and_runs_as_fast(hf, monkeypatch, caplog) -> None:
    def no_compiler() -> None:
        raise RuntimeError("Ninja is required to load C++ extensions")

    ext = q8_kernel._EXT
    monkeypatch.setattr(ext, "_state", {})
    monkeypatch.setattr(ext, "build", no_compiler)
    with caplog.at_level(logging.WARNING, logger="duetime.engine.q8_kernel"):
        model = engine_from_hf(hf, "q8", bf16_rows=False)
        assert not q8_available()
    warnings = [r for r in caplog.records if "int8 weight-only kernel" in r.getMessage()]
    assert len(warnings) == 1
    assert "Ninja is required" in warnings[0].getMessage()
    w = torch.randn(4, 8)
    fallback = DenseLinear(w, torch.float32)
    assert q8_or(w, fallback) is fallback
    ids = list(range(3, 15))
    fast = engine_from_hf(hf, "fast")
    assert torch.equal(_decode_logits(model, ids), _decode_logits(fast, ids))


def test_q8_store_round_trips_and_rejects_bad_files(tmp_path, caplog) -> None:
    from duetime.engine.q8_cache import Q8Store, q8_cache_path

    path = q8_cache_path(tmp_path / "model-10-20-v2.safetensors")
    assert path.name == "model-10-20-v2.q8-v1.safetensors"
    g = torch.Generator().manual_seed(6)
    a, b = torch.randn(9, 13, generator=g), torch.randn(4, 8, generator=g)
    store = Q8Store(path)
    qa = store.quantize("a", a)
    store.quantize("b", b)
    assert store.dirty
    store.save()
    again = Q8Store(path)
    got = again.quantize("a", a)
    assert not again.dirty  # served from the file, nothing quantised
    assert torch.equal(got.packed, qa.packed)
    assert torch.equal(got.scale, qa.scale)
    assert (got.out_features, got.in_features) == (9, 13)
    # a weight of another shape under the same name is quantised afresh
    assert again.quantize("b", torch.randn(5, 8)).out_features == 5
    assert again.dirty
    # an older file of the same GGUF is removed when a new one is written
    newer = q8_cache_path(tmp_path / "model-10-21-v2.safetensors")
    fresh = Q8Store(newer)
    fresh.quantize("a", a)
    fresh.save()
    assert newer.exists()
    assert not path.exists()
    newer.write_bytes(b"not a safetensors file")
    with caplog.at_level(logging.WARNING, logger="duetime.engine.q8_cache"):
        broken = Q8Store(newer)
    assert "unreadable int8 weight cache" in caplog.text
    broken.quantize("a", a)
    assert broken.dirty


@needs_kernel
def test_bench_scores_q8_on_its_decode_path(hf) -> None:
    from duetime.bench import engine_speed
    from duetime.engine.config import Gemma3Config

    ref, q8 = engine_from_hf(hf, "fp32"), engine_from_hf(hf, "q8")
    prompts = [[2, 5, 9, 14], [2, 77, 3]]
    share_self, n = engine_speed.agreement(ref, ref, prompts, 6)
    assert (share_self, n) == (1.0, 12)  # decode-by-decode scoring reproduces fp32's own picks
    assert engine_speed.agreement(ref, q8, prompts, 6)[0] >= 0.9
    source = (Gemma3Config.from_hf(hf.config), dict(hf.state_dict()))
    fig = engine_speed.run(
        source,
        quick=True,
        engines=("fp32", "q8"),
        prefill_tokens=(8,),
        batch_sizes=(1, 16),
        context=8,
        steps=1,
        reps=1,
        transformers=(),
        progress=False,
    )
    q8_mb = fig["variants"]["q8"]["weight_mb_by_batch"]
    fp32_mb = fig["variants"]["fp32"]["weight_mb_by_batch"]
    assert q8_mb[1] < 0.5 * fp32_mb[1]  # int8 kernel at one row
    assert q8_mb[16] > q8_mb[1]  # 16 rows: fp32 layers, fbgemm int8 head
    assert "q8" in fig["agreement"]


@needs_kernel
def test_kernel_microbenchmark_reports_units_and_roofline(tmp_path) -> None:
    import json

    from duetime.bench import q8_kernel_speed

    fig = q8_kernel_speed.run((1, 3), layers=1, reps=1, head=False, probe_mb=16)
    assert [c["rows"] for c in fig["cells"]] == [1, 3]
    for c in fig["cells"]:
        assert c["q8_weight_mb"] < 0.3 * c["fp32_weight_mb"]  # int8 + one scale per row
        assert c["roofline_ms"] == pytest.approx(
            c["q8_weight_mb"] / 1e3 / fig["memory_bandwidth_gb_s"] * 1e3
        )
        assert c["q8_ms"] > 0
        assert c["roofline_fraction"] == pytest.approx(c["roofline_ms"] / c["q8_ms"])
    q8_kernel_speed.main(
        [
            "--rows",
            "1",
            "--reps",
            "1",
            "--layers",
            "1",
            "--no-head",
            "--json",
            str(tmp_path / "k.json"),
        ]
    )
    assert json.loads((tmp_path / "k.json").read_text())["cells"][0]["rows"] == 1
    with pytest.raises(SystemExit):
        q8_kernel_speed.main(["--rows", "0"])


def test_cli_names_q8_among_the_dtypes_and_serve_defaults_to_it() -> None:
    import inspect

    from typer.testing import CliRunner

    from duetime.cli import app
    from duetime.cli.serve import serve

    res = CliRunner().invoke(app, ["serve", "--model", "tiny", "--dtype", "q4"])
    assert res.exit_code == 2
    assert "q4" in res.output
    assert "q8" in res.output  # the message lists the accepted dtypes
    assert inspect.signature(serve).parameters["dtype"].default == "q8"


@needs_kernel
@pytest.mark.real_model
def test_real_gemma3_q8_decodes_like_fp32() -> None:
    from duetime.engine import greedy_generate
    from duetime.engine.gemma3 import Gemma3
    from duetime.engine.q8_cache import Q8Store, q8_cache_path
    from duetime.engine.weights import cache_path, default_gguf_path, load_weights
    from duetime.tokenizer import encode

    cfg, weights = load_weights(progress=False)
    store = Q8Store(q8_cache_path(cache_path(default_gguf_path())))  # what load_model uses
    q8 = Gemma3(cfg, weights, "q8", q8_quantize=store.quantize)
    fp32 = Gemma3(cfg, weights, "fp32")
    ids = encode("The capital of France is")
    assert ids[0] == cfg.bos_token_id
    # greedy decoding: every step after the prompt is a one-row product (the kernel),
    # ranked in int4 where the CPU has VNNI (q4_rank), re-scored in fp32
    assert q8.int4_ranking == q4_available()
    assert greedy_generate(q8, [ids], 8) == greedy_generate(fp32, [ids], 8)
    layer = q8.layers[0].gate_up
    assert isinstance(layer, Q8Linear)
    assert layer.q.nbytes < 0.26 * 4 * layer.q.out_features * layer.q.in_features
