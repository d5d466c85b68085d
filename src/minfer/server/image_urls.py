"""Remote images of a request (an ``image_url`` that is an http(s) URL), fetched only where the server was started with
``--allow-image-urls``: the server then makes requests to whatever address a client names, which is why it is off by
default (SECURITY.md). Each fetch is bounded: ``MAX_BYTES`` read at most, ``TIMEOUT_SECONDS`` in all, a few redirects,
http(s) only; any failure is a 400 naming the image's field."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

import httpx

from minfer.runtime.vision import ImageInput
from minfer.server.errors import ApiError

MAX_BYTES = 20 * 1024 * 1024  # an image file larger than this is refused before it is all read
TIMEOUT_SECONDS = 10.0  # connect, every read and the whole download
MAX_REDIRECTS = 3


async def fetch_images(images: Sequence[ImageInput], allowed: bool, max_bytes: int = MAX_BYTES,
                       timeout: float = TIMEOUT_SECONDS) -> list[ImageInput]:
    """``images`` with every remote one's bytes fetched (concurrently); a 400 naming its field when remote images
    are not ``allowed`` or one cannot be fetched within the limits."""
    remote = [img for img in images if img.url is not None and not img.data]
    if not remote:
        return list(images)
    if not allowed:
        img = remote[0]
        raise ApiError(f"{img.where}: remote image URLs are not fetched by this server (it fetches them only when "
                       "started with --allow-image-urls); send the image as a data: URL (data:image/png;base64,...)",
                       param=img.where, code="image_urls_not_allowed")
    async with httpx.AsyncClient(timeout=timeout, follow_redirects=True, max_redirects=MAX_REDIRECTS) as client:
        fetched = await asyncio.gather(*(_fetch(client, img, max_bytes, timeout) for img in remote))
    by_id = {id(img): new for img, new in zip(remote, fetched, strict=True)}
    return [by_id.get(id(img), img) for img in images]


async def _fetch(client: httpx.AsyncClient, img: ImageInput, max_bytes: int, timeout: float) -> ImageInput:
    assert img.url is not None
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("GET", img.url) as response:
                if response.status_code != 200:
                    raise ApiError(f"{img.where}: fetching {img.url} answered HTTP {response.status_code}",
                                   param=img.where)
                data = bytearray()
                async for chunk in response.aiter_bytes():
                    data += chunk
                    if len(data) > max_bytes:
                        raise ApiError(f"{img.where}: the image at {img.url} is larger than {max_bytes} bytes",
                                       param=img.where)
    except TimeoutError:
        raise ApiError(f"{img.where}: fetching {img.url} took more than {timeout:g} s", param=img.where) from None
    except httpx.HTTPError as e:
        raise ApiError(f"{img.where}: cannot fetch {img.url} ({type(e).__name__}: {e})".replace("\n", " "),
                       param=img.where) from None
    return dataclasses.replace(img, data=bytes(data))
