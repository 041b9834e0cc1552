"""The fixtures the structured-output tests share: the tiny model and the grammar compiler.

``model`` is the tiny random-weight model over the byte codec (one token per byte),
``compiler`` the grammar compiler for that codec. Import them into a test module to
use them there (``from tests.grammar_fixtures import model_fixture  # noqa: F401``):
each module that does builds its own (module scope), which is cheap.
"""

from __future__ import annotations

import pytest

from duetime.engine.gemma3 import Gemma3
from duetime.engine.grammar import GrammarCompiler
from duetime.engine.testing import engine_from_hf, tiny_hf_model
from duetime.server.codec import ByteCodec
from tests.grammar_cases import CODEC


@pytest.fixture(scope="module", name="model")
def model_fixture() -> Gemma3:
    return engine_from_hf(tiny_hf_model(seed=1, vocab_size=ByteCodec.vocab_size))


@pytest.fixture(scope="module", name="compiler")
def compiler_fixture() -> GrammarCompiler:
    return GrammarCompiler(CODEC.guidance_tokenizer)
