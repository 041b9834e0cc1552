"""A reference greedy loop over :meth:`Gemma3.step`, for tests, demos and quick benchmarks.

It is deliberately naive (not the executor): every step, each sequence still
reading its prompt contributes its next chunk of at most ``chunk_size`` tokens
and every other live sequence contributes one decode token, so with prompts of
different lengths most steps mix prefill chunks and decodes.
"""

from __future__ import annotations

from collections.abc import Sequence

from duetime.engine.batch import SeqChunk
from duetime.engine.gemma3 import Gemma3
from duetime.engine.kv_cache import KVCache

__all__ = ["greedy_generate"]


def greedy_generate(
    model: Gemma3,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    chunk_size: int | None = None,
    kv: KVCache | None = None,
    stop_at_eos: bool = False,
) -> list[list[int]]:
    """Greedy continuation of every prompt, all sequences batched in each step.

    Returns the generated ids (not the prompts). Frees the sequences' KV at the end.
    """
    assert all(len(p) > 0 for p in prompts), "prompts must be non-empty"
    kv = kv if kv is not None else model.new_kv_cache()
    slots = [kv.allocate(len(p) + max_new_tokens) for p in prompts]
    fed = [0] * len(prompts)  # prompt tokens already run
    out: list[list[int]] = [[] for _ in prompts]
    done = [max_new_tokens == 0] * len(prompts)
    eos = model.config.eos_token_id
    try:
        while not all(done):
            chunks, owners = [], []
            for i, p in enumerate(prompts):
                if done[i]:
                    continue
                if fed[i] < len(p):
                    n = len(p) - fed[i] if chunk_size is None else min(chunk_size, len(p) - fed[i])
                    chunks.append(SeqChunk(slots[i], list(p[fed[i] : fed[i] + n]), fed[i]))
                    fed[i] += n
                else:
                    chunks.append(SeqChunk(slots[i], [out[i][-1]], kv.seq_len(slots[i])))
                owners.append(i)
            next_ids = model.greedy_step(chunks, kv).tolist()
            for i, tok in zip(owners, next_ids, strict=True):
                if fed[i] < len(prompts[i]):
                    continue  # mid-prompt chunk: its logits are not a prediction we use
                out[i].append(tok)
                if len(out[i]) >= max_new_tokens or (stop_at_eos and tok == eos):
                    done[i] = True
    finally:
        for s in slots:
            kv.free(s)
    return out
