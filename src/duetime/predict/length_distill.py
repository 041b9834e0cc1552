"""Distilling fine-tuned RLPs into one (``duetime predict train-length --teacher ...``).

Why: the mean bucket distribution of several fine-tuned models predicts
lengths better than any one of them (four seeds at 128 word pieces: test MAE
126.3 against 128.9-130.4 alone), but a prompt would then pay four encoder
passes, past the 20 ms budget. Training one model on the hard label *and* the
teachers' mean distribution (knowledge distillation, Hinton et al. 2015) keeps
most of that gain at the cost of one pass (docs/predictors.md, measured).

A teacher must not have seen the rows the student is judged on, so it must
come from the same rows and split: its file's ``dataset`` has to equal the
bundle's. Only train rows get a distribution; the student's validation,
calibration and test stay on the hard labels.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from duetime.predict.length_model import LengthModel, RLPConfig
from duetime.predict.length_tokens import TokenBundle


def load_teacher(path: str | Path, bundle: TokenBundle, cfg: RLPConfig) -> LengthModel:
    """A teacher's model file, refused unless it is fine-tuned, has the student's buckets and
    was trained on this bundle's rows and split."""
    model = LengthModel.load(path)
    if not model.adapters:
        raise ValueError(
            f"{path}: a teacher must be a fine-tuned model (minilm-ft); "
            f"this one reads {model.config.encoder!r} frozen"
        )
    mine, theirs = (cfg.bucket_size, cfg.max_len), (model.config.bucket_size, model.config.max_len)
    if mine != theirs:
        raise ValueError(
            f"{path}: teacher has buckets of {theirs[0]} tokens up to {theirs[1]}; "
            f"the student {mine[0]} up to {mine[1]}"
        )
    if model.meta.get("dataset") != bundle.dataset:
        raise ValueError(
            f"{path}: teacher was trained on other rows or another split "
            f"({model.meta.get('dataset')!r}, not {bundle.dataset!r}); it may have seen the "
            "rows the student is validated and tested on"
        )
    return model


def teacher_distributions(
    bundle: TokenBundle,
    teachers: Sequence[str | Path],
    cfg: RLPConfig,
    *,
    device: str = "cpu",
    threads: int | None = None,
    progress: bool = True,
) -> np.ndarray:
    """``(len(bundle), n_classes)`` float32: the teachers' mean bucket distribution of each
    train row; other rows are zeros (never read).

    On a CPU each teacher runs as its predictor does (adapters merged, in the
    precision it was calibrated in); on a GPU, in bfloat16 autocast.
    """
    if not teachers:
        raise ValueError("no teachers given")
    models = [load_teacher(p, bundle, cfg) for p in teachers]
    rows = bundle.splits["train"]
    seqs = bundle.seqs(rows)
    out = np.zeros((len(bundle), cfg.n_classes), dtype=np.float64)
    for path, model in zip(teachers, models, strict=True):
        emb = _features(model, seqs, device, threads, progress, f"teacher {Path(path).name}")
        out[rows] += model.weights.probs(emb, bundle.prompt_len[rows])
    out[rows] /= len(models)
    return out.astype(np.float32)


def teachers_digest(teachers: Sequence[str | Path]) -> str:
    """A short hash of the teachers' files, in order: a student's checkpoint resumes
    only with the same teachers."""
    import hashlib

    h = hashlib.sha1()
    for path in teachers:
        h.update(Path(path).read_bytes())
    return "teachers:" + h.hexdigest()[:16]


def teachers_meta(teachers: Sequence[str | Path]) -> list[dict[str, Any]]:
    """What a distilled model file records of its teachers: name, encoder, test MAE."""
    rows = []
    for path in teachers:
        model = LengthModel.load(path)
        test = model.meta.get("test_metrics", {}).get(model.config.readout, {})
        rows.append(
            {
                "file": Path(path).name,
                "encoder": model.config.encoder,
                "seed": model.config.seed,
                "train_seed": model.config.training_seed,
                "test_mae_tokens": test.get("mae_tokens"),
            }
        )
    return rows


def _features(
    model: LengthModel,
    seqs: list[np.ndarray],
    device: str,
    threads: int | None,
    progress: bool,
    desc: str,
) -> np.ndarray:
    if not device.startswith("cuda"):
        from duetime.predict.length_ft_encoder import FinetunedMiniLMEncoder

        encoder = model.encoder(threads=threads)
        assert isinstance(encoder, FinetunedMiniLMEncoder)  # load_teacher admits no other
        return encoder.encode_ids(seqs, progress=progress)

    import torch

    from duetime.predict.length_features import encode_in_batches
    from duetime.predict.length_ft_encoder import (
        FT_DIM,
        load_base,
        merge_adapters,
        parse_ft_spec,
        pooled_features,
    )

    max_tokens, layers = parse_ft_spec(model.config.encoder)
    bert = load_base(layers)
    merge_adapters(bert, model.adapters)
    bert = bert.to(device)

    def forward(batch: list[np.ndarray]) -> Any:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return pooled_features(bert, batch, max_tokens, device).float().cpu()

    return encode_in_batches(
        seqs,
        FT_DIM,
        forward,
        max_tokens=max_tokens,
        batch_size=256,
        threads=threads,
        desc=desc,
        progress=progress,
    )
