"""Predictor commands (`duetime predict ...`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from duetime.cli.common import (
    AlaDataOpt,
    JsonOpt,
    _user_errors,
    open_share,
    out,
    predict_app,
)
from duetime.cli.paths import output_path
from duetime.cli.predict_train import (
    check_option_combinations,
    check_precision_and_device,
    check_train_numbers,
    report_test_metrics,
    save_model,
    say_checkpoint,
    train_finetuned,
    train_head,
)
from duetime.predict.ala_limits import MAX_BATCH, MAX_TOKENS

# `train-length` and `export-length-data`: the bucket range the model is trained for.
MaxLenOpt = Annotated[int, typer.Option(min=1, help="N_model: longest answer kept.")]
AllTurnsOpt = Annotated[
    bool,
    typer.Option(
        "--all-turns",
        help="minilm-ft: also train on the later human/gpt pairs of the train conversations "
        "(3.5x the rows; val, calib and test stay first pairs).",
    ),
]


@predict_app.command("train-length")
def predict_train_length(
    out_path: Annotated[
        Path, typer.Option("--out", help="Model file to write (.npz).", callback=output_path)
    ] = Path("out/rlp.npz"),
    encoder: Annotated[
        str,
        typer.Option(
            help="minilm[:word pieces], minilm-static[:word pieces], or minilm-ft[:pieces[:layers]]"
            " (fine-tuned with LoRA: minutes on a GPU, ~15 min on 2 cores with native bf16)."
        ),
    ] = "minilm-static:512",
    bucket_size: Annotated[int, typer.Option(min=1, help="B, tokens per bucket.")] = 16,
    max_len: MaxLenOpt = 4096,
    hidden: Annotated[int, typer.Option(min=0, help="MLP width (0: linear head).")] = 256,
    dropout: Annotated[
        float | None,
        typer.Option(
            min=0.0, max=0.9, help="Head dropout. Default 0.2 for a head, 0.1 for minilm-ft."
        ),
    ] = None,
    epochs: Annotated[
        int | None, typer.Option(min=1, help="Default 40 for a head, 6 for minilm-ft.")
    ] = None,
    batch_size: Annotated[
        int | None, typer.Option(min=1, help="Default 256 for a head, 32 for minilm-ft.")
    ] = None,
    lr: Annotated[float, typer.Option(help="Learning rate of the head.")] = 1e-3,
    label_sigma: Annotated[float, typer.Option(min=0.0, help="Label smoothing, buckets.")] = 0.0,
    readout: Annotated[str, typer.Option(help="median, mean or argmax (TimeBill).")] = "median",
    seed: Annotated[int, typer.Option(min=0, help="Seed of the split and the training.")] = 0,
    train_seed: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="Seed of the training alone (initialisation, shuffles, dropout), on the "
            "split --seed makes: other models on one split, e.g. teachers.  [default: --seed]",
        ),
    ] = None,
    coverage: Annotated[
        float,
        typer.Option(help="Interval coverage for the report, in (0, 1).", callback=open_share),
    ] = 0.9,
    lora_rank: Annotated[int, typer.Option(min=1, help="minilm-ft: LoRA rank.")] = 16,
    encoder_lr: Annotated[float, typer.Option(help="minilm-ft: adapters' learning rate.")] = 5e-4,
    device: Annotated[str, typer.Option(help="minilm-ft: torch device (cpu, cuda).")] = "cpu",
    precision: Annotated[
        str,
        typer.Option(
            help="Contextual encoders (minilm, minilm-ft): auto (bf16 on a GPU or a CPU with"
            " native bf16, else fp32), bf16, fp32; the model runs in it (minilm-static: fp32)."
        ),
    ] = "auto",
    bundle: Annotated[
        Path | None,
        typer.Option(help="minilm-ft: a token bundle from export-length-data instead of ShareGPT."),
    ] = None,
    all_turns: AllTurnsOpt = False,
    teachers: Annotated[
        list[Path] | None,
        typer.Option(
            "--teacher",
            help="minilm-ft: a fine-tuned model file trained on the same rows and split; "
            "repeat it for several. The student also learns their mean bucket distribution.",
        ),
    ] = None,
    soft_weight: Annotated[
        float | None,
        typer.Option(
            min=0.0,
            max=1.0,
            help="With --teacher: weight of the teachers' distribution in the loss, the hard "
            "label's is 1 minus it.  [default: 1.0]",
        ),
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue from the checkpoint beside --out.")
    ] = False,
    json_path: JsonOpt = None,
) -> None:
    """Train TimeBill's bucket classifier on ShareGPT; save a model file.

    A frozen encoder trains only the head (a minute on this CPU); ``minilm-ft``
    fine-tunes the encoder with it (minutes on a GPU, ``--device cuda``; ~2.5 minutes an
    epoch on 2 CPU cores with native bfloat16, twice that without). A
    checkpoint (``<out>.ckpt``) is written after every epoch and removed once
    the model file is saved; after an interruption, ``--resume`` continues it.
    """
    from duetime.predict.length_model import RLPConfig

    finetune = encoder.partition(":")[0] == "minilm-ft"
    with _user_errors():
        check_train_numbers(
            lr=lr,
            encoder_lr=encoder_lr,
            label_sigma=label_sigma,
            dropout=dropout,
        )
        check_option_combinations(
            finetune=finetune,
            bundle=bundle,
            all_turns=all_turns,
            teachers=teachers,
            soft_weight=soft_weight,
            device=device,
        )
        check_precision_and_device(precision, device, finetune=finetune)
        # a fine-tuned encoder overfits sooner and its steps cost more than a head's: its
        # own dropout, epochs and batch size; the teachers' weight is 0 without teachers
        cfg = RLPConfig(
            bucket_size=bucket_size,
            max_len=max_len,
            encoder=encoder,
            hidden=hidden,
            dropout=dropout if dropout is not None else (0.1 if finetune else 0.2),
            epochs=epochs or (6 if finetune else 40),
            batch_size=batch_size or (32 if finetune else 256),
            lr=lr,
            label_sigma=label_sigma,
            readout=readout,
            seed=seed,
            lora_rank=lora_rank,
            encoder_lr=encoder_lr,
            soft_weight=(1.0 if soft_weight is None else soft_weight) if teachers else 0.0,
            train_seed=train_seed,
        )
        ckpt = out_path.with_name(out_path.name + ".ckpt")
        say_checkpoint(ckpt, resume=resume)
        if finetune:
            rlp = train_finetuned(
                cfg,
                bundle=bundle,
                all_turns=all_turns,
                teachers=teachers,
                device=device,
                checkpoint=ckpt,
                resume=resume,
                coverage=coverage,
                precision=precision,
            )
        else:
            rlp = train_head(
                cfg, precision=precision, checkpoint=ckpt, resume=resume, coverage=coverage
            )
        save_model(rlp, out_path, ckpt)
    report_test_metrics(rlp, cfg, out_path=out_path, coverage=coverage, json_path=json_path)


@predict_app.command("export-length-data")
def predict_export_length_data(
    out_path: Annotated[
        Path, typer.Option("--out", help="Bundle to write (.npz).", callback=output_path)
    ] = Path("out/rlp-tokens.npz"),
    max_len: MaxLenOpt = 4096,
    seed: Annotated[int, typer.Option(min=0, help="Seed of the split.")] = 0,
    all_turns: AllTurnsOpt = False,
) -> None:
    """Write the RLP's training rows as MiniLM word-piece ids (~2 MB; ~4 MB with
    --all-turns): `train-length --bundle` then fine-tunes on a machine without the
    ShareGPT package (a GPU box)."""
    from duetime.predict.length_tokens import build_bundle

    with _user_errors():
        b = build_bundle(max_len=max_len, seed=seed, all_turns=all_turns).save(out_path)
    out.print(f"wrote {escape(str(b))} ({b.stat().st_size / 1e6:.1f} MB)")


@predict_app.command("throughput")
def predict_throughput(
    input_len: Annotated[
        int,
        typer.Option(
            "--input-len",
            min=1,
            max=MAX_TOKENS,
            help=f"ii: prompt tokens (at most {MAX_TOKENS:,}: the longest context windows).",
        ),
    ],
    output_len: Annotated[
        int,
        typer.Option(
            "--output-len",
            min=1,
            max=MAX_TOKENS,
            help=f"oo: output tokens (at most {MAX_TOKENS:,}, as --input-len).",
        ),
    ],
    batch: Annotated[
        int,
        typer.Option(
            "--batch",
            min=1,
            max=MAX_BATCH,
            help=f"bb: concurrent requests (at most {MAX_BATCH:,}; engines run hundreds or "
            "thousands).",
        ),
    ],
    config: Annotated[
        str, typer.Option(help="Hardware/software configuration in the data.")
    ] = "sim-a100-llama2-7b",
    data: AlaDataOpt = None,
    coverage: Annotated[
        float, typer.Option(help="Nominal interval coverage, in (0, 1).", callback=open_share)
    ] = 0.9,
    json_path: JsonOpt = None,
) -> None:
    """ALA throughput (tok/s) for a batch of one workload shape, with interval and confidence."""
    from dataclasses import asdict

    from duetime.metrics import write_json
    from duetime.predict.ala_data import config_data
    from duetime.predict.ala_model import AlaPredictor

    with _user_errors():
        pred = AlaPredictor(config_data(config, data), coverage=coverage)
        p = pred.predict_throughput(input_len, output_len, batch)
        if json_path is not None:  # before the lines: a closed stdout must not lose the file
            point = {
                f"{k}_tok_s" if k in ("point", "lo", "hi") else k: v for k, v in asdict(p).items()
            }
            payload = {
                "config": config,
                "ii": input_len,
                "oo": output_len,
                "bb": batch,
                **point,
                "heldout_median_err_pct": pred.cv_median_err_pct,
                "heldout_folds": pred.cv_folds,
            }
            write_json(json_path, payload)
    how = "fitted curve (workload was run)" if p.from_database else "XGBoost-predicted curve"
    out.print(
        f"{escape(config)}: ii={input_len} oo={output_len} bb={batch}: "
        f"{p.point:,.1f} tok/s, {coverage * 100:g} % interval [{p.lo:,.1f}, {p.hi:,.1f}], "
        f"confidence {p.confidence:.2f}\n{how}; held-out median error of this config's model "
        f"{pred.cv_median_err_pct:.1f} % ({pred.cv_folds} folds over (ii, oo) pairs)"
    )


@predict_app.command("collect-throughput")
def predict_collect_throughput(
    config: Annotated[
        list[str] | None,
        typer.Option(
            help="A configuration to collect; repeat for several (default: the simulated ones)."
        ),
    ] = None,
    out_path: Annotated[
        Path, typer.Option("--out", help="CSV to append to.", callback=output_path)
    ] = Path("out/ala-throughput.csv"),
    quick: Annotated[bool, typer.Option(help="A tiny grid (smoke test).")] = False,
) -> None:
    """Measure throughput over an (ii, oo, bb) grid; resumable (skips rows already in --out)."""
    from duetime.cli.common import _progress
    from duetime.predict.ala_collect import SIM_SPECS, Grid, collect

    names = config or [s.name for s in SIM_SPECS]  # collect runs a repeated name once
    grid = Grid(ii=(16, 32), oo=(4, 8), bb=(1, 2, 4)) if quick else None
    with _user_errors():
        prog, cb = _progress(1, "collecting throughput")
        with prog:
            counts = collect(names, out_path, grid=grid, progress=cb)
    out.print(
        f"ran {counts['run']} shapes, skipped {counts['skipped']} already in "
        f"{escape(str(out_path))}"
        + (" (an unfinished last row, from an interrupted run, was cut off and run again)"
           if counts["torn"] else "")
    )  # fmt: skip
