"""Structured outputs: answers masked to a grammar (JSON schema, regex, choice, Lark).

On a tiny random-weight model with the byte codec (one token per byte), whose
unconstrained answers are noise: so an answer that fits its grammar shows the
mask at work. The engine tests compare against a reference that shares nothing
with the executor: the model stepped alone, one token at a time, each masked by a
fresh grammar.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from fastapi.testclient import TestClient

from duetime.core.grammar import GrammarSpec
from duetime.core.request import Job, Request
from duetime.core.sampling import SamplingParams
from duetime.engine.batch import SeqChunk
from duetime.engine.executor import EngineExecutor
from duetime.engine.gemma3 import Gemma3
from duetime.engine.grammar import GrammarCompiler, GrammarError
from duetime.engine.sampling import Sampler
from duetime.engine.testing import engine_from_hf, tiny_hf_model
from duetime.policies import available_policies, make_policy
from duetime.predict.oracle import make_job_predictor
from duetime.server.app import create_app
from duetime.server.build import ServeOptions, build_state, load_served_model
from duetime.server.codec import ByteCodec
from tests.factories import SIMPLE_COST, record_evictions

CODEC = ByteCodec()
CHOICES = ["hello", "help", "world"]
DIGITS = r"[0-9]{3}-[a-c]{2,5}"
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
}
LARK = 'start: "x" ("y" | "zz") ("y" | "zz")? "!"'
#: long keys: runs of forced tokens longer than the tiny model's window and a cache block
LONG_KEYS = {
    "type": "object",
    "properties": {
        "the_first_rather_long_property_name": {"enum": ["yes", "no"]},
        "and_a_second_one_that_is_long_as_well": {"type": "boolean"},
    },
    "required": ["the_first_rather_long_property_name", "and_a_second_one_that_is_long_as_well"],
    "additionalProperties": False,
}
SPECS = [
    GrammarSpec.choice(CHOICES, "choice"),
    GrammarSpec("regex", DIGITS, "regex"),
    GrammarSpec.json_schema(SCHEMA, "schema"),
    GrammarSpec("grammar", LARK, "lark"),
    GrammarSpec.json_schema(LONG_KEYS, "long keys"),
]


@pytest.fixture(scope="module")
def model() -> Gemma3:
    return engine_from_hf(tiny_hf_model(seed=1, vocab_size=ByteCodec.vocab_size))


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(CODEC.guidance_tokenizer)


def _text(ids: list[int]) -> str:
    return CODEC.decode(ids)


def _fits(spec: GrammarSpec, text: str) -> bool:
    """Whether ``text`` is a whole answer of ``spec``, checked without the grammar library."""
    if spec.kind == "choice":
        return text in CHOICES
    if spec.kind == "regex":
        return re.fullmatch(DIGITS, text) is not None
    if spec.kind == "grammar":
        return re.fullmatch(r"x(y|zz){1,2}!", text) is not None
    try:
        value = json.loads(text)
    except ValueError:
        return False
    if spec.field == "long keys":
        first, second = LONG_KEYS["properties"]  # type: ignore[misc]
        return set(value) == {first, second} and value[first] in ("yes", "no")
    return (
        set(value) == {"ok", "color"}
        and isinstance(value["ok"], bool)
        and value["color"] in SCHEMA["properties"]["color"]["enum"]  # type: ignore[index]
    )


def _reference(
    model: Gemma3,
    compiler: GrammarCompiler,
    spec: GrammarSpec,
    prompt: list[int],
    n: int,
    sampling: SamplingParams | None = None,
) -> list[int]:
    """The constrained answer of ``prompt`` made alone: one step a token, its logits
    masked by a grammar that follows the answer, stopped where the grammar is complete.
    Tokens the grammar forces are taken as it writes them, with no draw."""
    grammar = compiler.grammar(spec)
    sampler = Sampler(sampling) if sampling is not None else None
    kv = model.new_kv_cache()
    slot = kv.allocate()
    logits = model.step([SeqChunk(slot, prompt, 0)], kv)[0]
    out: list[int] = []
    queue: list[int] = []
    while len(out) < n:
        queue = queue or grammar.take_forced()
        if queue:
            tok = queue.pop(0)
        else:
            row = grammar.mask(logits)
            tok = (
                int(row.argmax())
                if sampler is None
                else sampler.pick(row, prompt + out, len(prompt))
            )
            assert grammar.accept(tok)
        out.append(tok)
        if grammar.finished and not queue:
            break
        logits = model.step([SeqChunk(slot, [tok], len(prompt) + len(out) - 1)], kv)[0]
    return out


# --- the grammar alone ---------------------------------------------------------------


def test_a_grammar_allows_only_its_next_tokens_and_ends_where_it_is_complete(
    compiler: GrammarCompiler,
) -> None:
    g = compiler.grammar(GrammarSpec.choice(CHOICES, "choice"))
    start = set(g.allowed().nonzero().flatten().tolist())
    assert start == {ord("h") + 3, ord("w") + 3}
    for byte in b"hel":
        assert g.accept(byte + 3)
    assert set(g.allowed().nonzero().flatten().tolist()) == {ord("l") + 3, ord("p") + 3}
    allowed = g.allowed()
    assert [g.allows(t) for t in range(ByteCodec.vocab_size)] == allowed.tolist()
    assert not g.allows(-1)
    assert not g.allows(ByteCodec.vocab_size)
    row = g.mask(__import__("torch").zeros(ByteCodec.vocab_size))
    assert row.isfinite().sum() == 2
    assert g.accept(ord("p") + 3)
    assert g.finished
    assert not compiler.grammar(GrammarSpec.choice(CHOICES, "choice")).accept(ord("x") + 3)


def test_allowed_ids_lists_a_few_next_tokens_and_gives_up_past_the_limit(
    compiler: GrammarCompiler,
) -> None:
    g = compiler.grammar(GrammarSpec.choice(CHOICES, "choice"))
    ids = g.allowed_ids(2)
    assert ids is not None
    assert ids.tolist() == sorted([ord("h") + 3, ord("w") + 3])
    assert ids.tolist() == g.allowed().nonzero().flatten().tolist()
    assert g.allowed_ids(1) is None  # two allowed: more than the limit
    free = compiler.grammar(GrammarSpec("regex", "[a-z]+", "regex"))
    assert free.allowed_ids(10) is None  # 26 letters
    assert len(free.allowed_ids(26)) == 26  # type: ignore[arg-type]


def test_reset_and_copy_give_independent_grammars(compiler: GrammarCompiler) -> None:
    g = compiler.grammar(GrammarSpec("regex", "ab|ac", "regex"))
    assert g.accept(ord("a") + 3)
    twin = g.copy()
    assert twin.accept(ord("b") + 3)
    assert twin.finished
    assert not g.finished
    g.reset()
    assert set(g.allowed().nonzero().flatten().tolist()) == {ord("a") + 3}


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (GrammarSpec("regex", "(a", "structured_outputs.regex"), "unclosed group"),
        (GrammarSpec.json_schema({"type": 5}, "response_format"), "type must be"),
        (GrammarSpec("json_schema", "{not json", "guided_json"), "guided_json"),
        (GrammarSpec("grammar", "start: undefined_rule", "structured_outputs.grammar"), ""),
        (GrammarSpec("choice", "[]", "guided_choice"), ""),
    ],
)
def test_a_bad_grammar_is_an_error_naming_its_field(
    compiler: GrammarCompiler, spec: GrammarSpec, words: str
) -> None:
    with pytest.raises(GrammarError) as err:
        compiler.grammar(spec)
    assert err.value.field == spec.field
    assert str(err.value).startswith(spec.field + ": ")
    assert words in str(err.value)


# --- in the engine -------------------------------------------------------------------


def _jobs(n: int, max_tokens: int = 24) -> list[Job]:
    jobs = []
    for rid in range(n):
        prompt = CODEC.encode(f"request {rid}: answer " + "abc"[rid % 3] * (rid % 5))
        req = Request(
            rid=rid,
            arrival=0.0,
            prompt_len=len(prompt),
            prompt_token_ids=tuple(prompt),
            max_tokens=max_tokens if rid % 4 else 3,
        )
        jobs.append(Job(req, output_len=req.max_tokens))
    return jobs


def _run(
    model: Gemma3,
    compiler: GrammarCompiler,
    jobs: list[Job],
    policy: Any,
    sampling: dict[int, SamplingParams],
    **kwargs: Any,
) -> tuple[EngineExecutor, dict[int, list[int]], set[int]]:
    evicted = record_evictions(policy)
    ex = EngineExecutor(
        policy,
        model,
        predictor=make_job_predictor(getattr(policy, "default_predictor", None), seed=0),
        cost=SIMPLE_COST,
        **kwargs,
    )
    for j in jobs:
        rid = j.request.rid
        ex.grammars[rid] = compiler.grammar(SPECS[rid % len(SPECS)])
        if rid in sampling:
            ex.samplers[rid] = Sampler(sampling[rid])
    res = ex.run(jobs, max_wall_s=60.0)
    assert not ex.in_system
    assert ex.kv_used == 0
    assert not ex.kv.slots
    return ex, res.outputs, evicted


@pytest.mark.parametrize("cache", [0, 128])
@pytest.mark.parametrize("policy", available_policies())
def test_every_policy_serves_grammar_answers_equal_to_the_reference(
    model: Gemma3, compiler: GrammarCompiler, policy: str, cache: int
) -> None:
    """Under memory pressure (preemptions, suspensions, chunked prefills), with and
    without a prefix cache (answers' blocks offered as they fill), every answer is its
    request's constrained answer made alone: the grammar follows recomputes and
    restarts, forced runs jump ahead where memory allows. Each ends where its grammar
    is complete or at max_tokens."""
    jobs = _jobs(10)
    _, outputs, evicted = _run(
        model,
        compiler,
        jobs,
        make_policy(policy),
        {},
        kv_capacity=90,
        max_num_seqs=4,
        max_batch_tokens=32,
        prefix_cache_tokens=cache,
    )
    assert len(outputs) == len(jobs)
    for j in jobs:
        rid, prompt = j.request.rid, list(j.request.prompt_token_ids or ())
        out = outputs[rid]
        spec = SPECS[rid % len(SPECS)]
        if rid not in evicted:
            assert out == _reference(model, compiler, spec, prompt, j.request.max_tokens), rid
        if len(out) < j.request.max_tokens:
            assert _fits(spec, _text(out)), (rid, _text(out))


def test_a_restart_replays_the_answer_through_its_grammar(
    model: Gemma3, compiler: GrammarCompiler
) -> None:
    """Restart preemption voids the answer and replays it: the grammar is reset and
    walked through the same tokens, so sampled answers equal an uninterrupted run's."""
    jobs = _jobs(10)
    rids = [j.request.rid for j in jobs]
    sampling = {rid: SamplingParams(temperature=1.0, seed=7 + rid) for rid in rids}
    _, roomy, _ = _run(model, compiler, jobs, make_policy("fcfs"), sampling)
    tight_ex, tight, _ = _run(
        model,
        compiler,
        jobs,
        make_policy("fcfs", preempt_mode="restart"),
        sampling,
        kv_capacity=70,
        max_batch_tokens=32,
    )
    assert tight_ex.counters.get("restarts", 0) > 0  # the point of the test
    assert tight_ex.counters.get("forced_tokens_jumped", 0) > 0  # with forced runs
    assert tight == roomy
    for j in jobs:
        rid = j.request.rid
        spec = SPECS[rid % len(SPECS)]
        prompt = list(j.request.prompt_token_ids or ())
        assert roomy[rid] == _reference(
            model, compiler, spec, prompt, j.request.max_tokens, sampling[rid]
        )


def _count_extra_rows(ex: EngineExecutor, into: list[int]) -> None:
    """Have ``ex`` append to ``into`` each step's rows beyond its prefill and decoders."""
    log_step = ex._log_step

    def count_rows(
        computed: int, attn: float, n_dec: int, kv: int, dt: float, chunks: list[tuple[int, int]]
    ) -> None:
        assert ex.last_step is not None
        into.append(ex.last_step[1] - computed)  # (its P: computed rows + riding rows)
        log_step(computed, attn, n_dec, kv, dt, chunks)

    ex._log_step = count_rows  # type: ignore[method-assign]


def test_forced_runs_jump_ahead_in_fewer_steps_with_the_same_answers(
    model: Gemma3, compiler: GrammarCompiler
) -> None:
    """Jump-forward: the tokens a grammar forces (the long keys, the JSON punctuation)
    are fed in one chunk each instead of one decode step each; the answers are the
    same as one step a token, in far fewer steps."""
    jobs = _long_key_jobs(4, "call")
    runs = {}
    extra_rows: list[int] = []  # each step's rows beyond its prefill and its decoders
    for jump in (False, True):
        ex = EngineExecutor(make_policy("fcfs"), model, cost=SIMPLE_COST)
        ex.jump_forward = jump
        for j in jobs:
            ex.grammars[j.request.rid] = compiler.grammar(SPECS[4])
        if jump:
            _count_extra_rows(ex, extra_rows)
        runs[jump] = (ex.run(jobs), ex)
    (step_res, _), (jump_res, jump_ex) = runs[False], runs[True]
    assert jump_res.outputs == step_res.outputs
    assert all(_fits(SPECS[4], _text(out)) for out in jump_res.outputs.values())
    assert jump_ex.counters["forced_tokens_jumped"] > 0.8 * sum(
        len(o) for o in jump_res.outputs.values()
    )
    # each answer's own count, which a server learns its grammar's steps from
    assert sum(jump_ex.jumped.values()) == jump_ex.counters["forced_tokens_jumped"]
    assert set(jump_ex.jumped) == set(jump_res.outputs)
    # of those, the ones that rode as rows of a step are the rows the steps computed
    # beyond their prefill and decoders (the rest ended an answer: never fed back)
    assert sum(jump_ex.rode.values()) == sum(extra_rows) > 0
    assert all(0 < jump_ex.rode[rid] < jump_ex.jumped[rid] for rid in jump_res.outputs)
    assert jump_res.engine_steps < step_res.engine_steps / 4, (
        jump_res.engine_steps,
        step_res.engine_steps,
    )


@pytest.mark.parametrize("spec", [SPECS[0], SPECS[2], SPECS[3], SPECS[4]], ids=str)
def test_the_grammar_walk_counts_at_least_the_steps_its_answers_take(
    model: Gemma3, compiler: GrammarCompiler, spec: GrammarSpec
) -> None:
    """``choice_steps`` walks a grammar without the model (its forced runs, the choices
    left, where they are few): for these grammars no answer the engine made under them
    took more steps (tokens less those that jumped), and the walk is at most one step
    over the most; its riding rows are the most any answer's forced runs computed, to
    a token (the walk's path and the model's may tokenise a choice differently). Free
    text (the regex's digits) it does not count."""
    prior = compiler.grammar(spec).choice_steps()
    assert prior is not None
    jobs = _long_key_jobs(6, "walk")
    ex = EngineExecutor(make_policy("fcfs"), model, cost=SIMPLE_COST)
    for j in jobs:
        ex.grammars[j.request.rid] = compiler.grammar(spec)
    res = ex.run(jobs)
    steps = [len(out) - ex.jumped.get(rid, 0) for rid, out in res.outputs.items()]
    rode = [ex.rode.get(rid, 0) for rid in res.outputs]
    assert all(_fits(spec, _text(out)) for out in res.outputs.values())
    assert max(steps) <= prior.steps <= max(steps) + 1, (steps, prior)
    assert abs(prior.rows - max(rode)) <= 1, (rode, prior)


def test_the_grammar_walk_gives_up_on_free_text(compiler: GrammarCompiler) -> None:
    free = GrammarSpec.json_schema(
        {"type": "object", "properties": {"name": {"type": "string"}}}, "s"
    )
    assert compiler.grammar(free).choice_steps() is None
    assert compiler.grammar(SPECS[1]).choice_steps(fanout=5) is None  # ten digits to choose from


def test_a_stop_token_ends_the_answer_before_a_forced_run(
    model: Gemma3, compiler: GrammarCompiler
) -> None:
    """The model picks "a" or "b", then the grammar forces "xyz": where the client's stop
    ids hold "a" and "b", the answer ends at the one picked (jumped or not)."""
    from duetime.engine.executor import StopRule

    a, b = ord("a") + ByteCodec.OFFSET, ord("b") + ByteCodec.OFFSET
    for jump in (True, False):
        jobs = _long_key_jobs(3, "stop")
        ex = EngineExecutor(make_policy("fcfs"), model, cost=SIMPLE_COST)
        ex.jump_forward = jump
        for j in jobs:
            ex.grammars[j.request.rid] = compiler.grammar(GrammarSpec("regex", "(a|b)xyz", "r"))
            ex.stop_tokens[j.request.rid] = StopRule(frozenset({a, b}))
        res = ex.run(jobs)
        assert all(out in ([a], [b]) for out in res.outputs.values()), (jump, res.outputs)


def test_concurrent_jumps_share_the_free_memory(model: Gemma3, compiler: GrammarCompiler) -> None:
    """Four answers' forced runs (40-odd tokens each) at once, with room for about 110:
    together they take no more than is free; the rest come later, and every answer
    still fits its grammar with the books and the cache agreeing after every step."""
    jobs = _long_key_jobs(4, "call")
    ex = EngineExecutor(make_policy("fcfs"), model, cost=SIMPLE_COST, kv_capacity=150)
    for j in jobs:
        ex.grammars[j.request.rid] = compiler.grammar(SPECS[4])
    res = ex.run(jobs)
    assert ex.counters["forced_tokens_jumped"] > 0
    assert res.kv_peak <= ex.kv_capacity
    assert all(_fits(SPECS[4], _text(out)) for out in res.outputs.values())


def test_a_jumped_answer_offers_its_blocks_to_the_prefix_cache(
    model: Gemma3, compiler: GrammarCompiler
) -> None:
    """A forced run crosses cache blocks (16 tokens) many times the tiny model's sliding
    window (4): each block it fills is offered before its KV can be trimmed, so the next
    turn (prompt + this answer) finds the answer's blocks in the cache."""
    first = _long_key_jobs(1, "a conversation that goes on")[0]
    ex = _ChainChecked(
        make_policy("fcfs"), model, cost=SIMPLE_COST, prefix_cache_tokens=1024, eviction="streaming"
    )
    ex.grammars[0] = compiler.grammar(SPECS[4])
    res = ex.run([first])
    answer = res.outputs[0]
    assert ex.counters["forced_tokens_jumped"] > 32
    ids = (*(first.request.prompt_token_ids or ()), *answer, *CODEC.encode(" next")[1:])
    nxt = Request(rid=1, arrival=0.0, prompt_len=len(ids), prompt_token_ids=ids, max_tokens=1)
    assert ex.cached_prefix_len(ids) >= (len(ids) - 1) // 16 * 16 - 16
    again = ex.run([Job(nxt, output_len=1)])
    assert again.records[0].cached_prompt_tokens >= 48


class _ChainChecked(EngineExecutor):
    """Checks after every step that each decoder has offered the prefix cache every
    block its KV holds (none waits for a later step, when its KV may be trimmed)."""

    def _check_kv(self) -> None:
        super()._check_kv()
        assert self.prefix_cache is not None
        size = self.prefix_cache.block_size
        for seq in self.running.values():
            chain = self._chains.get(seq.rid)
            if chain is not None and seq.decoding:
                assert chain[0] == self._kv_positions(seq) // size, (seq, chain)


def _long_key_jobs(n: int, text: str) -> list[Job]:
    jobs = []
    for rid in range(n):
        ids = CODEC.encode(f"{text} {rid}")
        req = Request(
            rid=rid, arrival=0.0, prompt_len=len(ids), prompt_token_ids=tuple(ids), max_tokens=120
        )
        jobs.append(Job(req, output_len=120))
    return jobs


def test_without_a_grammar_the_tiny_model_answers_noise(model: Gemma3) -> None:
    """The control: unconstrained answers fit none of the grammars."""
    ex = EngineExecutor(make_policy("fcfs"), model, cost=SIMPLE_COST)
    res = ex.run(_jobs(8, max_tokens=12), max_wall_s=60.0)
    texts = [_text(out) for out in res.outputs.values()]
    assert not any(_fits(spec, t) for spec in SPECS for t in texts)


# --- over HTTP -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def client() -> Any:
    options = ServeOptions(model="tiny", predictor=None, seed=1)
    m, codec, name = load_served_model(options)
    with TestClient(create_app(build_state(options, m, codec, name))) as c:
        yield c, name


def _post(client: Any, path: str = "/v1/completions", **body: Any) -> Any:
    c, name = client
    if path.endswith("chat/completions"):
        body.setdefault("messages", [{"role": "user", "content": "Colour?"}])
    else:
        body.setdefault("prompt", "Which colour? ")
    return c.post(path, json={"model": name, "max_tokens": 40, **body})


RESPONSE_SCHEMA = {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}


@pytest.mark.parametrize(
    ("fields", "spec"),
    [
        ({"response_format": RESPONSE_SCHEMA}, SPECS[2]),
        ({"structured_outputs": {"json": SCHEMA}}, SPECS[2]),
        ({"guided_json": json.dumps(SCHEMA)}, SPECS[2]),
        ({"structured_outputs": {"regex": DIGITS}}, SPECS[1]),
        ({"guided_regex": DIGITS}, SPECS[1]),
        ({"structured_outputs": {"choice": CHOICES}}, SPECS[0]),
        ({"guided_choice": CHOICES}, SPECS[0]),
        ({"structured_outputs": {"grammar": LARK}}, SPECS[3]),
        ({"guided_grammar": 'root ::= "x" ("y" | "zz") ("y" | "zz")? "!"'}, SPECS[3]),  # GBNF
    ],
)
def test_each_request_form_constrains_the_answer(
    client: Any, fields: dict[str, Any], spec: GrammarSpec
) -> None:
    r = _post(client, **fields)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert _fits(spec, choice["text"]), choice["text"]


def test_json_object_mode_gives_a_json_object(client: Any) -> None:
    # (this random model ends its object after "x"; after most prompts it writes an
    # endless number, which JSON allows: "length")
    r = _post(client, prompt="x", response_format={"type": "json_object"}, max_tokens=200)
    choice = r.json()["choices"][0]
    assert r.status_code == 200, r.text
    assert choice["finish_reason"] == "stop", r.text
    assert isinstance(json.loads(choice["text"]), dict)
    endless = _post(client, prompt="hello", response_format={"type": "json_object"}).json()
    assert endless["choices"][0]["text"].startswith('{"": ')
    plain = _post(client, response_format={"type": "text"}, max_tokens=12).json()
    assert not plain["choices"][0]["text"].startswith("{")  # text: no constraint


def test_streamed_sampled_several_choices_and_chat_each_fit(client: Any) -> None:
    c, name = client
    body = {
        "model": name,
        "prompt": "Which colour? ",
        "max_tokens": 40,
        "response_format": RESPONSE_SCHEMA,
        "temperature": 1.5,
        "seed": 2,
        "n": 3,
    }
    whole = c.post("/v1/completions", json=body).json()
    texts = [ch["text"] for ch in sorted(whole["choices"], key=lambda ch: ch["index"])]
    assert all(_fits(SPECS[2], t) for t in texts), texts
    assert len(set(texts)) > 1  # sampled: the choices differ
    with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line[6:] not in ("", "[DONE]")]
    streamed = ["", "", ""]
    for ev in events:
        for ch in ev["choices"]:
            streamed[ch["index"]] += ch["text"]
    assert streamed == texts  # same seeds, same answers
    chat = _post(client, "/v1/chat/completions", structured_outputs={"choice": CHOICES}).json()
    assert chat["choices"][0]["message"]["content"] in CHOICES


