"""Images for vision models: decoding (bounded and checked) and the preprocessing of HF image processors.

``preprocess`` reproduces transformers 5.24's ``Gemma3ImageProcessorPil`` (the SigLIP-style processor
without pan-and-scan) step for step, so the engine's pixels equal the reference ones up to float rounding:

1. ``convert_to_rgb`` (``transformers.image_transforms``): an image with an alpha band or a
   ``transparency`` entry is converted to RGBA and alpha-composited onto opaque white, then to RGB; any
   other mode is converted with ``Image.convert("RGB")``;
2. ``resize``: the uint8 RGB array back to a Pillow image, ``Image.resize((width, height), resample)``;
3. ``rescale``: ``uint8 -> float64 * rescale_factor -> float32``;
4. ``normalize``: ``(x - mean) / std`` in float32 with float32 mean and std, per channel;
5. channels first: ``[3, H, W]``.

``patches`` lays the result out as rows of SigLIP's patch-embedding convolution, so that the convolution
becomes one matrix product with the conv weight reshaped to ``[hidden, 3 * p * p]``.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from minfer.errors import BadRequestError, FormatError

# the formats a request may carry (Pillow format names); anything else is refused before decoding
SUPPORTED_FORMATS: tuple[str, ...] = ("PNG", "JPEG", "GIF", "WEBP", "BMP")
# 40 megapixels (e.g. 8000 x 5000): below Pillow's own decompression-bomb threshold (~89.5 MP)
DEFAULT_MAX_PIXELS = 40_000_000

# Pillow's resampling filters by the integer HF configs store (PIL.Image.Resampling values)
_RESAMPLE_NAMES = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}

# leading bytes of common formats we do not accept, to name them in the error
_OTHER_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"\x00\x00\x01\x00", "ICO"),
    (b"%PDF", "PDF"),
    (b"8BPS", "PSD"),
    (b"\x00\x00\x00\x0cjP  ", "JPEG 2000"),
    (b"\xff\x4f\xff\x51", "JPEG 2000"),
)


def _sniff_other(data: bytes) -> str | None:
    for magic, fmt in _OTHER_MAGIC:
        if data.startswith(magic):
            return fmt
    if data[4:12] in (b"ftypheic", b"ftypheix", b"ftypmif1", b"ftypavif", b"ftypavis"):
        return "HEIF/AVIF"
    head = data[:256].lstrip().lower()
    if head.startswith(b"<svg") or (head.startswith(b"<?xml") and b"<svg" in head):
        return "SVG"
    return None


def load_image(data: bytes, name: str, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Decode ``data`` (the image called ``name`` in messages) with Pillow, checked and bounded.

    Only ``SUPPORTED_FORMATS`` are accepted (a GIF or animated WEBP gives its first frame); the header's
    width x height must not exceed ``max_pixels``, checked before any pixel is decoded. An EXIF orientation
    is applied (as ``transformers.image_utils.load_image`` does). Raises ``BadRequestError`` naming the image
    and the problem for an empty, corrupt, truncated, unsupported or oversized file.
    """
    if not data:
        raise BadRequestError(f"image {name!r}: empty file")
    try:
        image = Image.open(io.BytesIO(data), formats=list(SUPPORTED_FORMATS))
    except UnidentifiedImageError:
        other = _sniff_other(data)
        what = f"{other} images are not supported" if other else "not a recognizable image (corrupt or unsupported)"
        raise BadRequestError(f"image {name!r}: {what}; send {', '.join(SUPPORTED_FORMATS)}") from None
    except Image.DecompressionBombError as exc:
        raise BadRequestError(f"image {name!r}: too many pixels, limit {max_pixels} ({_one_line(exc)})") from None
    except Exception as exc:  # Pillow raises many types on a broken header
        raise BadRequestError(f"image {name!r}: unreadable header ({_one_line(exc)})") from None
    try:
        width, height = image.size
        if width <= 0 or height <= 0:
            raise BadRequestError(f"image {name!r}: invalid size {width}x{height}")
        if width * height > max_pixels:
            raise BadRequestError(
                f"image {name!r}: {width}x{height} = {width * height} pixels is over the limit of {max_pixels}"
            )
        image.load()
        orientation = image.getexif().get(0x0112, 1)
    except BadRequestError:
        image.close()
        raise
    except Image.DecompressionBombError as exc:
        image.close()
        raise BadRequestError(f"image {name!r}: too many pixels, limit {max_pixels} ({_one_line(exc)})") from None
    except Exception as exc:  # truncated / corrupt data: OSError, SyntaxError, ValueError, EOFError, zlib errors
        image.close()
        raise BadRequestError(f"image {name!r}: corrupt or truncated {image.format} data ({_one_line(exc)})") from None
    if orientation not in (None, 1):
        from PIL import ImageOps

        try:
            image = ImageOps.exif_transpose(image)
        except Exception as exc:
            raise BadRequestError(f"image {name!r}: bad EXIF orientation ({_one_line(exc)})") from None
    return image


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:200]


