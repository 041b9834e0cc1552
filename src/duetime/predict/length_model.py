"""TimeBill's fine-grained response-length classifier: a head over frozen prompt embeddings.

TimeBill (§4.1, Eq. 2) predicts the *bucket* ``n = ⌈N / B⌉`` of the answer
length ``N`` instead of ``N`` itself, with ``⌈N_model / B⌉`` classes, and
reports ``N̂ = min(N_max, n̂·B)``: the upper edge of the predicted bucket,
capped by the request's generation limit. We keep that readout (``argmax``)
and add two that use the whole predicted distribution: ``median`` (the
length where the bucket CDF reaches ½, interpolated within the bucket: the
MAE-optimal point) and ``mean`` (the expected length: the MSE-optimal one).

Inputs are one :mod:`~duetime.predict.length_features` embedding per prompt
plus the standardised ``log`` of the prompt's token count (public: every
request carries it). The head is a one-hidden-layer MLP (``hidden=0``: a
linear softmax), trained with cross-entropy, optionally against labels
smoothed over neighbouring buckets (``label_sigma``, in buckets), which
tells the loss that bucket 20 is a better miss than bucket 200.

Inference is numpy: a 400-input MLP costs tens of microseconds, well below the
encoder. Weights are kept in float16 *before* calibration, so the shipped file
predicts exactly what was calibrated.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from duetime.predict.conformal import BucketCDF
from duetime.predict.npz_file import NpzKind
from duetime.predict.precision import INFER_PRECISIONS

if TYPE_CHECKING:
    from duetime.predict.length_features import MiniLMEncoder
    from duetime.predict.length_ft_encoder import FinetunedMiniLMEncoder

Readout = Literal["argmax", "median", "mean"]
READOUTS: tuple[str, ...] = ("argmax", "median", "mean")


def bucket_of(lengths: np.ndarray | int, bucket_size: int) -> np.ndarray:
    """TimeBill's label ``n = ⌈N / B⌉`` (1-based; a length of 0 counts as bucket 1)."""
    n = np.ceil(np.asarray(lengths, dtype=np.float64) / bucket_size).astype(np.int64)
    return np.maximum(n, 1)


def bucket_length(
    n_hat: np.ndarray | int, bucket_size: int, n_max: np.ndarray | float
) -> np.ndarray:
    """Eq. 2: ``N̂ = min(N_max, n̂·B)``."""
    return np.minimum(np.asarray(n_max, dtype=np.float64), np.asarray(n_hat) * bucket_size)


@dataclass(slots=True)
class RLPConfig:
    """Hyper-parameters of the response-length predictor (RLP)."""

    bucket_size: int = 16  # B, tokens per bucket (TimeBill's finest setting)
    max_len: int = 4096  # N_model: ⌈max_len / B⌉ classes; longer answers fall in the last
    encoder: str = "minilm:64"  # see length_features.make_encoder
    hidden: int = 256  # MLP width; 0 gives a linear softmax head
    dropout: float = 0.2
    label_sigma: float = 0.0  # Gaussian label smoothing over buckets (0: hard labels, as TimeBill)
    epochs: int = 40
    batch_size: int = 256
    lr: float = 1e-3
    weight_decay: float = 1e-4
    readout: str = "median"  # default readout; argmax is TimeBill's Eq. 2
    seed: int = 0  # of the split, and of the training unless train_seed says otherwise
    lora_rank: int = 16  # minilm-ft only: rank of the encoder's LoRA adapters
    encoder_lr: float = 5e-4  # minilm-ft only: learning rate of the adapters (lr is the head's)
    soft_weight: float = 0.0  # minilm-ft only: weight of the teachers' distribution in the loss
    train_seed: int | None = None  # initialisation, shuffles, dropout; None: seed

    @property
    def training_seed(self) -> int:
        """The training's seed: ``train_seed`` where given (other models on the same
        split: an ensemble's teachers), else the split's ``seed``."""
        return self.seed if self.train_seed is None else self.train_seed

    def __post_init__(self) -> None:
        # each names the field and the command line's option for it (train-length's)
        if self.bucket_size < 1:
            raise ValueError(f"bucket_size (--bucket-size) must be >= 1, got {self.bucket_size}")
        if self.max_len < self.bucket_size:
            raise ValueError(
                f"max_len (--max-len) must be >= bucket_size (--bucket-size) "
                f"{self.bucket_size}, got {self.max_len}"
            )
        if self.readout not in READOUTS:
            raise ValueError(
                f"readout (--readout) must be one of {', '.join(READOUTS)}, got {self.readout!r}"
            )
        if self.hidden < 0:
            raise ValueError(f"hidden (--hidden) must be >= 0, got {self.hidden}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout (--dropout) must be in [0, 1), got {self.dropout}")
        if not self.label_sigma >= 0:
            raise ValueError(f"label_sigma (--label-sigma) must be >= 0, got {self.label_sigma}")
        if not 0 <= self.soft_weight <= 1:
            raise ValueError(
                f"soft_weight (--soft-weight) must be in [0, 1], got {self.soft_weight}"
            )

    @property
    def n_classes(self) -> int:
        return math.ceil(self.max_len / self.bucket_size)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RLPConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def prompt_len_feature(prompt_len: np.ndarray) -> np.ndarray:
    """``log`` of the prompt's token count: its scale spans 1 to 10⁴⁺ tokens."""
    return np.log(np.maximum(np.asarray(prompt_len, dtype=np.float64), 1.0))


