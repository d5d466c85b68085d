"""Hugging Face model folders against transformers' fp32 references.

The tiny fixtures' ``hf/`` folders (fp32 safetensors, tokenizer.json) load with NEOX RoPE pairing (HF
weights are not permuted) and give transformers' logits within 1e-4 at every position; folders derived
from them at test time (sharded, f16, bf16) are checked against the same or against transformers on the
rounded weights (``variants/``, written by ``scripts/make_fixtures.py``).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from conftest import (
    ARCHS,
    convert_hf_folder,
    copy_hf_folder,
    fixture_dir,
    fixture_logits,
    fixture_sequences,
    load_json,
    read_safetensors,
    variant_dir,
    write_safetensors,
)

import minfer
from minfer.graph.ir import RopeStyle
from minfer.models.hf_checkpoint import HFCheckpoint

TOL = 1e-4


@pytest.fixture(scope="module", params=ARCHS)
def arch(request):
    return request.param


def _max_diff(model, arch: str) -> float:
    return max(float(np.abs(model.logits(s) - fixture_logits(arch, k)).max())
               for k, s in enumerate(fixture_sequences(arch)))


@pytest.mark.parametrize("kernels", ["fast", "reference"])
@pytest.mark.parametrize("threads", [1, 2])
def test_hf_folder_logits_match_transformers(arch, threads, kernels):
    model = minfer.load(fixture_dir(arch) / "hf", n_ctx=64, threads=threads, kernels=kernels)
    assert model.transformer.rope_style is RopeStyle.NEOX and isinstance(model.transformer.source, HFCheckpoint)
    for k, seq in enumerate(fixture_sequences(arch)):
        got, want = model.logits(seq), fixture_logits(arch, k)
        assert got.shape == want.shape
        diff = float(np.abs(got - want).max())
        assert diff <= TOL, f"{arch} sequence {k}: max |dlogit| = {diff:.3g}"


@pytest.mark.parametrize("kernels", ["fast", "reference"])
def test_hf_folder_equals_its_gguf_conversion(arch, kernels):
    """Same weights, same numbers: bit-identical for qwen (same layout), and for llama, whose GGUF permuted
    W_q/W_k rows to pair (2i, 2i+1), equal up to the order of the q.k sums."""
    hf = minfer.load(fixture_dir(arch) / "hf", n_ctx=64, kernels=kernels)
    gg = minfer.load(fixture_dir(arch) / "model-f32.gguf", n_ctx=64, kernels=kernels)
    # GGUF stores the epsilon as float32, which is what RMSNorm adds either way; a RoPE scaling (gemma3's
    # global layers) says where it was read
    def same(h):
        return dataclasses.replace(h, rms_eps=float(np.float32(h.rms_eps)),
                                   rope_scaling=dataclasses.replace(h.rope_scaling, source=""))

    assert same(hf.hparams) == same(gg.hparams)
    for seq in fixture_sequences(arch):
        a, b = hf.logits(seq), gg.logits(seq)
        if arch == "llama":
            assert float(np.abs(a - b).max()) <= 2e-5
        else:
            np.testing.assert_array_equal(a, b)


def test_hf_tokenizer_matches_transformers(arch):
    model = minfer.load(fixture_dir(arch) / "hf", n_ctx=64)
    tok, ref = model.tokenizer, load_json(fixture_dir(arch) / "tokens.json")
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (ref["special_ids"]["bos"], ref["special_ids"]["eos"], True)
    # gemma3's tokenizer.json is SentencePiece-style (▁ spaces, <0xNN> byte fallback), the others byte-level BPE
    assert tok.model == "hf" and tok.decoder_kind == ("sentencepiece" if arch == "gemma3" else "byte-level")
    assert model.tokenize(ref["prompt_text"]) == ref["prompt_ids"]
    for case in ref["tokenizer_cases"]:
        ids = model.tokenize(case["text"])
        if arch == "qwen2":
            # transformers 5 loads this folder as Qwen2Tokenizer, which keeps only the vocabulary and merges of
            # tokenizer.json and splits with Qwen2's own regex (digits one by one); minfer, like `tokenizers` and
            # llama.cpp's converter, follows the file (GPT-2's split here). Real Qwen2 files carry Qwen2's regex.
            from tokenizers import Tokenizer as Raw

            raw = Raw.from_file(str(fixture_dir(arch) / "hf" / "tokenizer.json"))
            assert ids == raw.encode(case["text"], add_special_tokens=True).ids
            if "123" not in case["text"]:
                assert ids == case["ids_with_bos"]
        else:
            assert ids == case["ids_with_bos"]
        assert tok.decode(ids, skip_special=True) == case["decoded_without_specials"]
        assert b"".join(tok.token_bytes(i) for i in ids[1:]).decode() == case["text"]
    assert tok.is_eog(ref["special_ids"]["eos"]) and not tok.is_eog(ref["special_ids"]["bos"])


def test_hf_greedy_continuation_matches_transformers(arch):
    from minfer.runtime.requests import GenerationRequest
    from minfer.runtime.sampling import Sampler, SamplingParams

    ref = load_json(fixture_dir(arch) / "greedy.json")
    model = minfer.load(fixture_dir(arch) / "hf", n_ctx=64)
    steps = model.engine.run(GenerationRequest(ref["prompt_ids"], Sampler(SamplingParams(temperature=0)),
                     max_tokens=len(ref["generated_ids"]), stop_ids=frozenset()))
    assert [s.token for s in steps if s.token is not None] == ref["generated_ids"]


def test_sharded_folder_gives_the_same_logits(tmp_path):
    """The llama fixture's tensors re-saved as three shards with an index: bit-identical logits."""
    folder = copy_hf_folder(tmp_path / "sharded", "llama", weights=False)
    tensors = read_safetensors(fixture_dir("llama") / "hf" / "model.safetensors")
    names = list(tensors)
    shards = {f"model-0000{i + 1}-of-00003.safetensors": names[i::3] for i in range(3)}
    weight_map = {}
    for shard, members in shards.items():
        write_safetensors(folder / shard, {n: tensors[n] for n in members})
        weight_map.update({n: shard for n in members})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    sharded = minfer.load(folder, n_ctx=64)
    single = minfer.load(fixture_dir("llama") / "hf", n_ctx=64)
    assert sharded.transformer.format_name == "HF safetensors folder, 3 shards (model.safetensors.index.json)"
    for seq in fixture_sequences("llama"):
        np.testing.assert_array_equal(sharded.logits(seq), single.logits(seq))


