"""The architectures the engine runs: every module of :mod:`minfer.models` that defines ``ARCH`` (an
:class:`~minfer.models.architecture.Architecture`), by GGUF ``general.architecture`` name and by HF
``model_type``. Adding a family is adding its module; nothing here names one.

The modules are looked up on each call rather than at import time: the model and HF loaders that ask are
modules of the same package, which an import-time scan would import half-initialized. The lookup is a
directory listing and a ``sys.modules`` hit per module, once per model load.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from types import MappingProxyType

from minfer import models
from minfer.errors import ModelError
from minfer.models.architecture import Architecture


def all_architectures() -> Mapping[str, Architecture]:
    """Every architecture, by name (those that only read HF folders included: Mixtral)."""
    found: dict[str, Architecture] = {}
    for info in pkgutil.iter_modules(models.__path__):
        arch = getattr(importlib.import_module(f"{models.__name__}.{info.name}"), "ARCH", None)
        if isinstance(arch, Architecture):
            if arch.name in found or any(a.hf.model_type == arch.hf.model_type for a in found.values()):
                raise RuntimeError(f"{info.name}: architecture {arch.name!r} / {arch.hf.model_type!r} declared twice")
            found[arch.name] = arch
    return MappingProxyType(found)


def architectures() -> Mapping[str, Architecture]:
    """Every architecture GGUF files name, by GGUF name."""
    return MappingProxyType({name: a for name, a in all_architectures().items() if a.gguf})


def get_architecture(name: str, source: str = "") -> Architecture:
    """The architecture of a GGUF ``general.architecture``; a :class:`ModelError` naming ``source`` if none."""
    known = architectures()
    arch = known.get(name)
    if arch is None:
        where = f"{source}: " if source else ""
        raise ModelError(f"{where}unsupported architecture {name!r} (supported: {', '.join(sorted(known))})")
    return arch


def architecture_of_model_type(model_type: str, source: str = "") -> Architecture:
    """The architecture whose HF folders carry ``config.json`` ``model_type``; a :class:`ModelError` if none."""
    by_model_type = {a.hf.model_type: a for a in all_architectures().values()}
    arch = by_model_type.get(model_type)
    if arch is None:
        where = f"{source}: " if source else ""
        raise ModelError(f"{where}unsupported model_type {model_type!r} "
                         f"(supported: {', '.join(sorted(by_model_type))})")
    return arch
