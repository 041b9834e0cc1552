"""The 400s and 404s a generation request gets before admission: the model it names,
and prompts the model cannot take."""

from __future__ import annotations

from duetime.server.errors import ApiError
from duetime.server.server_state import ServerConfig

__all__ = ["check_model", "check_prompt"]


def check_model(cfg: ServerConfig, model: str | None) -> None:
    """A 404 where the request names another model (None: this one)."""
    if model is not None and model != cfg.model_name:
        raise ApiError(
            404,
            f"model {model!r} does not exist; this server serves {cfg.model_name!r}",
            type="not_found_error",
            param="model",
            code="model_not_found",
        )


def check_prompt(cfg: ServerConfig, ids: list[int], max_tokens: int, which: str) -> None:
    """A 400 for a prompt the model cannot take (``which`` names it among several)."""
    if any(i >= cfg.vocab_size for i in ids):
        raise ApiError(400, f"{which}prompt token ids must be < {cfg.vocab_size}", param="prompt")
    if len(ids) >= cfg.max_context:
        raise ApiError(
            400,
            f"{which}the prompt ({len(ids)} tokens) leaves no room in the context length "
            f"{cfg.max_context}",
            param="prompt",
            code="context_length_exceeded",
        )
    if len(ids) + max_tokens > cfg.max_context:
        raise ApiError(
            400,
            f"{which}prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
            f"context length {cfg.max_context}",
            param="max_tokens",
            code="context_length_exceeded",
        )
