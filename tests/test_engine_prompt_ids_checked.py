"""A prompt token id outside the model's vocabulary is refused as it arrives, by name,
and leaves nothing behind (it was an IndexError from inside the embedding, mid-step)."""

from __future__ import annotations

import pytest

from duetime.core.request import Job, Request
from duetime.engine.executor import EngineExecutor
from duetime.engine.testing import engine_from_hf, tiny_hf_model
from duetime.policies import make_policy


def test_an_id_past_the_vocabulary_is_refused_on_arrival() -> None:
    model = engine_from_hf(tiny_hf_model(seed=2))
    vocab = model.config.vocab_size
    ex = EngineExecutor(make_policy("fcfs"), model, kv_capacity=512, max_num_seqs=4)
    bad = Job(Request(rid=7, arrival=0.0, prompt_len=3, prompt_token_ids=(2, vocab, 5)), 4)
    with pytest.raises(
        ValueError, match=rf"request 7: prompt token id {vocab} is not in .*0\.\.{vocab - 1}"
    ):
        ex.admit_arrival(bad)
    assert not ex.seqs
    assert not ex.tokens
    good = Job(Request(rid=7, arrival=0.0, prompt_len=3, prompt_token_ids=(2, 4, 5)), 4)
    res = ex.run([good])  # the same id, now well formed: nothing of the refused one is in the way
    assert res.records[0].output_tokens == 4
