"""Session files edited and validly re-signed (the checksum matches): each one a clean one-line
MinferError at ``Conversation.load``, or a conversation that loads and takes the next turn.

The corpus: every field deleted, every field replaced by a value of each wrong type (null, a string, a
list, a huge integer, NaN, an object), ``messages`` as a string, bad roles, lone surrogates, tokens outside
the vocabulary, array entries bent, KV cells set to NaN. Then hypothesis picks fields and values itself.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any

import numpy as np
import pytest
from fuzz_support import Tally
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_conversation import chat_template_model

from minfer.runtime.conversation import Conversation
from minfer.runtime.session_file import MAGIC

_HEADER_AT = 62


def split(blob: bytes) -> tuple[dict[str, Any], bytes]:
    header_len, _ = struct.unpack_from("<QQ", blob, 46)
    header = json.loads(blob[_HEADER_AT:_HEADER_AT + header_len])
    data_at = -(-(_HEADER_AT + header_len) // 64) * 64
    return header, blob[data_at:]


def sign(header: dict[str, Any], data: bytes) -> bytes:
    """A session file of ``header`` and ``data`` with correct lengths and checksum."""
    raw = json.dumps(header, ensure_ascii=True, separators=(",", ":"), allow_nan=True).encode()
    pad = b"\0" * ((-(_HEADER_AT + len(raw))) % 64)
    hashed = struct.pack("<QQ", len(raw), len(data)) + raw + pad + data
    return MAGIC + struct.pack("<I", 1) + hashlib.sha256(hashed).digest() + hashed


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return chat_template_model(tmp_path_factory.mktemp("m"), threads=1)


@pytest.fixture(scope="module")
def original(model, tmp_path_factory):
    conv = Conversation(model, system="be brief", seed=3, temperature=0.7)
    conv.send("hello", max_tokens=3)
    path = tmp_path_factory.mktemp("s") / "chat.session"
    conv.save(path)
    return path.read_bytes()


@pytest.fixture(scope="module")
def tally(request):
    t = Tally("session")
    yield t
    t.report(request.config)


def resume(model, path) -> None:
    conv = Conversation.load(model, path)
    conv.send("and then?", max_tokens=2)


WRONG_VALUES: list[Any] = [None, "text", [1, "x"], 2**70, float("nan"), {"a": 1}, -1, True]


def _paths(header: dict[str, Any]) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = [(k,) for k in header]
    out += [("meta", k) for k in header["meta"]] + [("sampler_state", "rng", k) for k in header["sampler_state"]["rng"]]
    out += [("meta", "sampling", k) for k in header["meta"]["sampling"]]
    out += [("arrays", "0", k) for k in header["arrays"][0]] + [("meta", "messages", "1", "content"),
                                                                 ("meta", "messages", "1", "role")]
    return out


def _edit(header: dict[str, Any], path: tuple[str, ...], value: Any, delete: bool = False) -> dict[str, Any]:
    h = json.loads(json.dumps(header))
    node = h
    for part in path[:-1]:
        node = node[int(part)] if isinstance(node, list) else node[part]
    key: Any = int(path[-1]) if isinstance(node, list) else path[-1]
    if delete:
        del node[key]
    else:
        node[key] = value
    return h


def test_corpus_of_re_signed_edits(model, original, tally, tmp_path):
    header, data = split(original)
    path = tmp_path / "edited.session"

    def attempt(kind: str, case: str, h: dict[str, Any], d: bytes = data) -> None:
        path.write_bytes(sign(h, d))
        tally.run(kind, case, lambda: resume(model, path))

    for p in _paths(header):
        attempt("deleted_field", ".".join(p), _edit(header, p, None, delete=True))
        for v in WRONG_VALUES:
            kind = "nan_values" if isinstance(v, float) else "huge_ints" if v == 2**70 else "wrong_types"
            attempt(kind, f"{'.'.join(p)}={v!r}", _edit(header, p, v))
    attempt("wrong_types", "messages as a string", _edit(header, ("meta", "messages"), "hello"))
    content = ("meta", "messages", "1", "content")
    attempt("surrogates", "content with a lone surrogate", _edit(header, content, "\ud800"))
    attempt("surrogates", "system with a lone surrogate", _edit(header, ("meta", "system"), "a\udc00"))
    attempt("bad_values", "token outside the vocabulary", _edit(header, ("tokens", "0"), 10**6))
    attempt("bad_values", "unknown sampling field", _edit(header, ("meta", "sampling", "warp"), 9))
    attempt("bad_values", "sampling out of range", _edit(header, ("meta", "sampling", "temperature"), -3))
    generator = ("sampler_state", "rng", "bit_generator")
    attempt("bad_values", "rng of another generator", _edit(header, generator, "MT19937"))
    attempt("bad_values", "rng state huge", _edit(header, ("sampler_state", "rng", "state", "state"), 2**200))
    cells = np.frombuffer(data, dtype=np.float32).copy()
    cells[: 64] = np.nan
    attempt("nan_values", "KV cells NaN", header, cells.tobytes())
    attempt("truncation", "data cut short", header, data[: len(data) // 2])
    tally.assert_clean()


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**80), 2**80) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=120, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck),
          database=None)
@given(st.data())
def test_property_any_field_any_value(model, original, tally, tmp_path_factory, data):
    header, blob = split(original)
    p = data.draw(st.sampled_from(_paths(header)), label="field")
    delete = data.draw(st.booleans(), label="delete")
    value = None if delete else data.draw(JSON_VALUES, label="value")
    path = tmp_path_factory.mktemp("p") / "x.session"
    path.write_bytes(sign(_edit(header, p, value, delete=delete), blob))
    tally.run("hypothesis_fields", f"{'.'.join(p)} {'deleted' if delete else repr(value)[:60]}",
              lambda: resume(model, path))
    tally.assert_clean()
