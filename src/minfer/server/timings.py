"""llama-server's ``timings`` object of a finished sequence: prompt and generation counts, times and rates."""

from __future__ import annotations

from typing import Any

from minfer.runtime.sequence import GenerationStats
from minfer.server.jobs import Choice


def timings(stats: GenerationStats, cached_tokens: int) -> dict[str, Any]:
    """``prompt_n`` counts the prompt tokens evaluated (not those reused from the cache, ``cache_n``);
    ``predicted_ms`` runs from the first generated token to the last, as llama-server measures it. With speculative
    decoding (tokens drafted) also ``draft_n`` and ``draft_n_accepted``, as llama-server adds them."""
    prompt_n = max(stats.prompt_tokens - cached_tokens, 0)
    prompt_ms = stats.prefill_seconds * 1000.0
    predicted_n = stats.generated_tokens
    predicted_ms = stats.decode_seconds * 1000.0
    out: dict[str, Any] = {
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
    if stats.drafted_tokens > 0:
        out |= {"draft_n": stats.drafted_tokens, "draft_n_accepted": stats.accepted_tokens}
    return out


def answer_timings(choice: Choice) -> dict[str, Any]:
    """``{"timings": ...}`` of a finished choice, as llama-server puts on every OpenAI answer (the whole one, or a
    stream's last event) whether or not ``timings_per_token`` was asked; nothing for a choice that never ran."""
    if choice.stats is None:
        return {}
    return {"timings": timings(choice.stats, choice.cached_tokens)}


def running_timings(live: GenerationStats, n_prompt: int, n_generated: int, cached_tokens: int) -> dict[str, Any]:
    """``timings`` of a sequence still generating (a streamed chunk's, with ``timings_per_token``): the
    engine's times so far (``live``, the sequence's stats as the engine thread updates them) over the
    ``n_generated`` tokens sent so far."""
    snapshot = GenerationStats(prompt_tokens=n_prompt, generated_tokens=n_generated,
                               prefill_seconds=live.prefill_seconds,
                               decode_seconds=live.decode_seconds if n_generated > 1 else 0.0)
    return timings(snapshot, cached_tokens)


def prompt_progress(total: int, cached: int, processed: int, started: float, now: float) -> dict[str, Any]:
    """llama-server's ``prompt_progress`` (``return_progress``): the prompt's tokens, those the cache served,
    those in the slot so far (the cached ones included), and the milliseconds since the request (whole)."""
    return {"total": total, "cache": cached, "processed": processed, "time_ms": int((now - started) * 1000.0)}
