"""The phases of `duetime predict train-length`: check the options, train
(a fine-tuned encoder or a head on a frozen one), save, report.

The command in :mod:`duetime.cli.predict` calls these in that order. Every check runs
before any data loads, so a wrong option costs a line, not a training run; the heavy
modules (torch, the encoders, the data) are imported only inside the helpers that
need them, so ``duetime --help`` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rich.markup import escape

from duetime.cli.common import _user_errors, out

if TYPE_CHECKING:  # (the predictor's modules import numpy and torch: not before a training)
    import numpy as np

    from duetime.predict.length_model import LengthModel, RLPConfig
    from duetime.predict.length_tokens import TokenBundle


def check_train_numbers(
    *, lr: float, encoder_lr: float, label_sigma: float, dropout: float | None
) -> None:
    """Numbers typer's own range checks let through (NaN passes ``min``/``max``; the rates
    have no range): refused before any data loads, not after the training."""
    import math

    for opt, v in (("--lr", lr), ("--encoder-lr", encoder_lr)):
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"{opt} must be finite and > 0, got {v}")
    if not math.isfinite(label_sigma):
        raise ValueError(f"--label-sigma must be finite, got {label_sigma}")
    if dropout is not None and not math.isfinite(dropout):
        raise ValueError(f"--dropout must be finite, got {dropout}")


def check_option_combinations(
    *,
    finetune: bool,
    bundle: Path | None,
    all_turns: bool,
    teachers: list[Path] | None,
    soft_weight: float | None,
    device: str = "cpu",
) -> None:
    """Options that only a fine-tuned encoder reads, or that contradict each other: a
    frozen encoder would ignore them silently, so they are refused instead."""
    if device != "cpu" and not finetune:
        raise ValueError(
            f"--device {device} moves a fine-tuned encoder only (--encoder minilm-ft...); "
            "a head on a frozen encoder trains on the CPU"
        )
    if bundle is not None and not finetune:
        raise ValueError("--bundle feeds a fine-tuned encoder only (--encoder minilm-ft...)")
    if all_turns and not finetune:
        raise ValueError(
            "--all-turns feeds a fine-tuned encoder only (--encoder minilm-ft...): "
            "a frozen encoder's head did not gain from them (docs/predictors.md)"
        )
    if all_turns and bundle is not None:
        raise ValueError("--all-turns builds the rows; a --bundle has its rows already")
    if teachers and not finetune:
        raise ValueError(
            "--teacher distils into a fine-tuned encoder only (--encoder minilm-ft...)"
        )
    if soft_weight is not None and not teachers:
        raise ValueError("--soft-weight weighs the teachers' distribution: give --teacher")


def say_checkpoint(ckpt: Path, *, resume: bool) -> None:
    """Say what becomes of the checkpoint beside ``--out``: ``--resume`` with none to
    continue, and a run's checkpoint that a new training will write over, both went
    unsaid."""
    from duetime.cli.common import err

    if resume and not ckpt.exists():
        err.print(f"no checkpoint at {escape(str(ckpt))} to resume: training from the start")
    elif not resume and ckpt.exists():
        err.print(
            f"{escape(str(ckpt))} holds an interrupted training; starting over writes over it "
            "(--resume continues it)"
        )


def check_precision_and_device(precision: str, device: str, *, finetune: bool) -> None:
    """A bad ``--precision`` or ``--device`` fails here, before the data loads, not at
    the first training step."""
    from duetime.predict.precision import resolve_precision

    resolve_precision(precision, device)
    if finetune:
        from duetime.predict.length_finetune import check_device

        check_device(device)


def _load_tokens(bundle: Path | None, *, max_len: int, seed: int, all_turns: bool) -> TokenBundle:
    """The fine-tuning rows: a ``--bundle`` file, else built from ShareGPT. A bundle split
    with another seed is refused: the model file records ``--seed`` as its split and the
    bench splits by it again, so the two must agree."""
    from duetime.predict.length_tokens import TokenBundle, build_bundle

    tokens = (
        TokenBundle.load(bundle)
        if bundle is not None
        else build_bundle(max_len=max_len, seed=seed, all_turns=all_turns)
    )
    if tokens.split_seed not in (None, seed):
        raise ValueError(
            f"{bundle}: its rows were split with seed {tokens.split_seed}, not --seed "
            f"{seed}; --seed names the split (the model file records it and the bench "
            "splits by it again): vary the training with --train-seed"
        )
    return tokens


def _teacher_targets(
    tokens: TokenBundle, teachers: list[Path] | None, cfg: RLPConfig, *, device: str
) -> tuple[np.ndarray | None, str | None]:
    """The teachers' mean bucket distribution over the rows and a digest of their files
    (a checkpoint resumes only with the same teachers); ``(None, None)`` without any."""
    if not teachers:
        return None, None
    from duetime.predict.length_distill import teacher_distributions, teachers_digest

    soft = teacher_distributions(tokens, teachers, cfg, device=device)
    return soft, teachers_digest(teachers)


def train_finetuned(
    cfg: RLPConfig,
    *,
    bundle: Path | None,
    all_turns: bool,
    teachers: list[Path] | None,
    device: str,
    checkpoint: Path,
    resume: bool,
    coverage: float,
    precision: str,
) -> LengthModel:
    """Fine-tune the encoder (LoRA) with the head, distilling the teachers where given;
    the model file then names its teachers."""
    from duetime.predict.length_finetune import train_finetuned_rlp

    tokens = _load_tokens(bundle, max_len=cfg.max_len, seed=cfg.seed, all_turns=all_turns)
    soft, soft_id = _teacher_targets(tokens, teachers, cfg, device=device)
    rlp = train_finetuned_rlp(
        tokens,
        cfg,
        device=device,
        checkpoint=checkpoint,
        resume=resume,
        coverage=coverage,
        precision=precision,
        soft_targets=soft,
        soft_identity=soft_id,
    )
    if teachers:
        from duetime.predict.length_distill import teachers_meta

        rlp.meta["teachers"] = teachers_meta(teachers)
    return rlp


def train_head(
    cfg: RLPConfig, *, precision: str, checkpoint: Path, resume: bool, coverage: float
) -> LengthModel:
    """Train a head on a frozen encoder's embeddings. The static encoder is a lookup
    table: it runs in fp32 unless a precision is asked for."""
    from duetime.predict.length_features import make_encoder
    from duetime.predict.length_fit import load_length_data, train_rlp
    from duetime.predict.precision import resolve_precision

    static = cfg.encoder.partition(":")[0] == "minilm-static"
    infer = "fp32" if static and precision == "auto" else resolve_precision(precision, "cpu")
    enc = make_encoder(cfg.encoder, precision=infer)
    data = load_length_data(enc, max_len=cfg.max_len, seed=cfg.seed)
    return train_rlp(data, cfg, checkpoint=checkpoint, resume=resume, coverage=coverage)


def save_model(rlp: LengthModel, out_path: Path, checkpoint: Path) -> None:
    """Write the model file, then drop the checkpoint beside it: once the model file is
    written, nothing is left to resume."""
    rlp.save(out_path)
    checkpoint.unlink(missing_ok=True)


def report_test_metrics(
    rlp: LengthModel, cfg: RLPConfig, *, out_path: Path, coverage: float, json_path: Path | None
) -> None:
    """One line of the test split's metrics under the config's readout, and with
    ``--json`` the model's config and metadata for scripts."""
    from duetime.metrics import write_json

    m = rlp.meta["test_metrics"][cfg.readout]
    out.print(
        f"wrote {escape(str(out_path))} (best epoch {rlp.meta['best_epoch']}/{cfg.epochs}); "
        f"test, {cfg.readout}: "
        f"MAE {m['mae_tokens']:.1f} tokens, RMSE {m['rmse_tokens']:.1f} tokens, R² {m['r2']:.3f}, "
        f"bucket acc {m['bucket_acc']:.3f}, {coverage:.0%} interval covers {m['coverage']:.3f} "
        f"(mean width {m['interval_width_tokens']:.0f} tokens)"
    )
    if json_path is not None:
        with _user_errors():  # the model is saved: a full disk here is one line, not a traceback
            write_json(json_path, {"config": rlp.config, "meta": rlp.meta})
