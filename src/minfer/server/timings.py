"""llama-server's ``timings`` object of a finished sequence: prompt and generation counts, times and rates."""

from __future__ import annotations

from typing import Any

from minfer.runtime.sequence import GenerationStats


def timings(stats: GenerationStats, cached_tokens: int) -> dict[str, Any]:
    """``prompt_n`` counts the prompt tokens evaluated (not those reused from the cache, ``cache_n``);
    ``predicted_ms`` runs from the first generated token to the last, as llama-server measures it."""
    prompt_n = max(stats.prompt_tokens - cached_tokens, 0)
    prompt_ms = stats.prefill_seconds * 1000.0
    predicted_n = stats.generated_tokens
    predicted_ms = stats.decode_seconds * 1000.0
    return {
        "cache_n": cached_tokens,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": 1000.0 * prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
        "predicted_per_second": 1000.0 * predicted_n / predicted_ms if predicted_ms > 0 else 0.0,
    }
