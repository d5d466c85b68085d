"""What llama-server adds to a streamed answer's chunks on request, whichever API streams them
(``/completion``, ``/v1/completions``, ``/v1/chat/completions``):

- ``return_progress``: chunks of their own with ``prompt_progress`` (``total``, ``cache``, ``processed``,
  ``time_ms``) before the tokens: one when the sequence gets its slot (``processed`` the cached tokens), one
  once the prompt is evaluated (``processed`` the whole prompt), just before the first token's chunk;
- ``timings_per_token``: each chunk carries ``timings``, the times so far.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from minfer.server.jobs import Choice, Job
from minfer.server.protocols.openai import GenerationParams
from minfer.server.timings import prompt_progress, running_timings


class StreamExtras:
    """One streamed request's extra fields. ``prompt_length(choice)``: the tokens of the choice's prompt."""

    def __init__(self, job: Job, params: GenerationParams, prompt_length: Callable[[Choice], int]) -> None:
        self.job = job
        self.want_timings = params.timings
        self.want_progress = params.return_progress and params.stream
        self.prompt_length = prompt_length
        self.started_at = time.perf_counter()
        self._evaluated: set[int] = set()  # the choices whose "prompt evaluated" progress went out

    def timings(self, c: Choice) -> dict[str, Any]:
        """``{"timings": ...}`` for a chunk of ``c`` still generating, with ``timings_per_token``; else nothing."""
        if not self.want_timings:
            return {}
        live = self.job.requests[c.index].stats
        return {"timings": running_timings(live, self.prompt_length(c), len(c.text), c.cached_tokens)}

    def on_start(self, c: Choice) -> dict[str, Any] | None:
        """The fields of the progress chunk sent when ``c`` gets its slot; None without ``return_progress``."""
        if not self.want_progress:
            return None
        return self._progress(c, c.cached_tokens)

    def before_token(self, c: Choice) -> dict[str, Any] | None:
        """The fields of the progress chunk that goes before ``c``'s first token (the prompt evaluated);
        None after it, or without ``return_progress``."""
        if not self.want_progress or c.index in self._evaluated:
            return None
        self._evaluated.add(c.index)
        return self._progress(c, self.prompt_length(c))

    def _progress(self, c: Choice, processed: int) -> dict[str, Any]:
        total = self.prompt_length(c)
        progress = prompt_progress(total, min(c.cached_tokens, total), processed, self.started_at,
                                   time.perf_counter())
        return {**self.timings(c), "prompt_progress": progress}
