"""The engine's KV cache kept in step with the core's books: a request's slot and its
prefix-cache blocks at admission, eviction (SnapKV or StreamingLLM), suspension
spooled to disk and back, a restart's answer replayed token for token, and the check
that cache and books agree after a step."""

from __future__ import annotations

import tempfile
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import torch

from duetime.core.executor import ExecutorError
from duetime.core.prefix_cache import block_key, id_keys
from duetime.core.request import Job
from duetime.core.sequence import Seq
from duetime.engine.eviction import snapkv_evict, streaming_llm_evict
from duetime.engine.executor_state import EngineState


class EngineKV(EngineState):
    """The core's KV hooks on the engine's cache (``_on_*``), and arrivals' token ids."""

    def admit_arrival(self, job: Job) -> None:
        ids = job.request.prompt_token_ids
        if ids is None or len(ids) != job.request.prompt_len:
            raise ValueError(
                f"request {job.request.rid}: the engine needs prompt_token_ids of length "
                f"prompt_len={job.request.prompt_len}"
            )
        vocab = self.model.config.vocab_size
        if (bad := next((t for t in ids if not 0 <= t < vocab), None)) is not None:
            # an index error deep in the embedding otherwise, mid-step
            raise ValueError(
                f"request {job.request.rid}: prompt token id {bad} is not in the model's "
                f"vocabulary (0..{vocab - 1})"
            )
        # The core refuses a duplicate id; only then may the ids be stored, or a live
        # request with that id would go on decoding from the newcomer's prompt.
        super().admit_arrival(job)
        self.tokens[job.request.rid] = list(ids)

    def cached_prefix_len(self, ids: Sequence[int]) -> int:
        """Prompt tokens of ``ids`` the prefix cache would supply if admitted now (0
        without a cache): for estimates, such as the server's admission control."""
        cache = self.prefix_cache
        if cache is None:
            return 0
        return cache.peek(id_keys(ids, len(ids) - self.prefix_compute_tail, cache.block_size))

    def _on_admit(self, seq: Seq, prefix: list[Any]) -> int:
        slot = self.slots[seq.rid] = self.kv.allocate(seq.prefill_target + 16)
        cached = self.kv.load_prefix(slot, prefix)
        if self.eviction == "snapkv":
            self.kv.watch(slot, self.snapkv_window)  # the prefill's last queries, for SnapKV
        return cached

    def _block_key(self, seq: Seq, start: int, end: int, parent: Hashable) -> Hashable:
        """Every token is known here (prompt and answer): a block's key hashes them."""
        assert isinstance(parent, bytes)
        return block_key(parent, self.tokens[seq.rid][start:end])

    def _block_payload(self, seq: Seq, start: int, end: int) -> torch.Tensor:
        """The block's K/V, all layers. One that began in an earlier step is still held,
        since sliding layers keep ``block_size - 1`` entries more than their window."""
        return self.kv.read_positions(self.slots[seq.rid], start, end)

    def _on_drop_kv(self, seq: Seq) -> None:
        slot = self.slots.pop(seq.rid, None)
        if slot is not None:
            self.kv.free(slot)
        spooled = self._spooled.pop(seq.rid, None)
        if spooled is not None:
            spooled.unlink(missing_ok=True)

    def _on_restart(self, seq: Seq) -> None:
        """The answer so far is void for the books (its KV is gone, it is generated again),
        but a client may have it already: the new run replays those tokens instead of
        sampling them, so the answer cannot change under it when a different batch
        (other float rounding, a near-tie) would pick another token. The steps, time
        and memory are those of generating them."""
        ids = self.tokens[seq.rid]
        answer = ids[seq.req.prompt_len :]
        if len(answer) > len(self._replay.get(seq.rid, ())):
            self._replay[seq.rid] = answer
        del ids[seq.req.prompt_len :]
        seg = self.segmenters.get(seq.rid)
        if seg is not None:
            seg.reset()
        grammar = self.grammars.get(seq.rid)
        if grammar is not None:
            grammar.reset()  # the replayed tokens take it through the answer again
            self._forced.pop(seq.rid, None)  # forced again once the replay is through
            self.jumped.pop(seq.rid, None)  # (the replay takes a step a token)
            self.rode.pop(seq.rid, None)

    def _on_swap_out(self, seq: Seq) -> None:
        """Spool the sequence's KV to disk: on a CPU engine, KV memory *is* RAM."""
        slot = self.slots.pop(seq.rid)
        path = self._spool_dir() / f"{seq.rid}.pt"
        torch.save(self.kv.export(slot), path)
        self._spooled[seq.rid] = path

    def _on_swap_in(self, seq: Seq) -> None:
        path = self._spooled.pop(seq.rid)
        self.slots[seq.rid] = self.kv.restore(torch.load(path, weights_only=True))
        path.unlink()

    def _spool_dir(self) -> Path:
        if self._spool is None:
            self._spool = Path(tempfile.mkdtemp(prefix="duetime-kv-"))
        return self._spool

    def _on_evict(self, seq: Seq, n_tokens: int, alpha: float) -> None:
        if seq.rid in self._spooled:  # swapped out: bring it back, evict, spool it again
            self._on_swap_in(seq)
            self._evict_slot(self.slots[seq.rid], n_tokens)
            self._on_swap_out(seq)
        else:
            self._evict_slot(self.slots[seq.rid], n_tokens)

    def _evict_slot(self, slot: int, n_tokens: int) -> None:
        kv = self.kv
        if self.eviction == "snapkv" and kv.obs_window(slot) is not None:
            snapkv_evict(kv, slot, n_tokens, window=self.snapkv_window)
        else:
            if self.eviction == "snapkv" and n_tokens:
                self.counters["snapkv_fallbacks"] = self.counters.get("snapkv_fallbacks", 0) + 1
            streaming_llm_evict(kv, slot, n_tokens)
        kv.unwatch(slot)  # one eviction per prefill: the window's memory goes now

    def _replayed(self, seq: Seq, index: int) -> int | None:
        """Token ``index`` of ``seq``'s answer as made before its restart; None past it."""
        before = self._replay[seq.rid]
        if index >= len(before):
            del self._replay[seq.rid]
            return None
        if index == len(before) - 1:
            del self._replay[seq.rid]
        return before[index]

    def _check_kv(self) -> None:
        held = sum(self.kv.num_tokens(s) for s in self.slots.values())
        if held != self.kv_device:
            raise ExecutorError(
                f"KV accounting drifted: cache holds {held} tokens, executor counts "
                f"{self.kv_device}"
            )
