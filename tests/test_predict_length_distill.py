"""Distilling into a fine-tuned RLP (``train-length --teacher``): soft targets in the loss, the
teachers' mean distribution, and what is refused. Real MiniLM cut to one layer and 16 pieces."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from duetime.predict.epoch_loop import CheckpointError
from duetime.predict.length_distill import load_teacher, teacher_distributions, teachers_digest
from duetime.predict.length_finetune import check_soft_targets, train_finetuned_rlp
from duetime.predict.length_model import LengthModel, RLPConfig, bucket_of
from tests.length_bundles import CFG, make_bundle, synthetic_texts

FAST = replace(CFG, epochs=2)


@pytest.fixture(scope="module")
def bundle():
    texts, out = synthetic_texts()
    return make_bundle(texts, out)


@pytest.fixture(scope="module")
def teachers(bundle, tmp_path_factory):
    folder = tmp_path_factory.mktemp("teachers")
    paths = []
    for seed in (0, 1):
        cfg = replace(FAST, seed=seed)
        model = train_finetuned_rlp(bundle, cfg, progress=False, threads=1, precision="fp32")
        paths.append(model.save(folder / f"teacher{seed}.npz"))
    return paths


def one_hot(bundle, cfg: RLPConfig) -> np.ndarray:
    classes = np.minimum(bucket_of(bundle.output_len, cfg.bucket_size), cfg.n_classes) - 1
    return np.eye(cfg.n_classes, dtype=np.float32)[classes]


def train(bundle, cfg, soft=None, **kw):
    return train_finetuned_rlp(
        bundle, cfg, progress=False, threads=1, precision="fp32", soft_targets=soft, **kw
    )


def test_one_hot_soft_targets_train_as_the_hard_labels_and_others_do_not(bundle):
    plain = train(bundle, FAST)
    soft = replace(FAST, soft_weight=1.0)
    same = train(bundle, soft, one_hot(bundle, FAST))
    uniform = np.full((len(bundle), FAST.n_classes), 1 / FAST.n_classes, dtype=np.float32)
    other = train(bundle, soft, uniform)
    for k, v in plain.adapters.items():
        np.testing.assert_allclose(same.adapters[k], v, atol=1e-5, err_msg=k)
    np.testing.assert_allclose(same.weights.w2, plain.weights.w2, atol=1e-5)
    assert not np.allclose(other.weights.w2, plain.weights.w2, atol=1e-3)
    assert same.config.soft_weight == 1.0  # the file says how it was trained


def test_teachers_mean_distribution_fills_train_rows_only(bundle, teachers):
    d0 = teacher_distributions(bundle, teachers[:1], FAST, progress=False)
    d1 = teacher_distributions(bundle, teachers[1:], FAST, progress=False)
    both = teacher_distributions(bundle, teachers, FAST, progress=False)
    tr = bundle.splits["train"]
    np.testing.assert_allclose(both, (d0 + d1) / 2, atol=1e-6)
    np.testing.assert_allclose(both[tr].sum(axis=1), 1.0, atol=1e-5)
    others = np.setdiff1d(np.arange(len(bundle)), tr)
    assert not both[others].any()  # val, calib, test rows are never taught
    assert not np.allclose(d0[tr], d1[tr], atol=1e-3)  # two seeds, two teachers

    # each teacher's distribution is the one its predictor computes for those rows
    model = LengthModel.load(teachers[0])
    emb = model.encoder().encode_ids(bundle.seqs(tr))
    probs = model.predict(emb, bundle.prompt_len[tr], FAST.max_len).probs
    np.testing.assert_allclose(d0[tr], probs, atol=1e-5)


def test_distillation_moves_the_student_toward_its_teachers(bundle, teachers):
    soft = teacher_distributions(bundle, teachers, FAST, progress=False)
    tr = bundle.splits["train"]
    student = train(bundle, replace(FAST, soft_weight=1.0), soft)
    plain = train(bundle, FAST)

    def gap(model: LengthModel) -> float:  # mean total-variation distance to the teachers
        emb = model.encoder().encode_ids(bundle.seqs(tr))
        probs = model.predict(emb, bundle.prompt_len[tr], FAST.max_len).probs
        return float(np.abs(probs - soft[tr]).sum(axis=1).mean() / 2)

    assert gap(student) < gap(plain)


def test_soft_targets_and_weight_must_go_together():
    cfg = replace(FAST, soft_weight=0.5)
    good = np.full((10, cfg.n_classes), 1 / cfg.n_classes, dtype=np.float32)
    check_soft_targets(good, cfg, 10)
    check_soft_targets(None, FAST, 10)
    with pytest.raises(ValueError, match="needs soft targets"):
        check_soft_targets(None, cfg, 10)
    with pytest.raises(ValueError, match="soft_weight 0"):
        check_soft_targets(good, FAST, 10)
    with pytest.raises(ValueError, match=r"\(11, 32\)"):
        check_soft_targets(good, cfg, 11)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"soft_weight \(--soft-weight\) must be in"):
            replace(FAST, soft_weight=bad)


def test_a_checkpoint_resumes_only_with_the_same_teachers(bundle, tmp_path):
    cfg = replace(FAST, soft_weight=1.0)
    ckpt = tmp_path / "s.ckpt"
    soft = one_hot(bundle, cfg)
    train(bundle, cfg, soft, checkpoint=ckpt, stop_after=1)
    other = soft.copy()
    other[:, 0] += 1e-3
    with pytest.raises(CheckpointError, match="soft_targets"):
        train(bundle, cfg, other, checkpoint=ckpt, resume=True)
    resumed = train(bundle, cfg, soft, checkpoint=ckpt, resume=True)
    assert resumed.meta["epochs_run"] == 2


def test_a_checkpoint_named_by_its_teachers_resumes_despite_numeric_noise(
    bundle, teachers, tmp_path
):
    """A GPU's teacher pass need not repeat bit for bit: named by the teachers' files,
    a resumed run takes the targets as they come; other teachers are still refused."""
    cfg = replace(FAST, soft_weight=1.0)
    ckpt = tmp_path / "s.ckpt"
    soft = teacher_distributions(bundle, teachers, cfg, progress=False)
    name = teachers_digest(teachers)
    assert name != teachers_digest(teachers[:1])
    train(bundle, cfg, soft, checkpoint=ckpt, stop_after=1, soft_identity=name)
    noisy = soft * (1 + 1e-6)
    resumed = train(bundle, cfg, noisy, checkpoint=ckpt, resume=True, soft_identity=name)
    assert resumed.meta["epochs_run"] == 2
    with pytest.raises(CheckpointError, match="soft_targets"):
        train(
            bundle,
            cfg,
            soft,
            checkpoint=ckpt,
            resume=True,
            soft_identity=teachers_digest(teachers[:1]),
        )


def test_teachers_that_cannot_teach_are_refused(bundle, teachers, tmp_path):
    from duetime.predict.length_fit import shipped_model_path

    with pytest.raises(ValueError, match="must be a fine-tuned model"):
        load_teacher(shipped_model_path("minilm-static"), bundle, FAST)
    with pytest.raises(ValueError, match="buckets of 16 tokens up to 512"):
        load_teacher(teachers[0], bundle, replace(FAST, max_len=1024))
    foreign = LengthModel.load(teachers[0])
    foreign.meta["dataset"] = "another split"
    with pytest.raises(ValueError, match="other rows or another split"):
        load_teacher(foreign.save(tmp_path / "foreign.npz"), bundle, FAST)
    with pytest.raises(ValueError, match="no teachers"):
        teacher_distributions(bundle, [], FAST)


def test_cli_distils_and_records_its_teachers(bundle, teachers, tmp_path):
    from typer.testing import CliRunner

    from duetime.cli import app

    b = bundle.save(tmp_path / "b.npz")
    out = tmp_path / "student.npz"
    args = ["predict", "train-length", "--encoder", "minilm-ft:16:1", "--bundle", str(b),
            "--max-len", "512", "--hidden", "16", "--epochs", "2", "--batch-size", "16",
            "--lr", "0.03", "--lora-rank", "2", "--precision", "fp32"]  # fmt: skip
    teach = [f for t in teachers for f in ("--teacher", str(t))]
    r = CliRunner().invoke(app, [*args, *teach, "--soft-weight", "0.7", "--out", str(out)])
    assert r.exit_code == 0, r.output
    student = LengthModel.load(out)
    assert student.config.soft_weight == 0.7
    assert [t["file"] for t in student.meta["teachers"]] == ["teacher0.npz", "teacher1.npz"]

    bad = {
        "static": (
            ["--encoder", "minilm-static:512", *teach],
            "--teacher distils into a fine-tuned encoder only",
        ),
        "no teacher": (["--soft-weight", "0.5"], "give --teacher"),
        "range": ([*teach, "--soft-weight", "1.5"], "--soft-weight"),
    }
    for name, (extra, needle) in bad.items():
        x = tmp_path / "x.npz"
        cmd = [*args, *extra, "--out", str(x)]
        if name == "static":
            cmd.remove("--bundle")
            cmd.remove(str(b))
        r = CliRunner().invoke(app, cmd)
        assert r.exit_code == 2, (name, r.output)
        assert needle in r.output, (name, r.output)
        assert not x.exists()


def test_train_seed_varies_the_training_on_one_split(bundle):
    same = train(bundle, replace(FAST, train_seed=0))
    plain = train(bundle, FAST)
    other = train(bundle, replace(FAST, train_seed=1))
    np.testing.assert_array_equal(same.weights.w2, plain.weights.w2)  # None means seed
    assert not np.allclose(other.weights.w2, plain.weights.w2, atol=1e-3)
    assert other.meta["split_seed"] == 0  # the split the bench re-makes: the bundle's
    assert other.meta["split_sizes"] == plain.meta["split_sizes"]
    assert other.config.training_seed == 1


def test_cli_refuses_a_seed_that_is_not_the_bundles_split(bundle, tmp_path):
    from typer.testing import CliRunner

    from duetime.cli import app

    assert bundle.split_seed is None  # a bundle made by hand records none
    seeded = replace(bundle, dataset="rows|split seed 0, max_len 512|all turns")
    assert seeded.split_seed == 0
    b = seeded.save(tmp_path / "b.npz")
    x = tmp_path / "x.npz"
    args = ["predict", "train-length", "--encoder", "minilm-ft:16:1", "--bundle", str(b),
            "--max-len", "512", "--seed", "1", "--out", str(x)]  # fmt: skip
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2, r.output
    assert "split with seed 0" in r.output, r.output
    assert "--train-seed" in r.output, r.output
    assert not x.exists()
