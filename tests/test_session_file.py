"""The session file container: round trips, the documented layout, every kind of damage, atomic saves."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
from pathlib import Path

import numpy as np
import pytest

from minfer.errors import BadRequestError, FormatError, MinferError
from minfer.runtime import session_file as sf
from minfer.runtime.session_file import FORMAT_VERSION, SessionData, load_session, save_session


def _data(**changes) -> SessionData:
    rng = np.random.default_rng(7)
    fields = dict(
        model_fingerprint="smollm2-135m-instruct:sha256:0123abcd",
        cache_type="q8_0",
        n_ctx=2048,
        tokens=[1, 9690, 198, 2, 0, 2**31 - 1],
        sampler_state={"seed": 42, "rng": [1, 2, 3], "temperature": 0.7, "logit_bias": {"13": float("-inf")}},
        meta={
            "system": "Tu es un assistant. 你好 🙂",
            "messages": [{"role": "user", "content": 'naïve café — ünïcödé \u2028 "quoted" \\ back'}],
            "params": {"top_k": 40, "stop": ["\n\n"], "none": None, "flag": True},
        },
        arrays={
            "k.0": rng.standard_normal((5, 192)).astype(np.float32),
            "v.0": rng.standard_normal((5, 192)).astype(np.float16),
            "k.1": rng.integers(0, 256, (5, 204), dtype=np.uint8),
            "v.1": np.zeros((0, 204), np.uint8),  # empty: no positions used
            "scalar": np.array(3.5, np.float32),
            "odd": rng.standard_normal(7).astype(np.float16),  # 14 bytes: the next array needs padding
            "after_odd": np.arange(3, dtype=np.float32),
        },
    )
    fields.update(changes)
    return SessionData(**fields)


def _assert_same(a: SessionData, b: SessionData) -> None:
    assert (a.model_fingerprint, a.cache_type, a.n_ctx, a.tokens) == (
        b.model_fingerprint,
        b.cache_type,
        b.n_ctx,
        b.tokens,
    )
    assert json.dumps(a.sampler_state) == json.dumps(b.sampler_state)  # -inf compares through its JSON
    assert a.meta == b.meta
    assert list(a.arrays) == list(b.arrays)
    for name, x in a.arrays.items():
        y = b.arrays[name]
        assert y.dtype == x.dtype.newbyteorder("=") and y.shape == x.shape, name
        np.testing.assert_array_equal(y, x)


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, SessionData]:
    path = tmp_path / "chat.session"
    data = _data()
    save_session(path, data)
    return path, data


# ---------------------------------------------------------------------------------------------------------
# round trips and the layout


def test_round_trip(saved):
    path, data = saved
    loaded = load_session(path, expect_fingerprint=data.model_fingerprint, expect_cache_type="q8_0")
    _assert_same(data, loaded)
    assert isinstance(loaded.tokens, list) and all(type(t) is int for t in loaded.tokens)


def test_arrays_are_independent_and_writable(saved):
    path, _ = saved
    loaded = load_session(path)
    k0, v0 = loaded.arrays["k.0"], loaded.arrays["v.0"]
    assert all(a.flags.writeable and a.flags.c_contiguous for a in loaded.arrays.values())
    before = v0.copy()
    k0[:] = 0
    np.testing.assert_array_equal(v0, before)
    assert not np.shares_memory(k0, v0)
    assert load_session(path).arrays["k.0"].any()  # the file is not mapped: writing changed nothing there


def test_round_trip_minimal_and_odd_layouts(tmp_path):
    path = tmp_path / "s"
    empty = SessionData("", "f32", 1, [], {}, {}, {})
    save_session(path, empty)
    _assert_same(empty, load_session(path))
    # a non-contiguous view and a big-endian array are stored as their values (C order, little-endian)
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    odd = _data(arrays={"t": base.T, "step": base[:, ::2], "be": base.astype(">f4"), "be16": base.astype(">f2")})
    save_session(path, odd)
    _assert_same(odd, load_session(path))
    # tokens may come as a tuple or numpy integers
    save_session(path, _data(tokens=np.array([5, 6], np.int32), arrays={}))
    assert load_session(path).tokens == [5, 6]


def test_layout_is_as_documented(saved):
    path, data = saved
    raw = path.read_bytes()
    assert raw[:10] == b"MINFERSESS"
    assert struct.unpack_from("<I", raw, 10) == (FORMAT_VERSION,)
    assert raw[14:46] == hashlib.sha256(raw[46:]).digest()
    header_len, data_len = struct.unpack_from("<QQ", raw, 46)
    header = json.loads(raw[62 : 62 + header_len])
    start = -(-(62 + header_len) // 64) * 64
    assert raw[62 + header_len : start] == bytes(start - 62 - header_len)
    assert len(raw) == start + data_len and data_len % 64 == 0
    assert [e["name"] for e in header["arrays"]] == list(data.arrays)
    assert header["tokens"] == data.tokens and header["cache_type"] == "q8_0" and header["n_ctx"] == 2048
    for e in header["arrays"]:
        a = data.arrays[e["name"]]
        assert e["offset"] % 64 == 0 and e["nbytes"] == a.nbytes and e["shape"] == list(a.shape)
        assert (
            raw[start + e["offset"] : start + e["offset"] + e["nbytes"]]
            == a.astype(a.dtype.newbyteorder("<")).tobytes()
        )


# ---------------------------------------------------------------------------------------------------------
# damage: every kind is a FormatError naming the file, never partial data


def _load_fails(path: Path, match: str) -> FormatError:
    with pytest.raises(FormatError, match=match) as e:
        load_session(path)
    assert str(path) in str(e.value)
    return e.value


@pytest.mark.parametrize(
    "where",
    ["checksum", "lengths", "header_start", "header_middle", "header_end", "padding", "payload_first", "payload_last"],
)
def test_flipped_byte_is_caught(saved, where):
    path, _ = saved
    raw = bytearray(path.read_bytes())
    header_len = struct.unpack_from("<Q", raw, 46)[0]
    offset = {
        "checksum": 20,
        "lengths": 50,  # a high byte of the header length: announces a longer file
        "header_start": 62,
        "header_middle": 62 + header_len // 2,
        "header_end": 62 + header_len - 1,
        "padding": 62 + header_len,
        "payload_first": -(-(62 + header_len) // 64) * 64,
        "payload_last": len(raw) - 1 - 64,  # inside the last array or the padding before it
    }[where]
    raw[offset] ^= 0x10
    path.write_bytes(bytes(raw))
    _load_fails(path, "corrupted|truncated or damaged")


def test_every_single_bit_flip_is_caught(tmp_path):
    path = tmp_path / "small"
    save_session(path, _data(arrays={"k": np.arange(8, dtype=np.float16)}, meta={"m": "é"}))
    raw = path.read_bytes()
    for i in range(len(raw)):  # magic, version, checksum, lengths, header, padding, data
        damaged = bytearray(raw)
        damaged[i] ^= 0x01 << (i % 8)
        path.write_bytes(bytes(damaged))
        with pytest.raises(FormatError):
            load_session(path)


def test_truncation_at_any_point(saved):
    path, _ = saved
    raw = path.read_bytes()
    header_len = struct.unpack_from("<Q", raw, 46)[0]
    for n in sorted({0, 3, 10, 12, 14, 30, 46, 50, 61, 62, 62 + header_len // 2, 62 + header_len, len(raw) - 1}):
        path.write_bytes(raw[:n])
        e = _load_fails(path, "truncated|not a minfer session")
        assert ("not a minfer session" in str(e)) == (n == 0)


def test_trailing_bytes(saved):
    path, _ = saved
    path.write_bytes(path.read_bytes() + b"\0")
    _load_fails(path, "1 unexpected bytes")


def test_wrong_magic(saved, tmp_path):
    path, _ = saved
    raw = path.read_bytes()
    path.write_bytes(b"MINFERSESX" + raw[10:])
    _load_fails(path, "not a minfer session file")
    other = tmp_path / "model.gguf"
    other.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(100))
    _load_fails(other, "not a minfer session file")


def test_future_and_unknown_versions(saved):
    path, _ = saved
    raw = path.read_bytes()
    path.write_bytes(raw[:10] + struct.pack("<I", 2) + raw[14:])
    e = _load_fails(path, "format version 2, written by a newer minfer")
    assert f"reads format version {FORMAT_VERSION}" in str(e)
    path.write_bytes(raw[:10] + struct.pack("<I", 0) + raw[14:])
    _load_fails(path, "unknown format version 0")


def _write_raw(path: Path, header: object, data: bytes = b"") -> None:
    """A file with a correct checksum around an arbitrary header: only the structure checks can object."""
    h = json.dumps(header).encode()
    pad = bytes(-(-(62 + len(h)) // 64) * 64 - 62 - len(h))
    body = struct.pack("<QQ", len(h), len(data)) + h + pad + data
    path.write_bytes(b"MINFERSESS" + struct.pack("<I", 1) + hashlib.sha256(body).digest() + body)


def _good_header() -> dict:
    return {
        "model_fingerprint": "m",
        "cache_type": "f16",
        "n_ctx": 8,
        "tokens": [1],
        "sampler_state": {},
        "meta": {},
        "arrays": [{"name": "k", "dtype": "float16", "shape": [2, 2], "offset": 0, "nbytes": 8}],
    }


def _broken(change):
    h = _good_header()
    change(h)
    return h


@pytest.mark.parametrize(
    ("header", "match"),
    [
        ([1, 2], "not a JSON object"),
        (_broken(lambda h: h.pop("tokens")), "missing tokens"),
        (_broken(lambda h: h.update(model_fingerprint=3)), "model_fingerprint is not a string"),
        (_broken(lambda h: h.update(n_ctx=0)), "n_ctx"),
        (_broken(lambda h: h.update(n_ctx=True)), "n_ctx"),
        (_broken(lambda h: h.update(tokens=[1, "2"])), "tokens"),
        (_broken(lambda h: h.update(tokens=[2**31])), "tokens"),
        (_broken(lambda h: h.update(meta=[])), "meta is not an object"),
        (_broken(lambda h: h.update(arrays={})), "arrays is not a list"),
        (_broken(lambda h: h["arrays"][0].pop("nbytes")), "lacks one of"),
        (_broken(lambda h: h["arrays"][0].update(dtype="object")), "unsupported dtype"),
        (_broken(lambda h: h["arrays"][0].update(shape=[-1, 2])), "invalid shape"),
        (_broken(lambda h: h["arrays"][0].update(nbytes=9)), "do not hold shape"),
        (_broken(lambda h: h["arrays"][0].update(offset=64)), "leaves the data"),
        (_broken(lambda h: h["arrays"][0].update(offset=3)), "invalid offset"),
        (_broken(lambda h: h["arrays"].append(dict(h["arrays"][0]))), "repeated name"),
    ],
)
def test_malformed_header_with_valid_checksum(tmp_path, header, match):
    path = tmp_path / "crafted"
    _write_raw(path, _good_header(), bytes(64))
    assert load_session(path).arrays["k"].shape == (2, 2)  # the crafting helper itself is sound
    _write_raw(path, header, bytes(64))
    _load_fails(path, "malformed header: .*" + match)


def test_header_not_json(tmp_path):
    path = tmp_path / "crafted"
    body_header = b"{not json"
    pad = bytes(-(-(62 + len(body_header)) // 64) * 64 - 62 - len(body_header))
    body = struct.pack("<QQ", len(body_header), 0) + body_header + pad
    path.write_bytes(b"MINFERSESS" + struct.pack("<I", 1) + hashlib.sha256(body).digest() + body)
    _load_fails(path, "malformed header: not JSON")


def test_missing_file_and_directory(tmp_path):
    _load_fails(tmp_path / "nope", "does not exist")
    _load_fails(tmp_path, "is a directory")


# ---------------------------------------------------------------------------------------------------------
# identity


def test_identity_mismatches(saved):
    path, data = saved
    with pytest.raises(BadRequestError, match="saved with cache type q8_0, this model uses f16"):
        load_session(path, expect_cache_type="f16")
    with pytest.raises(BadRequestError, match=r"model fingerprint 'smollm2-135m-instruct:sha256:0123abcd'.*'qwen3'"):
        load_session(path, expect_fingerprint="qwen3", expect_cache_type="q8_0")
    _assert_same(data, load_session(path, expect_fingerprint=data.model_fingerprint))


def test_damage_is_reported_before_identity(saved):
    path, _ = saved
    raw = bytearray(path.read_bytes())
    raw[-70] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(FormatError, match="corrupted"):
        load_session(path, expect_cache_type="f16")


# ---------------------------------------------------------------------------------------------------------
# saving: atomic, never over a foreign file, refuses what it cannot store faithfully


def _siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir())


def test_failure_mid_write_keeps_the_old_file(saved, monkeypatch):
    path, data = saved
    before = path.read_bytes()
    real_write = sf._write

    def write_half_then_fail(f, header, arrays):
        real_write(f, header, arrays)
        f.truncate(f.tell() // 2)
        raise RuntimeError("disk pulled out")

    monkeypatch.setattr(sf, "_write", write_half_then_fail)
    with pytest.raises(RuntimeError, match="disk pulled out"):
        save_session(path, _data(tokens=[1, 2, 3]))
    assert path.read_bytes() == before
    assert _siblings(path) == [path.name]  # the temporary file is gone
    _assert_same(data, load_session(path))


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_os_failure_keeps_the_old_file(saved, monkeypatch, failing):
    path, _ = saved
    before = path.read_bytes()

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sf.os, failing, fail)
    with pytest.raises(MinferError, match=f"cannot save session to {path}: No space left on device"):
        save_session(path, _data(tokens=[4]))
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert _siblings(path) == [path.name]


def test_new_file_failure_leaves_nothing(tmp_path, monkeypatch):
    path = tmp_path / "new.session"
    monkeypatch.setattr(sf, "_write", lambda f, h, a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        save_session(path, _data())
    assert list(tmp_path.iterdir()) == []


def test_refuses_to_overwrite_a_foreign_file(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("my precious notes")
    with pytest.raises(BadRequestError, match="refusing to overwrite .*notes.txt.*not a minfer session"):
        save_session(path, _data())
    assert path.read_text() == "my precious notes"
    assert _siblings(path) == ["notes.txt"]
    with pytest.raises(BadRequestError, match="is a directory"):
        save_session(tmp_path, _data())


def test_overwrites_sessions_and_empty_files_keeping_the_mode(saved, tmp_path):
    path, _ = saved
    os.chmod(path, 0o640)
    new = _data(tokens=[7, 8, 9], cache_type="f16")
    save_session(path, new)
    _assert_same(new, load_session(path))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
    empty = tmp_path / "empty"
    empty.touch()
    save_session(empty, new)
    _assert_same(new, load_session(empty))


def test_save_through_a_symlink_updates_its_target(saved, tmp_path):
    path, _ = saved
    link = tmp_path / "link.session"
    link.symlink_to(path)
    new = _data(tokens=[11])
    save_session(link, new)
    assert link.is_symlink()
    assert load_session(path).tokens == [11]


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        (dict(meta={1: "int key"}), "non-string key 1"),
        (dict(sampler_state={"state": np.zeros(3)}), "holds a ndarray"),
        (dict(meta={"x": {1, 2}}), r"meta\['x'\] holds a set"),
        (dict(arrays={"k": np.zeros(3, np.int64)}), "dtype int64; supported: float32, float16, uint8"),
        (dict(arrays={"": np.zeros(3, np.float32)}), "non-empty strings"),
        (dict(arrays={"k": [1.0, 2.0]}), "must be a numpy array"),
        (dict(tokens=[1, 2**31]), "int32"),
        (dict(tokens=[1.0]), "int32"),
        (dict(tokens="abc"), "list of int32"),
        (dict(n_ctx=0), "n_ctx"),
        (dict(cache_type=None), "cache_type must be a string"),
    ],
)
def test_refuses_data_it_cannot_store_faithfully(tmp_path, changes, match):
    path = tmp_path / "s"
    with pytest.raises(BadRequestError, match=match):
        save_session(path, _data(**changes))
    assert not path.exists() and list(tmp_path.iterdir()) == []


def test_tuples_come_back_as_lists(tmp_path):
    path = tmp_path / "s"
    save_session(path, _data(meta={"pair": (1, "a")}))
    assert load_session(path).meta == {"pair": [1, "a"]}
