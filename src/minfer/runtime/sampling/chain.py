"""The sampler: one sequence's chain of steps, built from :class:`SamplingParams`, and its state.

The chain (``common_sampler`` in llama.cpp's ``common/sampling.cpp``)::

    logits -> logit_bias -> penalties -> dry -> top_n_sigma -> top_k -> typ_p -> top_p -> min_p -> xtc
           -> temperature -> dist

``logit_bias`` always runs first; the steps between it and the draw follow ``SamplingParams.samplers``
(the names of :data:`.params.STEPS`, in its order by default). A step that is switched off by its parameter is left
out of the chain. With ``mirostat`` 1 or 2 the chain is ``logit_bias -> temperature -> mirostat``.

History: ``reset(prompt_tokens)`` seeds the penalty window with the prompt (and restores ``mu`` and the
random streams), ``accept(token)`` appends each generated token; ``sample`` does not append by itself
(llama.cpp's ``common_sampler_sample`` / ``common_sampler_accept``). A decode loop::

    sampler.reset(prompt_ids)
    while ...:
        token = sampler.sample(logits)          # or sample_with_logprobs(logits, n_top)
        sampler.accept(token)

The draw and XTC's coin use two streams spawned from the one seed; with ``seed=None`` a random seed is
chosen and kept in ``Sampler.seed`` so the run can be replayed.

A sampler takes one *route* to the chain's answer, chosen when it is made (``route="auto"``: the first
that applies, in this order):

- ``"compiled"``: llama.cpp's default shape runs in one compiled call (:mod:`.compiled`), many sequences'
  rows in the same call (:func:`.batched.sample_batch`);
- ``"greedy"``: an argmax after the logit processors, where the steps' declared kinds prove the chain
  picks that token;
- ``"fused"``: the steps in numpy, logit_bias and top_k as one pass over the vocabulary;
- ``"steps"``: every step in numpy, one after the other.

They give the same tokens (the tests hold each to ``"steps"``); ``route`` names one to check it. At a
49152-token vocabulary the default chain takes about 0.1 ms a token, greedy about 0.02 ms.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal, get_args

import numpy as np

from minfer.errors import BadRequestError
from minfer.runtime.sampling.batched import sample_batch
from minfer.runtime.sampling.candidates import Candidates, check_drawable, checked_logits
from minfer.runtime.sampling.compiled import CompiledChain
from minfer.runtime.sampling.filters import Temperature, TopK
from minfer.runtime.sampling.logprobs import TokenLogprob, check_n_top, token_logprobs
from minfer.runtime.sampling.params import BY_NAME, SamplingParams, is_int
from minfer.runtime.sampling.pickers import Dist, Mirostat, MirostatV2
from minfer.runtime.sampling.processors import LogitBias, bias_then_top_k
from minfer.runtime.sampling.registry import STEP_CLASSES
from minfer.runtime.sampling.step import Kind, State, Step, TokenText

Route = Literal["auto", "compiled", "greedy", "fused", "steps"]
ROUTES: tuple[str, ...] = get_args(Route)[1:]  # the order "auto" tries them in


class Sampler:
    """Runs the chain of :class:`SamplingParams` over one sequence's logits.

    ``token_text(id)`` gives a token's text (str, or the bytes it decodes to, e.g. the tokenizer's
    ``token_bytes``); only DRY with sequence breakers needs it. ``route``: how the chain's answer is
    computed (see the module's text); a route that does not apply to the chain is refused.
    """

    def __init__(
        self, params: SamplingParams | None = None, token_text: TokenText | None = None, route: Route = "auto"
    ) -> None:
        self.params = params if params is not None else SamplingParams()
        p = self.params
        # the effective seed is kept so that a run with seed=None can be reported and replayed
        self.seed: int = p.seed if p.seed is not None else int(np.random.SeedSequence().entropy % 2**32)
        self._state = State()
        self._steps = steps = self._build(token_text)
        chain = CompiledChain.of(steps)
        processors = _argmax_processors(steps)  # what the greedy route runs before its argmax
        # logit_bias right before top_k: the fused route runs the two as one (see bias_then_top_k)
        bias_top_k = ((steps[0], steps[1].k)
                      if len(steps) > 2 and isinstance(steps[0], LogitBias) and isinstance(steps[1], TopK) else None)
        applies = {"compiled": chain is not None, "greedy": processors is not None, "fused": bias_top_k is not None,
                   "steps": True}
        if route == "auto":
            route = next(r for r in ROUTES if applies[r])  # type: ignore[assignment]
        elif route not in applies:
            raise BadRequestError(f"route must be one of auto, {', '.join(ROUTES)}; got {route!r}")
        elif not applies[route]:
            raise BadRequestError(f"route {route!r} does not apply to the chain {self.describe()}")
        self.route: Route = route
        # what ``token_logprobs`` reports: the model's distribution (OpenAI's logprobs), or with this set the
        # chain's, the one the draw chose from (llama-server's post_sampling_probs); off, it costs nothing
        self.reports_chain = False
        self._chain = chain if route == "compiled" else None
        self._processors: list[Step] = processors if route == "greedy" and processors is not None else []
        # a compiled row the kernel leaves (logits that fail a check) goes through the fused steps, which raise
        self._bias_top_k = bias_top_k if route in ("compiled", "fused") else None
        self.reset()

    # -- chain -------------------------------------------------------------------------------------

    def _build(self, token_text: TokenText | None) -> list[Step]:
        p, st = self.params, self._state
        steps: list[Step] = [LogitBias(p.logit_bias)] if p.logit_bias else []
        if p.mirostat:
            picker = (Mirostat(st, p.mirostat_tau, p.mirostat_eta) if p.mirostat == 1 else
                      MirostatV2(st, p.mirostat_tau, p.mirostat_eta))
            return [*steps, Temperature.from_params(p, st, token_text), picker]
        for name in p.samplers:
            if BY_NAME[name].enabled(p):
                steps.append(STEP_CLASSES[name].from_params(p, st, token_text))
        steps.append(Dist(st))
        return steps

    def describe(self) -> str:
        """The active chain, as llama.cpp prints it: ``logits -> top_k -> ... -> dist``."""
        return " -> ".join(["logits", *(s.name for s in self._steps)])

    @property
    def compiled_chain(self) -> CompiledChain | None:
        """The chain's compiled form (what ``sample_batch`` runs in one call), or None where the route is another."""
        return self._chain

    # -- state -------------------------------------------------------------------------------------

    @property
    def mu(self) -> float:
        """Mirostat's running surprise bound (2 * tau after a reset)."""
        return self._state.mu

    @property
    def history(self) -> tuple[int, ...]:
        return tuple(self._state.history)

    @property
    def draw_rng(self) -> np.random.Generator:
        """The random stream the draws take their numbers from."""
        return self._state.rng

    def reset(self, prompt_tokens: Iterable[int] = ()) -> None:
        """Start a new sequence: history = ``prompt_tokens``, mu and the random streams restored."""
        st = self._state
        st.history = [_check_token(t) for t in prompt_tokens]
        # separate streams for the draw and XTC's coin, both from the one seed
        draw_seq, xtc_seq = np.random.SeedSequence(self.seed).spawn(2)
        st.rng = np.random.default_rng(draw_seq)
        st.xtc_rng = np.random.default_rng(xtc_seq)
        st.mu = 2.0 * self.params.mirostat_tau

    def accept(self, token: int) -> None:
        """Append a generated token to the history the penalties and DRY look at."""
        h = self._state.history
        h.append(_check_token(token))
        keep = self._history_needed()
        if keep is not None and len(h) > 2 * keep + 64:
            del h[: len(h) - keep]  # trimmed in batches, not every step

    def _history_needed(self) -> int | None:
        p = self.params
        if p.repeat_last_n < 0 or p.dry_penalty_last_n < 0:
            return None
        return max(p.repeat_last_n, p.dry_penalty_last_n)

    # -- sampling ----------------------------------------------------------------------------------

    def sample(self, logits: np.ndarray) -> int:
        """The next token from ``logits`` ([n_vocab]); does not add it to the history (see ``accept``)."""
        if self._chain is not None and isinstance(logits, np.ndarray) and logits.ndim == 1:
            token = sample_batch([self], logits[None, :])[0]
            if isinstance(token, Exception):
                raise token
            return token
        return self.sample_in_numpy(logits)

    def sample_in_numpy(self, logits: np.ndarray) -> int:
        """``sample`` by the route's numpy steps (the greedy argmax, or the chain's steps): every route but
        the compiled one, and the compiled one's rows that its kernel leaves."""
        cand = Candidates(checked_logits(logits))
        if self.route == "greedy":
            for step in self._processors:
                step.apply(cand)
            best = int(np.argmax(cand.logits))  # numpy returns the first maximum: the lowest id
            if cand.logits[best] == -np.inf:
                check_drawable(cand)
            return best
        steps = self._steps
        if self._bias_top_k is not None and bias_then_top_k(cand, *self._bias_top_k):
            steps = steps[2:]
        for step in steps:
            token = step.apply(cand)
            if token is not None:
                return token
        raise AssertionError("the chain ends with a picking step")

    def distribution(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, probabilities) the draw would choose from, most likely first; for inspection.

        Runs every step but the pick (with mirostat: the distribution mirostat starts from, mu untouched).
        Like ``sample`` it advances XTC's random stream.
        """
        cand = Candidates(checked_logits(logits))
        for step in self._steps:
            if step.kind.picks:
                break
            step.apply(cand)
        check_drawable(cand)
        cand.sort()
        ids = np.arange(len(cand)) if cand.ids is None else cand.ids
        return ids.copy(), cand.probs()

    def token_logprobs(self, logits: np.ndarray, token: int, n_top: int = 0) -> TokenLogprob:
        """``token``'s log-probability and the ``n_top`` most likely tokens: of the model's distribution
        (:func:`.logprobs.token_logprobs`), or with ``reports_chain`` of the chain's (``chain_logprobs``).
        Call it before ``accept(token)``: the chain's penalties read the history ``sample`` saw."""
        if self.reports_chain:
            return self.chain_logprobs(logits, token, n_top)
        return token_logprobs(logits, token, n_top)

    def chain_logprobs(self, logits: np.ndarray, token: int, n_top: int = 0) -> TokenLogprob:
        """The distribution the draw chose ``token`` from (every step but the pick, renormalised over the
        candidates kept), as log-probabilities: ``token``'s and the ``n_top`` most likely kept tokens' (fewer
        where the chain kept fewer; none with probability 0). XTC's random stream is put back afterwards,
        so asking changes no later draw (its coin here is the next one, not the one ``sample`` used)."""
        check_n_top(n_top, len(logits))
        xtc = self._state.xtc_rng.bit_generator.state
        try:
            ids, probs = self.distribution(logits)
        finally:
            self._state.xtc_rng.bit_generator.state = xtc
        with np.errstate(divide="ignore"):
            logs = np.log(probs.astype(np.float64))
        where = np.flatnonzero(ids == token)
        own = float(logs[where[0]]) if len(where) else -np.inf
        top = tuple((int(i), float(lp)) for i, p, lp in zip(ids[:n_top], probs[:n_top], logs[:n_top], strict=True)
                    if p > 0)
        return TokenLogprob(int(token), own, top)

    def sample_with_logprobs(self, logits: np.ndarray, n_top: int = 0) -> tuple[int, TokenLogprob]:
        """The next token and its log-probability with the ``n_top`` most likely alternatives."""
        x = checked_logits(logits)
        check_n_top(n_top, len(x))
        token = self.sample(x)
        return token, self.token_logprobs(x, token, n_top)


def _argmax_processors(steps: Sequence[Step]) -> list[Step] | None:
    """The logit processors after which an argmax is the chain's pick, or None where the chain must run.

    Read from the steps' kinds. A greedy step (keeping only the best token) picks the argmax of what the
    processors before it leave, when everything between them and it keeps the best token (top_k, top_p,
    min_p, top_n_sigma) or the order (and no processor follows those: it would rank only their
    survivors). Anything else before it (a step that may drop the best token, a pick: a chain without a
    greedy step samples at temperature 1 as llama.cpp does) needs the chain. After the greedy step a
    single candidate is left, which only a picker with state (mirostat's mu) still acts on.
    """
    processors: list[Step] = []
    cut = False  # a step has rewritten or dropped candidates: a processor now would rank only those left
    for i, step in enumerate(steps):
        if step.kind is Kind.PROCESSOR:
            if cut:
                return None
            processors.append(step)
        elif step.kind in (Kind.KEEPS_BEST, Kind.KEEPS_ORDER):
            cut = True
        elif step.kind is Kind.ONLY_BEST:
            return None if any(s.kind is Kind.PICKS_ITSELF for s in steps[i + 1 :]) else processors
        else:
            return None
    return None


def _check_token(token: object) -> int:
    if not (is_int(token) and token >= 0):
        raise BadRequestError(f"token ids must be integers >= 0, got {token!r}")
    return int(token)
