"""Vision passes: images' pixels through the vision model's graph (:mod:`minfer.models.gemma3_vision`,
:mod:`minfer.models.idefics3_vision`) into the text model's image tokens, and where those tokens go in a prompt.

A pass runs a batch of images (one plan per image count, kept for reuse); each image's patches are a run of rows
that attention never leaves (the graph's ``spans``), so an image's tokens are the same bits alone or in a batch.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from collections import OrderedDict
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from minfer.errors import BadRequestError
from minfer.formats.images import (
    DEFAULT_MAX_PIXELS,
    Idefics3ProcessorConfig,
    ImageProcessorConfig,
    load_image,
    patches,
    preprocess,
    preprocess_idefics3,
)
from minfer.formats.tokenizer import Tokenizer
from minfer.graph.fusion import fuse
from minfer.graph.ir import Backend
from minfer.graph.plan import BufferArena, Plan, Step
from minfer.models.gemma3_vision import VisionModel
from minfer.models.idefics3_vision import Idefics3VisionModel

MAX_PLANS = 4
T = TypeVar("T")


class VisionRunner:
    """Forward passes of a vision model on a backend: pixels ``[3, H, W]`` -> image tokens ``[T, text n_embd]``."""

    def __init__(self, model: VisionModel | Idefics3VisionModel, backend: Backend) -> None:
        self.model = model
        self.backend = backend
        self.arena = BufferArena()
        self._plans: OrderedDict[int, Plan] = OrderedDict()
        self.images_encoded = 0  # images run through the tower so far (what a cached image does not add to)

    def plan(self, n_images: int) -> Plan:
        plan = self._plans.get(n_images)
        if plan is None:
            graph = fuse(self.model.build_graph(n_images), self.backend.quantized_input)
            plan = self._plans[n_images] = Plan(graph, self.backend, (), arena=self.arena)
            if len(self._plans) > MAX_PLANS:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(n_images)
        return plan

    def encode(self, pixels: Sequence[np.ndarray], on_step: Callable[[Step, float], None] | None = None) -> np.ndarray:
        """Each image's tokens ``[n_images, tokens_per_image, text n_embd]`` (a fresh array); ``pixels`` as the image
        processor gives them (``[3, image_size, image_size]`` float32). ``on_step``: the trace's observer of
        :meth:`Plan.run`."""
        return drain(self.encode_slices(pixels, on_step))

    def encode_slices(self, pixels: Sequence[np.ndarray], on_step: Callable[[Step, float], None] | None = None,
                      ) -> Generator[None, None, np.ndarray]:
        """:meth:`encode` as a generator that yields between two layers of the tower (the pixels are checked
        before the first slice runs). Two encodings must not interleave: the plans share one arena."""
        hp = self.model.hparams
        n = len(pixels)
        if n == 0:
            raise BadRequestError("no images to encode")
        for k, p in enumerate(pixels):
            if p.shape != (3, hp.image_size, hp.image_size):
                raise BadRequestError(f"image {k}: pixels of shape {p.shape}, expected (3, {hp.image_size}, "
                                      f"{hp.image_size})")
        plan = self.plan(n)
        inp = plan.inputs
        inp["patches"][:] = np.concatenate([patches(p, hp.patch_size) for p in pixels])
        inp["patch_positions"][:] = np.tile(np.arange(hp.n_patches), n)
        inp["spans"][:] = np.repeat(np.arange(n) * hp.n_patches, hp.n_patches)
        for i, rows in enumerate(self.model.pool_rows(n)):
            inp[f"pool.{i}"][:] = rows
        slices = plan.run_slices(on_step)
        while True:
            with self.backend.running():
                try:
                    next(slices)
                except StopIteration as done:
                    out = done.value
                    break
            yield
        self.images_encoded += n
        return out.reshape(n, hp.tokens_per_image, -1).copy()


def drain(slices: Generator[None, None, T]) -> T:
    """Run a generator of slices (``encode_slices``, ``prompt_slices``) to its end; its return value."""
    while True:
        try:
            next(slices)
        except StopIteration as done:
            return done.value


@dataclass(frozen=True)
class PassImage:
    """An image's tokens in a forward pass (or in a prompt): rows ``first .. first + len(vectors) - 1`` of the pass
    (the prompt) take them."""

    first: int
    vectors: np.ndarray  # [tokens_per_image, n_embd] float32

    @property
    def end(self) -> int:
        return self.first + self.vectors.shape[0]


def image_token_id(digest: bytes) -> int:
    """The prompt id of an image's rows: negative (no vocabulary entry has it), and the same for the same pixels,
    so that the prefix cache, which compares prompt ids, reuses an image's cells for that image alone."""
    return -2 - int.from_bytes(digest[:4], "little") % (2**31 - 2)  # (the KV cache's -1 marks a position unknown)