def processor_fields(path: str | Path) -> tuple[dict[str, Any], str]:
    """An HF folder's image processor fields, and the file they are in: ``preprocessor_config.json``, else the
    ``image_processor`` entry of ``processor_config.json`` (what transformers 5 writes); a one-line
    :class:`FormatError` naming the file otherwise."""
    folder = Path(path)
    file, key = folder / "preprocessor_config.json", None
    if not file.is_file():
        file, key = folder / "processor_config.json", "image_processor"
        if not file.is_file():
            raise FormatError(f"{folder}: no preprocessor_config.json or processor_config.json")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"{file}: unreadable JSON ({_one_line(exc)})") from None
    if key is not None:
        raw = raw.get(key) if isinstance(raw, dict) else None
    if not isinstance(raw, dict):
        raise FormatError(f"{file}: not a JSON object" if key is None else
                          f"{file}: field 'image_processor' missing or not an object")
    return raw, str(file)


@dataclass(frozen=True)
class ImageProcessorConfig:
    """The fields of an HF ``preprocessor_config.json`` that SigLIP-style processors (Gemma 3) use."""

    height: int = 224
    width: int = 224
    resample: int = 2  # PIL.Image.Resampling.BILINEAR
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    do_convert_rgb: bool = True

    @classmethod
    def square(cls, size: int, mean: tuple[float, float, float] | None = None,
               std: tuple[float, float, float] | None = None, resample: int = 2) -> ImageProcessorConfig:
        """A ``size`` x ``size`` resize (bilinear by default, as llama.cpp resizes Gemma 3's images), rescaling by
        1/255 and normalizing with ``mean`` / ``std`` (``None``: Gemma3ImageProcessor's 0.5); the rest as the
        processor's defaults. For files that carry only these settings (an mmproj GGUF)."""
        d = cls()
        return cls(height=size, width=size, resample=resample, image_mean=d.image_mean if mean is None else mean,
                   image_std=d.image_std if std is None else std)

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> ImageProcessorConfig:
        """Read ``preprocessor_config.json`` (or the ``image_processor`` entry of ``processor_config.json``).

        ``null`` fields take the processor's defaults (``do_convert_rgb`` null means True, as
        ``Gemma3Processor`` passes it). Raises ``FormatError`` naming the file and the field.
        """
        raw, file = processor_fields(path)
        return cls.from_dict(raw, file)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "preprocessor_config.json") -> ImageProcessorConfig:
        """Validate the fields of a parsed ``preprocessor_config.json``; ``source`` names it in errors."""
        d = cls()

        def bad(field: str, why: str) -> FormatError:
            return FormatError(f"{source}: field {field!r} {why}")

        def flag(field: str, default: bool) -> bool:
            v = raw.get(field)
            if v is None:
                return default
            if not isinstance(v, bool):
                raise bad(field, f"must be true or false, got {v!r}")
            return v

        def number(field: str, default: float) -> float:
            v = raw.get(field)
            if v is None:
                return default
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise bad(field, f"must be a positive number, got {v!r}")
            return float(v)

        def triple(field: str, default: tuple[float, float, float], positive: bool) -> tuple[float, float, float]:
            v = raw.get(field)
            if v is None:
                return default
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                v = [v, v, v]
            ok = isinstance(v, list) and len(v) == 3
            ok = ok and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v)
            if not ok or (positive and any(x <= 0 for x in v)):
                raise bad(field, f"must be 3 finite{' positive' if positive else ''} numbers, got {v!r}")
            return (float(v[0]), float(v[1]), float(v[2]))

        size = raw.get("size")
        height, width = d.height, d.width
        if size is not None:
            if not isinstance(size, dict) or set(size) - {"height", "width"} or {"height", "width"} - set(size):
                raise bad("size", f"must be {{'height': H, 'width': W}} (other resize modes unsupported), got {size!r}")
            for k in ("height", "width"):
                v = size[k]
                if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                    raise bad(f"size.{k}", f"must be a positive integer, got {v!r}")
            height, width = size["height"], size["width"]
        resample = raw.get("resample")
        if resample is None:
            resample = d.resample
        if isinstance(resample, bool) or not isinstance(resample, int) or resample not in _RESAMPLE_NAMES:
            raise bad("resample", f"must be a Pillow filter 0-5, got {resample!r}")
        if raw.get("do_pan_and_scan"):
            raise bad("do_pan_and_scan", "is not supported")
        return cls(
            height=height,
            width=width,
            resample=resample,
            do_resize=flag("do_resize", d.do_resize),
            do_rescale=flag("do_rescale", d.do_rescale),
            rescale_factor=number("rescale_factor", d.rescale_factor),
            do_normalize=flag("do_normalize", d.do_normalize),
            image_mean=triple("image_mean", d.image_mean, positive=False),
            image_std=triple("image_std", d.image_std, positive=True),
            do_convert_rgb=flag("do_convert_rgb", d.do_convert_rgb),
        )


