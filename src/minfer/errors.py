"""The one exception family of the engine.

User mistakes (a missing file, a bad model, a prompt that does not fit) raise a subclass of
``MinferError`` whose message names the problem; the CLI prints it on one line and exits non-zero.
"""


class MinferError(Exception):
    """Base class of every error the engine raises on purpose."""


class FormatError(MinferError):
    """A model file is missing, unreadable, truncated or not in the expected format."""


class ModelError(MinferError):
    """A model file is well-formed but describes something we cannot run (architecture, shapes, types)."""


class ContextOverflowError(MinferError):
    """A position does not fit in the context (position >= n_ctx). ``n_prompt_tokens`` and ``n_ctx``: the
    counts, where the raiser knows them (the server's 400 reports them as llama-server does)."""

    def __init__(self, message: str, n_prompt_tokens: int | None = None, n_ctx: int | None = None) -> None:
        super().__init__(message)
        self.n_prompt_tokens = n_prompt_tokens
        self.n_ctx = n_ctx

    def __reduce__(self) -> object:  # whole across a process boundary
        return (ContextOverflowError, (str(self), self.n_prompt_tokens, self.n_ctx))


class BadRequestError(MinferError):
    """A caller passed an invalid argument (sampling parameter, message list, ...)."""
