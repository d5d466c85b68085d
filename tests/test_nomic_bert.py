"""nomic-bert (nomic-embed-text's recipe: rotary positions, SwiGLU, a fused q/k/v matrix, no biases): the folder
in nomic's own config fields as well as transformers', llama.cpp's GGUF layout, and one-line errors for the
variants the recipe does not compute. The parity of every position against transformers is in
``test_encoders.py`` (``EMBEDDERS``: ``nomic``, ``nomic-gguf-f32``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import minfer
from minfer.errors import FormatError, ModelError
from minfer.models.bert import BertModel, is_encoder_checkpoint

NOMIC = Path(__file__).parent / "fixtures" / "nomic"


def _folder(tmp_path: Path, config: dict) -> Path:
    """The fixture with ``config`` as its config.json (the weights, tokenizer and modules copied beside it)."""
    out = tmp_path / "nomic"
    top = str(NOMIC)
    shutil.copytree(NOMIC, out, ignore=lambda where, names: [n for n in names if n.endswith(".gguf") or (
        where == top and n.startswith("config"))])
    (out / "config.json").write_text(json.dumps(config))
    return out


def _nomic_config() -> dict:
    return json.loads((NOMIC / "config_nomic.json").read_text())


def test_nomic_s_own_config_fields_give_the_same_model(tmp_path):
    """The hub's nomic-embed-text folders carry nomic's config (n_embd, rotary_emb_base, ...), not transformers'."""
    folder = _folder(tmp_path, _nomic_config())
    assert is_encoder_checkpoint(folder)
    ref = np.load(NOMIC / "reference.npz")
    texts = json.loads((NOMIC / "texts.json").read_text())
    enc = minfer.load(folder)
    assert enc.model.hparams.rope_base == 1000.0 and enc.model.hparams.n_ctx_train == 8192
    hidden = enc.runner.hidden_states([enc.tokenize(t) for t in texts])
    for k, h in enumerate(hidden):
        np.testing.assert_allclose(h, ref[f"last_hidden_state_{k}"], atol=1e-4, rtol=0)
    np.testing.assert_array_equal(enc.embed(texts), minfer.load(NOMIC).embed(texts))


def test_the_gguf_is_llama_cpp_s_layout():
    model = BertModel.open(NOMIC / "model-f32.gguf")
    hp = model.hparams
    assert (hp.arch, hp.rope_base, hp.activation, hp.biases, hp.n_ctx_train) == ("nomic-bert", 1000.0, "swiglu",
                                                                                False, 2048)
    # the fused matrix is split into views of its rows, named after it in errors
    assert model.tensor("blk.1.attn_k.weight").shape == (32, 32)
    assert "attn_qkv" in model.describe_tensor("blk.1.attn_k.weight")
    assert not model.has_tensor("position_embd.weight")


def test_rotary_positions_matter():
    """The same tokens in another order give other hidden states (no position table: only RoPE sees order)."""
    enc = minfer.load(NOMIC)
    ids = enc.tokenize("the cat sat on the mat")
    swapped = [ids[0], ids[2], ids[1], *ids[3:]]
    a, b = enc.runner.hidden_states([ids, swapped])
    assert np.abs(a[3:] - b[3:]).max() > 1e-3


@pytest.mark.parametrize("field,value,match", [
    ("rotary_emb_interleaved", True, "rotary_emb_interleaved True is not supported"),
    ("prenorm", True, "prenorm True is not supported"),
    ("qkv_proj_bias", True, "qkv_proj_bias True is not supported"),
    ("rotary_emb_fraction", 0.5, "rotary_emb_fraction 0.5 is not supported"),
    ("rotary_scaling_factor", 2.0, "rotary_scaling_factor 2.0 is not supported"),
    ("activation_function", "gelu", "activation 'gelu' is not supported"),
    ("n_head", 5, "not divisible by 5 heads"),
    ("n_embd", "32", "field 'n_embd' must be a positive integer"),
    ("rotary_emb_base", -1, "field 'rotary_emb_base' must be a positive number"),
    ("n_layer", 1, "num_hidden_layers is 1 but the weights have layer 1"),
])
def test_unsupported_or_bad_config_fields_are_one_line_errors(tmp_path, field, value, match):
    cfg = _nomic_config() | {field: value}
    with pytest.raises((ModelError, FormatError), match=match) as err:
        BertModel.open(_folder(tmp_path, cfg))
    assert "\n" not in str(err.value)


def test_a_wrong_width_of_the_fused_matrix_names_it(tmp_path):
    cfg = _nomic_config() | {"n_embd": 16, "n_head": 2}
    with pytest.raises(ModelError, match=r"tensor 'encoder.layers.0.attn.Wqkv.weight' has shape \(96, 32\), "
                                         r"expected \(48, 16\)"):
        BertModel.open(_folder(tmp_path, cfg))
