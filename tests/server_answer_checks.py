"""What the server property test checks of each client's answer: the status a body
deserves, the OpenAI error object, and for an answer that ran to its end the model's
greedy continuation cut where its ``finish_reason`` says (a prefix of it for an abort),
with ``usage``, the ``duetime`` object and ``logprobs`` agreeing with the text; and that
a streamed and a non-streamed answer to the same greedy request are the same.

Kept apart from ``tests/test_server_properties.py`` so that the test file holds the
property alone.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tests.factories import answer_shape_problems, byte_codec_text
from tests.served import CharCodec, answer_stops, turn_ended
from tests.server_calls import Call, Engine, Seen, greedy, make_codec


# --- what the answers must be ----------------------------------------------------------
def _text_after(codec: str, gen: Sequence[int], *, final: bool) -> str:
    """The text of ``gen`` a client may have: a character still missing bytes is not
    part of it until the answer ends (then it is U+FFFD); a broken byte is U+FFFD."""
    if codec == "char":
        return CharCodec().decode(gen)
    return byte_codec_text(gen, final=final)


def _greedy_request(c: Call) -> bool:
    """Whether ``c``'s answer is the model's plain greedy one (the reference's)."""
    f = c.fields
    argmax = f.get("temperature", 0.0) == 0 or f.get("top_k") == 1
    return argmax and not f.get("frequency_penalty")


def _reference(eng: Engine, c: Call) -> tuple[str, str, int]:
    """(text, finish reason, completion tokens) of the answer to ``c`` run to its end.

    The greedy continuation ends at the first end-of-sequence it may end at
    (not before ``min_tokens``, never with ``ignore_eos``), and before the first
    stop string that begins after the first ``min_tokens`` tokens; the tokens
    counted are those up to the end of that stop."""
    codec = make_codec(eng.codec)
    gen = greedy(c.ids, c.max_tokens)
    reason = "length"
    min_tokens = c.fields.get("min_tokens", 0)
    ends = set(c.fields.get("stop_token_ids") or ())  # kept in the answer, as vLLM does
    if not c.fields.get("ignore_eos"):
        ends.add(codec.eos_id)
    for k, tok in enumerate(gen):
        if tok in ends and k + 1 >= max(min_tokens, 1):
            gen, reason = gen[: k + 1], "stop"
            break
    stops = answer_stops(c.fields, c.chat)
    floor = len(_text_after(eng.codec, gen[:min_tokens], final=False))
    # A stop string is found once its last token is in: scan the answer token by token.
    for k in range(max(min_tokens, 1), len(gen) + 1):
        text = _text_after(eng.codec, gen[:k], final=k == len(gen))
        hits = [text.find(s, floor) for s in stops if s in text[floor:]]
        if hits:
            return text[: min(hits)], "stop", k
    return codec.decode(gen), reason, len(gen)


def check_call(eng: Engine, c: Call, s: Seen) -> list[str]:
    """What is wrong with one client's answer (empty: nothing)."""
    bad = list(s.problems)
    if s.gone:
        return bad
    if s.status is None:
        return [*bad, "no status"]
    if c.expect is not None:  # a body the server must refuse, and how
        if s.status != c.expect:
            bad.append(f"status {s.status}, expected {c.expect}: {s.error}")
        return bad + _error_object(s)
    if s.status == 429:
        bad += _error_object(s)
        if int(s.headers.get("retry-after", "0")) < 1:
            bad.append("429 without Retry-After")
        code = (s.error or {}).get("code")
        if code == "deadline_unreachable" and not _judged(c):
            bad.append("deadline_unreachable for a request that cannot be refused for it")
        if code not in ("queue_full", "deadline_unreachable"):
            bad.append(f"429 with code {code!r}")
        return bad
    if s.status == 504:
        if eng.request_timeout_s > 60:
            bad.append("504 under a 600 s timeout")
        return bad + _error_object(s)
    if s.status != 200:
        return [*bad, f"status {s.status}: {s.error}"]
    if not s.final:
        return bad
    return bad + _check_answer(eng, c, s)


def _asks_logprobs(c: Call) -> bool:
    v = c.fields.get("logprobs")  # chat: true; completions: 0 to 5 (0 asks too)
    return v is not None and v is not False


def _judged(c: Call) -> bool:
    """Whether admission may refuse ``c`` for its deadline."""
    has = "deadline_ms" in c.fields or "time_budget_ms" in c.fields
    kv = c.fields.get("kv_eviction", "off")
    return has and (kv == "off" or kv == 0.0)


def _error_object(s: Seen) -> list[str]:
    e = s.error
    if not isinstance(e, dict) or not isinstance(e.get("message"), str) or not e.get("type"):
        return [f"status {s.status} without an OpenAI error object: {e}"]
    return []


def _check_answer(eng: Engine, c: Call, s: Seen) -> list[str]:
    bad: list[str] = []
    choice = s.final["choices"][0]
    reason = choice["finish_reason"]
    timing = s.final.get("duetime")
    if timing is None:
        return ["no duetime object"]
    n = timing["completion_tokens"]
    if s.usage is not None:
        want = {"prompt_tokens": len(c.ids), "completion_tokens": n, "total_tokens": len(c.ids) + n}
        usage = dict(s.usage)
        cached = (usage.pop("prompt_tokens_details", None) or {}).get("cached_tokens")
        if usage != want:
            bad.append(f"usage {s.usage}, expected {want}")
        # whole 16-token blocks of the prompt; all of it only for a prefill recomputed after
        # a preemption, whose last computed token is then one of the answer's
        if not (
            isinstance(cached, int)
            and 0 <= cached <= len(c.ids)
            and (cached % 16 == 0 or cached == len(c.ids))
        ):
            bad.append(f"usage {s.usage}: cached_tokens not whole blocks of the prompt")
    text = s.text
    pieces = s.pieces
    if c.fields.get("echo"):
        codec = make_codec(eng.codec)
        prompt = c.fields["prompt"]
        echo = prompt[0] if isinstance(prompt, list) and isinstance(prompt[0], str) else prompt
        if not isinstance(echo, str) or _asks_logprobs(c):  # a scored prompt: its ids decoded
            echo = codec.decode(c.ids)
        if not text.startswith(echo):
            return [*bad, f"echo {echo!r} missing: {text!r}"]
        text = text[len(echo) :]
        if _asks_logprobs(c):  # the prompt's tokens come first, the first without a score
            scored, pieces = s.pieces[: len(c.ids)], s.pieces[len(c.ids) :]
            if "".join(scored) != echo or len(scored) != len(c.ids):
                bad.append(f"scored prompt {scored} does not make up the echo {echo!r}")
            if not s.scores or s.scores[0] is not None:
                bad.append(f"the prompt's first token has a score: {s.scores[:2]}")
            elif n and None in s.scores[1 : len(c.ids)]:
                bad.append("a prompt token without a score after the prefill")
    want_text, want_reason, want_n = _reference(eng, c)
    # Evicted KV or sampling (or a penalty) leave the greedy reference: shape checks only.
    unlike_ref = timing["kv_eviction_ratio"] > 0 or not _greedy_request(c)
    if reason not in ("stop", "length", "abort"):
        bad.append(f"finish_reason {reason!r}")
    elif reason == "abort":  # cut short by the policy: what was sent stands
        # Text held back as the possible start of a stop string is sent at the end: the
        # stop never came. A half character at the cut is sent as U+FFFD.
        full = _text_after(eng.codec, greedy(c.ids, c.max_tokens), final=True)
        stops = answer_stops(c.fields, c.chat)
        if not unlike_ref and not full.startswith(text.rstrip("\ufffd")):
            bad.append(f"aborted answer {text!r} is not a prefix of {full!r}")
        if any(stop in text for stop in stops):
            bad.append(f"aborted answer {text!r} holds a stop string of {stops}")
    elif not unlike_ref and (text, reason, n) != (want_text, want_reason, want_n):
        bad.append(
            f"answer {text!r} {reason} ({n} tokens); the model's is {want_text!r} "
            f"{want_reason} ({want_n} tokens)"
        )
    if _asks_logprobs(c):  # one entry per token, whose strings make up the text
        if "".join(pieces) != text:
            bad.append(f"logprobs' tokens {pieces} do not make up the text {text!r}")
        # a stop string cuts the text, and the entries with it, short of the tokens
        full = _text_after(eng.codec, greedy(c.ids, c.max_tokens), final=True)
        turn_end_cut = turn_ended(c.fields, c.chat, full)
        if len(pieces) > n or (not (c.fields.get("stop") or turn_end_cut) and len(pieces) != n):
            bad.append(f"{len(pieces)} logprobs entries for {n} tokens")
    elif s.pieces:
        bad.append("logprobs nobody asked for")
    if eng.codec == "char" and len(text) > n:  # one character per token (none for ids < 3)
        bad.append(f"{len(text)} characters but completion_tokens {n}")
    bad += answer_shape_problems(n, reason, c.max_tokens, timing)
    e2e = timing["e2e_ms"]
    budget = c.fields.get("deadline_ms", c.fields.get("time_budget_ms"))
    met = timing["deadline_met"]
    if (budget is None) != (met is None):
        bad.append(f"deadline_met {met} with deadline {budget}")
    elif met and (reason == "abort" or e2e > budget + 0.01):
        bad.append(f"deadline_met with {reason}, e2e {e2e} ms, deadline {budget} ms")
    return bad


def same_prompt_same_answer(eng: Engine, calls: list[Call], seen: list[Seen]) -> list[str]:
    """A streamed and a non-streamed answer to the same greedy request are the same text."""
    keys = ("ignore_eos", "min_tokens", "stop", "echo")
    texts: dict[Any, set[tuple[bool, str, str]]] = {}
    for c, s in zip(calls, seen, strict=True):
        if not s.answered or c.expect is not None:
            continue
        reason = s.final["choices"][0]["finish_reason"]
        if reason == "abort" or s.final["duetime"]["kv_eviction_ratio"] > 0:
            continue
        if not _greedy_request(c):
            continue
        key = (c.route, c.ids, c.max_tokens, json.dumps([c.fields.get(k) for k in keys]))
        texts.setdefault(key, set()).add((c.stream, s.text, reason))
    return [
        f"{key}: different answers {sorted(v)}"
        for key, v in texts.items()
        if len({(t, r) for _, t, r in v}) > 1
    ]
