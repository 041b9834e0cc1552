"""The real Gemma 3 270M Q4_K_M file against transformers (one test, ~15-25 s).

The reference is built with transformers' *own* GGUF tables: its config key
mapping, its name map (``get_gguf_hf_weights_map``) and its Gemma tensor
processor (the ``1 + w`` norm fix). Only the raw tensor bytes come through our
``GGUFFile``, whose dequantisation is checked against ``gguf.GGUFReader`` in
test_engine_gguf.py. (``from_pretrained(gguf_file=...)`` would do the same but
needs ``accelerate``, which is not a dependency, and parses the tokenizer arrays
twice at ~21 s each; our run of it on this file matched too: logits within
1.8e-5, same 8 greedy tokens.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from duetime.core.request import Job, Request
from duetime.engine import GGUFFile, SeqChunk, greedy_generate, load_model
from duetime.engine.executor import EngineExecutor
from duetime.engine.logprobs import LogprobLog
from duetime.engine.weights import default_gguf_path
from duetime.policies import make_policy

PROMPT = ["<bos>", "The", "▁capital", "▁of", "▁France", "▁is"]


def _transformers_reference(gguf: GGUFFile, vocab: list[str]):
    from transformers import AutoConfig, Gemma3ForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import (
        GGUF_TO_TRANSFORMERS_MAPPING,
        TENSOR_PROCESSORS,
        get_gguf_hf_weights_map,
    )

    keys = GGUF_TO_TRANSFORMERS_MAPPING["config"]["gemma3"]
    cfg = {
        hf: gguf.get(f"gemma3.{k}")
        for k, hf in keys.items()
        if hf and f"gemma3.{k}" in gguf.metadata
    }
    cfg["vocab_size"] = len(vocab)  # what transformers does for Gemma 3
    hf_config = AutoConfig.for_model("gemma3_text", **cfg)
    hf_config._attn_implementation = "eager"
    with no_init_weights():
        model = Gemma3ForCausalLM(hf_config)
    processor = TENSOR_PROCESSORS["gemma3"](config=cfg)
    name_map = get_gguf_hf_weights_map(model, processor)
    state = {}
    for name in gguf.tensors:
        out = processor.process(
            weights=gguf.read(name), name=name, tensor_key_mapping=name_map, parsed_parameters={}
        )
        if out.name in name_map:
            state[name_map[out.name]] = torch.from_numpy(np.copy(out.weights))
    result = model.load_state_dict(state, strict=False)
    assert result.missing_keys == ["lm_head.weight"]  # tied to the embedding
    model.tie_weights()
    return model.eval()


@pytest.mark.real_model
def test_real_gemma3_matches_transformers() -> None:
    path = default_gguf_path()
    gguf = GGUFFile(path)
    vocab = gguf.get("tokenizer.ggml.tokens")
    ids = [vocab.index(t) for t in PROMPT]

    model = load_model(path, dtype="fp32")
    cfg = model.config
    assert cfg.add_bos_token
    assert ids[0] == cfg.bos_token_id == 2  # Gemma 3 babbles without <bos> first
    assert sum(cfg.sliding_layers) == 15
    assert cfg.num_layers == 18

    ref_model = _transformers_reference(gguf, vocab)
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0]
    kv = model.new_kv_cache()
    got = model.step([SeqChunk(kv.allocate(), ids, 0)], kv, all_logits=True)
    torch.testing.assert_close(got, ref, atol=1e-3, rtol=0)

    # the prompt's log-probabilities (echo + logprobs), scored in 4-token chunks
    log = LogprobLog(top_n=1, prompt=True)
    ex = EngineExecutor(make_policy("fcfs"), model, max_batch_tokens=4)
    ex.logprob_logs[0] = log
    ex.run([Job(Request(rid=0, arrival=0.0, prompt_len=len(ids), prompt_token_ids=tuple(ids)), 1)])
    want = torch.log_softmax(ref, dim=-1)
    scored = [e.logprob for e in log.prompt_entries or []]
    assert scored == pytest.approx(
        [float(want[i, ids[i + 1]]) for i in range(len(ids) - 1)], abs=1e-3
    )

    ours = greedy_generate(model, [ids], 6)[0]
    with torch.no_grad():
        theirs = ref_model.generate(
            torch.tensor([ids]), max_new_tokens=6, do_sample=False, top_k=None, top_p=None
        )[0, len(ids) :].tolist()
    assert ours == theirs
    assert [vocab[i] for i in ours[:3]] == ["▁the", "▁capital", "▁of"]
