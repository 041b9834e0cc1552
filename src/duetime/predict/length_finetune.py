"""Fine-tuning the RLP (``minilm-ft``): LoRA adapters on MiniLM, trained with the bucket head.

The loss is TimeBill's: cross-entropy over length buckets, here through the
encoder as well as the head. LoRA (``peft``) keeps the trainable part small,
so a model file carries ~1.6 MB of adapters instead of a 90 MB encoder.
Training takes minutes on a GPU (``--device cuda``); on a CPU with native
bfloat16 (AVX512-BF16) ~2.5 minutes an epoch on 2 cores, about half the
float32 time (:func:`~duetime.predict.precision.resolve_precision`). The
epoch kept is the one with the lowest validation MAE of the model's readout
(the cross-entropy of 256 classes tracks MAE loosely here).

Epochs run as the frozen head's do (:func:`~duetime.predict.epoch_loop.run_epochs`:
seeded shuffles and dropout, a checkpoint after every epoch, resumption that
refuses other settings or data). On a CPU a resumed run ends with the same
weights as an uninterrupted one; GPU kernels are not bit-reproducible.
"""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from duetime.predict.conformal import BucketCDF
from duetime.predict.epoch_loop import (
    CheckpointError,
    RunControl,
    TrainedEpochs,
    Trainee,
    run_rlp_epochs,
)
from duetime.predict.length_ft_encoder import (
    FT_DIM,
    LORA_TARGETS,
    FinetunedMiniLMEncoder,
    load_base,
    parse_ft_spec,
    pooled_features,
)
from duetime.predict.length_model import HeadWeights, LengthModel, RLPConfig, bucket_of
from duetime.predict.length_model import readout_point as _readout
from duetime.predict.length_tokens import TokenBundle
from duetime.predict.length_train import _mlp, head_weights
from duetime.predict.precision import resolve_precision

WARMUP_FRACTION = 0.05
_PEFT_PREFIX = "base_model.model."


def check_device(device: str) -> None:
    """Refuse a ``--device`` training cannot use, before minutes of loading data.

    Only ``cpu`` and ``cuda[:N]`` are accepted: autocast and precision are chosen
    for those two (:func:`~duetime.predict.precision.resolve_precision`). torch
    itself would fail only at the first ``.to(device)``, after the data loaded.
    """
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {device!r} is not a torch device to train on; use cpu or cuda")
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise ValueError(f"--device {device!r}: torch sees no CUDA GPU here; use cpu")
        if dev.index is not None and dev.index >= n:
            raise ValueError(
                f"--device {device!r}: torch sees {n} CUDA GPU(s), cuda:0 to cuda:{n - 1}"
            )


def _build(cfg: RLPConfig, device: str) -> Any:
    from peft import LoraConfig, get_peft_model
    from torch import nn

    _, layers = parse_ft_spec(cfg.encoder)
    lora = LoraConfig(
        r=cfg.lora_rank, lora_alpha=2 * cfg.lora_rank, target_modules=list(LORA_TARGETS)
    )
    with warnings.catch_warnings():
        # peft asks the model for transformers' deprecated `is_gradient_checkpointing`;
        # the FutureWarning is theirs to fix, and said nothing a user could act on.
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
        bert = get_peft_model(load_base(layers), lora)
    head = _mlp(FT_DIM + 1, cfg.n_classes, cfg.hidden, cfg.dropout)
    return nn.ModuleDict({"bert": bert, "head": head}).to(device)


def _logits(net: Any, seqs: list[np.ndarray], z: np.ndarray, max_tokens: int, device: str) -> Any:
    import torch

    feats = pooled_features(net["bert"], seqs, max_tokens, device)
    zt = torch.as_tensor(z, dtype=torch.float32, device=device)[:, None]
    return net["head"](torch.cat([feats, zt], dim=1)).float()


def export_adapters(net: Any) -> dict[str, np.ndarray]:
    """``<module>.lora_A`` (r × in) and ``<module>.lora_B`` (out × r, scaling folded in),
    rounded to float16: what the model file keeps and inference merges."""
    out = {}
    for name, module in net["bert"].named_modules():
        if not hasattr(module, "lora_A") or "default" not in module.lora_A:
            continue
        plain = name.removeprefix(_PEFT_PREFIX)
        a = module.lora_A["default"].weight.detach().float().cpu().numpy()
        b = module.lora_B["default"].weight.detach().float().cpu().numpy()
        b = b * float(module.scaling["default"])
        out[f"{plain}.lora_A"] = a.astype(np.float16).astype(np.float32)
        out[f"{plain}.lora_B"] = b.astype(np.float16).astype(np.float32)
    return out


