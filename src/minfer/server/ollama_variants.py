"""LoRA adapters as ollama model variants: each loaded adapter is a model of its own in ollama's API, named
``<base>:<adapter stem>`` (``smollm2:pirate``), its ``parent_model`` the served base. Chatting with a variant runs
the base with that adapter alone, at its scale (ollama's 1.0 for an adapter given to ``/api/create``; the
``--lora FILE:SCALE`` scale for one loaded at startup, 1.0 if it was loaded off), the others off.

Variants come from the adapters the server was started with (``--lora``), and from ``/api/create`` (an adapter
blob uploaded to ``/api/blobs``), which may also give the variant a system prompt and default options; only
those can be deleted. The registry lives on the event loop's thread (the routes'), so it needs no lock; the
adapters themselves are loaded on the engine's thread (:meth:`minfer.api.Model.add_lora_adapter`).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minfer.server.ollama_blobs import model_sha256


@dataclass
class Variant:
    """One adapter of the served model as an ollama model."""

    name: str  # "base:stem"
    adapter: int  # its id in the model's adapters (llama-server's "id")
    scale: float
    path: Path  # the adapter's file (a blob, for a created one) or PEFT folder
    created: bool = False  # made by /api/create (so /api/delete may remove it), not loaded at startup
    system: str | None = None  # /api/create's system prompt: a request that sends none gets it
    parameters: dict[str, Any] = field(default_factory=dict)  # /api/create's options: a request's own win
    license: str | None = None  # /api/create's license text, which /api/show answers with
    modified_at: str | None = None  # when /api/create made it (a startup one: its file's time)
    _digest: str | None = None

    @property
    def lora(self) -> list[dict[str, Any]]:
        """The per-request ``lora`` that runs this variant: its adapter on, every other off."""
        return [{"id": self.adapter, "scale": self.scale}]

    def modelfile(self, base_path: str | Path) -> str:
        """The Modelfile text that would make this variant (``/api/show``'s ``modelfile``)."""
        lines = [f"FROM {base_path}", f"ADAPTER {self.path}"]
        if self.system is not None:
            lines.append(f'SYSTEM """{self.system}"""')
        lines += [f"PARAMETER {k} {v}" for k, value in self.parameters.items()
                  for v in (value if isinstance(value, list) else [value])]
        return "\n".join(lines) + "\n"

    async def digest(self, base_digest: str) -> str:
        """The adapter's sha256 mixed with the base's (the same adapter on another base is another model),
        computed on a worker thread once."""
        if self._digest is None:
            adapter = await asyncio.to_thread(model_sha256, self.path)
            self._digest = hashlib.sha256(f"{base_digest}\n{adapter}\n".encode()).hexdigest()
        return self._digest


def tagged(name: str) -> str:
    """An ollama model name with its tag (``pirate`` is ``pirate:latest``)."""
    return name if ":" in name.rpartition("/")[2] else f"{name}:latest"


class Variants:
    """The variants of the one served model (``base``: its ollama name, ``NAME:latest``), by name."""

    def __init__(self, base: str) -> None:
        self.base = base
        self._by_name: dict[str, Variant] = {}
        self._blob_adapters: dict[str, int] = {}  # an uploaded blob's digest -> the adapter loaded from it

    @classmethod
    def of_startup_adapters(cls, base: str, adapters: Sequence[Mapping[str, Any]]) -> Variants:
        """The variants of the adapters loaded at startup (``Model.lora_adapters``: id, path, scale)."""
        variants = cls(base)
        stem = base.rpartition(":")[0] or base
        for a in adapters:
            path = Path(a["path"])
            name = f"{stem}:{path.stem if path.is_file() else path.name}"
            if name in variants._by_name or name == base:  # two adapters of one stem: the later gets its id
                name = f"{name}-{a['id']}"
            scale = float(a["scale"]) or 1.0  # (loaded off, --lora-init-without-apply: the variant turns it on)
            variants._by_name[name] = Variant(name, int(a["id"]), scale, path)
        return variants

    def __iter__(self) -> Iterator[Variant]:
        return iter(list(self._by_name.values()))

    def get(self, name: str | None) -> Variant | None:
        """The variant ``name`` names (untagged: ``:latest``), None if none."""
        if not name:
            return None
        return self._by_name.get(name) or self._by_name.get(tagged(name))

    def add(self, variant: Variant, blob: str | None = None) -> None:
        self._by_name[variant.name] = variant
        if blob is not None:
            self._blob_adapters[blob] = variant.adapter

    def remove(self, name: str) -> Variant | None:
        """Forget a variant (its adapter stays loaded, off, for a later variant of the same blob)."""
        v = self.get(name)
        if v is not None:
            del self._by_name[v.name]
        return v

    def adapter_of_blob(self, blob: str) -> int | None:
        """The adapter already loaded from blob ``blob`` (creating a variant of it again loads nothing)."""
        return self._blob_adapters.get(blob)
