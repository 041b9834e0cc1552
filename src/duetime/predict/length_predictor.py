"""``LearnedLengthPredictor``: the trained RLP behind the executor-side ``JobPredictor`` seam.

It reads only what a server would have when the request arrives: the prompt
(``Request.prompt_text``, or else ``Request.prompt_token_ids`` decoded with
the Gemma tokenizer), the prompt's token count and ``max_tokens`` (N_max).
It never reads ``Job.output_len``: :meth:`predict_job` hands the *request*
on, so the truth is out of reach.

Prompts of the ShareGPT set are found by text hash in the embedding cache
(:func:`~duetime.predict.length_features.sharegpt_embeddings`) when that
cache exists for this model's encoder, which skips the encoder; any other
prompt is encoded on the spot. A small in-process memo keyed the same way
makes repeated prompts free.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from duetime.core.request import Job, LengthPrediction, Request
from duetime.predict.length_model import LengthModel


class LearnedLengthPredictor:
    """Point + calibrated ``coverage`` interval from a trained :class:`LengthModel`.

    ``confidence`` is the interval's calibrated coverage: the probability,
    over prompts like the calibration set's, that the answer lies in
    ``[lo, hi]``. ``readout`` overrides the model's (``argmax`` is TimeBill's
    Eq. 2). ``use_cache`` looks ShareGPT prompts up in the embedding cache.
    Prompts encoded here are memoised too, but only the newest
    ``MAX_FRESH_MEMO`` of them: a server sees an endless stream of new prompts.
    """

    MAX_FRESH_MEMO = 65_536

    name = "learned"

    def __init__(
        self,
        model: LengthModel | str | Path | None = None,
        *,
        coverage: float = 0.9,
        readout: str | None = None,
        use_cache: bool = True,
        threads: int | None = 1,
    ) -> None:
        if model is None or isinstance(model, str | Path):
            from duetime.predict.length_fit import default_model_path

            model = LengthModel.load(model or default_model_path())
        self.model = model
        self.coverage = coverage
        self.levels = model.levels(coverage)  # validates coverage once
        self.readout = readout or model.config.readout
        self.encoder = model.encoder(threads=threads)
        self.use_cache = use_cache
        self._memo: dict[int, np.ndarray] = {}
        self._fresh: deque[int] = deque()  # memo keys the encoder produced, oldest first
        self._cache_loaded = False

    # --- prompts -> embeddings ---------------------------------------------------------------
    def _load_cache(self) -> None:
        """Seed the memo from the ShareGPT embedding cache, if it was built for this encoder."""
        self._cache_loaded = True
        if not self.use_cache:
            return
        from duetime.predict.length_features import cached_embeddings

        found = cached_embeddings(self.encoder)
        if found is not None:
            emb, keys = found
            self._memo.update(zip(keys.tolist(), emb, strict=True))

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """One embedding row per text, from the memo or the encoder."""
        from duetime.predict.length_features import text_key

        if not self._cache_loaded:
            self._load_cache()
        keys = [text_key(t) for t in texts]
        missing = list({k: i for i, k in enumerate(keys) if k not in self._memo}.values())
        if missing:  # each distinct new prompt is encoded once
            fresh = self.encoder.encode([texts[i] for i in missing])
            rows = {keys[i]: row for i, row in zip(missing, fresh, strict=True)}
            out = [rows[k] if k in rows else self._memo[k] for k in keys]
            for k, row in rows.items():
                self._memo[k] = row
                self._fresh.append(k)
            while len(self._fresh) > self.MAX_FRESH_MEMO:
                self._memo.pop(self._fresh.popleft(), None)
            return np.stack(out)
        return np.stack([self._memo[k] for k in keys]) if keys else np.empty((0, self.encoder.dim))

    def warm_up(self) -> None:
        """Load the encoder (and the embedding cache) now rather than on the first
        prediction: a server would otherwise charge ~4.5 s to its first request."""
        self.predict_texts(["warm-up"], [2], 16)

    # --- predictions -------------------------------------------------------------------------
    def predict_texts(
        self,
        texts: Sequence[str],
        prompt_lens: Sequence[int] | np.ndarray,
        max_tokens: Sequence[int] | np.ndarray | int,
    ) -> list[LengthPrediction]:
        """Predictions for prompts given as text, with their Gemma token counts (``<bos>`` in)."""
        emb = self.embed(texts)
        pred = self.model.predict(
            emb,
            np.asarray(prompt_lens, dtype=np.float64),
            np.asarray(max_tokens, dtype=np.float64),
            coverage=self.coverage,
            readout=self.readout,
        )
        return [
            LengthPrediction(point=float(p), lo=float(lo), hi=float(hi), confidence=self.coverage)
            for p, lo, hi in zip(pred.point, pred.lo, pred.hi, strict=True)
        ]

    def predict_requests(self, requests: Sequence[Request]) -> list[LengthPrediction]:
        texts = [prompt_text(r) for r in requests]
        return self.predict_texts(
            texts, [r.prompt_len for r in requests], [r.max_tokens for r in requests]
        )

    def predict_request(self, request: Request) -> LengthPrediction:
        return self.predict_requests([request])[0]

    def predict_job(self, job: Job) -> LengthPrediction:
        """The prediction for ``job``'s request. ``job.output_len`` is never read."""
        return self.predict_request(job.request)

    def annotate(self, jobs: Iterable[Job]) -> None:
        """Fill ``request.predicted`` for many jobs in one batch (executors skip filled ones)."""
        todo = [j.request for j in jobs if j.request.predicted is None]
        for req, pred in zip(todo, self.predict_requests(todo), strict=True):
            req.predicted = pred


def prompt_text(request: Request) -> str:
    """The prompt as text: ``prompt_text`` if set, else the decoded ``prompt_token_ids``."""
    if request.prompt_text is not None:
        return request.prompt_text
    if request.prompt_token_ids is not None:
        from duetime.tokenizer import decode

        return decode(request.prompt_token_ids)
    raise ValueError(
        f"request {request.rid}: the learned length predictor needs the prompt; set "
        "Request.prompt_text or prompt_token_ids (build_jobs(..., with_prompt_ids=True))"
    )


def make_learned_predictor(spec: str) -> LearnedLengthPredictor:
    """``learned`` (the default shipped model), ``learned:<name>`` (a shipped model by
    encoder: ``minilm-static``, ``minilm``, ``minilm-ft``) or ``learned:<path to a model file>``."""
    from duetime.predict.length_fit import SHIPPED_MODELS, shipped_model_path

    _, _, arg = spec.partition(":")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if arg in SHIPPED_MODELS:
        return LearnedLengthPredictor(shipped_model_path(arg))
    return LearnedLengthPredictor(Path(arg) if arg else None)
