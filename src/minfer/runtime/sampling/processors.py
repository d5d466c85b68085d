"""The logit processors: steps that rewrite the logits of the tokens they concern, wherever they rank.

- ``logit_bias``: adds ``bias[token]`` to the token's logit; ``-inf`` bans the token.
- ``penalties``: over the last ``repeat_last_n`` tokens of the history (``-1``: all of it, ``0``: off), each
  token seen ``c`` times has its logit divided by ``repeat_penalty`` if positive, multiplied if not,
  then lowered by ``c * frequency_penalty + presence_penalty``.
- ``dry`` ("don't repeat yourself"): a token that would extend a repetition of ``n >= dry_allowed_length``
  tokens found in the last ``dry_penalty_last_n`` tokens loses ``dry_multiplier * dry_base ** (n -
  dry_allowed_length)``; repetitions do not reach across a sequence breaker (strings matched on the
  tokens' text, which is why the sampler needs ``token_text``), and a token containing a breaker is
  never penalised.

They touch only the tokens they change (no pass over the vocabulary).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from minfer.errors import BadRequestError
from minfer.runtime.sampling.candidates import NOTHING_DRAWABLE, Candidates, check_drawable
from minfer.runtime.sampling.compiled import CompiledChain, Stage
from minfer.runtime.sampling.params import SamplingParams
from minfer.runtime.sampling.step import Kind, State, Step, TokenText, check_in_vocab
from minfer.runtime.sampling.top_k_kernel import prunes_well, top_k_biased


class LogitBias(Step):
    name = "logit_bias"
    kind = Kind.PROCESSOR

    def __init__(self, bias: Mapping[int, float]) -> None:
        self.tokens = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
        self.values = np.fromiter(bias.values(), dtype=np.float64, count=len(bias))

    def apply(self, cand: Candidates) -> None:
        check_in_vocab(self.tokens, cand.n_vocab, "logit_bias")
        pos, which = cand.positions_of(self.tokens)
        x = cand.writable()
        x[pos] += self.values[which]
        cand.sorted = False
        check_drawable(cand)  # only a ban can leave nothing to sample; say so before any step divides by 0

    def compile_into(self, chain: CompiledChain) -> Stage:
        chain.bias_tokens, chain.bias_values = self.tokens, self.values
        return Stage.LOGIT_BIAS


def bias_then_top_k(cand: Candidates, bias: LogitBias, k: int) -> bool:
    """``bias.apply(cand)`` then ``TopK(k).apply(cand)`` without copying the vocabulary (see
    ``top_k_biased``); False (nothing done) where that does not apply: candidates already cut, logits
    other than float32, or a k the compiled top-k does not prune well."""
    x, n = cand.logits, len(cand.logits)
    if cand.ids is not None or x.dtype != np.float32 or k >= n or not prunes_well(n, k + len(bias.tokens)):
        return False
    check_in_vocab(bias.tokens, n, "logit_bias")
    ids, vals = top_k_biased(x, k, bias.tokens, bias.values)
    if vals[0] == -np.inf:
        raise BadRequestError(NOTHING_DRAWABLE)
    cand.ids = ids
    cand.logits = vals.astype(np.float64)
    cand.owned = cand.sorted = True
    return True


class Penalties(Step):
    name = "penalties"
    kind = Kind.PROCESSOR

    def __init__(self, state: State, last_n: int, repeat: float, freq: float, present: float) -> None:
        self.state, self.last_n, self.repeat, self.freq, self.present = state, last_n, repeat, freq, present

    @classmethod
    def from_params(cls, params: SamplingParams, state: State, token_text: TokenText | None) -> Penalties:
        p = params
        return cls(state, p.repeat_last_n, p.repeat_penalty, p.frequency_penalty, p.presence_penalty)

    def apply(self, cand: Candidates) -> None:
        window = self.state.window(self.last_n)
        if not window:
            return
        tokens, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
        check_in_vocab(tokens, cand.n_vocab, "penalties (sampler history)")
        pos, which = cand.positions_of(tokens)
        if not len(pos):
            return
        x = cand.writable()
        v = x[pos].astype(np.float64)
        # dividing a negative logit would make the token more likely: llama.cpp multiplies those
        v = np.where(v <= 0, v * self.repeat, v / self.repeat)
        v -= counts[which] * self.freq + self.present
        x[pos] = v
        cand.sorted = False


class Dry(Step):
    """DRY, ported from llama.cpp (itself from koboldcpp), with the sequence breakers matched on text.

    llama.cpp turns each breaker into token sequences by tokenizing; matching the breaker strings on the
    bytes of the tokens' text gives the same answer for any tokenization, and only the texts of tokens
    in the history and of penalised tokens are ever looked up.
    """

    name = "dry"
    kind = Kind.PROCESSOR

    def __init__(
        self,
        state: State,
        multiplier: float,
        base: float,
        allowed_length: int,
        last_n: int,
        breakers: Sequence[str],
        token_text: TokenText | None,
    ) -> None:
        if breakers and token_text is None:
            raise BadRequestError(
                "dry_sequence_breakers need the tokens' text: create the Sampler with token_text=..."
            )
        self.state, self.multiplier, self.base = state, multiplier, base
        self.allowed_length, self.last_n = allowed_length, last_n
        self.breakers = [b.encode("utf-8") for b in breakers]
        self.max_breaker = max((len(b) for b in self.breakers), default=0)
        self.token_text = token_text
        self._texts: dict[int, bytes] = {}
        # exponent cap so that base ** exponent stays below float32's max, as llama.cpp does
        self.max_exponent = int(88.7228391 / math.log(base)) if base > 1.000001 else 0

    @classmethod
    def from_params(cls, params: SamplingParams, state: State, token_text: TokenText | None) -> Dry:
        p = params
        return cls(state, p.dry_multiplier, p.dry_base, p.dry_allowed_length, p.dry_penalty_last_n,
                   p.dry_sequence_breakers, token_text)

    def _text(self, token: int) -> bytes:
        t = self._texts.get(token)
        if t is None:
            assert self.token_text is not None
            s = self.token_text(token)
            t = s.encode("utf-8", "surrogateescape") if isinstance(s, str) else bytes(s)
            self._texts[token] = t
        return t

    def _contains_breaker(self, token: int) -> bool:
        if not self.breakers:
            return False
        text = self._text(token)
        return any(b in text for b in self.breakers)

    def _repeat_limit(self, window: Sequence[int]) -> int:
        """Tokens after the most recent sequence breaker (the window's length if there is none)."""
        n = len(window)
        if not self.breakers:
            return n
        following: list[bytes] = []  # texts of the tokens after token i, nearest first
        tail = b""  # their first max_breaker - 1 bytes: enough for an occurrence starting in token i
        for i in range(n):  # i tokens back from the most recent
            text = self._text(window[n - 1 - i])
            s = text + tail
            longest = -1  # most tokens after token i that an occurrence starting in token i runs into
            for b in self.breakers:
                start = s.find(b)
                while 0 <= start < len(text):
                    over, spans = start + len(b) - len(text), 0
                    while over > 0:
                        over -= len(following[spans])
                        spans += 1
                    longest = max(longest, spans)
                    start = s.find(b, start + 1)
            if longest >= 0:
                return i - longest
            following.insert(0, text)
            while len(following) > 1 and sum(map(len, following[:-1])) >= self.max_breaker - 1:
                following.pop()
            tail = s[: self.max_breaker - 1]
        return n

    def apply(self, cand: Candidates) -> None:
        window = self.state.window(self.last_n)
        n = len(window)
        if n <= self.allowed_length:
            return
        rep_limit = self._repeat_limit(window)
        if rep_limit < self.allowed_length:
            return
        # z[k]: length of the longest common prefix of the reversed window and the reversed window from k,
        # i.e. how many tokens before position k repeat the most recent tokens (the Z-algorithm, linear)
        rev = window[::-1]
        z = _z_function(rev)
        longest: dict[int, int] = {}
        for k in range(1, n):
            length = min(z[k], rep_limit)
            if length >= self.allowed_length:
                token = rev[k - 1]  # the token that followed the earlier occurrence
                if longest.get(token, -1) < length:
                    longest[token] = length
        if not longest:
            return
        tokens, amounts = [], []
        for token, length in longest.items():
            if self._contains_breaker(token):
                continue  # llama.cpp never penalises a token that is a sequence breaker by itself
            exponent = length - self.allowed_length
            if self.max_exponent > 0:
                exponent = min(exponent, self.max_exponent)
            tokens.append(token)
            amounts.append(self.multiplier * self.base**exponent)
        if not tokens:
            return
        tok = np.asarray(tokens, dtype=np.int64)
        check_in_vocab(tok, cand.n_vocab, "dry (sampler history)")
        pos, which = cand.positions_of(tok)
        x = cand.writable()
        x[pos] -= np.asarray(amounts)[which]
        cand.sorted = False


def _z_function(s: Sequence[int]) -> list[int]:
    n = len(s)
    z = [0] * n
    left = right = 0
    for k in range(1, n):
        if k < right:
            z[k] = min(right - k, z[k - left])
        while k + z[k] < n and s[z[k]] == s[k + z[k]]:
            z[k] += 1
        if k + z[k] > right:
            left, right = k, k + z[k]
    return z