def to_rgb_array(image: Image.Image) -> np.ndarray:
    """``transformers.image_transforms.convert_to_rgb`` of a Pillow image: uint8 ``[H, W, 3]``.

    Transparency (an alpha band, or a ``transparency`` entry of P / L / RGB images) is composited onto
    opaque white; every other mode goes through ``Image.convert("RGB")``.
    """
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if has_alpha:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        rgb = Image.alpha_composite(background, rgba).convert("RGB")
    else:
        rgb = image.convert("RGB")
    return np.asarray(rgb, dtype=np.uint8)


def preprocess(image: Image.Image, cfg: ImageProcessorConfig) -> np.ndarray:
    """The pixel values of ``image`` as ``Gemma3ImageProcessorPil`` computes them: float32 ``[3, H, W]``."""
    if cfg.do_convert_rgb:
        arr = to_rgb_array(image)
    else:
        if image.mode != "RGB":
            raise BadRequestError(f"image of mode {image.mode} needs RGB conversion, which the processor disables")
        arr = np.asarray(image, dtype=np.uint8)
    if cfg.do_resize:
        resized = Image.fromarray(arr).resize((cfg.width, cfg.height), resample=Image.Resampling(cfg.resample))
        arr = np.asarray(resized, dtype=np.uint8)
    chw = np.ascontiguousarray(np.moveaxis(arr, -1, 0))  # [3, H, W] uint8
    x: np.ndarray
    if cfg.do_rescale:
        x = (chw.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    else:
        x = chw
    if cfg.do_normalize:
        if not np.issubdtype(x.dtype, np.floating):
            x = x.astype(np.float32)
        mean = np.asarray(cfg.image_mean, dtype=x.dtype)[:, None, None]
        std = np.asarray(cfg.image_std, dtype=x.dtype)[:, None, None]
        x = (x - mean) / std
    return np.ascontiguousarray(x, dtype=np.float32)


def patches(pixels: np.ndarray, patch: int) -> np.ndarray:
    """Rows of SigLIP's patch embedding: ``[n_patches, 3 * patch * patch]`` float32.

    ``pixels`` is ``[C, H, W]`` with H and W multiples of ``patch``. Rows go row-major over the patch grid
    (the order of ``Conv2d(...)(x).flatten(2).transpose(1, 2)``), each flattened as (channel, ky, kx), the
    layout of the conv weight ``[hidden, C, patch, patch]`` reshaped to ``[hidden, C * patch * patch]``: the
    convolution equals ``patches(pixels, p) @ weight.reshape(hidden, -1).T`` (+ bias).
    """
    if pixels.ndim != 3 or patch <= 0:
        raise ValueError(f"patches: need [C, H, W] pixels and a positive patch, got {pixels.shape} / {patch}")
    c, h, w = pixels.shape
    if h % patch or w % patch:
        raise ValueError(f"patches: image {h}x{w} is not a multiple of the patch size {patch}")
    gh, gw = h // patch, w // patch
    x = pixels.astype(np.float32, copy=False).reshape(c, gh, patch, gw, patch)
    x = x.transpose(1, 3, 0, 2, 4)  # [gh, gw, c, ky, kx]
    return np.ascontiguousarray(x.reshape(gh * gw, c * patch * patch))


# -- Idefics3 (SmolVLM): images split into tiles ---------------------------------------------------------

_IDEFICS3_MAX_IMAGE_SIZE = 4096  # transformers' MAX_IMAGE_SIZE: no edge grows past it


@dataclass(frozen=True)
class Idefics3ProcessorConfig:
    """The fields of an ``Idefics3ImageProcessor`` ``preprocessor_config.json`` (SmolVLM's): the image's longest edge
    is resized to ``longest_edge``, then (``do_image_splitting``) to multiples of ``tile`` and cut into ``tile`` x
    ``tile`` tiles plus the whole image resized to one tile; defaults are the processor's."""

    longest_edge: int = 4 * 364  # size.longest_edge
    tile: int = 364  # max_image_size.longest_edge
    resample: int = 1  # PIL.Image.Resampling.LANCZOS
    do_resize: bool = True
    do_image_splitting: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    do_convert_rgb: bool = True

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> Idefics3ProcessorConfig:
        """Read ``preprocessor_config.json`` (or the ``image_processor`` entry of ``processor_config.json``); a missing
        or wrong field is a one-line :class:`FormatError` naming the file and the field."""
        raw, file = processor_fields(path)
        return cls.from_dict(raw, file)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "preprocessor_config.json") -> Idefics3ProcessorConfig:
        """Validate the fields of a parsed ``preprocessor_config.json``; ``source`` names it in errors."""
        d = cls()
        # the fields Gemma 3's processor shares are checked by its reader (a square ``size`` aside)
        base = ImageProcessorConfig.from_dict({k: v for k, v in raw.items() if k != "size"}, source)

        def edge(field: str, default: int) -> int:
            v = raw.get(field)
            if v is None:
                return default
            inner = v.get("longest_edge") if isinstance(v, dict) else None
            if not isinstance(v, dict) or set(v) != {"longest_edge"} or isinstance(inner, bool) \
                    or not isinstance(inner, int) or inner <= 0:
                raise FormatError(f"{source}: field '{field}' must be {{'longest_edge': N}} with N a positive "
                                  f"integer, got {v!r}")
            return inner

        split = raw.get("do_image_splitting")
        if split is not None and not isinstance(split, bool):
            raise FormatError(f"{source}: field 'do_image_splitting' must be true or false, got {split!r}")
        return cls(
            longest_edge=edge("size", d.longest_edge), tile=edge("max_image_size", d.tile),
            resample=base.resample if raw.get("resample") is not None else d.resample,
            do_resize=base.do_resize, do_image_splitting=d.do_image_splitting if split is None else split,
            do_rescale=base.do_rescale, rescale_factor=base.rescale_factor, do_normalize=base.do_normalize,
            image_mean=base.image_mean, image_std=base.image_std, do_convert_rgb=base.do_convert_rgb,
        )


