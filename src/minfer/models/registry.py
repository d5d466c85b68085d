"""The architectures the engine runs, by GGUF ``general.architecture`` name."""

from minfer.errors import ModelError
from minfer.models import gemma3, llama, qwen2, qwen3
from minfer.models.architecture import Architecture

ARCHITECTURES: dict[str, Architecture] = {m.ARCH.name: m.ARCH for m in (llama, qwen2, qwen3, gemma3)}


def get_architecture(name: str, source: str = "") -> Architecture:
    try:
        return ARCHITECTURES[name]
    except KeyError:
        where = f"{source}: " if source else ""
        raise ModelError(
            f"{where}unsupported architecture {name!r} (supported: {', '.join(sorted(ARCHITECTURES))})"
        ) from None
