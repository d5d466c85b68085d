"""Image decoding and preprocessing for vision models (``minfer.formats.images``).

References: ``tests/fixtures/gemma3_vision`` (``scripts/make_vision_fixtures.py``): the pixel values of
transformers 5.24's ``Gemma3Processor`` (``Gemma3ImageProcessorPil``) for each test image.
"""

from __future__ import annotations

import io
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from minfer.errors import BadRequestError, FormatError
from minfer.formats.images import (
    SUPPORTED_FORMATS,
    ImageProcessorConfig,
    load_image,
    patches,
    preprocess,
)

FIXTURE = Path(__file__).parent / "fixtures" / "gemma3_vision"
IMAGES = FIXTURE / "images"
TOL = 1e-6


def _refs() -> dict[str, np.ndarray]:
    with np.load(IMAGES / "pixels_ref.npz") as z:
        return {n: z[n] for n in z.files}


REFS = _refs()


def _load(name: str) -> Image.Image:
    return load_image((IMAGES / name).read_bytes(), name)


def _png_bytes(width: int, height: int, mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (width, height), "red").save(buf, format="PNG")
    return buf.getvalue()


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims ``width`` x ``height`` but whose IDAT holds one tiny row: decoding it fails."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 4)
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", idat) + _png_chunk(b"IEND", b"")


