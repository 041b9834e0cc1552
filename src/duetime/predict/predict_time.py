"""TimeBill's predictor-time model and prompt compression (Fan et al., arXiv 2512.21859, Sec. 5.2).

The response-length predictor runs in parallel with the target model's prefill;
its time is hidden when ``t_Predict <= t_prefill``. The paper models the
predictor's time as ``t̂_Predict(N_p) = a_p·N_p² + b_p·N_p + c_p`` in the
length ``N_p`` of its input, bounds ``N_p`` by solving ``t̂_Predict(N_p) <=
t̂_prefill(N_x)`` (Eq. 4a, the ETE) and compresses the prompt ``x`` into a
shorter ``x_p`` when it is longer than that.

Here the predictor is the learned RLP (:class:`LearnedLengthPredictor`), whose
input is the prompt's MiniLM word pieces (at most the encoder's ``max_tokens``).
Compression keeps the *first* ``N_p`` word pieces (the cut the encoder already
makes at ``max_tokens``); the paper cites a learned prompt compressor, which we
do not have. The prompt's full token count ``N_x`` stays a feature: it is known
without reading the text.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from duetime.core.request import Job, LengthPrediction, Request

MIN_PIECES = 4  # [CLS], at least two word pieces, [SEP]


@dataclass(slots=True, frozen=True)
class PredictTimeModel:
    """``t̂_Predict(N_p) = a_p·N_p² + b_p·N_p + c_p`` seconds, ``N_p`` in word pieces.

    ``floor_s`` (the fastest call measured) bounds the curve from below: a least-squares
    quadratic through noisy timings can dip below zero at small ``N_p``, and a predictor
    never runs in less than its fixed overhead.
    """

    a_p: float
    b_p: float
    c_p: float
    max_pieces: int
    floor_s: float = 0.0

    def time_s(self, n: float) -> float:
        return max(self.a_p * n * n + self.b_p * n + self.c_p, self.floor_s)

    def max_len(self, budget_s: float) -> int:
        """The largest ``N_p`` (>= ``MIN_PIECES``) with ``t̂_Predict(N_p) <= budget_s``.

        Scanned over integers rather than solved in closed form, so a fitted
        curve that is not monotone (noise, ``a_p < 0``) still gives a safe bound.
        """
        n = np.arange(MIN_PIECES, self.max_pieces + 1, dtype=np.float64)
        ok = np.maximum(self.a_p * n * n + self.b_p * n + self.c_p, self.floor_s) <= budget_s
        if not ok[0]:
            return MIN_PIECES
        bad = np.flatnonzero(~ok)
        return int(n[bad[0] - 1]) if bad.size else self.max_pieces

    @classmethod
    def fit(
        cls, pieces: Sequence[int], seconds: Sequence[float], max_pieces: int
    ) -> PredictTimeModel:
        """Least squares on measured ``(N_p, seconds)`` pairs (a line if < 3 distinct N_p)."""
        x, y = np.asarray(pieces, dtype=np.float64), np.asarray(seconds, dtype=np.float64)
        if x.size == 0:
            raise ValueError("no predictor timings to fit")
        distinct = np.unique(x).size
        if distinct >= 3:
            a, b, c = np.polyfit(x, y, 2)
        elif distinct == 2:
            a, (b, c) = 0.0, np.polyfit(x, y, 1)
        else:
            a, b, c = 0.0, 0.0, float(y.mean())
        return cls(float(a), float(b), float(c), max_pieces, float(y.min()))


@dataclass(slots=True)
class PredictCall:
    """What one prediction read and cost."""

    pieces_full: int  # word pieces the encoder would read uncompressed (<= max_pieces)
    pieces_used: int
    t_prefill_hat_s: float | None  # the ETE's prefill estimate that bounded N_p
    seconds: float = 0.0


@dataclass
class CompressingRLP:
    """The learned RLP that cuts its input to the ``N_p`` the prefill can hide.

    ``prefill_time`` is the ETE's ``t̂_prefill(N_x)`` (None: never compress);
    ``time_model`` is :class:`PredictTimeModel` from :meth:`calibrate` (None:
    never compress). Each :meth:`predict_job` appends a :class:`PredictCall`
    to ``calls`` (thread-safe: ``list.append`` is atomic).
    """

    rlp: Any  # LearnedLengthPredictor; Any keeps its heavy import lazy
    prefill_time: Callable[[int], float] | None = None
    time_model: PredictTimeModel | None = None
    calls: list[PredictCall] = field(default_factory=list)

    @classmethod
    def load(cls, spec: str = "learned") -> CompressingRLP:
        """The shipped RLP (``learned``, ``learned:minilm``, ``learned:<path>``), encoding on the
        spot (no embedding cache: its time is what is measured) and leaving torch's thread
        count alone (the engine is running beside it)."""
        from duetime.predict.length_predictor import LearnedLengthPredictor, make_learned_predictor

        base = make_learned_predictor(spec)
        rlp = LearnedLengthPredictor(
            base.model, readout=base.readout, use_cache=False, threads=None
        )
        return cls(rlp)

    @property
    def max_pieces(self) -> int:
        return int(self.rlp.encoder.max_tokens)

    def _pieces(self, text: str) -> tuple[int, list[tuple[int, int]]]:
        enc = self.rlp.encoder
        enc.token_ids([""])  # loads the tokenizer once
        cut = enc.max_tokens * 16  # the encoder's own characters-per-piece cut
        e = enc._tokenizer.encode(text[:cut])
        return len(e.ids), e.offsets

    def compress(self, text: str, n_pieces: int) -> tuple[str, int]:
        """``text`` cut to its first ``n_pieces`` word pieces ([CLS] and [SEP] included)."""
        full, offsets = self._pieces(text)
        if full <= n_pieces:
            return text, full
        keep = max(n_pieces - 2, 1)  # content pieces; offsets[0] is [CLS]
        return text[: offsets[keep][1]], n_pieces

    def predict_text(self, text: str, prompt_len: int, max_tokens: int) -> LengthPrediction:
        """Encoder + bucket head on ``text``, bypassing the predictor's memo (a memo hit
        would time nothing)."""
        emb = self.rlp.encoder.encode([text])
        pred = self.rlp.model.predict(
            emb,
            np.asarray([prompt_len], dtype=np.float64),
            np.asarray([max_tokens], dtype=np.float64),
            coverage=self.rlp.coverage,
            readout=self.rlp.readout,
        )
        return LengthPrediction(
            point=float(pred.point[0]),
            lo=float(pred.lo[0]),
            hi=float(pred.hi[0]),
            confidence=self.rlp.coverage,
        )

    def predict_request(self, req: Request) -> LengthPrediction:
        from duetime.predict.length_predictor import prompt_text

        t0 = time.perf_counter()
        text = prompt_text(req)
        # the encoder reads no more than max_pieces: a longer prompt is not "over the bound"
        # when the whole encoder fits the prefill (cutting it would drop what a bag-of-pieces
        # feature reads beyond the contextual part, as minilm-ft's does)
        full = min(self._pieces(text)[0], self.max_pieces)
        t_pre = None if self.prefill_time is None else float(self.prefill_time(req.prompt_len))
        used = full
        if t_pre is not None and self.time_model is not None:
            bound = self.time_model.max_len(t_pre)
            if full > bound:
                text, used = self.compress(text, bound)
        pred = self.predict_text(text, req.prompt_len, req.max_tokens)
        self.calls.append(PredictCall(full, used, t_pre, time.perf_counter() - t0))
        return pred

    def predict_job(self, job: Job) -> LengthPrediction:
        """The prediction for ``job``'s request; ``job.output_len`` is never read."""
        return self.predict_request(job.request)

    def calibrate(
        self, texts: Sequence[str], grid: Sequence[int] = (8, 32, 64, 128, 256, 512), reps: int = 2
    ) -> PredictTimeModel:
        """Time the predictor on ``texts`` cut to each ``N_p`` of ``grid`` and fit the model."""
        pieces: list[int] = []
        secs: list[float] = []
        self.predict_text(texts[0], 16, 64)  # warm-up: first calls allocate
        for n in sorted({min(g, self.max_pieces) for g in grid}):
            for text in texts:
                cut, used = self.compress(text, n)
                for _ in range(reps):
                    t0 = time.perf_counter()
                    self._pieces(cut)  # the real path tokenises to count pieces first
                    self.predict_text(cut, 256, 128)
                    secs.append(time.perf_counter() - t0)
                    pieces.append(used)
        self.time_model = PredictTimeModel.fit(pieces, secs, self.max_pieces)
        return self.time_model
