"""TimeBill's bucketing (Eq. 2) and the readouts of a known bucket distribution."""

from __future__ import annotations

import numpy as np
import pytest

from duetime.predict.conformal import BucketCDF
from duetime.predict.length_model import (
    HeadWeights,
    RLPConfig,
    bucket_length,
    bucket_of,
    predict_buckets,
    readout_point,
    soft_labels,
)


def test_bucket_label_is_ceil_of_length_over_b():
    lengths = np.array([1, 15, 16, 17, 32, 33, 4096])
    assert bucket_of(lengths, 16).tolist() == [1, 1, 1, 2, 2, 3, 256]
    assert bucket_of(0, 16).tolist() == 1  # an empty answer still counts as bucket 1


def test_eq2_caps_the_bucket_edge_at_n_max():
    # N̂ = min(N_max, n̂·B)
    assert bucket_length(np.array([1, 3, 10]), 16, 100).tolist() == [16, 48, 100]
    assert bucket_length(5, 16, np.array([64, 80, 81])).tolist() == [64, 80, 80]


def test_config_classes_and_validation():
    assert RLPConfig(bucket_size=16, max_len=4096).n_classes == 256
    assert RLPConfig(bucket_size=16, max_len=4100).n_classes == 257
    with pytest.raises(ValueError, match="readout"):
        RLPConfig(readout="mode")
    with pytest.raises(ValueError, match="bucket_size"):
        RLPConfig(bucket_size=0)


def _constant_head(logits: np.ndarray, dim: int = 3) -> HeadWeights:
    """A linear head whose output ignores the input: every prompt gets ``logits``."""
    w1 = np.zeros((dim + 1, len(logits)), dtype=np.float32)
    return HeadWeights(w1, logits.astype(np.float32))


def test_readouts_of_a_known_distribution():
    cfg = RLPConfig(bucket_size=16, max_len=128)  # 8 classes
    probs = np.array([[0.1, 0.2, 0.4, 0.3, 0, 0, 0, 0]])
    cdf = BucketCDF(probs, 16)
    assert readout_point(cdf, "argmax")[0] == 3 * 16  # bucket n̂ = 3 → 48 tokens
    # median: CDF reaches 0.5 at 0.3 + 0.4·f, f = 0.5 → 2 buckets + half of bucket 3
    assert readout_point(cdf, "median")[0] == pytest.approx(2.5 * 16)
    centres = (np.arange(8) + 0.5) * 16
    assert readout_point(cdf, "mean")[0] == pytest.approx(float(probs[0] @ centres))
    with np.errstate(divide="ignore"):
        head = _constant_head(np.log(np.maximum(probs[0], 1e-12)))
    emb = np.zeros((2, 3), dtype=np.float32)
    out = predict_buckets(head, cfg, emb, np.array([10, 10]), np.array([128, 40]), readout="argmax")
    assert out.point.tolist() == [48.0, 40.0]  # the second is capped by its N_max
    assert out.bucket.tolist() == [3, 3]


def test_cdf_and_quantile_are_inverse():
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(20), size=50)
    cdf = BucketCDF(probs, 16)
    for q in (0.05, 0.3, 0.5, 0.9, 0.99):
        y = cdf.quantile(q)
        assert np.allclose(cdf.cdf(y), q, atol=1e-9)


def test_interval_contains_point_and_respects_n_max():
    cfg = RLPConfig(bucket_size=16, max_len=256)
    rng = np.random.default_rng(1)
    head = HeadWeights(rng.normal(size=(5, 16)).astype(np.float32), np.zeros(16, np.float32))
    emb = rng.normal(size=(100, 4)).astype(np.float32)
    n_max = rng.integers(1, 300, size=100)
    for readout in ("argmax", "median", "mean"):
        out = predict_buckets(
            head, cfg, emb, np.full(100, 50), n_max, readout=readout, levels=(0.05, 0.95)
        )
        assert np.all(out.lo <= out.point)
        assert np.all(out.point <= out.hi)
        assert np.all(out.hi <= n_max)
        assert np.all(out.lo >= 0)


def test_soft_labels_are_distributions_peaked_at_the_class():
    labels = soft_labels(np.array([0, 5, 9]), 10, sigma=1.5)
    assert np.allclose(labels.sum(axis=1), 1.0)
    assert labels.argmax(axis=1).tolist() == [0, 5, 9]
    assert soft_labels(np.array([2]), 4, 0.0).tolist() == [[0, 0, 1, 0]]
