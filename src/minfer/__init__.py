"""minfer: an LLM inference engine in Python."""

from minfer.api import Completion, Model, load
from minfer.errors import BadRequestError, ContextOverflowError, FormatError, MinferError, ModelError
from minfer.runtime.conversation import Conversation

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