def test_safetensors_are_memory_mapped_not_copied():
    model = minfer.load(fixture_dir("qwen3") / "hf", n_ctx=16)
    for t in model.transformer.tensors.values():
        base = t.data
        while base.base is not None and isinstance(base.base, np.ndarray):
            base = base.base
        assert not base.flags.owndata and not t.data.flags.writeable, t.name  # a view of the file's map


@pytest.mark.parametrize("kernels", ["fast", "reference"])
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_folder(tmp_path, arch, threads, kernels):
    """bf16 weights (rounded to nearest even from the fixture's fp32): transformers fp32 on the same rounded
    weights within 1e-4; against the fp32 originals, within what the rounding moves transformers' own logits
    (measured by the fixture script, ~0.1 here: bf16 keeps 8 significant bits) plus the 1e-4 of each side."""
    folder = convert_hf_folder(tmp_path / "bf16", arch, "BF16")
    model = minfer.load(folder, n_ctx=64, threads=threads, kernels=kernels)
    types = {name: t.ggml_type.name for name, t in model.transformer.tensors.items()}
    if arch == "gemma3":  # Gemma's norm weights w become the 1 + w gains, in float32 as a GGUF stores them
        assert {n for n, t in types.items() if t == "F32"} == {n for n in types if n.endswith("norm.weight")}
        types = {n: t for n, t in types.items() if not n.endswith("norm.weight")}
    assert set(types.values()) == {"BF16"}
    seq = fixture_sequences(arch)[2]
    got = model.logits(seq)
    diff = float(np.abs(got - np.load(variant_dir(arch, "bf16") / "logits_2.npy")).max())
    assert diff <= TOL, f"{arch} bf16: max |dlogit| vs transformers on bf16 weights = {diff:.3g}"
    rounding = load_json(variant_dir(arch, "bf16") / "meta.json")["self_check"]["vs_fp32_logits"]
    vs_fp32 = float(np.abs(got - fixture_logits(arch, 2)).max())
    assert 1e-3 < vs_fp32 <= rounding + 2 * TOL, (vs_fp32, rounding)


