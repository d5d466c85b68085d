"""Bad HF folders: one-line ``minfer.errors`` exceptions naming the file and the field or tensor, and the CLI
printing that line without a traceback."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import copy_hf_folder, fixture_dir, read_safetensors, write_safetensors
from test_cli import assert_clean_error, minfer

import minfer as mf
from minfer.errors import FormatError, MinferError, ModelError


def _folder(tmp_path, arch="llama"):
    return copy_hf_folder(tmp_path / "m", arch)


def _edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (folder / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(folder, edit):
    tensors = read_safetensors(folder / "model.safetensors")
    edit(tensors)
    write_safetensors(folder / "model.safetensors", tensors)


def _raises(folder, exc, pattern):
    with pytest.raises(exc, match=pattern) as info:
        mf.load(folder, n_ctx=16)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_missing_config(tmp_path):
    folder = _folder(tmp_path)
    (folder / "config.json").unlink()
    _raises(folder, FormatError, r"m/config\.json: missing \(an HF model folder needs config\.json\)")


def test_config_not_json(tmp_path):
    folder = _folder(tmp_path)
    (folder / "config.json").write_text("{'model_type': llama")
    _raises(folder, FormatError, r"config\.json: not valid JSON")


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                                   "vocab_size", "model_type"])
def test_config_missing_a_required_field(tmp_path, field):
    folder = _folder(tmp_path)
    _edit_config(folder, **{field: None})
    _raises(folder, FormatError, rf"config\.json: missing field '{field}'")


def test_config_field_of_the_wrong_kind(tmp_path):
    folder = _folder(tmp_path)
    _edit_config(folder, num_attention_heads="four")
    _raises(folder, FormatError, r"config\.json: field 'num_attention_heads' must be a positive integer, got 'four'")


def test_unsupported_model_type_lists_the_supported_ones(tmp_path):
    folder = _folder(tmp_path)
    _edit_config(folder, model_type="mamba")
    _raises(folder, ModelError, r"config\.json: unsupported model_type 'mamba' "
                                r"\(supported: gemma2, gemma3_text, granite, llama, mixtral, olmo2, phi3, qwen2, "
                                r"qwen2_moe, qwen3, qwen3_moe\)")


def test_unsupported_head_class(tmp_path):
    folder = _folder(tmp_path)
    _edit_config(folder, architectures=["LlamaForSequenceClassification"])
    _raises(folder, ModelError, r"not a causal LM minfer runs.*LlamaForCausalLM")


def test_index_naming_a_missing_shard(tmp_path):
    folder = _folder(tmp_path)
    names = list(read_safetensors(folder / "model.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in names[:-3]}
    weight_map.update({n: "model-00002-of-00002.safetensors" for n in names[-3:]})
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _raises(folder, FormatError, r"model\.safetensors\.index\.json: shard 'model-00002-of-00002\.safetensors' "
                                 r"\(holding .*\) does not exist")


def test_index_naming_a_tensor_its_shard_lacks(tmp_path):
    folder = _folder(tmp_path)
    names = list(read_safetensors(folder / "model.safetensors"))
    weight_map = {n: "model.safetensors" for n in names}
    weight_map["model.layers.9.mlp.up_proj.weight"] = "model.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _raises(folder, FormatError, r"model\.safetensors: tensor 'model\.layers\.9\.mlp\.up_proj\.weight' that "
                                 r"model\.safetensors\.index\.json puts here is missing")


def test_no_weights(tmp_path):
    folder = copy_hf_folder(tmp_path / "m", "llama", weights=False)
    (folder / "pytorch_model.bin").write_bytes(b"\0")
    _raises(folder, FormatError, r"no model\.safetensors or model\.safetensors\.index\.json \(PyTorch "
                                 r"pytorch_model\.bin weights are not supported")


def test_missing_tensor(tmp_path):
    folder = _folder(tmp_path)
    _edit_tensors(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    _raises(folder, FormatError, r"m: missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight' "
                                 r"\(llama, shape \(192, 64\)\)")


def test_missing_output_projection_of_an_untied_model(tmp_path):
    folder = _folder(tmp_path)
    _edit_tensors(folder, lambda t: t.pop("lm_head.weight"))
    _raises(folder, FormatError, r"missing tensor 'lm_head\.weight' \(config\.json tie_word_embeddings is false\)")


def test_tensor_of_the_wrong_shape(tmp_path):
    folder = _folder(tmp_path)

    def cut(t):
        dtype, shape, data = t["model.layers.0.self_attn.k_proj.weight"]
        t["model.layers.0.self_attn.k_proj.weight"] = (dtype, [31, 64], data[: 31 * 64 * 4])

    _edit_tensors(folder, cut)
    _raises(folder, ModelError, r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.k_proj\.weight' has shape "
                                r"\(31, 64\), expected \(32, 64\)")


def test_tensor_of_an_unsupported_dtype(tmp_path):
    folder = _folder(tmp_path)

    def widen(t):
        _, shape, data = t["model.norm.weight"]
        t["model.norm.weight"] = ("F64", shape, np.frombuffer(data, np.float32).astype(np.float64).tobytes())

    _edit_tensors(folder, widen)
    _raises(folder, ModelError, r"model\.safetensors: tensor 'model\.norm\.weight' has dtype F64, not supported "
                                r"\(supported: F32, F16, BF16\)")


def test_tensor_with_no_place_in_the_recipe(tmp_path):
    folder = _folder(tmp_path)
    _edit_tensors(folder, lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": ("F32", [64], bytes(256))}))
    _raises(folder, ModelError, r"tensor 'model\.layers\.0\.self_attn\.o_proj\.bias' has no place in the llama recipe")


def test_vocab_size_disagreeing_with_the_embeddings(tmp_path):
    folder = _folder(tmp_path)
    _edit_config(folder, vocab_size=600)
    _raises(folder, ModelError, r"config\.json: vocab_size is 600 but model\.embed_tokens\.weight has 512 rows")


def test_active_sliding_window_is_refused_for_now(tmp_path):
    folder = _folder(tmp_path, "qwen2")
    _edit_config(folder, use_sliding_window=True, sliding_window=16, max_window_layers=1, layer_types=None)
    _raises(folder, ModelError, r"config\.json: sliding-window attention \(window 16, layers 1\.\.2\) is not supported")


def test_not_a_safetensors_file(tmp_path):
    folder = _folder(tmp_path)
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    _raises(folder, FormatError, r"model\.safetensors: not a valid safetensors file")


def test_truncated_safetensors_file(tmp_path):
    folder = _folder(tmp_path)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    _raises(folder, FormatError, r"model\.safetensors: not a valid safetensors file")


def test_broken_tokenizer_json(tmp_path):
    folder = _folder(tmp_path)
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": 3}}')
    _raises(folder, FormatError, r"tokenizer\.json: not a valid tokenizer\.json \(")


def test_missing_tokenizer_json(tmp_path):
    folder = _folder(tmp_path)
    (folder / "tokenizer.json").unlink()
    _raises(folder, FormatError, r"tokenizer\.json: missing")


def test_tokenizer_config_naming_an_unknown_token(tmp_path):
    folder = _folder(tmp_path)
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    tc["eos_token"] = "<|nope|>"
    (folder / "tokenizer_config.json").write_text(json.dumps(tc))
    _raises(folder, FormatError, r"tokenizer_config\.json: eos_token '<\|nope\|>' is not a token of tokenizer\.json")


def test_unsupported_rope_type(tmp_path):
    folder = _folder(tmp_path)
    _edit_config(folder, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4})
    _raises(folder, ModelError, r"rope_parameters\.rope_type 'dynamic' is not supported \(supported: default, "
                                r"linear, llama3, yarn, longrope, su\)")


def test_unknown_quantize_type():
    with pytest.raises(MinferError, match="unknown quantize type 'q2'"):
        mf.load(fixture_dir("llama") / "hf", n_ctx=16, quantize="q2")


def test_cli_prints_one_line(tmp_path):
    folder = _folder(tmp_path)
    _edit_config(folder, model_type="mamba")
    for cmd in (["run", str(folder), "hi"], ["inspect", str(folder)], ["chat", str(folder)],
                ["perplexity", str(folder), "-f", str(folder / "config.json")]):
        assert_clean_error(minfer(*cmd), "minfer: error:", "unsupported model_type 'mamba'")
    (folder / "config.json").unlink()
    assert_clean_error(minfer("run", str(folder), "hi"), "config.json: missing")


@pytest.mark.parametrize(
    ("changes", "exc", "pattern"),
    [
        ({"final_logit_softcapping": 30.0}, ModelError, r"field 'final_logit_softcapping' \(30\.0\) is not supported"),
        ({"layer_types": ["sliding_attention"] * 3}, FormatError, r"field 'layer_types' must list .* each of the 7"),
        ({"sliding_window": 0}, FormatError, r"field 'sliding_window': gemma3 sliding window must be a positive"),
        ({"query_pre_attn_scalar": -1}, FormatError, r"field 'query_pre_attn_scalar' must be a positive number"),
        ({"hidden_activation": "gelu"}, ModelError, r"hidden_activation 'gelu' is not supported for gemma3_text"),
    ],
)
def test_bad_gemma3_config_fields(tmp_path, changes, exc, pattern):
    folder = _folder(tmp_path, "gemma3")
    _edit_config(folder, **changes)
    _raises(folder, exc, r"config\.json: " + pattern)


def test_gemma3_layer_types_decide_the_sliding_layers(tmp_path):
    """config.json's layer_types (here: only layer 2 global) set the sliding-window layers of an HF folder;
    without them, Gemma3TextConfig's pattern (every 6th layer global) applies."""
    folder = _folder(tmp_path, "gemma3")
    types = ["full_attention" if il == 2 else "sliding_attention" for il in range(7)]
    _edit_config(folder, layer_types=types)
    hp = mf.load(folder, n_ctx=16).hparams
    assert [il for il in range(7) if not hp.is_swa(il)] == [2]
    _edit_config(folder, layer_types=None)
    hp = mf.load(folder, n_ctx=16).hparams
    assert [il for il in range(7) if not hp.is_swa(il)] == [5]
    assert hp.attn_scale == 16**-0.5 and hp.layer_rope(0) == (10000.0, 1.0)
