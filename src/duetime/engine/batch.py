"""The plain data of one engine step: which tokens of which sequences to run.

One step mixes prefill chunks and single-token decodes of sequences of any
length (a "varlen" step): every chunk's tokens are laid end to end in one flat
``[T]`` tensor so the dense layers run once for the whole step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["SeqChunk", "StepBatch"]


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """Run ``token_ids`` of the sequence in ``slot``, the first at ``start_pos``.

    ``start_pos`` must equal the cache's ``seq_len(slot)``: it is asked for
    anyway so that a scheduler bug (a skipped or repeated chunk) fails loudly
    instead of silently producing wrong text.

    With ``shared`` > 0 the chunk covers ``shared`` positions more, *before*
    ``token_ids`` (which then begin at ``start_pos + shared``): their keys,
    values (and observation-window queries) are the first ``shared`` rows of
    chunk ``leader``, an earlier chunk of the same step that starts at the same
    position of a cache holding the same tokens and runs the same tokens there.
    They are copied, not computed (the core's ``_share_prefills`` finds them).
    """

    slot: int
    token_ids: Sequence[int] | torch.Tensor
    start_pos: int
    shared: int = 0
    leader: int = -1

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class StepBatch:
    """Flattened chunks: ``ids``/``positions`` are ``[T]``; chunk i is rows
    ``offsets[i]:offsets[i + 1]``."""

    chunks: tuple[SeqChunk, ...]
    ids: torch.Tensor
    positions: torch.Tensor
    offsets: tuple[int, ...]

    @classmethod
    def build(cls, chunks: Sequence[SeqChunk]) -> StepBatch:
        assert chunks, "a step needs at least one chunk"
        assert len({c.slot for c in chunks}) == len(chunks), "a slot appears twice in one step"
        offsets = [0]
        ids: list[torch.Tensor] = []
        for i, c in enumerate(chunks):
            n = len(c)
            assert n > 0, f"empty chunk for slot {c.slot}"
            if c.shared:
                assert 0 <= c.leader < i, f"slot {c.slot} borrows from chunk {c.leader}"
                lead = chunks[c.leader]
                assert not lead.shared, f"slot {c.slot} borrows from a borrower"
                assert lead.start_pos == c.start_pos, f"slot {c.slot}: leader starts elsewhere"
                assert 0 < c.shared <= len(lead), f"slot {c.slot} borrows {c.shared} rows"
            t = c.token_ids
            ids.append(t.reshape(-1).long() if isinstance(t, torch.Tensor) else torch.tensor(t))
            offsets.append(offsets[-1] + n)
        positions = torch.cat(
            [torch.arange(c.start_pos + c.shared, c.start_pos + c.shared + len(c)) for c in chunks]
        )
        return cls(tuple(chunks), torch.cat(ids), positions, tuple(offsets))

    @property
    def num_tokens(self) -> int:
        return self.offsets[-1]

    @property
    def last_rows(self) -> torch.Tensor:
        """Row of each chunk's last token: the rows whose logits a sampler needs."""
        return torch.tensor(self.offsets[1:]) - 1
