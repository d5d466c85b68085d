"""Writing GGUF files one tensor at a time, atomically: the shared writer of the synthetic-model and fixture scripts.

``gguf.GGUFWriter.add_tensor`` holds every tensor until the file is written (a 1.7B model would need its whole
size in memory); :func:`write_streamed` declares the tensors first (name, shape, type) and then asks ``make``
for each one's data in order, so only one tensor is alive at a time. The file is written under a temporary
name in the target's folder and renamed over it when complete, so the target is never a partial file.

Used by ``minfer.testing.synthetic_model``, ``bench/moe_synthetic.py`` and ``scripts/make_iq4_fixture.py``;
``scripts/requantize_gguf.py`` shares :func:`copy_fields`. Needs only numpy and ``gguf`` (no minfer), so the
reference environment can run it.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter


@dataclass(frozen=True)
class PlannedTensor:
    """A tensor to write: its name, its shape in numpy order (``[out, in]`` for a matrix) and its block type."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType

    @property
    def n_values(self) -> int:
        return int(np.prod(self.shape))

    @property
    def nbytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.ggml_type]
        if self.shape[-1] % block:
            raise ValueError(f"{self.name}: rows of {self.shape[-1]} are not whole {self.ggml_type.name} blocks")
        return self.n_values // block * size


def tensor_bytes(t: PlannedTensor, data: np.ndarray) -> np.ndarray:
    """``data`` (the tensor's values as float16/float32, or its raw blocks as uint8) checked against the plan."""
    if data.nbytes != t.nbytes:
        raise ValueError(f"{t.name}: {data.nbytes} bytes of data for a {t.ggml_type.name} tensor of {t.nbytes}")
    return np.ascontiguousarray(data)


def write_streamed(path: str | os.PathLike[str], arch: str, add_metadata: Callable[[GGUFWriter], None],
                   tensors: Sequence[PlannedTensor], make: Callable[[PlannedTensor], np.ndarray],
                   progress: Callable[[int, PlannedTensor], None] | None = None) -> None:
    """Write a GGUF file: ``add_metadata(writer)`` adds the key/values, then ``make(t)`` gives each tensor's data
    (float values or uint8 blocks of exactly ``t.nbytes``), called in order, one tensor alive at a time."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    try:
        w = GGUFWriter(tmp, arch)
        add_metadata(w)
        for t in tensors:
            # a placeholder dtype: with raw_dtype given, the shape is taken in values, not bytes
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.ggml_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for i, t in enumerate(tensors):
            w.write_tensor_data(tensor_bytes(t, make(t)))
            if progress is not None:
                progress(i, t)
        w.close()
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def copy_fields(reader: GGUFReader, writer: GGUFWriter, keep: Callable[[str], bool] = lambda name: True) -> None:
    """Copy the key/values of ``reader`` that ``keep`` accepts (never the header's or the architecture, which the
    writer writes itself)."""
    for field in reader.fields.values():
        name = field.name
        if name.startswith("GGUF.") or name == "general.architecture" or not keep(name):
            continue
        vtype = field.types[0]
        if vtype == GGUFValueType.ARRAY:
            sub = field.types[1]
            if sub == GGUFValueType.STRING:
                value = [bytes(field.parts[i]).decode("utf-8", "surrogateescape") for i in field.data]
            else:
                value = [field.parts[i].tolist()[0] for i in field.data]
            writer.add_array(name, value)
        elif vtype == GGUFValueType.STRING:
            writer.add_string(name, bytes(field.parts[field.data[0]]).decode("utf-8"))
        else:
            writer.add_key_value(name, field.parts[field.data[0]].tolist()[0], vtype)


def tokenizer_vocab_size(reader: GGUFReader) -> int:
    return len(reader.fields["tokenizer.ggml.tokens"].data)


def hf_tokenizer_fields(tokenizer_json: Path) -> dict[str, Any]:
    """The ``tokenizer.ggml.*`` contents (gpt2 BPE) of a byte-level BPE ``tokenizer.json``."""
    tj = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    vocab: dict[str, int] = dict(tj["model"]["vocab"])
    special: set[int] = set()
    for added in tj["added_tokens"]:
        vocab[added["content"]] = added["id"]
        if added["special"]:
            special.add(added["id"])
    by_id = sorted(vocab.items(), key=lambda kv: kv[1])
    if [i for _, i in by_id] != list(range(len(by_id))):
        raise ValueError("tokenizer ids are not contiguous")
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    return {
        "tokens": [tok for tok, _ in by_id],
        "token_types": [3 if i in special else 1 for _, i in by_id],  # CONTROL / NORMAL
        "merges": merges,
    }


def add_hf_tokenizer(w: GGUFWriter, tokenizer_json: Path, bos: int = 0, eos: int = 1,
                     add_bos: bool | None = None) -> int:
    """Add a gpt2-BPE tokenizer read from ``tokenizer.json``; returns the vocabulary size."""
    tok = hf_tokenizer_fields(tokenizer_json)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["token_types"])
    w.add_token_merges(tok["merges"])
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    return len(tok["tokens"])
