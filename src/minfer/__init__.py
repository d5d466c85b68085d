"""minfer: an LLM inference engine in Python."""

from minfer.api import Model, load
from minfer.errors import BadRequestError, ContextOverflowError, FormatError, MinferError, ModelError

__all__ = ["load", "Model", "MinferError", "FormatError", "ModelError", "ContextOverflowError", "BadRequestError"]
__version__ = "0.1.0"