def test_a_grammar_complete_at_max_tokens_is_a_stop_and_one_cut_short_a_length(
    client: Any,
) -> None:
    done = _post(client, guided_choice=["ab"], max_tokens=2).json()["choices"][0]
    assert (done["text"], done["finish_reason"]) == ("ab", "stop")
    cut = _post(client, guided_choice=["ab"], max_tokens=1).json()["choices"][0]
    assert (cut["text"], cut["finish_reason"]) == ("a", "length")
    usage = _post(client, guided_choice=["abc"], max_tokens=30).json()["usage"]
    assert usage["completion_tokens"] == 3  # ended with the grammar, no end-of-sequence step


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex", "unclosed group"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
            "response_format",
            "type must be",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs a json_schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", ""),
        (
            {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs",
            "exactly one",
        ),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp", ""),
        ({"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, None, "one constraint"),
        ({"guided_choice": []}, "guided_choice", ""),
        ({"guided_json": "{not json"}, "guided_json", ""),
        # a keyword the grammar cannot enforce: refused, not ignored
        ({"guided_json": {"type": "string", "format": "weird"}}, "guided_json", "weird"),
    ],
)
def test_a_bad_constraint_is_a_400_naming_it(
    client: Any, fields: dict[str, Any], param: str | None, words: str
) -> None:
    r = _post(client, **fields)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert words in err["message"], err
    assert _post(client, max_tokens=2).status_code == 200  # the server goes on


def test_a_choice_bounds_the_predicted_length_and_admission_judges_by_it(
    tmp_path: Any,
) -> None:
    """An answer from a choice can be no longer than its longest option (a token holds
    a byte at least) plus the end-of-sequence, one under a bounded JSON schema no longer
    than its longest text: the prediction policies and admission use is capped there.
    With 100 ms a decode step, 64 tokens cannot meet a 2 s deadline; the same request
    held to "yes" / "no" (at most 4 tokens) can, and one held to a small schema (32)
    meets 4 s."""
    profile = tmp_path / "decode-bound.json"
    profile.write_text(
        json.dumps({"name": "decode-bound", "coefficients": {"c0": 0.1, "a1": 1e-4}})
    )
    options = ServeOptions(model="tiny", predictor=None, kv_capacity=4096, profile=profile)
    m, codec, name = load_served_model(options)
    with TestClient(create_app(build_state(options, m, codec, name))) as c:
        body = {"model": name, "prompt": "ok?", "max_tokens": 64, "ignore_eos": True}
        free = c.post("/v1/completions", json={**body, "deadline_ms": 2000})
        assert free.status_code == 429, free.text
        assert "64 tokens assumed for this answer" in free.json()["error"]["message"]
        # (before any answer: the server's step-time fit then still is the profile's)
        held = {**body, "deadline_ms": 2000, "guided_choice": ["yes", "no"]}
        regex = c.post("/v1/completions", json={**held, "guided_choice": None, "guided_regex": "y"})
        # a regex's longest text is not worked out (max_tokens), but the grammar's walk
        # counts the one step "y" takes
        assert regex.status_code == 200, regex.text
        free_json = {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}
        r = c.post(
            "/v1/completions", json={**held, "guided_choice": None, "response_format": free_json}
        )
        assert r.status_code == 429  # any object: unbounded
        r = c.post("/v1/completions", json=held)
        assert r.status_code == 200, r.text
        assert r.json()["duetime"]["predicted_tokens"] == 4  # "yes" + end-of-sequence
        assert r.json()["choices"][0]["text"] in ("yes", "no")
        # a JSON schema whose every part is bounded: its longest text ('{"ok": false,
        # "color": "green"}', 31 bytes) + the end-of-sequence
        schema = {**held, "guided_choice": None, "response_format": RESPONSE_SCHEMA}
        r = c.post("/v1/completions", json={**schema, "deadline_ms": 4000})
        assert r.status_code == 200, r.text
        assert r.json()["duetime"]["predicted_tokens"] == 32


def test_the_answers_under_a_grammar_give_its_predicted_length() -> None:
    """The length predictor reads only the prompt (trained on chat answers); under a
    grammar the answers that ended say how long the next one is. Before any, the
    prediction is the predictor's (here none); after, the median of the answers,
    sampled or greedy, logprobs or not (``predicted_tokens`` reports the request's
    ``predicted``, which the policy reads)."""
    options = ServeOptions(model="tiny", predictor=None, kv_capacity=4096)
    m, codec, name = load_served_model(options)
    state = build_state(options, m, codec, name)
    body = {"model": name, "prompt": "ok?", "max_tokens": 64, "response_format": RESPONSE_SCHEMA}
    with TestClient(create_app(state)) as c:
        first = c.post("/v1/completions", json=body).json()
        assert first["duetime"]["predicted_tokens"] is None
        tokens = [first["usage"]["completion_tokens"]]
        for extra in ({"temperature": 1.0, "seed": 3}, {"logprobs": 1}, {}):
            r = c.post("/v1/completions", json={**body, **extra}).json()
            tokens.append(r["usage"]["completion_tokens"])
        assert max(tokens) < 32
        r = c.post("/v1/completions", json=body).json()
        want = sorted(tokens)[1:3]
        assert r["duetime"]["predicted_tokens"] == sum(want) / 2  # the median of four
        # another grammar knows nothing yet
        other = {**body, "response_format": None, "guided_choice": ["yes", "no"]}
        assert c.post("/v1/completions", json=other).json()["duetime"]["predicted_tokens"] is None


def test_admission_counts_the_steps_a_grammars_answers_take(tmp_path: Any) -> None:
    """Forced runs jump (the schema's keys and punctuation ride along): its answers take
    far fewer steps than tokens. A step for each of the 32 tokens its longest text may
    take would be 3.2 s at 100 ms a step, past a 2 s deadline; the grammar's own walk
    counts a few steps, and once answers have ended, the most steps they took rule.
    Where the grammar leaves free text (a name) there is no walk: a step a token."""
    profile = tmp_path / "decode-bound.json"
    profile.write_text(
        json.dumps({"name": "decode-bound", "coefficients": {"c0": 0.1, "a1": 1e-4}})
    )
    options = ServeOptions(model="tiny", predictor=None, kv_capacity=4096, profile=profile)
    m, codec, name = load_served_model(options)
    state = build_state(options, m, codec, name)
    spec = GrammarSpec.json_schema(SCHEMA, "response_format")
    with TestClient(create_app(state)) as c:
        body = {
            "model": name,
            "prompt": "ok?",
            "max_tokens": 64,
            "response_format": RESPONSE_SCHEMA,
        }
        assert state.grammar_steps.most(spec) is None
        first = c.post("/v1/completions", json={**body, "deadline_ms": 2000})
        assert first.status_code == 200, first.text  # by the walk, before any answer
        tokens = first.json()["usage"]["completion_tokens"]
        work = state.grammar_steps.most(spec)
        assert work is not None
        assert 1 <= work.steps < tokens / 3  # most of the JSON was forced
        assert work.steps + work.rows < tokens  # (its last forced run needed no row)
        again = c.post("/v1/completions", json={**body, "deadline_ms": 2000})
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
        # with log-probabilities its tokens come a step each: nothing is discounted, and
        # the tokens are as many as its two answers had (not the 32 of its longest text)
        one_by_one = {**body, "deadline_ms": 2000, "logprobs": 1}
        refused = c.post("/v1/completions", json=one_by_one)
        assert refused.status_code == 429
        assert f"{tokens} tokens assumed for this answer" in refused.json()["error"]["message"]
        named = {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 8}},
            "required": ["name"],
            "additionalProperties": False,
        }
        free = {"type": "json_schema", "json_schema": {"schema": named}}
        late = c.post(
            "/v1/completions", json={**body, "response_format": free, "deadline_ms": 2000}
        )
        assert late.status_code == 429, late.text  # free text: no walk, a step a token
        assert state.grammar_steps.most(GrammarSpec.json_schema(named, "x")) is None


