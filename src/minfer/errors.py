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
    """A position does not fit in the context (position >= n_ctx)."""


class BadRequestError(MinferError):
    """A caller passed an invalid argument (sampling parameter, message list, ...)."""
