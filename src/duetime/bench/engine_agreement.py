"""Top-1 agreement of a fast engine variant with the exact fp32 reference.

`duetime bench engine` reports it beside the speed of every non-exact
variant (``fast``, ``q8``, ...): speed bought by changing the answers would
not be a like-for-like comparison.
"""

from __future__ import annotations

import torch

from duetime.engine.batch import SeqChunk
from duetime.engine.config import Gemma3Config
from duetime.engine.gemma3 import Gemma3

__all__ = ["agreement", "agreement_prompts"]

_TEXTS = (
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Explain why the sky is blue in two sentences.",
)


@torch.no_grad()
def agreement(
    ref: Gemma3, other: Gemma3, prompts: list[list[int]], n: int, *, decode: bool = True
) -> tuple[float, int]:
    """Share of teacher-forced positions where ``other``'s arg-max equals ``ref``'s.

    ``ref`` continues each prompt greedily for ``n`` tokens and scores prompt +
    continuation in one step. ``other`` scores the same text the way it would
    generate it (``decode=True``): the prompt in one step, then one token per
    step — the single-row products that ``q8``'s int8 kernel serves (a one-step
    score would run ``q8`` on its multi-row fp32 path and hide the kernel), each
    step reading only its arg-max as greedy decoding does (``q8``'s int4 ranking). With
    ``decode=False`` it scores everything in one step too. Returns (share, positions).
    """
    from duetime.engine.generate import greedy_generate

    conts = greedy_generate(ref, prompts, n)
    hits = total = 0
    for p, c in zip(prompts, conts, strict=True):
        ids = p + c
        kv = ref.new_kv_cache()
        logits = ref.step([SeqChunk(kv.allocate(), ids, 0)], kv, all_logits=True)
        want = logits[len(p) - 1 : -1].argmax(-1)
        kv = other.new_kv_cache()
        slot = kv.allocate()
        if decode:
            rows = [other.greedy_step([SeqChunk(slot, p, 0)], kv)]
            rows += [
                other.greedy_step([SeqChunk(slot, [t], len(p) + i)], kv)
                for i, t in enumerate(c[:-1])
            ]
            got = torch.cat(rows)
        else:
            got = other.step([SeqChunk(slot, ids, 0)], kv, all_logits=True)[len(p) - 1 : -1]
            got = got.argmax(-1)
        hits += int((want == got).sum())
        total += len(c)
    return hits / max(total, 1), total


def agreement_prompts(real: bool, cfg: Gemma3Config, g: torch.Generator) -> list[list[int]]:
    if real:
        try:
            from duetime.tokenizer import encode

            return [encode(t) for t in _TEXTS]
        except Exception:  # the tokenizer is optional here: random ids still work
            pass
    lo = min(3, cfg.vocab_size - 1)
    return [
        [cfg.bos_token_id, *torch.randint(lo, cfg.vocab_size, (11,), generator=g).tolist()]
        for _ in range(3)
    ]