def test_a_forecast_charges_the_forced_rows_riding_in_a_grammars_steps(tmp_path: Any) -> None:
    """A structured answer takes few steps, but its forced runs are computed as rows of
    them. With rows that cost (20 ms each, the steps 100 ms), the forecast of an answer
    under a schema is its steps and its rows: ``steps·c0 + a1·(prompt rows + riding
    rows)``, and a deadline its steps alone would meet but its rows do not is refused."""
    profile = tmp_path / "row-bound.json"
    profile.write_text(json.dumps({"name": "row-bound", "coefficients": {"c0": 0.1, "a1": 0.02}}))
    options = ServeOptions(model="tiny", predictor=None, kv_capacity=4096, profile=profile)
    m, codec, name = load_served_model(options)
    state = build_state(options, m, codec, name)
    spec = GrammarSpec.json_schema(SCHEMA, "response_format")
    body = {"model": name, "prompt": "ok?", "max_tokens": 64, "response_format": RESPONSE_SCHEMA}
    with TestClient(create_app(state)) as c:
        first = c.post("/v1/completions", json={**body, "deadline_ms": 5000})
        assert first.status_code == 200, first.text
        work = state.grammar_steps.most(spec)
        assert work is not None
        assert work.rows >= 10  # the keys and punctuation rode along
        prompt = first.json()["usage"]["prompt_tokens"]
        # (the engine's image, which the forecast starts from, no longer holds it)
        assert state.engine.image is not None
        assert not state.engine.image.seqs
        again = c.post("/v1/completions", json={**body, "deadline_ms": 5000})
        assert again.status_code == 200, again.text
        forecast_s = again.json()["duetime"]["predicted_e2e_ms"] / 1000
        low = work.steps * 0.1 + 0.02 * (1 + work.rows)  # (the prompt from the cache, at most)
        high = work.steps * 0.1 + 0.02 * (prompt + work.rows)
        assert low - 1e-6 <= forecast_s <= high + 1e-6, (forecast_s, low, high, work)
        # a deadline the steps alone meet (with the whole prompt to compute) is refused
        steps_only_ms = 1000 * (work.steps * 0.1 + 0.02 * prompt)
        assert steps_only_ms + 1 < 1000 * low
        tight = c.post("/v1/completions", json={**body, "deadline_ms": steps_only_ms + 1})
        assert tight.status_code == 429, tight.text


