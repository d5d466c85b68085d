"""One interface, ``TensorSource``, between the model and a checkpoint's format: a GGUF file and an HF folder
each implement all of it, and the model built from either reads the same tensors under the same names."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import fixture_dir

from minfer.models.gguf_source import GGUFSource
from minfer.models.hf_checkpoint import HFCheckpoint
from minfer.models.model import TransformerModel
from minfer.models.tensor_source import TensorSource, open_tensor_source


def protocol_members() -> set[str]:
    """The interface's methods, properties and declared attributes."""
    return {name for name in vars(TensorSource) if not name.startswith("_")} | set(TensorSource.__annotations__)


@pytest.mark.parametrize("source", [GGUFSource, HFCheckpoint])
def test_each_format_implements_every_member_of_the_interface(source):
    members = protocol_members()
    assert {"tensors", "hparams", "load_tokenizer", "describe_tensor", "field_name"} <= members
    fields = set(getattr(source, "__dataclass_fields__", {})) | set(getattr(source, "__annotations__", {}))
    missing = sorted(m for m in members if not hasattr(source, m) and m not in fields)
    assert missing == [], f"{source.__name__} lacks {missing}"


def test_a_gguf_file_and_its_hf_folder_give_one_model_through_the_interface():
    gguf = TransformerModel(open_tensor_source(fixture_dir("llama") / "model-f32.gguf"))
    hf = TransformerModel(open_tensor_source(fixture_dir("llama") / "hf"))
    assert isinstance(gguf.source, GGUFSource) and isinstance(hf.source, HFCheckpoint)
    assert sorted(gguf.tensors) == sorted(hf.tensors)
    assert gguf.hparams.n_layer == hf.hparams.n_layer and gguf.hparams.n_vocab == hf.hparams.n_vocab
    # each names things in its own format
    assert gguf.source.field_name("n_layer") == "block_count" and hf.source.field_name("n_layer") == "num_hidden_layers"
    assert gguf.source.stored_name("blk.0.attn_q.weight") == "blk.0.attn_q.weight"
    assert hf.source.stored_name("blk.0.attn_q.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert gguf.format_name.startswith("GGUF v") and hf.format_name.startswith("HF safetensors folder")
    # an unpermuted HF weight pairs dimensions NEOX-style; the GGUF file keeps the architecture's layout
    assert gguf.rope_style is gguf.arch.rope_style and hf.rope_style.value == "neox"
    a, b = gguf.tensor("blk.0.ffn_down.weight"), hf.tensor("blk.0.ffn_down.weight")
    assert a.shape == b.shape
    np.testing.assert_array_equal(np.frombuffer(a.data, np.float32), np.frombuffer(b.data, np.float32))
    assert gguf.load_tokenizer().encode("hello world") == hf.load_tokenizer().encode("hello world")
