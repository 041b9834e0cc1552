"""The embedded CPU engine, model half: Gemma 3 weights, forward and KV cache.

Typical use by an executor::

    model = load_model(dtype="fp32")
    kv = model.new_kv_cache()
    slot = kv.allocate()
    logits = model.step([SeqChunk(slot, prompt_ids, 0)], kv)   # [1, vocab]
    ...
    kv.free(slot)
"""

from duetime.engine.batch import SeqChunk
from duetime.engine.config import Gemma3Config
from duetime.engine.gemma3 import Dtype, Gemma3
from duetime.engine.generate import greedy_generate
from duetime.engine.gguf_file import GGUFFile, ModelFileError
from duetime.engine.kv_cache import KVCache
from duetime.engine.load import load_model
from duetime.engine.weights import load_weights

__all__ = [
    "Dtype",
    "GGUFFile",
    "Gemma3",
    "Gemma3Config",
    "KVCache",
    "ModelFileError",
    "SeqChunk",
    "greedy_generate",
    "load_model",
    "load_weights",
]