# --- `duetime bench grammar` ---------------------------------------------------------


def test_bench_grammar_times_every_kind_beside_the_free_run(tmp_path: Any) -> None:
    from typer.testing import CliRunner

    from duetime.cli import app

    path = tmp_path / "grammar.json"
    args = ["bench", "grammar", "--model", "tiny", "--requests", "2", "--new-tokens", "12"]
    args += ["--admission-requests", "3", "--admission-burst", "2", "--admission-burst-rounds", "2"]
    res = CliRunner().invoke(app, [*args, "--repeats", "1", "--threads", "1", "--json", str(path)])
    assert res.exit_code == 0, res.output
    fig = json.loads(path.read_text())
    kinds = {"json_schema", "json_array", "regex", "lark"}
    assert set(fig["runs"]) == {"none", *kinds, *(k + ":whole" for k in kinds)}
    assert set(fig["gather_speedup"]) == kinds
    assert all(v > 0 for v in fig["gather_speedup"].values())
    assert "few allowed tokens' logits gathered, against whole rows masked: " in res.output
    for kind, run in fig["runs"].items():
        assert run["ms_per_token"] > 0
        if kind != "none":
            assert run["valid_pct"] == 100.0, kind  # every answer fits its grammar
            assert run["compile_ms"] >= 0
    assert fig["runs"]["none"]["overhead_pct"] == 0.0
    assert "a grammar costs at most" in res.output
    jump = fig["jump_forward"]
    assert jump["answers_identical"] is True
    assert jump["on"]["forced_tokens_jumped"] > 0 == jump["off"]["forced_tokens_jumped"]
    assert jump["on"]["engine_steps"] < jump["off"]["engine_steps"]
    # robot commands through a fresh server per arm (timing-bound: the tiny model's
    # figures are not compared, only accounted for)
    assert set(fig["admission"]) == {"grammar_steps", "step_per_token"}
    for arm in fig["admission"].values():
        assert arm["requests"] == 3
        assert 0 <= arm["met"] <= arm["accepted"] <= 3
        assert len(arm["e2e_ms"]) == arm["accepted"]
        ratio = arm["forecast_to_actual_e2e_median"]
        assert (ratio is None) == (arm["accepted"] == 0)
        assert ratio is None or ratio > 0
    # a fleet of two, rounds 2 s apart, companions expected or not: under ten times the
    # deadline, then under it
    assert set(fig["admission_bursts"]) == {"expected", "even"}
    for passes in fig["admission_bursts"].values():
        assert [passes[p]["deadline_ms"] for p in ("seen", "deadline")] == [5000.0, 500.0]
        for burst in passes.values():
            assert (burst["size"], burst["rounds"], burst["period_s"]) == (2, 2, 2.0)
            assert [len(r) for r in burst["e2e_ms"]] == [2, 2]
            kept = [e for r in burst["e2e_ms"] for e in r if e is not None]
            assert len(kept) == burst["accepted"] == sum(burst["accepted_per_round"])
            assert 0 <= burst["met"] <= burst["accepted"]
            firsts, lasts = burst["smallest_forecast_to_e2e"], burst["largest_forecast_to_e2e"]
            assert len(firsts) == len(lasts) <= 2
            assert all(r > 0 for r in firsts + lasts)
    assert "robot commands under 500 ms" in res.output
    assert "bursts of 2 every 2 s, companions expected: under 5000 ms" in res.output


