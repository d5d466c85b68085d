"""The decode loop: prefill the prompt, then one token per step until a stop condition.

Each step's positions are data: the prompt occupies positions 0..n-1, the k-th generated token is
evaluated at position n+k-1 and its K/V row lands there. A step: logits -> (constraint mask) -> sampler
chain -> token; the token's text goes through the UTF-8-safe detokenizer and the stop-string matcher.
Stops: an end-of-generation token (not part of the text), a stop string (not part of the text either),
a finished grammar, or ``max_tokens``. Running past the context is an error (ContextOverflowError naming
n_ctx and the position), never a silent stop.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from minfer.errors import BadRequestError, ContextOverflowError
from minfer.runtime.forward import ForwardRunner
from minfer.runtime.sampler import Sampler, TokenLogprob
from minfer.runtime.stop import StopMatcher


@dataclass
class TokenStep:
    """One generated token and the text it releases (may be empty: a split UTF-8 character, or text held
    back because it may begin a stop string). ``token`` is None for the final flush of held text."""

    token: int | None
    text: str
    logprob: TokenLogprob | None = None


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    finish_reason: str = ""  # "stop" (end-of-generation token, stop string, grammar done), "length"
    stop: str | None = None  # the stop string that ended generation, if one did
    tokens: list[int] = field(default_factory=list)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        # the first generated token comes out of prefill; decode steps are the rest
        steps = max(self.generated_tokens - 1, 0)
        return steps / self.decode_seconds if self.decode_seconds else 0.0


def generate(
    runner: ForwardRunner,
    tokenizer: Any,
    prompt_ids: Sequence[int],
    sampler: Sampler,
    max_tokens: int,
    stats: GenerationStats | None = None,
    stop_ids: frozenset[int] | None = None,
    stop: str | Sequence[str] = (),
    logprobs: int | None = None,
    constraint: Any = None,
    n_cached: int = 0,
    context_shift: bool = False,
    n_keep: int = 0,
) -> Iterator[TokenStep]:
    """Yield generated tokens with the text they release; fills ``stats`` as it goes.

    ``logprobs``: with a number N, each step carries the chosen token's log-probability and the N most
    likely alternatives. ``constraint``: an object with ``mask_logits``, ``accept`` and ``is_finished``
    (a grammar or JSON schema, :mod:`minfer.runtime.constraints`). ``n_cached``: the first ``n_cached``
    prompt tokens are already in the cache at their positions (a reused prefix): only the rest is evaluated.
    ``context_shift``: when the context is full, drop the oldest half after the first ``n_keep`` positions
    (a system prompt) and go on, instead of raising ContextOverflowError.
    """
    stats = stats if stats is not None else GenerationStats()
    n_ctx = runner.kv.capacity
    n = len(prompt_ids)
    if n == 0:
        raise BadRequestError("the prompt is empty (no tokens to start from)")
    if n > n_ctx:
        raise ContextOverflowError(f"the prompt has {n} tokens, more than the context of {n_ctx}")
    if max_tokens < 0:
        raise BadRequestError(f"max_tokens must be >= 0, got {max_tokens}")
    if not 0 <= n_cached < n:
        raise BadRequestError(f"n_cached must be in 0..{n - 1} (a prompt token must be evaluated), got {n_cached}")
    if logprobs is not None and not 0 <= logprobs <= 20:
        raise BadRequestError(f"logprobs must be between 0 and 20, got {logprobs}")
    stop_ids = tokenizer.eog_ids if stop_ids is None else stop_ids
    matcher = StopMatcher(stop) if stop else None
    stats.prompt_tokens = n
    if max_tokens == 0:
        stats.finish_reason = "length"
        return
    detok = tokenizer.detokenizer()
    sampler.reset(prompt_ids)

    t0 = time.perf_counter()
    logits = runner.forward(prompt_ids[n_cached:], range(n_cached, n), output_rows=[n - 1 - n_cached])[0]
    stats.prefill_seconds = time.perf_counter() - t0
    pos = n
    t0 = time.perf_counter()
    while True:
        if constraint is not None:
            constraint.mask_logits(logits)
        lp = None
        if logprobs is None:
            token = sampler.sample(logits)
        else:
            token, lp = sampler.sample_with_logprobs(logits, logprobs)
        sampler.accept(token)
        stats.tokens.append(token)
        stats.generated_tokens += 1
        if token in stop_ids:
            stats.finish_reason = "stop"
            break
        if constraint is not None:
            constraint.accept(token)
        text = detok.push(token)
        if matcher is not None:
            text, stopped = matcher.push(text)
            if stopped:
                stats.finish_reason, stats.stop = "stop", matcher.stop
                yield TokenStep(token, text, lp)
                return
        yield TokenStep(token, text, lp)
        if constraint is not None and constraint.is_finished():
            stats.finish_reason = "stop"
            break
        if stats.generated_tokens >= max_tokens:
            stats.finish_reason = "length"
            break
        if pos >= n_ctx and context_shift:
            n_discard = (pos - n_keep) // 2
            if n_discard < 1:
                raise ContextOverflowError(f"context shift: n_keep {n_keep} leaves nothing to drop in {n_ctx}")
            runner.shift_context(0, n_keep, n_discard)
            pos -= n_discard
        if pos >= n_ctx:
            raise ContextOverflowError(
                f"generation reached the end of the context: the next token would be at position {pos}, "
                f"n_ctx is {n_ctx} (use a larger context)"
            )
        logits = runner.forward([token], [pos])[0]
        pos += 1
        stats.decode_seconds = time.perf_counter() - t0
    tail = detok.flush()
    if matcher is not None:
        tail, stopped = matcher.push(tail)
        if stopped:
            stats.finish_reason, stats.stop = "stop", matcher.stop
        else:
            tail += matcher.flush()
    if tail:
        yield TokenStep(None, tail)