def check_prompt_images(prompt: Sequence[int], images: Sequence[PassImage], n_vocab: int, n_embd: int) -> None:
    """A :class:`BadRequestError` unless ``images`` are in order, apart, inside the prompt and of width ``n_embd``,
    and every other prompt id is in the vocabulary (an image's rows may hold any id: the image replaces it)."""
    end = 0
    for k, img in enumerate(images):
        if img.vectors.ndim != 2 or img.vectors.shape[1] != n_embd or img.vectors.shape[0] == 0:
            raise BadRequestError(f"image {k}: tokens of shape {img.vectors.shape}, expected (n, {n_embd})")
        if img.first < end or img.end > len(prompt):
            raise BadRequestError(f"image {k}: rows {img.first}..{img.end - 1} overlap another image or pass the end "
                                  f"of the {len(prompt)}-token prompt")
        end = img.end
    ids = np.asarray(prompt, dtype=np.int64)
    bad = (ids < 0) | (ids >= n_vocab)
    for img in images:
        bad[img.first:img.end] = False
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise BadRequestError(f"token id {int(ids[i])} at index {i} is outside the vocabulary (0..{n_vocab - 1})")


def images_in(images: Sequence[PassImage], start: int, end: int, row: int) -> list[PassImage]:
    """The parts of a prompt's ``images`` at its positions ``start .. end - 1``, as the rows of a pass where position
    ``start`` is row ``row``."""
    return [PassImage(row + max(img.first, start) - start, img.vectors[max(0, start - img.first):end - img.first])
            for img in images if img.first < end and img.end > start]


def whole_images(images: Sequence[PassImage], start: int, n: int, extend: bool) -> int:
    """How many prompt tokens from position ``start`` a pass takes instead of ``n``, so that it does not end inside
    an image (an image's rows see each other: they are evaluated in one pass): cut before the image, or where the
    pass starts inside it, with ``extend`` take the rest of the image (else none)."""
    for img in images:
        if img.first < start + n < img.end:
            if img.first > start:
                return img.first - start
            return img.end - start if extend else 0
    return n


def image_inputs(positions: np.ndarray, images: Sequence[PassImage], n_embd: int,
                 keep: np.ndarray, values: np.ndarray, key_ends: np.ndarray, bidirectional: bool = True) -> None:
    """Fill a vision-language plan's ``embd_keep``, ``embd_image`` and ``key_ends`` inputs for a pass whose rows are
    at ``positions``: text rows keep their token's embedding and see keys up to their own position; an image's rows
    take its tokens and, with ``bidirectional`` (Gemma 3), see every key up to the image's last position (its tokens
    attend to each other both ways), else (Idefics3) keys up to their own position, as text rows."""
    keep.fill(1.0)
    values.fill(0.0)
    key_ends[:] = positions
    n = positions.shape[0]
    for img in images:
        m = img.vectors.shape[0]
        end = img.first + m
        if img.first < 0 or end > n or img.vectors.shape[1] != n_embd:
            raise BadRequestError(f"an image's {m} tokens at rows {img.first}.. do not fit a pass of {n} rows of "
                                  f"width {n_embd}")
        span = positions[img.first:end]
        if not np.array_equal(span, np.arange(span[0], span[0] + m)):
            raise BadRequestError("an image's tokens must be at consecutive positions of one pass")
        keep[img.first:end] = 0.0
        values[img.first:end] = img.vectors
        if bidirectional:
            key_ends[img.first:end] = span[-1]


# -- images in chat messages ----------------------------------------------------------------------------------

# what an image part leaves in a message's text (llama.cpp's media marker): the chat template renders it as text,
# then the prompt is split at it (:meth:`ImagePrompter.prompt`), whatever the template does with the text around it
MEDIA_MARKER = "<__media__>"


@dataclass(frozen=True)
class ImageInput:
    """An image of a request, as sent (the file's bytes), and where it was in the request (for errors). A remote
    image is its ``url`` alone until someone fetches it (a server started with ``--allow-image-urls``)."""

    data: bytes
    where: str
    url: str | None = None


