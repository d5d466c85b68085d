"""What goes into the engine and what comes out: requests (a sequence to generate, a sequence to embed),
the events each one's ``emit`` receives, and the hooks a server's metrics hang on the steps.

These are the types the server, the API and the conversation layer share with the engine; nothing here
runs anything.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from minfer.runtime.pooling import Pooling
from minfer.runtime.sampling import Sampler
from minfer.runtime.sequence import GenerationStats, TokenStep
from minfer.runtime.speculative import SpeculativeSettings
from minfer.runtime.vision import PassImage


@dataclass
class Started:
    """The request got slot ``slot``; ``cached_tokens`` prompt tokens were reused from the cache."""

    cached_tokens: int
    slot: int = field(default=-1, compare=False)  # which slot: informative, not part of what happened


@dataclass
class Token:
    step: TokenStep


@dataclass
class Finished:
    """The last event of a request that ran to its end (``stats.finish_reason`` says why)."""

    stats: GenerationStats
    cached_tokens: int


@dataclass
class Failed:
    """The last event of a request that could not be served; the others go on."""

    error: Exception


@dataclass
class Embedded:
    """The last event of an embedding request: its vector ``[n_embd]`` (``[n_tokens, n_embd]`` with pooling
    ``none``); ``stats.prompt_tokens`` counts the tokens evaluated."""

    vector: np.ndarray
    stats: GenerationStats


Event = Started | Token | Finished | Failed | Embedded


@dataclass(eq=False)
class GenerationRequest:
    """One sequence to generate. ``emit`` receives its events on the thread that drives the engine."""

    prompt_ids: Seq[int]
    sampler: Sampler
    max_tokens: int | None  # None: until the slot's context is full
    emit: Callable[[Event], None] = lambda event: None
    stop: Seq[str] = ()
    logprobs: int | None = None
    constraint: Any = None
    stop_ids: frozenset[int] | None = None  # None: the tokenizer's end-of-generation tokens
    context_shift: bool = False  # at the end of the slot, drop the oldest half after n_keep positions
    n_keep: int = 0
    speculative: SpeculativeSettings | None = None  # None: the engine's
    reuse_prefix: bool = True  # False: evaluate the whole prompt (llama-server's cache_prompt: false)
    # each loaded LoRA adapter's scale for this sequence (the model's order); None: the engine's defaults
    lora: Seq[float] | None = None
    # a vision-language model's images in the prompt: the prompt rows each one's tokens take (their prompt ids are
    # the image's own negative ids, see runtime/vision.py, so a cached prefix holds an image only for that image)
    images: Seq[PassImage] = ()
    stats: GenerationStats = field(default_factory=GenerationStats)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted_at: float = field(default_factory=time.perf_counter)

    def cancel(self) -> None:
        """Stop generating (thread-safe); the slot is freed before the next forward pass."""
        self.cancelled.set()


@dataclass(eq=False)
class EmbeddingRequest:
    """One sequence to embed: every token evaluated (no cached prefix: each position's hidden state is
    needed), none sampled. ``emit`` gets ``Started`` then ``Embedded`` (or ``Failed``, or ``Finished``
    with reason "cancelled")."""

    prompt_ids: Seq[int]
    pooling: Pooling = "mean"
    normalize: bool = True
    emit: Callable[[Event], None] = lambda event: None
    stats: GenerationStats = field(default_factory=GenerationStats)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted_at: float = field(default_factory=time.perf_counter)

    def cancel(self) -> None:
        """Stop (thread-safe); the slot is freed before the next forward pass."""
        self.cancelled.set()


Request = GenerationRequest | EmbeddingRequest


@dataclass
class EngineHooks:
    """Callbacks a server's metrics hang on the engine (each called on the engine's thread)."""

    on_first_token: Callable[[float], None] | None = None  # seconds from submission to the first token
    on_token_gap: Callable[[float], None] | None = None  # seconds between two tokens of one sequence
    on_finished: Callable[[GenerationStats, int], None] | None = None  # stats, cached prompt tokens
    on_step: Callable[[int, int, float], None] | None = None  # tokens evaluated, sequences sampled, seconds
    on_verified: Callable[[int, int], None] | None = None  # speculative decoding: tokens drafted, accepted
    on_preempted: Callable[[], None] | None = None  # a sequence's blocks freed for others (unified cache)
    # end of each engine-loop iteration, once its events were emitted: a consumer that buffers events (the
    # server's event pump) hands them over then, one wake-up for the whole step
    after_events: Callable[[], None] | None = None
