"""GGUF parsing, GGUF → weights conversion, the safetensors cache, and file errors."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from duetime.engine import Gemma3, GGUFFile, ModelFileError, SeqChunk, load_weights
from duetime.engine import weights as weights_mod
from duetime.engine.testing import tiny_hf_model, write_tiny_gguf


@pytest.fixture(scope="module")
def tiny_hf():
    # 6 layers so the llama.cpp default pattern (every 6th layer global) yields one global layer;
    # query_pre_attn_scalar = head_dim because that is what a GGUF implies for non-27B models.
    return tiny_hf_model(seed=1, num_hidden_layers=6, layer_types=None, query_pre_attn_scalar=16)


@pytest.fixture
def tiny_gguf(tiny_hf, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DUETIME_CACHE", str(tmp_path / "cache"))
    return write_tiny_gguf(tiny_hf, tmp_path / "tiny.gguf", extra_q8_tensor=True)


def test_parser_agrees_with_gguf_reader(tiny_gguf: Path) -> None:
    ours, ref = GGUFFile(tiny_gguf), GGUFReader(tiny_gguf)
    assert set(ours.tensors) == {t.name for t in ref.tensors}
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.offset == t.data_offset
        expected = dequantize(t.data, t.tensor_type).reshape(info.shape)
        np.testing.assert_array_equal(ours.read(t.name), expected)
    assert ours.tensors["extra.q8"].qtype.name == "Q8_0"
    assert ours.get("gemma3.attention.sliding_window") == 4
    assert ours.get("tokenizer.ggml.tokens")[:3] == ["t0", "t1", "t2"]


def test_converted_weights_reproduce_transformers(tiny_hf, tiny_gguf: Path) -> None:
    config, weights = load_weights(tiny_gguf, progress=False)
    assert config.sliding_layers == (True, True, True, True, True, False)
    assert config.rope_theta_local == 10_000.0
    assert config.query_pre_attn_scalar == 16.0
    # norms were stored as 1 + w and must come back as w
    torch.testing.assert_close(
        weights["model.layers.0.input_layernorm.weight"],
        tiny_hf.state_dict()["model.layers.0.input_layernorm.weight"],
    )
    model = Gemma3(config, weights, "fp32")
    ids = torch.randint(0, 256, (11,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = tiny_hf(ids[None]).logits[0]
    kv = model.new_kv_cache()
    got = model.step([SeqChunk(kv.allocate(), ids, 0)], kv, all_logits=True)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


def test_second_load_comes_from_cache(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config, first = load_weights(tiny_gguf, progress=False)
    cached = weights_mod.cache_path(tiny_gguf)
    assert cached.is_file()

    def no_gguf(*_a: object, **_k: object) -> None:
        raise AssertionError("the GGUF must not be parsed when the cache is valid")

    monkeypatch.setattr(weights_mod, "GGUFFile", no_gguf)
    config2, second = load_weights(tiny_gguf, progress=False)
    assert config2 == config
    assert first.keys() == second.keys()
    for k in first:
        assert torch.equal(first[k], second[k]), k


def test_corrupt_cache_is_rebuilt(tiny_gguf: Path) -> None:
    load_weights(tiny_gguf, progress=False)
    cached = weights_mod.cache_path(tiny_gguf)
    cached.write_bytes(b"not a safetensors file")
    _, weights = load_weights(tiny_gguf, progress=False)
    assert "model.embed_tokens.weight" in weights
    assert cached.stat().st_size > 1000


def test_changed_gguf_gets_a_new_cache_and_old_one_is_dropped(tiny_gguf: Path) -> None:
    load_weights(tiny_gguf, progress=False)
    old = weights_mod.cache_path(tiny_gguf)
    st = tiny_gguf.stat()
    os.utime(tiny_gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    load_weights(tiny_gguf, progress=False)
    new = weights_mod.cache_path(tiny_gguf)
    assert new != old
    assert new.is_file()
    assert not old.exists()


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.gguf"
    with pytest.raises(ModelFileError, match="does not exist") as err:
        load_weights(path, use_cache=False)
    assert str(path) in str(err.value)


def test_random_bytes(tmp_path: Path) -> None:
    path = tmp_path / "noise.gguf"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ModelFileError, match="not a GGUF file") as err:
        load_weights(path, use_cache=False)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("keep_fraction", [0.0005, 0.05, 0.5, 0.999])
def test_truncated_copy(tiny_gguf: Path, tmp_path: Path, keep_fraction: float) -> None:
    data = tiny_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: max(24, int(len(data) * keep_fraction))])
    with pytest.raises(ModelFileError, match="truncated") as err:
        load_weights(cut, use_cache=False)
    assert str(cut) in str(err.value)


def test_truncated_real_file_head(tmp_path: Path) -> None:
    """The first megabyte of the real file: the tokenizer arrays are cut mid-way."""
    real = weights_mod.default_gguf_path()
    with real.open("rb") as f:
        head = f.read(1 << 20)
    cut = tmp_path / "gemma-head.gguf"
    cut.write_bytes(head)
    with pytest.raises(ModelFileError, match="truncated") as err:
        GGUFFile(cut)
    assert "tokenizer.ggml.tokens" in str(err.value)


def test_wrong_architecture(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "llama.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match="architecture is 'llama'"):
        load_weights(path, use_cache=False)