def test_bench_grammar_refuses_an_unknown_kind() -> None:
    from tests.factories import cli_refused

    cli_refused("bench", "grammar", "--model", "tiny", "--kinds", "json,yaml", names="--kinds")


def test_logits_of_allowed_rows_are_exact_at_their_tokens_and_minus_inf_elsewhere(
    model: Gemma3,
) -> None:
    import torch

    kv = model.new_kv_cache()
    a, b = kv.allocate(), kv.allocate()
    hidden, batch = model.hidden_states(
        [SeqChunk(a, CODEC.encode("one prompt"), 0), SeqChunk(b, CODEC.encode("two"), 0)], kv
    )
    last = hidden[batch.last_rows]
    full = model.logits(last)
    ids = torch.tensor([5, 70, 200])
    got = model.logits(last, allowed=[ids, None])
    assert torch.allclose(got[0, ids], full[0, ids], atol=1e-5)
    assert int(got[0].isfinite().sum()) == 3
    assert torch.allclose(got[1], full[1], atol=1e-5)  # a row without a list: the whole row
    assert torch.equal(model.logits(last, allowed=[None, None]), full)
    with pytest.raises(ValueError, match="allowed has 1 entries for 2 rows"):
        model.logits(last, allowed=[ids])


@pytest.mark.parametrize("sampled", [False, True])
def test_grammar_rows_take_their_few_allowed_logits_and_answer_as_with_whole_rows(
    model: Gemma3, compiler: GrammarCompiler, sampled: bool
) -> None:
    """A grammar row whose next tokens are few gets only their logits (the output
    layer's product over the vocabulary skipped); answers, greedy or sampled, are those
    of the masked whole rows (gathering turned off)."""
    jobs = _jobs(6)
    sampling = {rid: SamplingParams(temperature=0.9, seed=rid) for rid in (1, 4)} if sampled else {}

    def run(**kw: Any) -> tuple[dict[int, list[int]], list[bool]]:
        gathered: list[bool] = []
        step = model.step

        def spy(chunks: Any, kv: Any, **kw: Any) -> Any:
            gathered.append(kw.get("allowed") is not None)
            return step(chunks, kv, **kw)

        model.step = spy  # type: ignore[method-assign]
        try:
            _, outputs, _ = _run(model, compiler, jobs, make_policy("fcfs"), sampling, **kw)
        finally:
            del model.step
        return outputs, gathered

    with_gather, gathered = run()
    assert any(gathered)
    whole_rows, gathered_off = run(grammar_gather_max=0)
    assert not any(gathered_off)
    assert with_gather == whole_rows