def _idefics3_longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """transformers' ``get_resize_output_image_size`` of Idefics3: the longest edge to ``longest`` (the other edge
    rounded down, then up to even), then both below 4096."""
    aspect = width / height
    if width >= height:
        width = longest
        height = int(width / aspect)
        height += height % 2
    else:
        height = longest
        width = int(height * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > _IDEFICS3_MAX_IMAGE_SIZE:
        width = _IDEFICS3_MAX_IMAGE_SIZE
        height = int(width / aspect)
    elif height > width and height > _IDEFICS3_MAX_IMAGE_SIZE:
        height = _IDEFICS3_MAX_IMAGE_SIZE
        width = int(height * aspect)
    return max(height, 1), max(width, 1)


def _idefics3_tile_multiple_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """transformers' ``resize_for_vision_encoder``: both edges up to multiples of ``tile``."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


def preprocess_idefics3(image: Image.Image, cfg: Idefics3ProcessorConfig) -> tuple[list[np.ndarray], int, int]:
    """The pixel values of ``image`` as ``Idefics3ImageProcessorPil`` computes them: the tiles (float32 ``[3, tile,
    tile]``, row by row, then the whole image), and the tile grid's ``(rows, cols)`` ((0, 0): one tile, the whole
    image, unsplit)."""
    if cfg.do_convert_rgb:
        arr = to_rgb_array(image)
    else:
        if image.mode != "RGB":
            raise BadRequestError(f"image of mode {image.mode} needs RGB conversion, which the processor disables")
        arr = np.asarray(image, dtype=np.uint8)
    resample = Image.Resampling(cfg.resample)

    def resize(a: np.ndarray, height: int, width: int) -> np.ndarray:
        return np.asarray(Image.fromarray(a).resize((width, height), resample=resample), dtype=np.uint8)

    if cfg.do_resize:
        arr = resize(arr, *_idefics3_longest_edge_size(arr.shape[0], arr.shape[1], cfg.longest_edge))
    t = cfg.tile
    rows = cols = 0
    if cfg.do_image_splitting:
        arr = resize(arr, *_idefics3_tile_multiple_size(arr.shape[0], arr.shape[1], t))
        height, width = arr.shape[:2]
        if height > t or width > t:
            rows, cols = (height - t) // t + 1, (width - t) // t + 1
            tiles = [arr[r * t:(r + 1) * t, c * t:(c + 1) * t] for r in range(rows) for c in range(cols)]
            tiles.append(resize(arr, t, t))
        else:
            tiles = [arr]
    else:
        tiles = [resize(arr, t, t)]
    out = []
    for tile in tiles:
        x: np.ndarray = np.ascontiguousarray(np.moveaxis(tile, -1, 0))  # [3, H, W] uint8
        if cfg.do_rescale:
            x = (x.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
        if cfg.do_normalize:
            if not np.issubdtype(x.dtype, np.floating):
                x = x.astype(np.float32)
            x = (x - np.asarray(cfg.image_mean, dtype=x.dtype)[:, None, None]) / \
                np.asarray(cfg.image_std, dtype=x.dtype)[:, None, None]
        out.append(np.ascontiguousarray(x, dtype=np.float32))
    return out, rows, cols
