"""Remote images of a request (an ``image_url`` that is an http(s) URL), fetched only where the server was started with
``--allow-image-urls``: the server then makes requests to whatever address a client names, which is why it is off by
default (SECURITY.md). Each fetch is bounded: ``MAX_BYTES`` read at most, ``TIMEOUT_SECONDS`` in all, a few redirects,
http(s) only; any failure is a 400 naming the image's field.

``file://`` URLs (llama-server's ``--media-path DIR``) are read from DIR only: a relative path without ``..``, which
after symlinks still lies inside DIR, of a regular file of ``MAX_BYTES`` at most; without ``--media-path`` they are
refused."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

import httpx

from minfer.runtime.vision import ImageInput
from minfer.server.errors import ApiError

MAX_BYTES = 20 * 1024 * 1024  # an image file larger than this is refused before it is all read
TIMEOUT_SECONDS = 10.0  # connect, every read and the whole download
MAX_REDIRECTS = 3


async def fetch_images(images: Sequence[ImageInput], allowed: bool, max_bytes: int = MAX_BYTES,
                       timeout: float = TIMEOUT_SECONDS, media_path: str | None = None) -> list[ImageInput]:
    """``images`` with every remote one's bytes fetched (concurrently) and every ``file://`` one read from
    ``media_path``; a 400 naming its field when remote images are not ``allowed``, files have no ``media_path``,
    or one cannot be fetched or read within the limits."""
    local = [img for img in images if img.url is not None and img.url.startswith("file://") and not img.data]
    if local:
        read = {id(img): await asyncio.to_thread(read_media_file, img, media_path, max_bytes) for img in local}
        images = [read.get(id(img), img) for img in images]
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


def read_media_file(img: ImageInput, media_path: str | None, max_bytes: int = MAX_BYTES) -> ImageInput:
    """A ``file://`` image read from the ``--media-path`` folder (see the module docstring); a 400 naming its
    field otherwise."""
    assert img.url is not None
    name = img.url.removeprefix("file://")
    if media_path is None:
        raise ApiError(f"{img.where}: file:// URLs are read only from the folder the server names with --media-path, "
                       "and this server has none; send the image as a data: URL", param=img.where,
                       code="media_path_not_set")
    parts = Path(name).parts
    if not name or name.startswith("/") or "\0" in name or "\\" in name or ".." in parts:
        raise ApiError(f"{img.where}: file path {name!r} is not allowed: a path relative to --media-path, without "
                       "'..'", param=img.where)
    folder = Path(media_path).resolve()
    path = (folder / name).resolve()
    if not path.is_relative_to(folder):  # a symlink out of the folder
        raise ApiError(f"{img.where}: file path {name!r} is not allowed: it leads out of --media-path",
                       param=img.where)
    if not path.exists():
        raise ApiError(f"{img.where}: file {name!r} does not exist in --media-path", param=img.where)
    if not path.is_file():  # (a folder, or a pipe that would block the read)
        raise ApiError(f"{img.where}: {name!r} is not a regular file", param=img.where)
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size > max_bytes:
                raise ApiError(f"{img.where}: the file {name!r} is larger than {max_bytes} bytes", param=img.where)
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise ApiError(f"{img.where}: file {name!r} does not exist or cannot be read ({e.strerror or e})",
                       param=img.where) from None
    return dataclasses.replace(img, data=data)