@pytest.mark.parametrize("kernels", ["fast", "reference"])
def test_f16_folder(tmp_path, kernels):
    folder = convert_hf_folder(tmp_path / "f16", "llama", "F16")
    model = minfer.load(folder, n_ctx=64, kernels=kernels)
    assert {t.ggml_type.name for t in model.transformer.tensors.values()} == {"F16"}
    got = model.logits(fixture_sequences("llama")[2])
    diff = float(np.abs(got - np.load(variant_dir("llama", "f16") / "logits_2.npy")).max())
    assert diff <= TOL, f"f16: max |dlogit| vs transformers on f16 weights = {diff:.3g}"


def test_chat_template_and_generation_defaults(tmp_path):
    folder = copy_hf_folder(tmp_path / "chat", "qwen2")
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    tc["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(tc))
    (folder / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "eos_token_id": [1, 2]}))
    model = minfer.load(folder, n_ctx=64)
    messages = [{"role": "user", "content": "Hi"}]
    assert model.render_chat(messages) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    params = model.sampler().params
    assert (params.temperature, params.top_k, params.top_p) == (0.6, 20, 0.95)
    assert model.sampler(temperature=0).params.temperature == 0  # an explicit argument wins
    assert model.tokenizer.eog_ids == frozenset({1, 2})
    # transformers 4.43+ writes the template to its own file
    del tc["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(tc))
    (folder / "chat_template.jinja").write_text(template)
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.6}))
    model = minfer.load(folder, n_ctx=64)
    assert model.render_chat(messages).endswith("<|im_start|>assistant\n")
    assert model.sampler().params.temperature == 0.8  # greedy in transformers: minfer keeps its own defaults


def test_hf_folder_without_chat_template_says_where_it_looked():
    model = minfer.load(fixture_dir("llama") / "hf", n_ctx=16)
    with pytest.raises(minfer.MinferError, match="no chat template.*tokenizer_config.json"):
        model.render_chat([{"role": "user", "content": "x"}])


def test_conversation_saved_and_resumed_from_a_folder(tmp_path):
    folder = copy_hf_folder(tmp_path / "qwen3", "qwen3")
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    tc["chat_template"] = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                           "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(tc))
    model = minfer.load(folder, n_ctx=128, threads=1)
    conv = model.conversation(temperature=0)
    first = conv.send("hello there", max_tokens=4)
    conv.save(tmp_path / "chat.session")
    expect = conv.send("and again", max_tokens=4)

    from minfer.runtime.conversation import Conversation, model_fingerprint

    resumed = Conversation.load(minfer.load(folder, n_ctx=128, threads=1), tmp_path / "chat.session")
    assert resumed.messages[-1]["content"] == first
    assert resumed.send("and again", max_tokens=4) == expect
    assert model_fingerprint(model).startswith("qwen3:qwen3:")
    quantized = minfer.load(folder, n_ctx=128, quantize="q8_0")
    with pytest.raises(minfer.MinferError, match="fingerprint"):
        Conversation.load(quantized, tmp_path / "chat.session")  # other tensor types: not this cache's model


def test_output_layer_padded_past_the_tokenizer(tmp_path):
    """Embeddings and output padded to 1024 rows over a 1000-token tokenizer (as Qwen2.5 pads 151665 to
    151936): the padded ids are valid output that decodes to nothing; the other logits are unchanged."""
    folder = copy_hf_folder(tmp_path / "padded", "qwen3", weights=False)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["vocab_size"] = 1024
    (folder / "config.json").write_text(json.dumps(cfg))
    tensors = read_safetensors(fixture_dir("qwen3") / "hf" / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        dtype, shape, data = tensors[name]
        tensors[name] = (dtype, [1024, shape[1]], data + bytes(24 * shape[1] * 4))
    write_safetensors(folder / "model.safetensors", tensors)
    model = minfer.load(folder, n_ctx=64)
    seq = fixture_sequences("qwen3")[2]
    logits = model.logits(seq)
    assert logits.shape == (len(seq), 1024)
    np.testing.assert_array_equal(logits[:, :1000], minfer.load(fixture_dir("qwen3") / "hf", n_ctx=64).logits(seq))
    tok = model.tokenizer
    assert tok.vocab_size == 1000 and tok.decode([42, 1010, 43]) == tok.decode([42, 43])
    assert tok.token_bytes(1023) == b"" and tok.token_text(1010) == "[PAD1010]"
    with pytest.raises(minfer.MinferError, match="outside the vocabulary"):
        tok.decode([1024])
