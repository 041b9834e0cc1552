"""The Gemma 3 forward against transformers on tiny random-weight models (fp32: exact)."""

from __future__ import annotations

import pytest
import torch

from duetime.engine import SeqChunk, greedy_generate
from duetime.engine.testing import engine_from_hf, hf_greedy, tiny_hf_model

# Lengths around and well past the sliding window (4) and past the KV cache's
# minimum capacity (32), so sliding-window trimming happens mid-generation.
PROMPT_LENGTHS = (1, 3, 9, 17, 45)


def _prompts(lengths=PROMPT_LENGTHS, seed: int = 0, vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model(seed=0)


@pytest.fixture(scope="module")
def hf_reference(hf) -> list[list[int]]:
    return [hf_greedy(hf, p, 10) for p in _prompts()]


def test_logits_match_transformers(hf) -> None:
    model = engine_from_hf(hf)
    ids = torch.tensor(_prompts((23,))[0])
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    kv = model.new_kv_cache()
    got = model.step([SeqChunk(kv.allocate(), ids, 0)], kv, all_logits=True)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("chunk_size", [None, 1, 2, 5])
def test_greedy_matches_transformers_mixed_batch(hf, hf_reference, chunk_size) -> None:
    # With chunking, short prompts decode while long ones are still prefilling,
    # so most steps mix prefill chunks and decodes of different lengths.
    got = greedy_generate(engine_from_hf(hf), _prompts(), 10, chunk_size=chunk_size)
    assert got == hf_reference


def test_batched_step_equals_each_sequence_alone(hf) -> None:
    model = engine_from_hf(hf)
    prompts = _prompts((30, 12, 7), seed=5)
    # state before the mixed step: seq A fully prefilled (next: a decode),
    # seq B half-way through its prompt (next: a chunk), seq C new (next: its whole prompt)
    plan = [(prompts[0][:29], prompts[0][29:]), (prompts[1][:6], prompts[1][6:]), ([], prompts[2])]

    def run(which: list[int]) -> torch.Tensor:
        kv = model.new_kv_cache()
        slots = {i: kv.allocate() for i in which}
        warm = [SeqChunk(slots[i], plan[i][0], 0) for i in which if plan[i][0]]
        if warm:
            model.step(warm, kv)
        step = [SeqChunk(slots[i], plan[i][1], len(plan[i][0])) for i in which]
        return model.step(step, kv, all_logits=True)

    together = run([0, 1, 2])
    alone = torch.cat([run([i]) for i in range(3)])
    assert together.shape == (1 + 6 + 7, 256)
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "overrides",
    [
        {"num_key_value_heads": 1},  # Gemma 3 270M's layout: all 4 heads share one KV head
        {"final_logit_softcapping": 2.0},
        {
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            }
        },
        {
            "sliding_window": 1,
            "num_hidden_layers": 2,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ],
    ids=["one-kv-head", "final-softcap", "linear-rope", "window-1"],
)
def test_config_variants_match_transformers(overrides) -> None:
    hf = tiny_hf_model(seed=2, **overrides)
    model = engine_from_hf(hf)
    prompts = _prompts((2, 13), seed=7)
    assert greedy_generate(model, prompts, 6, chunk_size=3) == [
        hf_greedy(hf, p, 6) for p in prompts
    ]
    ids = torch.tensor(prompts[1])
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    kv = model.new_kv_cache()
    got = model.step([SeqChunk(kv.allocate(), ids, 0)], kv, all_logits=True)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    if "final_logit_softcapping" in overrides:
        assert got.abs().max() < 2.0


@pytest.mark.parametrize(
    ("dtype", "int8_output"), [("bf16", False), ("bf16", True), ("int8", None)]
)
def test_fast_dtypes_stay_close_to_fp32(hf, dtype, int8_output) -> None:
    ref_model = engine_from_hf(hf)
    model = engine_from_hf(hf, dtype, int8_output=int8_output)
    ids = _prompts((40,), seed=9)[0]
    outs = []
    for m in (ref_model, model):
        kv = m.new_kv_cache()
        outs.append(m.step([SeqChunk(kv.allocate(), ids, 0)], kv, all_logits=True))
    ref, got = outs
    assert got.dtype == torch.float32
    assert torch.isfinite(got).all()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean()
    cosine = torch.nn.functional.cosine_similarity(got, ref, dim=-1).min()
    if dtype == "int8":  # experimental: a sanity bound (not garbage), not a quality bar
        assert cosine > 0.95
        assert agree > 0.6
    else:
        assert (got - ref).abs().max() < 0.1 * ref.abs().max()
        assert cosine > 0.99
        assert agree > 0.8


def test_step_checks_its_inputs(hf) -> None:
    model = engine_from_hf(hf)
    kv = model.new_kv_cache()
    a = kv.allocate()
    model.step([SeqChunk(a, [1, 2, 3], 0)], kv)
    with pytest.raises(AssertionError, match="starts at 2"):
        model.step([SeqChunk(a, [4], 2)], kv)
    with pytest.raises(AssertionError, match="twice"):
        model.step([SeqChunk(a, [4], 3), SeqChunk(a, [5], 4)], kv)
    with pytest.raises(AssertionError, match="not allocated"):
        model.step([SeqChunk(99, [4], 0)], kv)
    assert kv.seq_len(a) == 3  # failed steps left the cache untouched


@pytest.mark.parametrize(("rows", "vocab", "k"), [(1, 4096, 32), (5, 8192, 32), (3, 1000, 8)])
def test_grouped_topk_finds_the_same_values_as_torch_topk(rows, vocab, k) -> None:
    from duetime.engine.rescored_head import topk_indices

    g = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows, vocab, generator=g)
    # a row whose best values crowd into one group: the grouped search must still find them
    logits[0, 128:160] += 10.0
    got = topk_indices(logits, k)
    want = logits.topk(k, dim=-1).indices
    assert got.shape == (rows, k)
    for r in range(rows):
        assert set(got[r].tolist()) == set(want[r].tolist())


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"final_logit_softcapping": 2.0},
        {
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            }
        },
    ],
    ids=["default", "final-softcap", "linear-rope"],
)
def test_hf_config_is_the_inverse_of_from_hf(overrides) -> None:
    """`bench.engine_peers.hf_config` and `Gemma3Config.from_hf` read one name table
    (`HF_NAMES`) in opposite directions: a config survives the round trip."""
    from duetime.bench.engine_peers import hf_config
    from duetime.engine.config import Gemma3Config

    cfg = Gemma3Config.from_hf(tiny_hf_model(seed=0, **overrides).config)
    assert Gemma3Config.from_hf(hf_config(cfg, torch.float32)) == cfg
