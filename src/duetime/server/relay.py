"""One answer on its way to the client: the engine's token batches as text deltas.

:class:`Relay` detokenizes what the engine publishes for one request, applies
its stop strings (holding back text that may begin one, and ending the
sequence when one appears), times the answer out, and hands out the answer
tokens' log-probabilities once their text is out. The HTTP shapes around it
are :mod:`duetime.server.answers`'.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator

from duetime.engine.logprobs import LogprobLog
from duetime.server.codec import Codec, Detokenizer
from duetime.server.engine_loop import EngineLoop
from duetime.server.errors import ApiError
from duetime.server.logprob_format import LoggedToken
from duetime.server.response_shapes import TimingInfo
from duetime.server.streams import Outcome, Stream

__all__ = ["Relay", "safe_end"]


def safe_end(text: str, stops: list[str]) -> int:
    """Index before the longest suffix of ``text`` that begins some stop string."""
    end = len(text)
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                end = min(end, len(text) - k)
                break
    return end


class Relay:
    """Turns the engine's token batches into text deltas, applying stop strings."""

    def __init__(
        self,
        engine: EngineLoop,
        rid: int,
        stream: Stream,
        stops: list[str],
        codec: Codec,
        min_tokens: int = 0,
        logprobs: LogprobLog | None = None,
        *,
        prompt_index: int = 0,
        echo: str | None = None,
        scored_ids: list[int] | None = None,
        lstrip: bool = False,
    ) -> None:
        self.engine = engine
        self.rid = rid
        self.stream = stream
        self.stops = stops
        self.detok = Detokenizer(codec)  # this answer's own: it holds back partial characters
        self.min_tokens = min_tokens
        self.sent = ""  # text handed to the client
        self.completion_tokens = 0
        self.outcome: Outcome | None = None
        self.stopped = False  # a stop string ended the answer
        #: Where in the text a stop string may begin: past the first ``min_tokens`` tokens
        #: ("never stop before this", as vLLM), None until they are in.
        self.floor: int | None = 0 if min_tokens <= 0 else None
        #: Where the engine puts the answer tokens' log-probabilities (None: not asked).
        self.logprobs = logprobs
        self._given = 0  # tokens whose log-probabilities the client has
        #: Which of the request's prompts this choice answers (completions take several).
        self.prompt_index = prompt_index
        #: The prompt a completion with ``echo`` repeats before the answer (None: none).
        self.echo = echo
        #: The prompt's ids where its tokens are scored (``echo`` with ``logprobs``).
        self.scored_ids = scored_ids
        #: The answer is shown from its first non-space character on: a chat answer, whose
        #: transcript's ``Assistant:`` the model continues with a space or a line break.
        self.lstrip = lstrip

    async def deltas(self, timeout: float) -> AsyncIterator[str]:
        """Text deltas until the answer ends; sets ``outcome``."""
        deadline = time.monotonic() + timeout
        while self.outcome is None:
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError
                # Times out while no token comes (queued, a long prefill): that too is a 504.
                item = await self.stream.get(left)
            except TimeoutError:
                self.abort()
                raise ApiError(
                    504,
                    f"the request timed out in the server (--request-timeout {timeout:g} s)",
                    type="server_error",
                    code="timeout",
                ) from None
            if isinstance(item, Outcome):
                self.detok.flush()
                out = self._emit(final=True)
                self.outcome = self._as_seen(item)
                self.stream.counted(self.outcome)
                if out:
                    yield out
                break
            if self.stopped:
                continue  # generated before the engine saw the stop: not part of the answer
            self.completion_tokens += len(item)
            if self.logprobs is None:
                self.detok.add(item)
            else:  # one at a time: where each token's text ends
                self.detok.add_each(item)
            if self.floor is None and self.completion_tokens >= self.min_tokens:
                self.floor = len(self.detok.text)
            out = self._emit(final=False)
            if out:
                yield out
            if self.stopped:
                # Ends the sequence as a normal "stop" (its deadline judged, its KV freed);
                # keep listening: the outcome still comes.
                self.engine.finish(self.rid)

    def _emit(self, *, final: bool) -> str:
        """The text that may be sent now: up to a stop string, holding back a possible start."""
        if self.stopped:
            return ""
        text = self.detok.text
        start = len(self.sent)
        end = len(text)
        floor = self.floor
        if floor is None:  # within min_tokens: no stop string counts, nothing is held back
            floor = end
        for stop in self.stops:
            cut = text.find(stop, max(start, floor))
            if cut >= 0 and cut < end:
                end = cut
                self.stopped = True
        if not self.stopped and not final:
            end = max(min(end, safe_end(text, self.stops)), floor)
        out = text[start:end] if end > start else ""
        self.sent += out
        if self.lstrip and out:
            out = out.lstrip()
            self.lstrip = not out  # only space so far: the next text may start with more
        return out

    def take_logprobs(self) -> list[LoggedToken]:
        """The tokens whose text the client now has whole and whose log-probabilities it
        has not got yet; once the answer ended, every token with text in it.

        So a chunk carries the figures of the tokens its text came from, as OpenAI's and
        vLLM's streams do. Only while the detokenizer holds text back (half a character)
        does the newest token wait for the next or the end: that text may yet be its
        (:meth:`Detokenizer.flush`), and a streamed answer splits its text as a whole one."""
        if self.logprobs is None:
            return []
        sent, ends, ended = len(self.sent), self.detok.ends, self.outcome is not None
        settled = ended or not self.detok.holding
        upto = min(len(ends) if settled else len(ends) - 1, len(self.logprobs.entries))
        out = []
        for i in range(self._given, upto):
            start = ends[i - 1] if i else 0
            whole = ends[i] <= sent or (ended and not self.stopped)
            if not whole and not (ended and start < sent):
                break
            text = self.sent[start : min(ends[i], sent)]
            out.append(LoggedToken(self.logprobs.entries[i], text, start))
            self._given = i + 1
        return out

    def _as_seen(self, outcome: Outcome) -> Outcome:
        """The outcome as the client sees it: a stop string it got ends the answer as
        "stop", whatever the engine had ended it with meanwhile ("length" at the same
        token, a policy's "abort" or an engine "error" before the finish arrived)."""
        if self.stopped and outcome.finish_reason != "stop":
            return dataclasses.replace(outcome, finish_reason="stop", error=None)
        return outcome

    def abort(self) -> None:
        self.stream.close()
        self.engine.abort(self.rid)

    def finish_reason(self) -> str:
        assert self.outcome is not None
        return self.outcome.finish_reason

    def timing(self) -> TimingInfo:
        o = self.outcome
        assert o is not None
        return TimingInfo(
            ttft_ms=None if o.ttft is None else round(o.ttft * 1000, 3),
            e2e_ms=round(o.e2e * 1000, 3),
            deadline_met=o.deadline_met,
            kv_eviction_ratio=o.kv_evicted_ratio,
            predicted_tokens=o.predicted_tokens,
            predicted_e2e_ms=None if o.forecast_e2e is None else round(o.forecast_e2e * 1000, 3),
            preemptions=o.preemptions,
            completion_tokens=self.completion_tokens,
        )
