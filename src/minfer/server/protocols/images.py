"""Images in request bodies, for the protocols that carry them in shapes of their own (Anthropic's image blocks,
the Responses API's ``input_image`` parts, ollama's and llama-server's base64 lists): each decoded into an
:class:`~minfer.runtime.vision.ImageInput` named by the caller's own field, its place in the text marked with
:data:`~minfer.runtime.vision.MEDIA_MARKER`. A bad one is a 400 naming that field."""

from __future__ import annotations

import base64
import binascii
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from minfer.errors import BadRequestError
from minfer.runtime.vision import MEDIA_MARKER, ImageInput, extract_images
from minfer.server.errors import ApiError

__all__ = ["MEDIA_MARKER", "image_from_part", "image_from_base64", "image_error_param"]

_PLACE = "messages[0].content[0]"


def image_from_part(part: Mapping[str, Any], where: str) -> ImageInput:
    """An image content part (OpenAI's ``image_url``, the Responses API's ``input_image``, Anthropic's ``image``
    block) at ``where`` in the body, decoded (not a remote URL, not a server file)."""
    try:
        _, images = extract_images([{"role": "user", "content": [dict(part)]}], allow_paths=False)
    except BadRequestError as e:
        message = str(e).replace(_PLACE, where)
        raise ApiError(message, param=message.split(" ", 1)[0].rstrip(":")) from None
    if len(images) != 1:
        raise ApiError(f"{where}: not an image part", param=where)
    # (a remote image is named by its URL's own field: the part's place plus ".image_url" or ".source.url")
    return dataclasses.replace(images[0], where=images[0].where.replace(_PLACE, where))


def image_from_base64(text: Any, where: str) -> ImageInput:
    """An image sent as bare base64 text (ollama's ``images``, llama-server's ``multimodal_data``)."""
    if not isinstance(text, str) or not text:
        raise ApiError(f"{where} must be a base64 string (an image file's bytes)", param=where)
    if text.startswith("data:"):  # a data URL where bare base64 was asked for: taken as what it plainly means
        return image_from_part({"type": "image_url", "image_url": {"url": text}}, where)
    try:
        return ImageInput(base64.b64decode(text, validate=True), where)
    except (binascii.Error, ValueError):
        raise ApiError(f"{where} is not valid base64", param=where) from None


def image_error_param(message: str, images: Sequence[ImageInput], default: str) -> str:
    """The field an image error is about: the image it names (``image 'messages[0].content[1]': ...``), else
    ``default``."""
    for img in images:
        if repr(img.where) in message or message.startswith(img.where):
            return img.where
    return default
