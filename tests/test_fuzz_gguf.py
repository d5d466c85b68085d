"""Mutated GGUF files: each one a clean one-line MinferError, or a model that loads and gives finite logits.

The probe's kinds of mutation, seeded: numeric metadata set to NaN, infinities, zero, negatives and huge
counts (``block_count`` 16,777,216 included); keys the fixtures lack added with bad values
(``rope.dimension_count`` 0); a BPE merge naming a token the vocabulary lacks; length and count fields of
the header set huge; truncations; bit flips in the header. Then hypothesis: random header bytes, and
random overwrites of the fixture's header. Figures: ``pytest tests/test_fuzz_gguf.py -s`` or the cache.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from conftest import fixture_dir
from fuzz_support import SEED, Tally, gguf_fields, numeric_mutations, patched, rewrite_gguf, scalar_offsets
from gguf import GGUFReader, GGUFValueType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minfer
from minfer.formats.gguf_file import GGUFFile

FIXTURES = ("qwen2", "llama", "gemma3")


def load_and_run(path: Path) -> str:
    model = minfer.load(path, n_ctx=32, threads=1, kernels="reference")
    ids = model.tokenize("Hello, world")[:8] or [0]
    logits = model.logits(ids)
    return "ok" if np.isfinite(logits).all() else "nan"


@pytest.fixture(scope="module")
def tally(request):
    t = Tally("gguf")
    yield t
    t.report(request.config)


def _kind(name: str) -> str:
    if name in ("nan", "inf", "-inf"):
        return "nan_values"
    return "huge_counts" if name in ("2^24", "max") else "bad_values"


def test_numeric_metadata_nan_inf_zero_negative_huge(tally, tmp_path):
    dst = tmp_path / "mutant.gguf"
    for family in FIXTURES:
        src = fixture_dir(family) / "model-f32.gguf"
        data = src.read_bytes()
        for key, (offset, dtype, vtype) in scalar_offsets(src).items():
            for name, value in numeric_mutations(vtype):
                dst.write_bytes(patched(data, offset, dtype, value))
                tally.run(_kind(name), f"{family} {key}={value}", lambda: load_and_run(dst))
    # keys the fixtures lack, added with bad values (rewritten files: slower, so only these)
    src = fixture_dir("qwen2") / "model-f32.gguf"
    for key, vtype in [("qwen2.rope.dimension_count", GGUFValueType.INT32),
                       ("qwen2.rope.scaling.factor", GGUFValueType.FLOAT32),
                       ("qwen2.attention.key_length", GGUFValueType.INT32)]:
        for name, value in numeric_mutations(vtype):
            if name in ("tiny", "huge", "2^24"):
                continue
            rewrite_gguf(src, dst, {key: (value, vtype, None)})
            tally.run(_kind(name), f"qwen2 +{key}={value}", lambda: load_and_run(dst))
    tally.assert_clean()


def test_merge_naming_a_missing_token_and_bad_vocab(tally, tmp_path):
    src = fixture_dir("qwen2") / "model-f32.gguf"
    fields = gguf_fields(src)
    merges, vtype, sub = fields["tokenizer.ggml.merges"]
    tokens = fields["tokenizer.ggml.tokens"][0]
    cases = {
        "merge of missing tokens": {"tokenizer.ggml.merges": ([*merges, "qzx\u00e9 zzq"], vtype, sub)},
        "merge of one part": {"tokenizer.ggml.merges": ([*merges, "abc"], vtype, sub)},
        "one-token vocabulary": {"tokenizer.ggml.tokens": (["a"], GGUFValueType.ARRAY, GGUFValueType.STRING)},
        "duplicate tokens": {"tokenizer.ggml.tokens": ([tokens[0]] * len(tokens), GGUFValueType.ARRAY,
                                                       GGUFValueType.STRING)},
        "bos beyond the vocabulary": {"tokenizer.ggml.bos_token_id": (10**6, GGUFValueType.UINT32, None)},
        "chat template of bad jinja": {"tokenizer.chat_template": ("{% for %}", GGUFValueType.STRING, None)},
        "architecture unknown": {"general.architecture": ("nosuch", GGUFValueType.STRING, None)},
        "block_count as a string": {"qwen2.block_count": ("three", GGUFValueType.STRING, None)},
        "freq_base as an array": {"qwen2.rope.freq_base": ([1.0, 2.0], GGUFValueType.ARRAY, GGUFValueType.FLOAT32)},
    }
    for name, override in cases.items():
        dst = tmp_path / "case.gguf"
        rewrite_gguf(src, dst, override)
        tally.run("vocab_and_types", name, lambda dst=dst: load_and_run(dst))
    for key in ("qwen2.block_count", "tokenizer.ggml.tokens", "qwen2.attention.layer_norm_rms_epsilon"):
        dst = tmp_path / "case.gguf"
        rewrite_gguf(src, dst, {}, drop=frozenset({key}))
        tally.run("vocab_and_types", f"without {key}", lambda dst=dst: load_and_run(dst))
    tally.assert_clean()


def _length_offsets(path: Path) -> list[tuple[int, int]]:
    """(offset, width) of every count and length in the header: tensor and key counts, key and string
    lengths, array lengths, tensor dimension counts and dimensions."""
    r = GGUFReader(path)
    base = r.data.ctypes.data
    out = []
    fields = list(r.fields.values()) + [t.field for t in r.tensors]
    for f in fields:
        for part in f.parts:
            if part.dtype in (np.uint64, np.uint32) and part.size == 1:
                out.append((part.ctypes.data - base, part.dtype.itemsize))
    return out


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_huge_counts_truncation_and_flips(tally, tmp_path, family):
    src = fixture_dir(family) / "model-f32.gguf"
    data = src.read_bytes()
    header_end = GGUFReader(src).data_offset
    rng = random.Random(SEED + len(family))
    dst = tmp_path / "mutant.gguf"

    def attempt(blob: bytes, kind: str, case: str) -> None:
        dst.write_bytes(blob)
        tally.run(kind, f"{family} {case}", lambda: load_and_run(dst))

    offsets = _length_offsets(src)
    for off, width in rng.sample(offsets, min(40, len(offsets))):
        for value in ((1 << (8 * width)) - 1, 1 << (8 * width - 2)):
            blob = bytearray(data)
            blob[off:off + width] = value.to_bytes(width, "little")
            attempt(bytes(blob), "huge_counts", f"@{off}={value}")
    for cut in sorted(rng.sample(range(1, len(data)), 30)) + [4, 8, 16, 24, header_end - 1, header_end]:
        attempt(data[:cut], "truncation", f"[:{cut}]")
    for case in range(120):
        blob = bytearray(data)
        for _ in range(rng.choice((1, 1, 2, 4))):
            off = rng.randrange(0, header_end)
            blob[off] ^= 1 << rng.randrange(8)
        attempt(bytes(blob), "flips", f"seeded flip #{case}")
    tally.assert_clean()


HEADER = fixture_dir("qwen2") / "model-f32.gguf"


@settings(max_examples=150, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck),
          database=None)
@given(st.binary(min_size=0, max_size=64))
def test_property_random_bytes_after_the_magic(tally, tmp_path_factory, tail):
    path = tmp_path_factory.mktemp("h") / "x.gguf"
    path.write_bytes(b"GGUF" + tail)
    tally.run("hypothesis_header_bytes", repr(tail[:32]), lambda: GGUFFile(path))
    tally.assert_clean()


@settings(max_examples=150, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck),
          database=None)
@given(st.lists(st.tuples(st.integers(0, 21951), st.integers(0, 255)), min_size=1, max_size=6))
def test_property_overwrites_of_a_real_header(tally, tmp_path_factory, edits):
    data = bytearray(HEADER.read_bytes())
    for off, byte in edits:
        data[off] = byte
    path = tmp_path_factory.mktemp("h") / "x.gguf"
    path.write_bytes(bytes(data))
    tally.run("hypothesis_header_overwrites", repr(edits), lambda: load_and_run(path))
    tally.assert_clean()
