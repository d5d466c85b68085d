"""The GGUF reader: parity with the gguf package's GGUFReader, memory mapping, clear errors."""

from __future__ import annotations

import os
import shutil

import gguf
import numpy as np
import pytest
from conftest import ARCHS, fixture_dir

from minfer.errors import FormatError, ModelError
from minfer.formats.gguf_file import GGUFFile
from minfer.models.model import TransformerModel


def assert_same_as_gguf_reader(path):
    ours = GGUFFile(path)
    ref = gguf.GGUFReader(path)
    ref_meta = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata.keys() == ref_meta.keys()
    for k, v in ref_meta.items():
        assert ours.metadata[k] == v, k
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert mine.ggml_type == t.tensor_type
        assert mine.shape == tuple(int(x) for x in reversed(t.shape.tolist()))
        assert np.array_equal(mine.data.reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("variant", ["model-f32.gguf", "model-q8_0.gguf"])
def test_reader_matches_gguf_package(arch, variant):
    assert_same_as_gguf_reader(fixture_dir(arch) / variant)


@pytest.mark.slow
def test_reader_matches_gguf_package_on_smollm2(smollm2_path):
    assert_same_as_gguf_reader(smollm2_path)


def test_tensors_are_memory_mapped_not_copied():
    f = GGUFFile(fixture_dir("llama") / "model-f32.gguf")
    t = f.tensor("blk.0.attn_q.weight")
    assert not t.data.flags.writeable and not t.data.flags.owndata


def _mapped_kib(path) -> int:
    """This process's resident KiB of its mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and ":" not in head[0]:
                inside = head[-1] == str(path)
            elif inside and head[0] == "Rss:":
                total += int(head[1])
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux's /proc/self/smaps")
def test_rows_read_from_the_file_equal_the_mapped_rows_and_map_no_page(tmp_path):
    """An embedding lookup's rows come through preadv, not the map: through the map, each scattered row
    makes the kernel's fault-around window (64 KiB) around it resident in the process."""
    from minfer.formats.tensors import ExpertTensors, tensor_rows

    rows, width = 4096, 1024  # 16 MiB of f32: 4 KiB per row
    table = np.random.default_rng(0).standard_normal((rows, width)).astype(np.float32)
    path = tmp_path / "big.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", table)
    w.add_tensor("stack", table.reshape(4, rows // 4, width))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t = GGUFFile(path).tensor("token_embd.weight")
    ids = np.arange(7, rows, 61)  # 67 rows, 244 KiB apart
    before = _mapped_kib(path)
    got = t.rows(ids)
    assert _mapped_kib(path) - before < 64  # nothing of the table became resident
    assert np.array_equal(got.view(np.float32), table[ids])
    sub = tensor_rows(t, 100, 200, "part")
    assert np.array_equal(sub.rows(np.array([0, 99])).view(np.float32), table[[100, 199]])
    expert = ExpertTensors.from_stacked(GGUFFile(path).tensor("stack")).experts[2]
    assert np.array_equal(expert.rows(np.array([5])).view(np.float32), table[[2 * rows // 4 + 5]])
    with pytest.raises(IndexError, match="outside 0..99"):
        sub.rows(np.array([100]))
    _ = t.data[ids].copy()  # the map's way: what the rows above did not do
    assert _mapped_kib(path) - before > 1024


def test_missing_file(tmp_path):
    with pytest.raises(FormatError, match="no such file"):
        GGUFFile(tmp_path / "nope.gguf")


def test_not_a_gguf_file(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_text("hello, I am not a model\n")
    with pytest.raises(FormatError, match="not a GGUF file"):
        GGUFFile(p)


@pytest.mark.parametrize("keep", [6, 100, 5000, 500_000])
def test_truncated_file(tmp_path, keep):
    src = fixture_dir("qwen2") / "model-f32.gguf"
    p = tmp_path / "cut.gguf"
    p.write_bytes(src.read_bytes()[:keep])
    with pytest.raises(FormatError, match="truncated"):
        GGUFFile(p)


def _write_gguf(path, arch="llama", drop=(), reshape=None, extra_kv=None):
    """A copy of the llama fixture with tensors dropped / reshaped or metadata changed."""
    src = GGUFFile(fixture_dir("llama") / "model-f32.gguf")
    w = gguf.GGUFWriter(str(path), arch)
    for k, v in src.metadata.items():
        if k in ("general.architecture",):
            continue
        key = k.replace("llama.", f"{arch}.", 1)
        if isinstance(v, bool):
            w.add_bool(key, v)
        elif isinstance(v, int):
            w.add_uint32(key, v)
        elif isinstance(v, float):
            w.add_float32(key, v)
        elif isinstance(v, str):
            w.add_string(key, v)
        elif isinstance(v, list):
            w.add_array(key, v)
    for k, v in (extra_kv or {}).items():
        w.add_uint32(k, v)
    for t in src:
        if t.name in drop:
            continue
        arr = t.data.view(np.float32).reshape(t.shape)
        if reshape and t.name == reshape:
            arr = arr[:-1]
        w.add_tensor(t.name, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_architecture(tmp_path):
    p = _write_gguf(tmp_path / "m.gguf", arch="mamba")
    with pytest.raises(ModelError,
                       match="unsupported architecture 'mamba'.*llama, olmo2, phi3, qwen2, qwen2moe, qwen3, qwen3moe"):
        TransformerModel.from_path(p)


def test_missing_tensor(tmp_path):
    p = _write_gguf(tmp_path / "m.gguf", drop={"blk.1.ffn_up.weight"})
    with pytest.raises(FormatError, match="missing tensor 'blk.1.ffn_up.weight'"):
        TransformerModel.from_path(p)


def test_wrong_tensor_shape(tmp_path):
    p = _write_gguf(tmp_path / "m.gguf", reshape="blk.0.attn_k.weight")
    with pytest.raises(ModelError, match=r"'blk.0.attn_k.weight' has shape \(31, 64\), expected \(32, 64\)"):
        TransformerModel.from_path(p)


def test_missing_metadata_key(tmp_path):
    src = fixture_dir("llama") / "model-f32.gguf"
    p = tmp_path / "m.gguf"
    shutil.copy(src, p)
    data = bytearray(p.read_bytes())
    key = b"llama.block_count"
    i = data.index(key)
    data[i : i + len(key)] = b"llama.blocks_cnt"[: len(key)].ljust(len(key), b"_")
    p.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="missing metadata key 'llama.block_count'"):
        TransformerModel.from_path(p)