def extract_images(messages: Sequence[Mapping[str, Any]], allow_paths: bool = False,
                   ) -> tuple[list[dict[str, Any]], list[ImageInput]]:
    """``messages`` with each image content part replaced by a text part holding :data:`MEDIA_MARKER`, and the
    images in order. Image parts: OpenAI's ``{"type": "image_url", "image_url": {"url": "data:..."}}``, the
    Responses API's ``{"type": "input_image", "image_url": "data:..."}``, Anthropic's ``{"type": "image",
    "source": {"type": "base64", "data": ...}}``, and transformers' ``{"type": "image", "image": bytes}`` (with
    ``allow_paths``, the Python API's, also a file path there or as ``"path"``). An http(s) URL is kept as the
    image's ``url``: it is not fetched here."""
    out: list[dict[str, Any]] = []
    images: list[ImageInput] = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, Mapping) else None
        if not isinstance(content, list):
            out.append(m)  # type: ignore[arg-type]
            continue
        parts = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            data = _image_bytes(part, where, allow_paths) if isinstance(part, Mapping) else None
            if data is None:
                parts.append(part)
            elif isinstance(data, str):  # a remote URL: named by its own field
                field = ".source.url" if isinstance(part.get("source"), Mapping) else \
                    ".image_url" if part.get("type") in ("image_url", "input_image") else ".url"
                images.append(ImageInput(b"", where + field, url=data))
                parts.append({"type": "text", "text": MEDIA_MARKER})
            else:
                path = part.get("path", part.get("image"))
                named = isinstance(path, str | os.PathLike) and not str(path).startswith(("data:", "http"))
                images.append(ImageInput(data, str(path) if named else where))
                parts.append({"type": "text", "text": MEDIA_MARKER})
        texts = [p.get("text") if isinstance(p, Mapping) and p.get("type") == "text" else None for p in parts]
        # text parts (the markers among them) become the one string chat templates take
        joined = "".join(texts) if all(isinstance(t, str) for t in texts) else parts  # type: ignore[arg-type]
        out.append({**m, "content": joined})
    return out, images


def _image_bytes(part: Mapping[str, Any], where: str, allow_paths: bool) -> bytes | str | None:
    """The bytes of an image part, or its remote URL (None: not an image part)."""
    kind = part.get("type")
    if kind in ("image_url", "input_image"):
        url = part.get("image_url")
        if isinstance(url, Mapping):
            url = url.get("url")
        return _from_url(url, f"{where}.image_url")
    if kind != "image":
        return None
    source = part.get("source")
    if isinstance(source, Mapping):  # Anthropic's
        if source.get("type") == "base64":
            return _base64(source.get("data"), f"{where}.source.data")
        if source.get("type") == "url":
            return _from_url(source.get("url"), f"{where}.source.url")
        raise BadRequestError(f"{where}.source.type must be 'base64' or 'url', got {source.get('type')!r}")
    for key in ("image", "url", "path"):
        value = part.get(key)
        if value is None:
            continue
        if isinstance(value, bytes | bytearray):
            return bytes(value)
        if isinstance(value, str) and value.startswith("file://") and allow_paths:
            value = value.removeprefix("file://")  # the Python API reads paths: a file URL is one
        if isinstance(value, str) and value.startswith(("data:", "http://", "https://", "file://")):
            return _from_url(value, f"{where}.{key}")
        if isinstance(value, str | os.PathLike) and allow_paths:
            try:
                return Path(value).read_bytes()
            except OSError as e:
                raise BadRequestError(f"{where}.{key}: cannot read {str(value)!r} ({e.strerror or e})") from None
        raise BadRequestError(f"{where}.{key} must be an image's bytes or a data: URL")
    raise BadRequestError(f"{where}: an image part needs 'image_url', 'image' or 'source'")


def _from_url(url: Any, where: str) -> bytes | str:
    """A data: URL's bytes, or an http(s) or file:// URL as it is (a server fetches or reads it, if it may)."""
    if not isinstance(url, str) or not url:
        raise BadRequestError(f"{where} must be a URL string")
    if url.startswith(("http://", "https://", "file://")):
        return url
    if not url.startswith("data:"):
        raise BadRequestError(f"{where} must be a data: URL (data:image/png;base64,...), got {url[:40]!r}")
    head, sep, payload = url[5:].partition(",")
    if not sep or not head.endswith(";base64"):
        raise BadRequestError(f"{where}: only base64 data: URLs are supported (data:image/png;base64,...)")
    return _base64(payload, where)


def _base64(text: Any, where: str) -> bytes:
    if not isinstance(text, str):
        raise BadRequestError(f"{where} must be base64 text")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequestError(f"{where} is not valid base64") from None