def _safetensors(path: Path) -> dict[str, np.ndarray]:
    """The F32 tensors of a safetensors file (8-byte header length, JSON header, data)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__" or info["dtype"] != "F32":
            continue
        a, b = info["data_offsets"]
        out[name] = np.frombuffer(raw[8 + n + a : 8 + n + b], dtype="<f4").reshape(info["shape"])
    return out


def _assert_bad_request(exc: pytest.ExceptionInfo[BadRequestError], name: str, *words: str) -> None:
    msg = str(exc.value)
    assert name in msg and "\n" not in msg, msg
    for w in words:
        assert w.lower() in msg.lower(), msg


# ---------------------------------------------------------------------------------------------------
# pixels equal to the HF processor's
# ---------------------------------------------------------------------------------------------------


def test_fixture_has_varied_images() -> None:
    assert len(REFS) >= 10
    modes = {_load(n).mode for n in REFS}
    formats = {_load(n).format for n in REFS}
    assert {"RGB", "RGBA", "L", "P"} <= modes
    assert set(SUPPORTED_FORMATS) <= formats


def test_config_from_hf_folder() -> None:
    cfg = ImageProcessorConfig.from_hf_folder(FIXTURE / "hf")
    assert (cfg.height, cfg.width, cfg.resample) == (32, 32, 2)
    assert cfg.do_convert_rgb  # null in the file: the processor's default
    assert cfg.image_mean == (0.5, 0.5, 0.5) and cfg.image_std == (0.5, 0.5, 0.5)
    assert cfg.rescale_factor == pytest.approx(1 / 255)


def test_config_from_processor_config_only(tmp_path: Path) -> None:
    (tmp_path / "processor_config.json").write_bytes((FIXTURE / "hf" / "processor_config.json").read_bytes())
    assert ImageProcessorConfig.from_hf_folder(tmp_path) == ImageProcessorConfig.from_hf_folder(FIXTURE / "hf")


@pytest.mark.parametrize(
    "field, value",
    [
        ("size", {"shortest_edge": 224}),
        ("size", {"height": 0, "width": 32}),
        ("resample", 9),
        ("rescale_factor", "x"),
        ("image_mean", [0.5, 0.5]),
        ("image_std", [0.5, 0.0, 0.5]),
        ("do_resize", "yes"),
    ],
)
def test_config_bad_field(tmp_path: Path, field: str, value: object) -> None:
    raw = json.loads((FIXTURE / "hf" / "preprocessor_config.json").read_text(encoding="utf-8"))
    raw[field] = value
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(raw), encoding="utf-8")
    with pytest.raises(FormatError) as exc:
        ImageProcessorConfig.from_hf_folder(tmp_path)
    assert "preprocessor_config.json" in str(exc.value) and field in str(exc.value)


def test_config_missing(tmp_path: Path) -> None:
    with pytest.raises(FormatError):
        ImageProcessorConfig.from_hf_folder(tmp_path)


@pytest.mark.parametrize("name", sorted(REFS))
def test_preprocess_matches_hf(name: str) -> None:
    cfg = ImageProcessorConfig.from_hf_folder(FIXTURE / "hf")
    got = preprocess(_load(name), cfg)
    assert got.dtype == np.float32 and got.shape == REFS[name].shape == (3, 32, 32)
    assert float(np.abs(got - REFS[name]).max()) <= TOL


def test_preprocess_matches_prompt_pixel_values() -> None:
    cfg = ImageProcessorConfig.from_hf_folder(FIXTURE / "hf")
    for k in (0, 1):
        prompt = json.loads((FIXTURE / f"prompt_{k}.json").read_text(encoding="utf-8"))
        want = np.load(FIXTURE / f"pixel_values_{k}.npy")
        got = np.stack([preprocess(_load(n), cfg) for n in prompt["images"]])
        assert float(np.abs(got - want).max()) <= TOL


def test_transparency_composited_on_white() -> None:
    cfg = ImageProcessorConfig(height=2, width=2)
    img = Image.new("RGBA", (2, 2), (0, 0, 0, 0))
    assert np.all(preprocess(img, cfg) == 1.0)  # white, normalised with mean = std = 0.5


# ---------------------------------------------------------------------------------------------------
# patch layout
# ---------------------------------------------------------------------------------------------------


def _conv_numpy(pixels: np.ndarray, weight: np.ndarray, patch: int) -> np.ndarray:
    """Conv2d(stride = kernel = patch) without bias, then flatten(2).transpose: [n_patches, hidden]."""
    c, h, w = pixels.shape
    gh, gw = h // patch, w // patch
    out = np.zeros((weight.shape[0], gh, gw), dtype=np.float64)
    for i in range(gh):
        for j in range(gw):
            window = pixels[:, i * patch : (i + 1) * patch, j * patch : (j + 1) * patch].astype(np.float64)
            out[:, i, j] = np.einsum("ckl,hckl->h", window, weight.astype(np.float64))
    return out.reshape(weight.shape[0], gh * gw).T


def test_patches_equal_fixture_conv() -> None:
    w = _safetensors(FIXTURE / "hf" / "model.safetensors")["vision_tower.embeddings.patch_embedding.weight"]
    assert w.shape == (32, 3, 4, 4)
    pixels = np.load(FIXTURE / "pixel_values_1.npy")[1]
    rows = patches(pixels, 4)
    assert rows.shape == (64, 48) and rows.dtype == np.float32
    got = rows.astype(np.float64) @ w.reshape(32, -1).T.astype(np.float64)
    assert np.abs(got - _conv_numpy(pixels, w, 4)).max() < 1e-9


def test_patches_random_non_square() -> None:
    rng = np.random.default_rng(0)
    pixels = rng.standard_normal((3, 12, 20)).astype(np.float32)
    w = rng.standard_normal((5, 3, 4, 4)).astype(np.float32)
    got = patches(pixels, 4).astype(np.float64) @ w.reshape(5, -1).T.astype(np.float64)
    assert np.abs(got - _conv_numpy(pixels, w, 4)).max() < 1e-9
    with pytest.raises(ValueError):
        patches(pixels, 7)


# ---------------------------------------------------------------------------------------------------
# refused images
# ---------------------------------------------------------------------------------------------------


def test_empty_file() -> None:
    with pytest.raises(BadRequestError) as exc:
        load_image(b"", "empty.png")
    _assert_bad_request(exc, "empty.png", "empty")


def test_corrupt_bytes() -> None:
    data = bytes(np.random.default_rng(1).integers(0, 256, 500, dtype=np.uint8))
    with pytest.raises(BadRequestError) as exc:
        load_image(data, "noise.bin")
    _assert_bad_request(exc, "noise.bin", "not a recognizable image")


def test_text_file() -> None:
    with pytest.raises(BadRequestError) as exc:
        load_image(b"hello, this is not an image\n" * 10, "notes.txt")
    _assert_bad_request(exc, "notes.txt", "not a recognizable image")


def test_truncated_png() -> None:
    data = (IMAGES / "rgb_64x64.png").read_bytes()
    with pytest.raises(BadRequestError) as exc:
        load_image(data[: len(data) // 2], "half.png")
    _assert_bad_request(exc, "half.png", "truncated")


def test_corrupt_png_data() -> None:
    data = bytearray((IMAGES / "rgb_64x64.png").read_bytes())
    data[100:140] = b"\x00" * 40  # inside the IDAT stream
    with pytest.raises(BadRequestError) as exc:
        load_image(bytes(data), "bad.png")
    _assert_bad_request(exc, "bad.png")


def test_truncated_jpeg() -> None:
    data = (IMAGES / "photo_40x28.jpg").read_bytes()
    with pytest.raises(BadRequestError) as exc:
        load_image(data[: len(data) // 2], "half.jpg")
    _assert_bad_request(exc, "half.jpg")


def test_over_max_pixels_header_only() -> None:
    # no pixel data at all: decoding it would fail with another message, so the size check came first
    with pytest.raises(BadRequestError) as exc:
        load_image(_png_header_only(8000, 8000), "huge.png")
    _assert_bad_request(exc, "huge.png", "64000000", "limit")
    with pytest.raises(BadRequestError) as exc:  # control: the same file under the limit fails in decoding
        load_image(_png_header_only(30, 30), "small.png")
    _assert_bad_request(exc, "small.png", "truncated")


def test_decompression_bomb_header() -> None:
    with pytest.raises(BadRequestError) as exc:
        load_image(_png_header_only(100_000, 100_000), "bomb.png")
    _assert_bad_request(exc, "bomb.png", "limit")


def test_lowered_max_pixels() -> None:
    data = _png_bytes(20, 10)
    assert load_image(data, "ok.png", max_pixels=200).size == (20, 10)
    with pytest.raises(BadRequestError) as exc:
        load_image(data, "small.png", max_pixels=199)
    _assert_bad_request(exc, "small.png", "limit of 199")


@pytest.mark.parametrize("fmt, label", [("TIFF", "TIFF"), ("ICO", "ICO")])
def test_unsupported_format(fmt: str, label: str) -> None:
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), "blue").save(buf, format=fmt)
    with pytest.raises(BadRequestError) as exc:
        load_image(buf.getvalue(), f"pic.{fmt.lower()}")
    _assert_bad_request(exc, f"pic.{fmt.lower()}", f"{label} images are not supported")


def test_gif_first_frame() -> None:
    img = _load("anim_19x23.gif")
    assert img.format == "GIF" and getattr(img, "n_frames", 1) == 2 and img.tell() == 0


def test_exif_orientation_applied() -> None:
    img = Image.new("RGB", (6, 2), "green")
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise
    buf = io.BytesIO()
    img.save(buf, format="JPEG", exif=exif.tobytes())
    assert load_image(buf.getvalue(), "rot.jpg").size == (2, 6)
