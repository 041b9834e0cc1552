"""Training, resumption, the versioned model file, and the data split."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from duetime.predict.epoch_loop import CheckpointError
from duetime.predict.length_data import LengthData, conversation_groups, merge_groups, split_rows
from duetime.predict.length_fit import train_rlp
from duetime.predict.length_model import (
    MODEL_VERSION,
    LengthModel,
    ModelVersionError,
    RLPConfig,
)

CFG = RLPConfig(
    bucket_size=16, max_len=512, encoder="test", hidden=16, epochs=8, batch_size=64, lr=1e-2
)


def synthetic_data(n: int = 600, dim: int = 8, seed: int = 0) -> LengthData:
    """Embeddings whose first coordinate sets the answer length; 4 rows per 'conversation'."""
    rng = np.random.default_rng(seed)
    emb = rng.normal(size=(n, dim)).astype(np.float32)
    out = np.clip(np.exp(5.0 + 0.8 * emb[:, 0] + rng.normal(0, 0.3, n)), 1, 500).astype(np.int64)
    plen = rng.integers(5, 400, n)
    groups = np.asarray([f"c{i // 4}" for i in range(n)])
    return LengthData(emb, plen, out, split_rows(groups, seed=0), encoder="test", dataset="syn")


def test_split_is_by_conversation_seeded_and_complete():
    parts = ["a_0", "a_1", "b_0", "c", "d_0", "d_12", "e"]  # a and d have several parts
    conv = np.asarray(
        [p.replace("_", f"{k}_") if "_" in p else f"{p}{k}" for k in range(30) for p in parts]
    )
    groups = conversation_groups(conv)
    assert len(set(groups)) == 5 * 30
    splits = split_rows(groups, seed=3)
    rows = np.sort(np.concatenate(list(splits.values())))
    assert rows.tolist() == list(range(len(conv)))
    where = {g: name for name, r in splits.items() for g in groups[r]}
    for name, r in splits.items():
        assert all(where[g] == name for g in groups[r])  # no conversation straddles two splits
    again = split_rows(groups, seed=3)
    assert all(np.array_equal(splits[k], again[k]) for k in splits)


def test_duplicated_chats_share_a_split_whatever_their_ids():
    # 40 conversations; conversation k and k + 20 are the same chat shared under two ids,
    # and one chat (key 99) also appears inside conversations 5 and 7.
    groups = np.asarray([f"c{k}" for k in range(40)])
    keys = np.asarray([k % 20 for k in range(40)])
    keys[[5, 7]] = 99
    merged = merge_groups(groups, keys)
    assert merged[3] == merged[23] == "c23"  # the smaller name, compared as strings
    assert merged[5] == merged[7]
    assert len(set(merged)) == 21  # 18 pairs, {5, 7}, and 25 and 27 alone
    for seed in range(5):
        splits = split_rows(merged, seed=seed)
        where = {int(r): name for name, rows in splits.items() for r in rows}
        for k in set(range(20)) - {5, 7}:
            assert where[k] == where[k + 20]
        assert where[5] == where[7]
    # Without the keys, ids alone split some copies apart: the assertions above can fail.
    where = {int(r): n for n, rows in split_rows(groups, seed=0).items() for r in rows}
    assert any(where[k] != where[k + 20] for k in range(20))


def test_training_learns_and_saves_a_small_file(tmp_path):
    data = synthetic_data()
    rlp = train_rlp(data, CFG, progress=False)
    m = rlp.meta["test_metrics"]["median"]
    const_mae = np.mean(np.abs(data.part("test")[2] - np.median(data.part("train")[2])))
    assert m["mae_tokens"] < const_mae  # the signal in emb[:, 0] is found
    path = rlp.save(tmp_path / "m.npz")
    assert path.stat().st_size < 50_000
    back = LengthModel.load(path)
    emb, plen, _ = data.part("test")
    a = rlp.predict(emb, plen, 512)
    b = back.predict(emb, plen, 512)
    assert np.array_equal(a.point, b.point)
    assert np.array_equal(a.hi, b.hi)
    assert back.config == rlp.config


def test_resume_from_checkpoint_equals_uninterrupted(tmp_path):
    data = synthetic_data()
    whole = train_rlp(data, CFG, progress=False)
    ckpt = tmp_path / "run.ckpt"
    train_rlp(data, CFG, checkpoint=ckpt, progress=False, stop_after=2)  # "interrupted"
    assert ckpt.exists()
    resumed = train_rlp(data, CFG, checkpoint=ckpt, resume=True, progress=False)
    assert resumed.meta["epochs_run"] == CFG.epochs
    for name, arr in whole.weights.arrays().items():
        assert np.array_equal(arr, resumed.weights.arrays()[name]), name
    assert np.array_equal(whole.conformal_scores, resumed.conformal_scores)


def test_resume_with_other_settings_is_refused(tmp_path):
    data = synthetic_data()
    ckpt = tmp_path / "run.ckpt"
    train_rlp(data, CFG, checkpoint=ckpt, progress=False, stop_after=1)
    changed = replace(CFG, hidden=32)
    with pytest.raises(CheckpointError, match="hidden: 16 -> 32"):
        train_rlp(data, changed, checkpoint=ckpt, resume=True, progress=False)


def _rewrite_header(src, dst, **changes):
    with np.load(src) as data:
        arrays = {k: data[k] for k in data.files}
    header = json.loads(str(arrays["header"])) | changes
    arrays["header"] = np.asarray(json.dumps(header))
    np.savez(dst, **arrays)


def test_model_of_another_version_gives_a_clear_error(tmp_path):
    path = train_rlp(synthetic_data(), CFG, progress=False).save(tmp_path / "m.npz")
    for other in (MODEL_VERSION - 1, MODEL_VERSION + 1):  # an old file, and a newer one
        _rewrite_header(path, tmp_path / "other.npz", version=other)
        with pytest.raises(
            ModelVersionError,
            match=rf"version {other}, but this duetime reads version {MODEL_VERSION}; retrain",
        ):
            LengthModel.load(tmp_path / "other.npz")
    _rewrite_header(path, tmp_path / "alien.npz", format="something-else")
    with pytest.raises(ModelVersionError, match="format"):
        LengthModel.load(tmp_path / "alien.npz")
    np.savez(tmp_path / "plain.npz", x=np.zeros(3))
    with pytest.raises(ModelVersionError, match="not a duetime length-model file"):
        LengthModel.load(tmp_path / "plain.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(ModelVersionError):
        LengthModel.load(tmp_path / "junk.npz")
    (tmp_path / "text.npz").write_text("a,b\n1,2\n")  # numpy advised allow_pickle=True
    with pytest.raises(ModelVersionError, match=r"text\.npz: .*\(not an \.npz archive\)$"):
        LengthModel.load(tmp_path / "text.npz")
    model = LengthModel.load(path)
    _rewrite_header(path, tmp_path / "fp16.npz", meta=model.meta | {"infer_precision": "fp16"})
    with pytest.raises(ValueError, match=r"fp16.npz: infer_precision 'fp16' is not one of"):
        LengthModel.load(tmp_path / "fp16.npz")


def _rewrite_arrays(src, dst, **changes):
    with np.load(src) as data:
        arrays = {k: data[k] for k in data.files} | changes
    np.savez(dst, **arrays)


def test_a_damaged_model_file_is_refused_at_load_naming_it(tmp_path):
    """Each loaded before: NaN weights answered every prompt with one bucket; a list
    meta and mismatched shapes failed later with tracebacks that named no file."""
    path = train_rlp(synthetic_data(), CFG, progress=False).save(tmp_path / "m.npz")
    with np.load(path) as data:
        w1, w2 = data["w1"], data["w2"]
    damaged = {
        "nan_w1": ({"w1": np.full_like(w1, np.nan)}, "not all finite"),
        "short_w2": ({"w2": w2[:, :-1]}, "layer 2 has shapes"),
        "classes": ({"w2": w2[:, :-1], "b2": np.zeros(w2.shape[1] - 1, w2.dtype)}, "logits"),
        "inf_scores": ({"conformal_scores": np.array([np.inf], np.float32)}, "scores"),
    }
    for name, (changes, says) in damaged.items():
        _rewrite_arrays(path, tmp_path / f"{name}.npz", **changes)
        with pytest.raises(ModelVersionError, match=rf"{name}\.npz: malformed .*{says}"):
            LengthModel.load(tmp_path / f"{name}.npz")
    for name, change in {"meta": {"meta": [1, 2]}, "feat_std": {"feat_std": 0.0}}.items():
        _rewrite_header(path, tmp_path / f"{name}.npz", **change)
        with pytest.raises(ModelVersionError, match=rf"{name}\.npz: malformed .*{name}"):
            LengthModel.load(tmp_path / f"{name}.npz")