class ImagePrompter:
    """A vision-language model's prompts with images: the rendered text's media markers expanded into each image's
    tokens as the model's processor does (the vision model's ``image_text``: Gemma 3: ``\\n\\n<start_of_image>``,
    ``tokens_per_image`` placeholders, ``<end_of_image>\\n\\n``; Idefics3: a run of placeholders per tile of the split
    image, and the whole image's), each run of placeholders given its tile's own ids, and the tiles encoded (each
    one once: the tokens of the last ``cache_size`` tiles are kept by a hash of their pixels)."""

    def __init__(self, runner: VisionRunner, processor: ImageProcessorConfig | Idefics3ProcessorConfig,
                 tokenizer: Tokenizer, max_pixels: int = DEFAULT_MAX_PIXELS, cache_size: int = 32) -> None:
        self.runner = runner
        self.processor = processor
        self.tokenizer = tokenizer
        self.max_pixels = max_pixels
        self.cache_size = cache_size
        self._cache: OrderedDict[bytes, np.ndarray] = OrderedDict()

    @property
    def expansion(self) -> str:
        """What an unsplit image's marker becomes."""
        return self.runner.model.image_text(self.tokenizer.token_text)

    def prompt(self, text: str, images: Sequence[ImageInput], add_special: bool = False,
               ) -> tuple[list[int], list[PassImage]]:
        """The prompt ids of ``text`` (a rendered prompt holding one :data:`MEDIA_MARKER` per image, special tokens
        included, or with ``add_special`` a plain one the tokenizer adds them to, BOS first) and where each tile's
        tokens go (one :class:`PassImage` per run of placeholders, in order)."""
        return drain(self.prompt_slices(text, images, add_special))

    def prompt_slices(self, text: str, images: Sequence[ImageInput], add_special: bool = False,
                      ) -> Generator[None, None, tuple[list[int], list[PassImage]]]:
        """:meth:`prompt` as a generator that yields between two layers of the vision tower (a server's engine
        decodes its running sequences between them)."""
        pieces = text.split(MEDIA_MARKER)
        if len(pieces) - 1 != len(images):
            raise BadRequestError(f"the prompt holds {len(pieces) - 1} image markers for {len(images)} images "
                                  f"(is {MEDIA_MARKER!r} in a message's text?)")
        tiles = [self.tiles(img) for img in images]
        model = self.runner.model
        expanded = [pieces[0]]
        for (_, rows, cols), piece in zip(tiles, pieces[1:], strict=True):
            expanded += [model.image_text(self.tokenizer.token_text, rows, cols), piece]
        ids = self.tokenizer.encode("".join(expanded), add_special=add_special)
        hp = model.hparams
        is_image = np.asarray(ids) == hp.image_token_id
        starts = [i for i in np.flatnonzero(is_image) if i == 0 or not is_image[i - 1]]
        n = hp.tokens_per_image
        n_tiles = sum(len(pixels) for pixels, _, _ in tiles)
        if len(starts) != n_tiles or int(is_image.sum()) != n * n_tiles:
            raise BadRequestError(f"the prompt's text holds image placeholder tokens of its own "
                                  f"({self.tokenizer.token_text(hp.image_token_id)!r})")
        out = []
        encoded = yield from self.encode_pixels_slices([p for pixels, _, _ in tiles for p in pixels])
        for start, (digest, vectors) in zip(starts, encoded, strict=True):
            ids[start:start + n] = [image_token_id(digest)] * n
            out.append(PassImage(int(start), vectors))
        return ids, out

    def tiles(self, image: ImageInput) -> tuple[list[np.ndarray], int, int]:
        """An image's pixels as the model's processor gives them: its tiles and their grid's (rows, cols)."""
        if not image.data and image.url is not None:
            raise BadRequestError(f"{image.where}: remote image URLs are not fetched; send the image as a data: URL "
                                  "(data:image/png;base64,...)")
        decoded = load_image(image.data, image.where, self.max_pixels)
        if isinstance(self.processor, Idefics3ProcessorConfig):
            return preprocess_idefics3(decoded, self.processor)
        return [preprocess(decoded, self.processor)], 0, 0

    def encode(self, images: Sequence[ImageInput]) -> list[tuple[bytes, np.ndarray]]:
        """Each image's tiles' pixel hashes and tokens, in order (one per tile: an unsplit image's one)."""
        return self.encode_pixels(self.pixels(images))

    def pixels(self, images: Sequence[ImageInput]) -> list[np.ndarray]:
        """The images' tiles, in order, as the vision model takes them."""
        return [p for img in images for p in self.tiles(img)[0]]

    def encode_pixels(self, pixels: Sequence[np.ndarray]) -> list[tuple[bytes, np.ndarray]]:
        """Each tile's pixel hash and tokens, the tiles not seen lately encoded in one pass."""
        return drain(self.encode_pixels_slices(pixels))

    def encode_pixels_slices(self, pixels: Sequence[np.ndarray],
                             ) -> Generator[None, None, list[tuple[bytes, np.ndarray]]]:
        digests = [hashlib.sha256(p.tobytes()).digest() for p in pixels]
        new = {d: p for d, p in zip(digests, pixels, strict=True) if d not in self._cache}
        if new:
            vectors = yield from self.runner.encode_slices(list(new.values()))
            for d, v in zip(new, vectors, strict=True):
                self._cache[d] = v
        for d in digests:
            self._cache.move_to_end(d)
        out = [(d, self._cache[d]) for d in digests]
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return out