def fit_finetuned(
    cfg: RLPConfig,
    bundle: TokenBundle,
    *,
    device: str = "cpu",
    checkpoint: Path | None = None,
    resume: bool = False,
    progress: bool = True,
    stop_after: int | None = None,
    threads: int | None = None,
    precision: str = "auto",
    soft_targets: np.ndarray | None = None,
    soft_identity: str | None = None,
) -> tuple[dict[str, np.ndarray], HeadWeights, TrainedEpochs]:
    """Train adapters and head on ``train``; keep the best-validation-MAE epoch.

    Returns (adapters, head weights, the epochs' record). ``threads`` caps
    torch's CPU threads (``None``: leave them); ``precision`` is the autocast
    of the forward passes (:func:`~duetime.predict.precision.resolve_precision`).
    ``soft_targets`` (one bucket distribution per bundle row, e.g. teachers'
    from :func:`~duetime.predict.length_distill.teacher_distributions`) enter
    the loss with weight ``cfg.soft_weight``; the hard labels keep the rest.
    ``soft_identity`` names where they came from (the teachers' files), for the
    checkpoint; without it the targets' own hash does, which a GPU's teacher pass
    need not reproduce bit for bit.
    """
    import torch

    max_tokens, _ = parse_ft_spec(cfg.encoder)
    check_soft_targets(soft_targets, cfg, len(bundle))
    tr, va = bundle.splits["train"], bundle.splits["val"]
    seqs_tr, seqs_va = bundle.seqs(tr), bundle.seqs(va)
    logp = np.log(np.maximum(bundle.prompt_len, 1).astype(np.float64))
    fm, fs = float(logp[tr].mean()), float(logp[tr].std() or 1.0)
    z = (logp - fm) / fs
    classes = np.minimum(bucket_of(bundle.output_len, cfg.bucket_size), cfg.n_classes) - 1
    y_va = bundle.output_len[va].astype(np.float64)

    torch.manual_seed(cfg.training_seed)
    net = _build(cfg, device)
    trainable = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        [
            {
                "params": [p for n, p in trainable if not n.startswith("head.")],
                "lr": cfg.encoder_lr,
            },
            {"params": [p for n, p in trainable if n.startswith("head.")], "lr": cfg.lr},
        ],
        weight_decay=cfg.weight_decay,
    )
    steps_per_epoch = math.ceil(len(tr) / cfg.batch_size)
    total = max(1, cfg.epochs * steps_per_epoch)
    warm = max(1, int(WARMUP_FRACTION * total))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))),
    )
    precision = resolve_precision(precision, device)
    autocast = torch.autocast(
        "cuda" if device.startswith("cuda") else "cpu",
        dtype=torch.bfloat16,
        enabled=precision == "bf16",
    )

    def train_epoch(gen: Any) -> float:
        net.train()
        loss_sum = 0.0
        perm = torch.randperm(len(tr), generator=gen).numpy()
        batches = tqdm(
            range(0, len(perm), cfg.batch_size),
            unit="batch",
            desc="epoch",
            leave=False,
            disable=not progress,
            file=sys.stderr,
        )
        for lo in batches:
            idx = perm[lo : lo + cfg.batch_size]
            with autocast:
                out = _logits(net, [seqs_tr[i] for i in idx], z[tr[idx]], max_tokens, device)
            target = torch.as_tensor(classes[tr[idx]], device=device)
            loss = torch.nn.functional.cross_entropy(out, target)
            if soft_targets is not None:
                soft = torch.as_tensor(soft_targets[tr[idx]], dtype=torch.float32, device=device)
                soft_loss = torch.nn.functional.cross_entropy(out, soft)
                loss = (1 - cfg.soft_weight) * loss + cfg.soft_weight * soft_loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            loss_sum += loss.item() * len(idx)
        return loss_sum / len(tr)

    trainee = Trainee(
        opt,
        sched,
        train_epoch,
        validate=lambda: _val_mae(net, cfg, seqs_va, z[va], y_va, max_tokens, device, autocast),
        weights=lambda: {n: p.detach().cpu().clone() for n, p in trainable},
        load_weights=lambda state: _load_trainable(net, state),
    )
    identity = {
        "config": asdict(cfg),
        "precision": precision,
        "data": bundle.dataset,
        "split": {k: [len(v), int(v.sum()) if len(v) else 0] for k, v in bundle.splits.items()},
    }
    if soft_targets is not None:  # only then: checkpoints of plain runs keep their identity
        identity["soft_targets"] = soft_identity or targets_digest(soft_targets)
    run = RunControl(checkpoint, resume, progress, stop_after, threads)
    desc = f"fine-tuning {cfg.encoder} (LoRA r={cfg.lora_rank}) on {device}, {precision}"
    epochs = run_rlp_epochs(trainee, cfg, run, score="val_mae_tokens", identity=identity, desc=desc)
    net.eval()
    return export_adapters(net), head_weights(net["head"].cpu(), fm, fs), epochs


