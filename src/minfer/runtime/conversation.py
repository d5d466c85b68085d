"""Multi-turn conversations that keep their KV cache between turns, and save / resume them.

Each turn renders the whole transcript with the model's chat template, but only the tokens after the
longest prefix the cache already holds are evaluated (positions are data: earlier turns stay where they
are). Saving writes the transcript, the cached tokens, the KV rows in their stored cell type and the
conversation's random state to a versioned, checksummed session file (:mod:`session_file`); loading one
made for another model or cell type is refused.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from minfer.errors import BadRequestError, FormatError
from minfer.models.model import TransformerModel
from minfer.runtime.kv_cache import KVCache
from minfer.runtime.sampling import Sampler
from minfer.runtime.sequence import TokenStep
from minfer.runtime.session_file import SessionData, load_session, save_session
from minfer.runtime.vision import MEDIA_MARKER, ImageInput, PassImage


class ChatModel(Protocol):
    """What a conversation needs of a model (``minfer.api.Model`` is one)."""

    transformer: TransformerModel
    kv: KVCache

    @property
    def cache_type(self) -> str: ...

    @property
    def lora_adapters(self) -> list[dict[str, Any]]: ...

    def sampler(self, **sampling: Any) -> Sampler: ...

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str: ...

    def tokenize(self, text: str, add_special: bool = True) -> list[int]: ...

    def image_prompt(self, prompt: str, images: Sequence[ImageInput]) -> tuple[list[int], list[PassImage]]: ...

    def stream(self, prompt: str | Sequence[int], max_tokens: int = 256, **kwargs: Any) -> Iterator[TokenStep]: ...


def model_fingerprint(model: ChatModel) -> str:
    """Identity of the weights a cache was computed with: architecture, shapes and types of every tensor."""
    t = model.transformer
    h = hashlib.sha256()
    t.digest_weights(h)
    # applied LoRA adapters change every cached K/V by the scales the conversation runs at (none: the
    # fingerprint of the model alone)
    for a in model.lora_adapters:
        h.update(f"lora:{Path(a['path']).name}:{a['scale']!r};".encode())
    return f"{t.arch.name}:{t.path.name}:{h.hexdigest()[:24]}"


ROLES = ("system", "user", "assistant")


def check_contents(data: SessionData, shown: str, n_vocab: int) -> tuple[str | None, list[dict[str, str]],
                                                                        dict[str, Any], np.random.Generator]:
    """The conversation a session holds, every field checked: ``(system, messages, sampling, rng)``.
    A missing or mistyped field is a FormatError naming it, here rather than at the next ``send()``."""

    def bad(problem: str) -> FormatError:
        return FormatError(f"session {shown}: {problem}")

    for i, t in enumerate(data.tokens):
        if not 0 <= t < n_vocab:
            raise bad(f"tokens[{i}] = {t} is outside the vocabulary (0..{n_vocab - 1})")
    meta = data.meta
    system = meta.get("system")
    if system is not None and not isinstance(system, str):
        raise bad(f"meta.system must be a string or null, got {type(system).__name__}")
    if system is not None:
        _check_text(system, "meta.system", bad)
    if "messages" not in meta:
        raise bad("meta.messages is missing")
    messages = meta["messages"]
    if not isinstance(messages, list):
        raise bad(f"meta.messages must be a list of messages, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise bad(f"meta.messages[{i}] must be an object with exactly 'role' and 'content'")
        if m["role"] not in ROLES:
            raise bad(f"meta.messages[{i}].role must be one of {', '.join(ROLES)}, got {m['role']!r}")
        if not isinstance(m["content"], str):
            raise bad(f"meta.messages[{i}].content must be a string, got {type(m['content']).__name__}")
        _check_text(m["content"], f"meta.messages[{i}].content", bad)
    sampling = meta.get("sampling", {})
    if not isinstance(sampling, dict):
        raise bad(f"meta.sampling must be an object, got {type(sampling).__name__}")
    from minfer.runtime.sampling.params import PARAMS

    unknown = sorted(set(sampling) - set(PARAMS))
    if unknown:
        raise bad(f"meta.sampling has unknown fields: {', '.join(map(str, unknown))}")
    if "rng" not in data.sampler_state:
        raise bad("sampler_state.rng is missing")
    state = data.sampler_state["rng"]
    rng = np.random.default_rng()
    if not isinstance(state, dict) or state.get("bit_generator") != type(rng.bit_generator).__name__:
        raise bad(f"sampler_state.rng is not a {type(rng.bit_generator).__name__} state")
    try:
        rng.bit_generator.state = state
    except (TypeError, ValueError, KeyError, OverflowError) as e:
        raise bad(f"sampler_state.rng is not a valid generator state ({type(e).__name__}: {e})") from None
    return system, [dict(m) for m in messages], sampling, rng


def _check_text(text: str, where: str, bad: Any) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(f"{where} holds a lone surrogate at character {e.start} (not text)") from None


class Conversation:
    """A chat with one model: ``send`` a user message, get the assistant's reply."""

    def __init__(self, model: ChatModel, system: str | None = None, seed: int | None = None, **sampling: Any) -> None:
        self.model = model
        self.system = system
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        self.sampling = sampling  # defaults for every turn; each send may override them
        self.images: list[ImageInput] = []  # the images the messages show, in order (a marker each in their text)
        model.sampler(**sampling)  # validates the defaults now, not at the first turn
        self._rng = np.random.default_rng(seed)  # per-turn seeds: a saved conversation replays the same draws

    # -- turns -------------------------------------------------------------------------------------

    def send(self, message: str, max_tokens: int = 512, stream: bool = False, images: Sequence[ImageInput] = (),
             **sampling: Any) -> str | Iterator[str]:
        """Add a user message (showing ``images`` before its text: a vision model) and generate the reply (an
        iterator of text pieces with ``stream``)."""
        if not isinstance(message, str):
            raise BadRequestError(f"message must be a string, got {type(message).__name__}")
        self.messages.append({"role": "user", "content": MEDIA_MARKER * len(images) + message})
        self.images.extend(images)
        pieces = self._reply(max_tokens, sampling, len(images))
        return pieces if stream else "".join(pieces)

    def regenerate(self, max_tokens: int = 512, stream: bool = False, **sampling: Any) -> str | Iterator[str]:
        """Drop the last reply and generate another one for the same user message."""
        if not self.messages or self.messages[-1]["role"] != "assistant":
            raise BadRequestError("there is no reply to regenerate")
        self.messages.pop()
        pieces = self._reply(max_tokens, sampling, 0)
        return pieces if stream else "".join(pieces)

    def clear(self) -> None:
        """Forget every turn (the system prompt stays)."""
        self.messages = self.messages[:1] if self.system else []
        self.images = []

    def _reply(self, max_tokens: int, sampling: dict[str, Any], new_images: int) -> Iterator[str]:
        params = {**self.sampling, **sampling}
        if params.get("seed") is None:
            params["seed"] = int(self._rng.integers(2**31))
        text: list[str] = []
        try:
            prompt = self.model.render_chat(self.messages)
            if self.images:  # each image encoded once, its cells reused while the conversation holds it
                ids, placed = self.model.image_prompt(prompt, self.images)
                params["images"] = placed
            else:
                ids = self.model.tokenize(prompt, add_special=False)  # the template writes BOS when the model wants it
            for step in self.model.stream(ids, max_tokens, **params):
                if step.text:
                    text.append(step.text)
                    yield step.text
        except BaseException:
            self.messages.pop()  # the turn failed: the transcript stays as it was before it
            del self.images[len(self.images) - new_images:]
            raise
        self.messages.append({"role": "assistant", "content": "".join(text)})

    # -- sessions ----------------------------------------------------------------------------------

    def save(self, path: str | os.PathLike[str]) -> None:
        if self.images:
            raise BadRequestError("a conversation with images cannot be saved (a session file holds no images)")
        kv = self.model.kv
        tokens = kv.tokens(0)
        arrays = {}
        for il, (k, v) in enumerate(kv.read(0, len(tokens))):
            arrays[f"k{il}"] = k
            arrays[f"v{il}"] = v
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
        # the checksum says the bytes are as written, not that a conversation wrote them: every field is
        # checked before the cache is touched
        system, messages, sampling, rng = check_contents(data, os.fspath(path), model.transformer.hparams.n_vocab)
        try:
            model.sampler(**sampling)
        except BadRequestError as e:
            raise FormatError(f"session {path}: meta.sampling is not valid: {e}") from None
        kv = model.kv
        n = len(data.tokens)
        if n > kv.capacity:
            raise BadRequestError(f"session {path} holds {n} tokens, more than this model's context of {kv.capacity}")
        for il, layer in enumerate(kv.layers):
            for name, region in ((f"k{il}", layer.k), (f"v{il}", layer.v)):
                arr = data.arrays.get(name)
                if arr is None or arr.shape != (n, *region.shape[1:]) or arr.dtype != region.dtype:
                    raise BadRequestError(f"session {path}: array {name} does not fit this model's KV cache")
                if arr.dtype.kind == "f" and not np.isfinite(arr).all():
                    raise FormatError(f"session {path}: array {name} holds non-finite values (NaN or infinity)")
        kv.write(0, [(data.arrays[f"k{il}"], data.arrays[f"v{il}"]) for il in range(len(kv.layers))])
        if n:
            kv.record(0, np.arange(n), np.asarray(data.tokens))
        conv = cls(model, system, **sampling)
        conv.messages = messages
        conv._rng = rng
        return conv