def soft_labels(classes: np.ndarray, n_classes: int, sigma: float) -> np.ndarray:
    """One-hot rows (``sigma == 0``) or Gaussian bumps of width ``sigma`` buckets."""
    if sigma == 0:
        out = np.zeros((len(classes), n_classes), dtype=np.float32)
        out[np.arange(len(classes)), classes] = 1.0
        return out
    grid = np.arange(n_classes)[None, :]
    w = np.exp(-0.5 * ((grid - classes[:, None]) / sigma) ** 2)
    return (w / w.sum(axis=1, keepdims=True)).astype(np.float32)


@dataclass(slots=True, eq=False)
class HeadWeights:
    """The MLP as numpy arrays (float16 on disk, float32 in use)."""

    w1: np.ndarray
    b1: np.ndarray
    w2: np.ndarray | None = None  # None for a linear head (w1 maps straight to classes)
    b2: np.ndarray | None = None
    feat_mean: float = 0.0  # standardisation of the log prompt length
    feat_std: float = 1.0

    def check(self, n_classes: int) -> None:
        """Raise ``ValueError`` unless the arrays chain into ``n_classes`` finite logits.

        A damaged file otherwise loaded: NaN weights answered every prompt with
        one bucket, and mismatched shapes failed at the first prediction in
        numpy's matmul, naming no file.
        """
        layers = [(self.w1, self.b1)] + ([(self.w2, self.b2)] if self.w2 is not None else [])
        if (self.w2 is None) != (self.b2 is None):
            raise ValueError("w2 and b2 come together")
        width = self.w1.shape[0] if self.w1.ndim == 2 else -1
        for i, (w, b) in enumerate(layers, 1):
            if w.ndim != 2 or w.shape[0] != width or b is None or b.shape != (w.shape[1],):
                raise ValueError(f"layer {i} has shapes w {w.shape}, b {getattr(b, 'shape', None)}")
            width = w.shape[1]
        if width != n_classes:
            raise ValueError(f"the head gives {width} logits for {n_classes} buckets")
        values = [*(a for layer in layers for a in layer), [self.feat_mean, self.feat_std]]
        if not all(np.isfinite(np.asarray(a, np.float64)).all() for a in values):
            raise ValueError("weights are not all finite")
        if not self.feat_std > 0:
            raise ValueError(f"feat_std must be > 0, got {self.feat_std}")

    def arrays(self) -> dict[str, np.ndarray]:
        out = {"w1": self.w1, "b1": self.b1}
        if self.w2 is not None and self.b2 is not None:
            out |= {"w2": self.w2, "b2": self.b2}
        return out

    def logits(self, emb: np.ndarray, prompt_len: np.ndarray) -> np.ndarray:
        z = (prompt_len_feature(prompt_len) - self.feat_mean) / self.feat_std
        x = np.concatenate([np.asarray(emb, np.float32), z[:, None].astype(np.float32)], axis=1)
        h = x @ self.w1 + self.b1
        if self.w2 is None or self.b2 is None:
            return h
        from scipy.special import erf

        h = 0.5 * h * (1.0 + erf(h / math.sqrt(2.0)))  # exact GELU, as torch's default
        return h @ self.w2 + self.b2

    def probs(self, emb: np.ndarray, prompt_len: np.ndarray) -> np.ndarray:
        logits = self.logits(emb, prompt_len).astype(np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        return p / p.sum(axis=1, keepdims=True)


@dataclass(slots=True, eq=False)
class BucketPrediction:
    """Per-row outputs of :meth:`LengthModel.predict` (arrays of length n)."""

    point: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    bucket: np.ndarray  # n̂, 1-based (the argmax bucket, whatever the readout)
    probs: np.ndarray = field(repr=False)


def readout_point(cdf: BucketCDF, readout: str) -> np.ndarray:
    """The point estimate (uncapped) a readout takes from the bucket distribution."""
    b = cdf.bucket_size
    if readout == "argmax":
        return (cdf.probs.argmax(axis=1) + 1.0) * b  # n̂·B
    if readout == "median":
        return cdf.quantile(0.5)
    if readout == "mean":
        centres = (np.arange(cdf.probs.shape[1]) + 0.5) * b
        return cdf.probs @ centres
    raise ValueError(f"unknown readout {readout!r}; use one of {READOUTS}")


def predict_buckets(
    weights: HeadWeights,
    cfg: RLPConfig,
    emb: np.ndarray,
    prompt_len: np.ndarray,
    n_max: np.ndarray | float,
    *,
    readout: str | None = None,
    levels: tuple[float, float] | None = None,
) -> BucketPrediction:
    """Point (Eq. 2 for ``argmax``) and, given CDF ``levels``, the interval, all capped at N_max.

    The interval is widened to contain the point if a readout lands outside
    it (``argmax`` can): widening never loses coverage.
    """
    probs = weights.probs(emb, prompt_len)
    cdf = BucketCDF(probs, cfg.bucket_size)
    n_max = np.broadcast_to(np.asarray(n_max, dtype=np.float64), (len(probs),))
    point = np.minimum(readout_point(cdf, readout or cfg.readout), n_max)
    point = np.maximum(point, 1.0)
    if levels is None:
        lo = hi = point
    else:
        lo = np.minimum(np.floor(cdf.quantile(levels[0])), point)
        hi = np.minimum(np.maximum(np.ceil(cdf.quantile(levels[1])), point), n_max)
        lo = np.clip(lo, 0.0, point)
    return BucketPrediction(point, lo, hi, probs.argmax(axis=1) + 1, probs)


def config_dict(cfg: RLPConfig) -> dict[str, Any]:
    return asdict(cfg)


# --- the model file ----------------------------------------------------------------------------

MODEL_FORMAT = "duetime-rlp"
# Bump when the file layout, the features or the head's meaning change; old files then refuse
# to load with ModelVersionError instead of predicting garbage. 2: encoder adapters
# (minilm-ft) and the split that keeps duplicated chats together.
MODEL_VERSION = 2
_ADAPTER = "adapter:"  # prefix of the encoder's adapter arrays inside the .npz


class ModelVersionError(ValueError):
    """A model file this version of duetime cannot read."""


#: The model's file kind: what its header must name, and how a refused file is named.
_MODEL_FILE = NpzKind(
    fmt=MODEL_FORMAT,
    version=MODEL_VERSION,
    what="duetime length-model file",
    fix="retrain it with `duetime predict train-length`",
    error=ModelVersionError,
)


@dataclass(slots=True, eq=False)
class LengthModel:
    """A trained RLP: config, head weights, conformal scores, and where it came from.

    ``conformal_scores`` are the sorted ``|F̂(y) − ½|`` of the calibration
    split (see :class:`~duetime.predict.conformal.DistributionConformal`), so
    any coverage can be asked for at prediction time. ``adapters`` are a
    fine-tuned encoder's LoRA weights (``minilm-ft``; empty for frozen
    encoders). ``meta`` records the encoder identity, the dataset, the split
    sizes and the test metrics.
    """

    config: RLPConfig
    weights: HeadWeights
    conformal_scores: np.ndarray
    meta: dict[str, Any] = field(default_factory=dict)
    adapters: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def infer_precision(self) -> str:
        """The precision its encoder runs in, as it was calibrated (``fp32`` for files
        written before the field existed, which were all calibrated in float32)."""
        return str(self.meta.get("infer_precision", "fp32"))

    def encoder(self, *, threads: int | None = 1) -> MiniLMEncoder | FinetunedMiniLMEncoder:
        """The prompt encoder this model reads, as its scores were calibrated (adapters
        merged, precision where this CPU runs it natively)."""
        from duetime.predict.length_features import make_encoder
        from duetime.predict.precision import runtime_precision

        return make_encoder(
            self.config.encoder,
            threads=threads,
            adapters=self.adapters,
            precision=runtime_precision(self.infer_precision),
        )

    def levels(self, coverage: float) -> tuple[float, float]:
        from duetime.predict.conformal import DistributionConformal

        return DistributionConformal(self.conformal_scores).levels(coverage)

    def predict(
        self,
        emb: np.ndarray,
        prompt_len: np.ndarray,
        n_max: np.ndarray | float,
        *,
        coverage: float | None = 0.9,
        readout: str | None = None,
    ) -> BucketPrediction:
        """Points and ``coverage`` intervals for embedded prompts (``None``: no interval)."""
        levels = None if coverage is None else self.levels(coverage)
        return predict_buckets(
            self.weights, self.config, emb, prompt_len, n_max, readout=readout, levels=levels
        )

    def save(self, path: str | Path) -> Path:
        """Write an ``.npz`` (no pickles): float16 weights, float32 scores, JSON metadata."""
        header = {
            "config": asdict(self.config),
            "feat_mean": self.weights.feat_mean,
            "feat_std": self.weights.feat_std,
            "meta": self.meta,
        }
        arrays = {k: v.astype(np.float16) for k, v in self.weights.arrays().items()}
        arrays |= {_ADAPTER + k: v.astype(np.float16) for k, v in self.adapters.items()}
        arrays["conformal_scores"] = self.conformal_scores.astype(np.float32)
        return _MODEL_FILE.save(path, header, arrays)

    @classmethod
    def load(cls, path: str | Path) -> LengthModel:
        """Read a model file; another format or version raises :class:`ModelVersionError`."""
        header, data = _MODEL_FILE.load(path)
        arr = {k: data[k].astype(np.float32) for k in ("w1", "b1", "w2", "b2") if k in data}
        adapters = {
            k.removeprefix(_ADAPTER): v.astype(np.float32)
            for k, v in data.items()
            if k.startswith(_ADAPTER)
        }
        # A file of the right format and version can still lack a piece (hand-made, or
        # corrupt): name the file and the piece rather than fail on a bare key.
        try:
            scores = data["conformal_scores"].astype(np.float64)
            weights = HeadWeights(
                arr["w1"],
                arr["b1"],
                arr.get("w2"),
                arr.get("b2"),
                float(header["feat_mean"]),
                float(header["feat_std"]),
            )
            config = RLPConfig.from_dict(header["config"])
            weights.check(config.n_classes)
            if not np.isfinite(scores).all():
                raise ValueError("conformal scores are not all finite")
        except KeyError as e:
            raise ModelVersionError(f"{path}: length-model file lacks {e}") from None
        except (TypeError, ValueError, AttributeError) as e:
            raise ModelVersionError(f"{path}: malformed length-model file ({e})") from None
        meta = header.get("meta", {})
        if not isinstance(meta, dict):  # an AttributeError traceback on meta.get
            raise ModelVersionError(f"{path}: malformed length-model file (meta is not an object)")
        if meta.get("infer_precision", "fp32") not in INFER_PRECISIONS:
            raise ValueError(
                f"{path}: infer_precision {meta['infer_precision']!r} is not one of "
                f"{INFER_PRECISIONS}; retrain it with `duetime predict train-length`"
            )
        return cls(config, weights, scores, meta, adapters)
