"""The fine-tuned RLP (``minilm-ft``): token bundle, LoRA training, resumption, model file,
and the predictor's CPU path. Real MiniLM weights cut to one layer and 16 word pieces."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from duetime.predict.epoch_loop import CheckpointError
from duetime.predict.length_features import MiniLMEncoder
from duetime.predict.length_finetune import train_finetuned_rlp
from duetime.predict.length_ft_encoder import FinetunedMiniLMEncoder, parse_ft_spec
from duetime.predict.length_model import LengthModel
from duetime.predict.length_predictor import LearnedLengthPredictor
from duetime.predict.length_tokens import BUNDLE_TOKENS, TokenBundle, pack
from duetime.predict.precision import resolve_precision
from tests.length_bundles import CFG, make_bundle, synthetic_texts


@pytest.fixture(scope="module")
def data() -> tuple[list[str], TokenBundle]:
    texts, out = synthetic_texts()
    return texts, make_bundle(texts, out)


@pytest.fixture(scope="module")
def trained(data):
    return train_finetuned_rlp(data[1], CFG, progress=False, threads=1)


def test_fine_tuning_learns_the_signal_and_calibrates(data, trained):
    _, bundle = data
    m = trained.meta["test_metrics"]["median"]
    y = bundle.output_len[bundle.splits["test"]]
    const_mae = np.mean(np.abs(y - np.median(bundle.output_len[bundle.splits["train"]])))
    assert m["mae_tokens"] < 0.5 * const_mae
    assert trained.adapters  # LoRA A and B of every adapted linear layer
    n_modules = {k.rsplit(".", 1)[0] for k in trained.adapters}
    assert len(n_modules) == 6  # query, key, value, attention/out, intermediate, output dense
    assert trained.meta["best_epoch"] >= 1
    assert len(trained.conformal_scores) == len(bundle.splits["calib"])


def test_model_file_round_trips_and_the_predictor_reads_text(data, trained, tmp_path):
    texts, bundle = data
    path = trained.save(tmp_path / "ft.npz")
    back = LengthModel.load(path)
    assert back.config == trained.config
    assert set(back.adapters) == set(trained.adapters)
    for k, v in trained.adapters.items():
        assert np.array_equal(back.adapters[k], v), k

    assert back.infer_precision == trained.meta["infer_precision"]
    assert back.infer_precision == resolve_precision("auto", "cpu")
    rows = bundle.splits["test"]
    enc = back.encoder()
    assert enc.precision == back.infer_precision
    from_ids = enc.encode_ids(bundle.seqs(rows))
    from_text = enc.encode([texts[r] for r in rows])
    np.testing.assert_allclose(from_text, from_ids, atol=1e-5)  # same features either way

    pred = LearnedLengthPredictor(back, use_cache=False)
    got = pred.predict_texts([texts[r] for r in rows], bundle.prompt_len[rows], 512)
    want = back.predict(from_ids, bundle.prompt_len[rows], 512)
    np.testing.assert_allclose([g.point for g in got], want.point, rtol=1e-6)
    # the figures stored at training time are the ones this file reproduces
    y = bundle.output_len[rows]
    mae = float(np.mean(np.abs(np.asarray([g.point for g in got]) - y)))
    assert mae == pytest.approx(trained.meta["test_metrics"]["median"]["mae_tokens"], rel=1e-5)


def test_adapters_change_the_encoder(data, trained):
    _, bundle = data
    seqs = bundle.seqs(bundle.splits["test"][:8])
    tuned = FinetunedMiniLMEncoder(16, 1, trained.adapters).encode_ids(seqs)
    zero = {k: np.zeros_like(v) for k, v in trained.adapters.items()}
    base = FinetunedMiniLMEncoder(16, 1, zero).encode_ids(seqs)
    assert not np.allclose(tuned[:, :384], base[:, :384], atol=1e-4)  # contextual half moved
    np.testing.assert_array_equal(tuned[:, 384:], base[:, 384:])  # static half is frozen


def test_resume_from_checkpoint_equals_uninterrupted(data, tmp_path):
    _, bundle = data
    cfg = replace(CFG, epochs=3)
    whole = train_finetuned_rlp(bundle, cfg, progress=False, threads=1)
    ckpt = tmp_path / "ft.ckpt"
    train_finetuned_rlp(bundle, cfg, checkpoint=ckpt, progress=False, stop_after=1, threads=1)
    assert ckpt.exists()
    resumed = train_finetuned_rlp(
        bundle, cfg, checkpoint=ckpt, resume=True, progress=False, threads=1
    )
    assert resumed.meta["epochs_run"] == 3
    for k, v in whole.adapters.items():
        assert np.array_equal(v, resumed.adapters[k]), k
    assert np.array_equal(whole.weights.w2, resumed.weights.w2)
    with pytest.raises(CheckpointError, match="lora_rank"):
        train_finetuned_rlp(
            bundle, replace(cfg, lora_rank=4), checkpoint=ckpt, resume=True, progress=False
        )
    other = "fp32" if resumed.meta["trained_precision"] == "bf16" else "bf16"
    with pytest.raises(CheckpointError, match="precision"):
        train_finetuned_rlp(
            bundle, cfg, checkpoint=ckpt, resume=True, progress=False, precision=other
        )


def test_fp32_and_bf16_training_both_learn_and_infer_as_calibrated(data, native):
    native(True)
    texts, bundle = data
    cfg = replace(CFG, epochs=3)
    rows = bundle.splits["test"]
    y = bundle.output_len[rows]
    maes = {}
    for p in ("fp32", "bf16"):
        model = train_finetuned_rlp(bundle, cfg, progress=False, threads=1, precision=p)
        assert model.meta["infer_precision"] == p  # an explicit precision holds at inference too
        maes[p] = model.meta["test_metrics"]["median"]["mae_tokens"]
        pred = LearnedLengthPredictor(model, use_cache=False)
        assert pred.encoder.precision == p
        got = pred.predict_texts([texts[r] for r in rows], bundle.prompt_len[rows], 512)
        mae = float(np.mean(np.abs(np.asarray([g.point for g in got]) - y)))
        assert mae == pytest.approx(maes[p], rel=1e-5), p  # the predictor runs what was scored
    const_mae = np.mean(np.abs(y - np.median(bundle.output_len[bundle.splits["train"]])))
    assert max(maes.values()) < 0.5 * const_mae, maes


def test_bf16_inference_is_close_to_fp32_under_its_own_identity(data, trained):
    _, bundle = data
    seqs = bundle.seqs(bundle.splits["test"])
    fp32 = FinetunedMiniLMEncoder(16, 1, trained.adapters, precision="fp32")
    bf16 = FinetunedMiniLMEncoder(16, 1, trained.adapters, precision="bf16")
    a, b = fp32.encode_ids(seqs), bf16.encode_ids(seqs)
    assert a.dtype == b.dtype == np.float32
    assert not np.array_equal(a, b)  # it did run in bfloat16
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    assert cos.min() > 0.999, cos.min()
    # the embedding cache keys on identity: fp32 keeps the one it always had
    assert fp32.identity.endswith(":v1")
    assert bf16.identity == fp32.identity + ":bf16"
    with pytest.raises(ValueError, match="precision must be one of"):
        FinetunedMiniLMEncoder(16, 1, trained.adapters, precision="fp16")


def test_bf16_encoder_equals_autocast_over_the_float32_weights(data, trained):
    """It casts the linear weights once instead of autocast casting them per call: same bits."""
    import torch

    from duetime.predict.length_ft_encoder import load_base, merge_adapters, pooled_features

    _, bundle = data
    bf16 = FinetunedMiniLMEncoder(16, 1, trained.adapters, precision="bf16")
    plain = load_base(1)
    merge_adapters(plain, trained.adapters)
    for seq in bundle.seqs(bundle.splits["test"][:6]):
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            want = pooled_features(plain, [seq], 16).numpy()
        np.testing.assert_array_equal(bf16.encode_ids([seq]), want)


def test_a_bf16_model_runs_in_fp32_where_bf16_is_not_native(data, trained, native, caplog):
    texts, bundle = data
    model = LengthModel(
        trained.config,
        trained.weights,
        trained.conformal_scores,
        dict(trained.meta, infer_precision="bf16"),
        trained.adapters,
    )
    native(False)
    with caplog.at_level("WARNING"):
        pred = LearnedLengthPredictor(model, use_cache=False)
    assert pred.encoder.precision == "fp32"
    assert "does not compute natively" in caplog.text
    rows = bundle.splits["test"][:5]
    assert len(pred.predict_texts([texts[r] for r in rows], bundle.prompt_len[rows], 512)) == 5
    native(True)
    assert model.encoder().precision == "bf16"


def test_files_without_a_recorded_precision_infer_in_fp32(trained, tmp_path):
    from duetime.predict.length_features import make_encoder

    old = LengthModel(
        trained.config,
        trained.weights,
        trained.conformal_scores,
        {k: v for k, v in trained.meta.items() if k != "infer_precision"},
        trained.adapters,
    )
    back = LengthModel.load(old.save(tmp_path / "old.npz"))
    assert back.infer_precision == "fp32"
    assert back.encoder().precision == "fp32"
    with pytest.raises(ValueError, match="runs in fp32 only"):
        make_encoder("minilm-static:512", precision="bf16")


def test_bundle_round_trip_and_bad_files(data, tmp_path):
    _, bundle = data
    back = TokenBundle.load(bundle.save(tmp_path / "b.npz"))
    assert back.dataset == bundle.dataset
    assert [s.tolist() for s in back.seqs(np.arange(5))] == [
        s.tolist() for s in bundle.seqs(np.arange(5))
    ]
    for k in bundle.splits:
        assert np.array_equal(back.splits[k], bundle.splits[k])
    other = tmp_path / "other.npz"
    np.savez(other, x=np.zeros(3))
    with pytest.raises(ValueError, match="not a duetime token bundle"):
        TokenBundle.load(other)


def test_fine_tuned_encoder_specs():
    assert parse_ft_spec("minilm-ft") == (128, 3)
    assert parse_ft_spec("minilm-ft:64") == (64, 3)
    assert parse_ft_spec("minilm-ft:64:6") == (64, 6)
    for bad in ("minilm-ft:1", "minilm-ft:64:7", "minilm-ft:x", "minilm-ft:1:2:3"):
        with pytest.raises(ValueError, match="minilm-ft"):
            parse_ft_spec(bad)
    from duetime.predict.length_features import make_encoder

    with pytest.raises(ValueError, match="needs a model file's adapters"):
        make_encoder("minilm-ft:64")


def test_cli_fine_tunes_from_a_bundle_and_rejects_bad_options(data, tmp_path):
    import json

    from typer.testing import CliRunner

    from duetime.cli import app

    _, bundle = data
    b = bundle.save(tmp_path / "b.npz")
    out, js = tmp_path / "m.npz", tmp_path / "m.json"
    args = ["predict", "train-length", "--encoder", "minilm-ft:16:1", "--bundle", str(b),
            "--max-len", "512", "--hidden", "16", "--epochs", "2", "--batch-size", "16",
            "--lr", "0.03", "--lora-rank", "2", "--precision", "fp32", "--out", str(out),
            "--json", str(js)]  # fmt: skip
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "median: MAE" in r.output
    model = LengthModel.load(out)
    assert model.adapters
    assert model.config.dropout == 0.1  # minilm-ft's default, not the head's 0.2
    assert model.meta["trained_precision"] == "fp32"
    assert json.loads(js.read_text())["meta"]["epochs_run"] == 2
    assert not out.with_name(out.name + ".ckpt").exists()  # removed once the file is saved

    bad = {
        "--precision": (["--precision", "fp16"], "precision (--precision) must be one of"),
        "--bundle": (["--encoder", "minilm-static:512"], "--bundle feeds a fine-tuned encoder"),
        "--all-turns": (["--all-turns"], "a --bundle has its rows already"),
    }
    for opt, (extra, needle) in bad.items():
        r = CliRunner().invoke(app, [*args[:-4], "--out", str(tmp_path / "x.npz"), *extra])
        assert r.exit_code == 2, (opt, r.output)
        assert needle in r.output, (opt, r.output)
        assert not (tmp_path / "x.npz").exists()


def test_later_turns_become_train_rows_only(tmp_path, monkeypatch):
    import json

    from duetime.predict.length_tokens import with_later_turns
    from duetime.workloads import sharegpt

    class Words:
        identity = "words"

        def count(self, texts, *, add_bos=False):
            return np.asarray([len(t.split()) + add_bos for t in texts], dtype=np.int64)

    monkeypatch.setenv("DUETIME_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(sharegpt, "_MEMORY", {})

    def chat(*texts):
        return [{"from": ("human", "gpt")[i % 2], "value": t} for i, t in enumerate(texts)]

    convs = [
        {"id": "a", "conversations": chat("first a", "x y", "now shorter", "x", "long", "w " * 9)},
        {"id": "b", "conversations": chat("first b", "x y z", "continue", "u v w")},
        {"id": "c", "conversations": chat("first c", "x", "held out follow-up", "x y")},
    ]  # fmt: skip
    path = tmp_path / "chats.json"
    path.write_text(json.dumps(convs), encoding="utf-8")
    lengths = sharegpt.load_sharegpt_lengths(path, counter=Words(), progress=False)
    words = MiniLMEncoder(BUNDLE_TOKENS, static=True)
    ids, off = pack(words.token_ids(["first a", "first b", "first c"]))
    empty = np.empty(0, dtype=np.int64)
    splits = {"train": np.asarray([0, 1]), "val": empty, "calib": empty, "test": np.asarray([2])}
    base = TokenBundle(ids, off, lengths.prompt_len,
                       lengths.output_len, splits, "chats", words.identity)  # fmt: skip

    more = with_later_turns(base, lengths, Words(), words, max_len=8)
    assert list(more.splits["train"]) == [0, 1, 3, 4]  # a's 2nd pair, b's 2nd; a's 3rd > 8 tokens
    assert list(more.splits["test"]) == [2]  # c's follow-up is never added
    assert list(more.output_len[3:]) == [1, 3]
    assert list(more.prompt_len[3:]) == [2 + 1, 1 + 1]
    want = words.token_ids(["now shorter", "continue"])
    assert [s.tolist() for s in more.seqs(np.asarray([3, 4]))] == [list(w) for w in want]
    assert [s.tolist() for s in more.seqs(np.arange(3))] == [
        s.tolist() for s in base.seqs(np.arange(3))
    ]
    assert more.dataset == "chats|all turns"

    class Other(Words):
        identity = "other"

    with pytest.raises(ValueError, match="not the one the rows were counted with"):
        with_later_turns(base, lengths, Other(), words, max_len=8)
    with pytest.raises(ValueError, match="are not the bundle's"):
        with_later_turns(base, lengths, Words(), MiniLMEncoder(64, static=True), max_len=8)


def test_cli_all_turns_is_for_fine_tuning_only(tmp_path):
    from typer.testing import CliRunner

    from duetime.cli import app

    out = tmp_path / "x.npz"
    args = ["predict", "train-length", "--encoder", "minilm-static:512", "--all-turns"]
    r = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert r.exit_code == 2, r.output
    assert "--all-turns feeds a fine-tuned encoder only" in r.output
    assert not out.exists()
