"""Multi-turn conversations that keep their KV cache between turns, and save / resume them.

Each turn renders the whole transcript with the model's chat template, but only the tokens after the
longest prefix the cache already holds are evaluated (positions are data: earlier turns stay where they
are). Saving writes the transcript, the cached tokens, the KV rows in their stored cell type and the
conversation's random state to a versioned, checksummed session file (:mod:`session_file`); loading one
made for another model or cell type is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from minfer.errors import BadRequestError
from minfer.models.model import TransformerModel
from minfer.runtime.kv_cache import KVCache
from minfer.runtime.sampling import Sampler
from minfer.runtime.sequence import TokenStep
from minfer.runtime.session_file import SessionData, load_session, save_session


class ChatModel(Protocol):
    """What a conversation needs of a model (``minfer.api.Model`` is one)."""

    transformer: TransformerModel
    kv: KVCache

    @property
    def cache_type(self) -> str: ...

    def sampler(self, **sampling: Any) -> Sampler: ...

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str: ...

    def tokenize(self, text: str, add_special: bool = True) -> list[int]: ...

    def stream(self, prompt: str | Sequence[int], max_tokens: int = 256, **kwargs: Any) -> Iterator[TokenStep]: ...


def model_fingerprint(model: ChatModel) -> str:
    """Identity of the weights a cache was computed with: architecture, shapes and types of every tensor."""
    t = model.transformer
    h = hashlib.sha256()
    h.update(json.dumps(vars(t.hparams), sort_keys=True, default=str).encode())
    for name, tensor in t.tensors.items():
        h.update(f"{name}:{tensor.ggml_type.name}:{tensor.shape}:{tensor.nbytes};".encode())
    return f"{t.arch.name}:{t.path.name}:{h.hexdigest()[:24]}"


class Conversation:
    """A chat with one model: ``send`` a user message, get the assistant's reply."""

    def __init__(self, model: ChatModel, system: str | None = None, seed: int | None = None, **sampling: Any) -> None:
        self.model = model
        self.system = system
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        self.sampling = sampling  # defaults for every turn; each send may override them
        model.sampler(**sampling)  # validates the defaults now, not at the first turn
        self._rng = np.random.default_rng(seed)  # per-turn seeds: a saved conversation replays the same draws

    # -- turns -------------------------------------------------------------------------------------

    def send(self, message: str, max_tokens: int = 512, stream: bool = False, **sampling: Any) -> str | Iterator[str]:
        """Add a user message and generate the reply (an iterator of text pieces with ``stream``)."""
        if not isinstance(message, str):
            raise BadRequestError(f"message must be a string, got {type(message).__name__}")
        self.messages.append({"role": "user", "content": message})
        pieces = self._reply(max_tokens, sampling)
        return pieces if stream else "".join(pieces)

    def regenerate(self, max_tokens: int = 512, stream: bool = False, **sampling: Any) -> str | Iterator[str]:
        """Drop the last reply and generate another one for the same user message."""
        if not self.messages or self.messages[-1]["role"] != "assistant":
            raise BadRequestError("there is no reply to regenerate")
        self.messages.pop()
        pieces = self._reply(max_tokens, sampling)
        return pieces if stream else "".join(pieces)

    def clear(self) -> None:
        """Forget every turn (the system prompt stays)."""
        self.messages = self.messages[:1] if self.system else []

    def _reply(self, max_tokens: int, sampling: dict[str, Any]) -> Iterator[str]:
        params = {**self.sampling, **sampling}
        if params.get("seed") is None:
            params["seed"] = int(self._rng.integers(2**31))
        prompt = self.model.render_chat(self.messages)
        ids = self.model.tokenize(prompt, add_special=False)  # the template writes BOS when the model wants it
        steps = self.model.stream(ids, max_tokens, **params)
        text: list[str] = []
        try:
            for step in steps:
                if step.text:
                    text.append(step.text)
                    yield step.text
        except BaseException:
            self.messages.pop()  # the turn failed: the transcript stays as it was before it
            raise
        self.messages.append({"role": "assistant", "content": "".join(text)})

    # -- sessions ----------------------------------------------------------------------------------

    def save(self, path: str | os.PathLike[str]) -> None:
        kv = self.model.kv
        tokens = kv.tokens(0)
        arrays = {}
        for il, layer in enumerate(kv.layers):
            arrays[f"k{il}"] = layer.k[: len(tokens)]
            arrays[f"v{il}"] = layer.v[: len(tokens)]
        save_session(path, SessionData(
            model_fingerprint=model_fingerprint(self.model),
            cache_type=kv.cache_type,
            n_ctx=kv.capacity,
            tokens=tokens,
            sampler_state={"rng": self._rng.bit_generator.state},
            meta={"system": self.system, "messages": self.messages, "sampling": self.sampling},
            arrays=arrays,
        ))

    @classmethod
    def load(cls, model: ChatModel, path: str | os.PathLike[str]) -> Conversation:
        data = load_session(path, expect_fingerprint=model_fingerprint(model), expect_cache_type=model.cache_type)
        kv = model.kv
        n = len(data.tokens)
        if n > kv.capacity:
            raise BadRequestError(f"session {path} holds {n} tokens, more than this model's context of {kv.capacity}")
        for il, layer in enumerate(kv.layers):
            for name, region in ((f"k{il}", layer.k), (f"v{il}", layer.v)):
                arr = data.arrays.get(name)
                if arr is None or arr.shape != (n, *region.shape[1:]) or arr.dtype != region.dtype:
                    raise BadRequestError(f"session {path}: array {name} does not fit this model's KV cache")
        kv.truncate(0, 0)
        for il, layer in enumerate(kv.layers):
            layer.k[:n] = data.arrays[f"k{il}"]
            layer.v[:n] = data.arrays[f"v{il}"]
        if n:
            kv.record(0, np.arange(n), np.asarray(data.tokens))
        conv = cls(model, data.meta.get("system"), **data.meta.get("sampling", {}))
        conv.messages = data.meta["messages"]
        conv._rng.bit_generator.state = data.sampler_state["rng"]
        return conv
