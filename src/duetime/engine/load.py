"""One call from a GGUF path (or the packaged Gemma 3 270M) to a ready model."""

from __future__ import annotations

from pathlib import Path

from duetime.engine.gemma3 import Dtype, Gemma3
from duetime.engine.q8_cache import Q8Store, q8_cache_path
from duetime.engine.weights import cache_path, default_gguf_path, load_weights

__all__ = ["load_model"]


def load_model(
    gguf_path: str | Path | None = None,
    *,
    dtype: Dtype = "fp32",
    int8_output: bool | None = None,
    packed: bool | None = None,
    use_cache: bool = True,
    progress: bool = True,
) -> Gemma3:
    """Load Gemma 3 for the engine: converts the GGUF once, then starts from the cache.

    ``dtype="fp32"`` is the exact reference; ``"fast"`` adds an int8 output layer
    with fp32 re-scoring of its top candidates (see :class:`Gemma3`); ``"q8"``
    adds the int8 decode kernel, its int8 weights cached beside the fp32 ones.

    Raises :class:`~duetime.engine.gguf_file.ModelFileError` if the file is missing,
    truncated or corrupt.
    """
    config, weights = load_weights(gguf_path, use_cache=use_cache, progress=progress)
    if dtype != "q8":
        return Gemma3(config, weights, dtype, int8_output=int8_output, packed=packed)
    path = Path(gguf_path) if gguf_path is not None else default_gguf_path()
    store = Q8Store(q8_cache_path(cache_path(path)) if use_cache else None)
    model = Gemma3(
        config, weights, dtype, int8_output=int8_output, packed=packed, q8_quantize=store.quantize
    )
    store.save()
    return model
