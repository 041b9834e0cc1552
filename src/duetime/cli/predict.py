"""Predictor commands (`duetime predict ...`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from duetime.cli.common import (
    JsonOpt,
    _user_errors,
    out,
    predict_app,
)


@predict_app.command("train-length")
def predict_train_length(
    out_path: Annotated[Path, typer.Option("--out", help="Model file to write (.npz).")] = Path(
        "out/rlp.npz"
    ),
    encoder: Annotated[
        str, typer.Option(help="minilm[:word pieces] or minilm-static[:word pieces].")
    ] = "minilm-static:512",
    bucket_size: Annotated[int, typer.Option(min=1, help="B, tokens per bucket.")] = 16,
    max_len: Annotated[int, typer.Option(min=1, help="N_model: longest answer kept.")] = 4096,
    hidden: Annotated[int, typer.Option(min=0, help="MLP width (0: linear head).")] = 256,
    epochs: Annotated[int, typer.Option(min=1)] = 40,
    label_sigma: Annotated[float, typer.Option(min=0.0, help="Label smoothing, buckets.")] = 0.0,
    readout: Annotated[str, typer.Option(help="median, mean or argmax (TimeBill).")] = "median",
    seed: Annotated[int, typer.Option(help="Seed of the split and the training.")] = 0,
    coverage: Annotated[float, typer.Option(help="Interval coverage for the report.")] = 0.9,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue from the checkpoint beside --out.")
    ] = False,
    json_path: JsonOpt = None,
) -> None:
    """Train TimeBill's bucket classifier on ShareGPT; save a model file.

    A checkpoint (``<out>.ckpt``) is written after every epoch and removed once
    the model file is saved; after an interruption, ``--resume`` continues it.
    """
    from duetime.metrics import write_json
    from duetime.predict.length_fit import load_length_data, train_rlp
    from duetime.predict.length_model import RLPConfig

    with _user_errors():
        cfg = RLPConfig(
            bucket_size=bucket_size,
            max_len=max_len,
            encoder=encoder,
            hidden=hidden,
            epochs=epochs,
            label_sigma=label_sigma,
            readout=readout,
            seed=seed,
        )
        data = load_length_data(encoder, max_len=max_len, seed=seed)
        ckpt = out_path.with_name(out_path.name + ".ckpt")
        rlp = train_rlp(data, cfg, checkpoint=ckpt, resume=resume, coverage=coverage)
        rlp.save(out_path)
        ckpt.unlink(missing_ok=True)  # the model file is written: nothing left to resume
    m = rlp.meta["test_metrics"][cfg.readout]
    out.print(
        f"wrote {out_path} (best epoch {rlp.meta['best_epoch']}/{epochs}); test, {readout}: "
        f"MAE {m['mae_tokens']:.1f} tokens, RMSE {m['rmse_tokens']:.1f}, R² {m['r2']:.3f}, "
        f"bucket acc {m['bucket_acc']:.3f}, {coverage:.0%} interval covers {m['coverage']:.3f} "
        f"(mean width {m['interval_width_tokens']:.0f} tokens)"
    )
    if json_path is not None:
        write_json(json_path, {"config": rlp.config, "meta": rlp.meta})
