"""`duetime bench engine` on a tiny random model: structure and sanity, not speed."""

from __future__ import annotations

import json
import math

import pytest
import torch

from duetime.bench import engine_machine, engine_speed
from duetime.engine.config import Gemma3Config
from duetime.engine.testing import tiny_hf_model


@pytest.fixture(scope="module")
def fig():
    hf = tiny_hf_model(seed=0)
    source = (Gemma3Config.from_hf(hf.config), dict(hf.state_dict()))
    return engine_speed.run(
        source, quick=True, engines=("fp32", "fast", "fp32-mkl"), reps=2, progress=False
    )


def test_structure_and_units(fig) -> None:
    assert set(fig["variants"]) == {
        "fp32",
        "fast",
        "fp32-mkl",
        "transformers-fp32",
        "transformers-bf16",
    }
    assert fig["memory_bandwidth_gb_s"] > 0
    assert fig["peak_rss_mib"] is None or fig["peak_rss_mib"] > 0
    assert fig["shared_weights_rss_mib"] < 50  # the tiny model's weights: in memory already
    for name, v in fig["variants"].items():
        assert [c["tokens"] for c in v["prefill"]] == fig["settings"]["prefill_tokens"], name
        assert [c["batch"] for c in v["decode"]] == fig["settings"]["batch_sizes"], name
        for c in v["prefill"]:
            assert c["prefill_tok_s"] > 0
            assert math.isfinite(c["prefill_tok_s"])
        for c in v["decode"]:
            assert c["decode_tok_s"] > 0
            assert c["roofline_tok_s"] > 0
            assert c["step_ms_best"] <= c["step_ms"]
            assert c["decode_tok_s"] == pytest.approx(c["batch"] / c["step_ms"] * 1e3)


def test_ratios_agreement_and_notes(fig) -> None:
    r = fig["ratios"]["fp32"]
    assert set(r) == {
        "speedup_vs_transformers_fp32",
        "speedup_vs_transformers_bf16",
        "speedup_vs_fp32_mkl",
    }
    assert set(r["speedup_vs_transformers_bf16"]) == {
        "prefill_16",
        "prefill_64",
        "decode_b1",
        "decode_b4",
    }
    assert all(x > 0 for x in r["speedup_vs_fp32_mkl"].values())
    a = fig["agreement"]["fast"]
    assert a["positions"] > 0
    assert 0.8 <= a["top1_agreement_vs_fp32"] <= 1.0  # rescored top-k: the arg-max is fp32's
    assert any("llama.cpp" in n for n in fig["notes"])
    json.dumps(fig, allow_nan=False)


def test_table_and_plot(fig, tmp_path) -> None:
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(engine_speed.table(fig))
    text = console.export_text()
    assert "transformers-bf16" in text
    assert "decode b4" in text
    png = engine_speed.plot(fig, tmp_path / "engine.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_variant_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown engine variant"):
        engine_speed.run(quick=True, engines=("fp64",), progress=False)


def test_shared_weights_are_paged_in_before_any_variant_is_measured(tmp_path) -> None:
    """A memory-mapped weight file's pages count once, here, not in the first variant's
    own RSS: reading them raises RSS by about the file's size, and a second read adds
    nothing."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = tmp_path / "w.safetensors"
    save_file({f"w{i}": torch.randn(1024, 1024) for i in range(16)}, str(path))  # 64 MB
    with safe_open(str(path), framework="pt") as f:
        weights = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open API)
    first = engine_machine.page_in(weights)
    again = engine_machine.page_in(weights)
    assert first > 40
    assert again < 8


def test_every_variant_is_compared_with_the_earlier_kernels_it_keeps() -> None:
    from duetime.bench.engine_speed_report import ratios

    def variant(b1: float) -> dict:
        return {"kind": "engine", "prefill": [], "decode": [{"batch": 1, "decode_tok_s": b1}]}

    r = ratios({"q8": variant(110.0), "q8-unfused": variant(100.0), "fp32-mkl": variant(50.0)})
    assert r["q8"]["speedup_vs_q8_unfused"] == {"decode_b1": pytest.approx(1.1)}
    assert r["q8"]["speedup_vs_fp32_mkl"] == {"decode_b1": pytest.approx(2.2)}
    assert "speedup_vs_q8_unfused" not in r["q8-unfused"]  # not against itself
    assert engine_speed.ENGINE_VARIANTS["q8-unfused"] == {"dtype": "q8", "fused_norms": False}
    assert "fused_norms" in engine_speed.MODEL_SWITCHES