def check_soft_targets(soft: np.ndarray | None, cfg: RLPConfig, rows: int) -> None:
    """Refuse targets and a weight that do not go together, before the model is built."""
    if soft is None:
        if cfg.soft_weight > 0:
            raise ValueError(f"soft_weight {cfg.soft_weight} needs soft targets (teachers)")
        return
    if cfg.soft_weight == 0:
        raise ValueError("soft targets given with soft_weight 0: they would not enter the loss")
    if soft.shape != (rows, cfg.n_classes):
        raise ValueError(
            f"soft targets have shape {soft.shape}; need one row per bundle row and one "
            f"column per bucket: ({rows}, {cfg.n_classes})"
        )


def targets_digest(soft: np.ndarray) -> str:
    """A short hash of the soft targets: a checkpoint resumes only with the same teachers."""
    import hashlib

    return hashlib.sha1(np.ascontiguousarray(soft, dtype=np.float32).tobytes()).hexdigest()[:16]


def _load_trainable(net: Any, state: dict[str, Any]) -> None:
    # strict=False: the frozen base weights are missing from ``state`` by design
    _, unexpected = net.load_state_dict(state, strict=False)
    wanted = {n for n, p in net.named_parameters() if p.requires_grad}
    if unexpected or wanted - set(state):
        raise CheckpointError("checkpoint does not hold this model's trainable weights")


def _val_mae(
    net: Any,
    cfg: RLPConfig,
    seqs: list[np.ndarray],
    z: np.ndarray,
    y: np.ndarray,
    max_tokens: int,
    device: str,
    autocast: Any,
) -> float:
    import torch

    net.eval()
    probs = []
    with torch.no_grad(), autocast:
        for lo in range(0, len(seqs), 128):
            out = _logits(net, seqs[lo : lo + 128], z[lo : lo + 128], max_tokens, device)
            probs.append(torch.softmax(out, dim=1).double().cpu().numpy())
    point = _readout(BucketCDF(np.concatenate(probs), cfg.bucket_size), cfg.readout)
    point = np.maximum(np.minimum(point, cfg.max_len), 1.0)
    return float(np.abs(point - y).mean())


def train_finetuned_rlp(
    bundle: TokenBundle,
    cfg: RLPConfig,
    *,
    device: str = "cpu",
    checkpoint: Path | None = None,
    resume: bool = False,
    progress: bool = True,
    coverage: float = 0.9,
    stop_after: int | None = None,
    threads: int | None = None,
    precision: str = "auto",
    soft_targets: np.ndarray | None = None,
    soft_identity: str | None = None,
) -> LengthModel:
    """Fine-tune on ``device``, then calibrate and score with the CPU inference path.

    The conformal scores and test figures come from
    :class:`FinetunedMiniLMEncoder` (adapters merged, as a predictor runs it),
    never from the training-time network, so the file predicts exactly what
    was calibrated. Inference runs in ``precision`` resolved for this CPU
    (``auto``: bfloat16 where it is native), recorded in the file as
    ``infer_precision``.
    """
    adapters, weights, epochs = fit_finetuned(
        cfg,
        bundle,
        device=device,
        checkpoint=checkpoint,
        resume=resume,
        progress=progress,
        stop_after=stop_after,
        threads=threads,
        precision=precision,
        soft_targets=soft_targets,
        soft_identity=soft_identity,
    )
    rlp = calibrate_finetuned(
        bundle,
        cfg,
        adapters,
        weights,
        epochs,
        precision=resolve_precision(precision, "cpu"),
        coverage=coverage,
        threads=threads,
        progress=progress,
    )
    rlp.meta["trained_on"] = device
    rlp.meta["trained_precision"] = resolve_precision(precision, device)
    return rlp


def calibrate_finetuned(
    bundle: TokenBundle,
    cfg: RLPConfig,
    adapters: dict[str, np.ndarray],
    weights: HeadWeights,
    epochs: TrainedEpochs,
    *,
    precision: str = "fp32",
    coverage: float = 0.9,
    threads: int | None = None,
    progress: bool = True,
) -> LengthModel:
    """Conformal scores on ``calib`` and figures on ``test`` through the inference encoder
    in ``precision`` (``fp32`` or ``bf16``), which the model file then records."""
    from duetime.predict.length_data import LengthData
    from duetime.predict.length_fit import calibrated_model

    max_tokens, layers = parse_ft_spec(cfg.encoder)
    enc = FinetunedMiniLMEncoder(max_tokens, layers, adapters, threads=threads, precision=precision)
    rows = np.concatenate([bundle.splits[k] for k in ("calib", "test")])  # all calibration reads
    emb = np.zeros((len(bundle), FT_DIM), dtype=np.float32)
    emb[rows] = enc.encode_ids(bundle.seqs(rows), progress=progress)
    data = LengthData(
        emb, bundle.prompt_len, bundle.output_len, bundle.splits, enc.identity, bundle.dataset
    )
    return calibrated_model(data, cfg, weights, epochs, coverage=coverage, adapters=adapters)
