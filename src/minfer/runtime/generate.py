"""The decode loop: prefill the prompt, then one token per step until a stop condition.

Each step's positions are data: the prompt occupies positions 0..n-1, the k-th generated token is
evaluated at position n+k-1 and its K/V row lands there. Stops: an end-of-generation token (not part
of the text), ``max_tokens``, or the context being full.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from minfer.errors import BadRequestError, ContextOverflowError
from minfer.runtime.forward import ForwardRunner
from minfer.runtime.sampler import Sampler


@dataclass
class TokenStep:
    """One generated token and the text it completes (may be empty while a UTF-8 character is split)."""

    token: int | None  # None for the final flush of bytes that never completed a character
    text: str


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    finish_reason: str = ""  # "stop" (end-of-generation token), "length" (max_tokens or context full)
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
    tokenizer,
    prompt_ids: Sequence[int],
    sampler: Sampler,
    max_tokens: int,
    stats: GenerationStats | None = None,
    stop_ids: frozenset[int] | None = None,
) -> Iterator[TokenStep]:
    """Yield generated tokens with their text as they are produced; fills ``stats`` as it goes."""
    stats = stats if stats is not None else GenerationStats()
    n_ctx = runner.kv.n_ctx
    n = len(prompt_ids)
    if n == 0:
        raise BadRequestError("the prompt is empty (no tokens to start from)")
    if n > n_ctx:
        raise ContextOverflowError(f"the prompt has {n} tokens, more than the context of {n_ctx}")
    if max_tokens < 0:
        raise BadRequestError(f"max_tokens must be >= 0, got {max_tokens}")
    stop_ids = tokenizer.eog_ids if stop_ids is None else stop_ids
    stats.prompt_tokens = n
    if max_tokens == 0:
        stats.finish_reason = "length"
        return
    detok = tokenizer.detokenizer()

    t0 = time.perf_counter()
    logits = runner.forward(prompt_ids, range(n), output_rows=[n - 1])[0]
    stats.prefill_seconds = time.perf_counter() - t0
    pos = n
    t0 = time.perf_counter()
    while True:
        token = sampler.sample(logits)
        stats.tokens.append(token)
        stats.generated_tokens += 1
        if token in stop_ids:
            stats.finish_reason = "stop"
            break
        yield TokenStep(token, detok.push(token))
        if stats.generated_tokens >= max_tokens or pos >= n_ctx:
            stats.finish_reason = "length"
            break
        logits = runner.forward([token], [pos])[0]
        pos += 1
        stats.decode_seconds = time.perf_counter() - t0
    tail = detok.flush()
    if tail:
        yield TokenStep(None, tail)
