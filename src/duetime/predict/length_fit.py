"""From data to a shipped RLP file: features, split, training, conformal calibration, test figures.

``duetime predict train-length`` is :func:`load_length_data` followed by
:func:`train_rlp` and :meth:`LengthModel.save`. The test split is scored
before saving, so the file carries the numbers it was shipped with.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from duetime.predict.conformal import BucketCDF, DistributionConformal
from duetime.predict.epoch_loop import TrainedEpochs
from duetime.predict.length_data import LengthData, from_sharegpt, pair_keys
from duetime.predict.length_features import PromptEncoder
from duetime.predict.length_metrics import length_metrics
from duetime.predict.length_model import (
    READOUTS,
    HeadWeights,
    LengthModel,
    RLPConfig,
    bucket_of,
    prompt_len_feature,
)
from duetime.predict.length_train import fit_head, head_weights
from duetime.predict.precision import precision_of

SHIPPED_MODELS = {
    "minilm-static": "rlp-minilm-static-b16.npz",  # the default: ~1 ms per prompt
    "minilm": "rlp-minilm-b16.npz",  # contextual MiniLM, 64 word pieces: p50 6.5 ms in bf16
    "minilm-ft": "rlp-minilm-ft-b16.npz",  # fine-tuned (LoRA), 6 layers over 96 pieces + static
}
DEFAULT_SHIPPED = "minilm-static"
SPLIT_RULE = "by conversation id, duplicated chats together"


def shipped_model_path(name: str = DEFAULT_SHIPPED) -> Path:
    """A model file shipped in ``duetime/data`` (see :data:`SHIPPED_MODELS`)."""
    if name not in SHIPPED_MODELS:
        raise ValueError(f"no shipped length model {name!r}; have {sorted(SHIPPED_MODELS)}")
    return Path(__file__).resolve().parent.parent / "data" / SHIPPED_MODELS[name]


def default_model_path() -> Path:
    """The default shipped RLP (``duetime/data/rlp-minilm-static-b16.npz``)."""
    return shipped_model_path(DEFAULT_SHIPPED)


def load_length_data(
    encoder: str | PromptEncoder,
    *,
    max_len: int,
    seed: int = 0,
    progress: bool = True,
    threads: int | None = 1,
) -> LengthData:
    """ShareGPT rows with cached embeddings for ``encoder`` (a spec or an encoder object,
    e.g. a fine-tuned model's), split by conversation with duplicated chats together."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from duetime.predict.length_features import (
        dataset_identity,
        make_encoder,
        sharegpt_embeddings,
    )
    from duetime.workloads import load_sharegpt_lengths

    enc = make_encoder(encoder, threads=threads) if isinstance(encoder, str) else encoder
    lengths = load_sharegpt_lengths(progress=progress)
    emb, _ = sharegpt_embeddings(enc, lengths, progress=progress)
    return from_sharegpt(
        lengths,
        emb,
        max_len=max_len,
        seed=seed,
        encoder=enc.identity,
        dataset=dataset_identity(lengths),
        content_keys=pair_keys(lengths),
    )


def _classes(y: np.ndarray, cfg: RLPConfig) -> np.ndarray:
    return np.minimum(bucket_of(y, cfg.bucket_size), cfg.n_classes) - 1


def train_rlp(
    data: LengthData,
    cfg: RLPConfig,
    *,
    checkpoint: Path | None = None,
    resume: bool = False,
    progress: bool = True,
    coverage: float = 0.9,
    stop_after: int | None = None,
) -> LengthModel:
    """Train on ``train``, keep the best ``val`` epoch, calibrate on ``calib``, score ``test``."""
    from duetime.predict.length_baselines import features

    e_tr, p_tr, y_tr = data.part("train")
    e_va, p_va, y_va = data.part("val")
    z = prompt_len_feature(p_tr)
    fm, fs = float(z.mean()), float(z.std() or 1.0)
    data_id = f"{data.encoder}|{data.dataset}|" + ",".join(
        f"{k}:{len(v)}:{int(v.sum()) if len(v) else 0}" for k, v in data.splits.items()
    )
    model, epochs = fit_head(
        cfg,
        features(e_tr, p_tr, fm, fs),
        _classes(y_tr, cfg),
        features(e_va, p_va, fm, fs),
        _classes(y_va, cfg),
        checkpoint=checkpoint,
        resume=resume,
        data_id=data_id,
        progress=progress,
        stop_after=stop_after,
    )
    return calibrated_model(data, cfg, head_weights(model, fm, fs), epochs, coverage=coverage)


def calibrated_model(
    data: LengthData,
    cfg: RLPConfig,
    weights: HeadWeights,
    epochs: TrainedEpochs,
    *,
    coverage: float = 0.9,
    adapters: dict[str, np.ndarray] | None = None,
) -> LengthModel:
    """A trained head (and encoder adapters) -> conformal scores on ``calib``, figures on ``test``.

    ``data.emb`` must hold the features of the calib and test rows exactly as
    inference computes them.
    """
    e_ca, p_ca, y_ca = data.part("calib")
    cdf = BucketCDF(weights.probs(e_ca, p_ca), cfg.bucket_size)
    scores = DistributionConformal.fit(cdf, y_ca).scores
    meta: dict[str, Any] = {
        "encoder": data.encoder,
        "dataset": data.dataset,
        "split_seed": cfg.seed,
        "split_rule": SPLIT_RULE,
        "split_sizes": {k: len(v) for k, v in data.splits.items()},
        "epochs_run": len(epochs.history),
        "best_epoch": epochs.best_epoch,
        "history": epochs.history,
        "infer_precision": precision_of(data.encoder),
    }
    rlp = LengthModel(cfg, weights, scores, meta, dict(adapters or {}))
    if len(data.splits["test"]):
        rlp.meta["test_metrics"] = evaluate_rlp(rlp, data, "test", coverage=coverage)
    return rlp


def evaluate_rlp(
    rlp: LengthModel, data: LengthData, split: str = "test", *, coverage: float = 0.9
) -> dict[str, dict[str, float]]:
    """Figures of each readout on one split, N_max = ``max_len``."""
    emb, plen, y = data.part(split)
    out = {}
    for readout in READOUTS:
        pred = rlp.predict(emb, plen, rlp.config.max_len, coverage=coverage, readout=readout)
        out[readout] = length_metrics(
            y, pred.point, pred.lo, pred.hi, bucket_size=rlp.config.bucket_size
        )
    return out
