"""minfer: an LLM inference engine in Python.

The names below are imported on first use: ``import minfer.errors`` (or a helper process that needs one
small module) must not pay for the engine's imports (numba, numpy, the kernels)."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from minfer.errors import BadRequestError, ContextOverflowError, FormatError, MinferError, ModelError

if TYPE_CHECKING:
    from minfer.api import Completion, Model, load
    from minfer.runtime.conversation import Conversation

_LAZY = {"load": "minfer.api", "Model": "minfer.api", "Completion": "minfer.api",
         "Conversation": "minfer.runtime.conversation"}

__all__ = [
    "load",
    "Model",
    "Completion",
    "Conversation",
    "MinferError",
    "FormatError",
    "ModelError",
    "ContextOverflowError",
    "BadRequestError",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups find it without coming here
        return value
    raise AttributeError(f"module 'minfer' has no attribute {name!r}")
