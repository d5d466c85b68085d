"""Load-time quantization (``--quantize q8_0|q4_k``): the block quantizers against their references, and
whole models quantized at load against the committed Q8_0 fixtures and against exactly dequantized weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numba
import numpy as np
import pytest
from conftest import (
    ARCHS,
    copy_hf_folder,
    derive_gguf,
    fixture_dir,
    fixture_logits,
    fixture_sequences,
    write_safetensors,
)

import minfer
from minfer.errors import BadRequestError
from minfer.formats.gguf_file import GGUFFile
from minfer.formats.quantize import quantize_rows, quantize_type, storage_type
from minfer.formats.quants import GGMLType, dequantize_rows

TOL = 1e-4
DATA = Path(__file__).parent / "data"


def test_q4_k_is_bit_equal_to_llama_cpp():
    """llama.cpp's quantize_row_q4_K_ref output (scripts/make_q4k_refs.py), byte for byte."""
    ref = np.load(DATA / "q4_k_ref.npz")
    names = sorted({k.split(".")[0] for k in ref.files if k != "source"})
    assert len(names) == 9
    for name in names:
        x, want = ref[f"{name}.x"], ref[f"{name}.q4_k"]
        np.testing.assert_array_equal(quantize_rows(x, GGMLType.Q4_K), want, err_msg=name)


def test_q4_k_round_trip_error_is_what_4_bits_allow():
    """Each value comes back within half a quantization step of its sub-block (plus the f16/6-bit rounding
    of the scales), and the dequantizer is gguf's (bit-equal, tests/test_kquants.py)."""
    x = np.load(DATA / "q4_k_ref.npz")["gaussian.x"]
    q = quantize_rows(x, GGMLType.Q4_K)
    back = dequantize_rows(q, GGMLType.Q4_K, x.shape[1])
    np.testing.assert_array_equal(back, gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q4_K))
    blocks = x.reshape(-1, 32)
    step = (blocks.max(axis=1) - np.minimum(blocks.min(axis=1), 0)) / 15
    err = np.abs(back - x).reshape(-1, 32).max(axis=1)
    assert (err <= 0.75 * step + 1e-7).all(), float((err / step).max())
    assert float(np.sqrt(((back - x) ** 2).mean()) / np.sqrt((x**2).mean())) < 0.1


def _edge_rows() -> np.ndarray:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((12, 256)).astype(np.float32)
    x[1, :32] = 0.0
    x[2, :32] = -0.0  # an all-zero block that starts with -0.0: gguf's d is +0 there
    x[3, 32:64] = 5.0
    x[4] *= 1e-30
    x[5, ::7] = -x[5, ::7] * 100
    return x


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_0"])
def test_q8_0_and_q5_0_are_bit_equal_to_gguf(qtype):
    t = GGMLType[qtype]
    for x in (_edge_rows(), np.load(DATA / "q4_k_ref.npz")["sparse.x"]):
        np.testing.assert_array_equal(quantize_rows(x, t), gguf.quants.quantize(x, t))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q5_0"])
def test_quantization_does_not_depend_on_threads(qtype):
    x = np.load(DATA / "q4_k_ref.npz")["gaussian.x"]
    previous = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = quantize_rows(x, GGMLType[qtype])
        numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
        two = quantize_rows(x, GGMLType[qtype])
    finally:
        numba.set_num_threads(previous)
    np.testing.assert_array_equal(one, two)


def test_fallback_types_and_names():
    assert storage_type(GGMLType.Q4_K, 512) == GGMLType.Q4_K
    assert storage_type(GGMLType.Q4_K, 192) == GGMLType.Q5_0  # llama.cpp's tensor_type_fallback
    assert storage_type(GGMLType.Q4_K, 48) == GGMLType.F16
    assert storage_type(GGMLType.Q8_0, 48) == GGMLType.F16
    assert quantize_type("Q8_0") == GGMLType.Q8_0
    with pytest.raises(BadRequestError, match="unknown quantize type 'q3_k'.*q8_0, q4_k"):
        quantize_type("q3_k")


def _permute_rows(t: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation of W_q/W_k rows (whole rows move, so it applies to block bytes too)."""
    return t.reshape(n_head, 2, t.shape[0] // n_head // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)


@pytest.mark.parametrize("arch", ARCHS)
def test_quantize_q8_0_reproduces_the_q8_0_gguf(arch):
    """Every matrix quantized at load is byte-for-byte the Q8_0 GGUF fixture's (gguf.quants.quantize), llama's
    q/k up to the converter's row permutation; with exact dequantization the logits are the float64
    reference over those weights within 1e-4, and the fast kernels agree with the Q8_0 GGUF."""
    model = minfer.load(fixture_dir(arch) / "hf", n_ctx=64, quantize="q8_0", kernels="reference")
    tensors = model.transformer.tensors
    hp = model.hparams
    for t in GGUFFile(fixture_dir(arch) / "model-q8_0.gguf"):
        ours = tensors[t.name]
        assert ours.ggml_type == t.ggml_type, t.name
        data = ours.data
        if arch == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            data = _permute_rows(data, hp.n_head if "attn_q" in t.name else hp.n_head_kv)
        np.testing.assert_array_equal(data, t.data, err_msg=t.name)
    for k, seq in enumerate(fixture_sequences(arch)):
        diff = float(np.abs(model.logits(seq) - fixture_logits(arch, k, q8_0=True)).max())
        assert diff <= TOL, f"{arch} q8_0 at load, sequence {k}: {diff:.3g}"
    fast = minfer.load(fixture_dir(arch) / "hf", n_ctx=64, quantize="q8_0")
    gguf_fast = minfer.load(fixture_dir(arch) / "model-q8_0.gguf", n_ctx=64)
    for seq in fixture_sequences(arch):
        assert float(np.abs(fast.logits(seq) - gguf_fast.logits(seq)).max()) <= TOL


def test_quantize_a_float_gguf_at_load():
    model = minfer.load(fixture_dir("qwen2") / "model-f32.gguf", n_ctx=64, quantize="q8_0")
    ref = GGUFFile(fixture_dir("qwen2") / "model-q8_0.gguf")
    for t in ref:
        np.testing.assert_array_equal(model.transformer.tensors[t.name].data, t.data)


def _dequantized_folder(model, dst: Path) -> Path:
    """An F32 HF folder holding exactly the dequantized weights of a model quantized at load."""
    from minfer.models.hf_checkpoint import hf_tensor_name

    dst.mkdir(parents=True)
    for f in model.path.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, dst / f.name)
    spec = model.transformer.source.spec
    out = {}
    for name, t in model.transformer.tensors.items():
        w = gguf.quants.dequantize(np.asarray(t.data), gguf.GGMLQuantizationType(int(t.ggml_type)))
        if spec.norm_gain_offset and name.endswith("norm.weight"):
            w = w - np.float32(1.0)  # the folder stores Gemma's w, the engine holds 1 + w (exact both ways here)
        out[hf_tensor_name(spec, name)] = ("F32", list(t.shape), np.ascontiguousarray(w, np.float32).tobytes())
    write_safetensors(dst / "model.safetensors", out)
    return dst


@pytest.mark.parametrize("arch", ARCHS)
def test_quantize_q4_k_on_tiny_rows_falls_back_to_q5_0(tmp_path, arch):
    """The fixtures' rows (64, 192 values) are not whole 256-value super-blocks: every matrix becomes Q5_0, as
    llama.cpp's quantizer does; the model then computes exactly what its dequantized weights give."""
    model = minfer.load(fixture_dir(arch) / "hf", n_ctx=64, quantize="q4_k", kernels="reference")
    types = {t.ggml_type.name for t in model.transformer.tensors.values() if len(t.shape) == 2}
    assert types == {"Q5_0"}
    plain = minfer.load(_dequantized_folder(model, tmp_path / "deq"), n_ctx=64, kernels="reference")
    for seq in fixture_sequences(arch):
        assert float(np.abs(model.logits(seq) - plain.logits(seq)).max()) <= TOL


def make_synthetic_llama(dst: Path, hidden: int = 256, ff: int = 512, layers: int = 2, seed: int = 5) -> Path:
    """A random llama folder with K-quant-sized rows (hidden 256, ffn 512), the llama fixture's tokenizer."""
    copy_hf_folder(dst, "llama", weights=False)
    cfg = json.loads((dst / "config.json").read_text())
    n_head, n_kv, head_dim = 4, 2, hidden // 4
    cfg.update(hidden_size=hidden, intermediate_size=ff, num_hidden_layers=layers, num_attention_heads=n_head,
               num_key_value_heads=n_kv, head_dim=head_dim)
    (dst / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(seed)
    vocab, kv = cfg["vocab_size"], n_kv * head_dim
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden),
              "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (ff, hidden), p + "mlp.up_proj.weight": (ff, hidden),
            p + "mlp.down_proj.weight": (hidden, ff),
        })
    tensors = {}
    for name, shape in shapes.items():
        w = 1 + 0.2 * rng.standard_normal(shape) if len(shape) == 1 else rng.standard_normal(shape) / np.sqrt(shape[-1])
        tensors[name] = ("F32", list(shape), w.astype(np.float32).tobytes())
    write_safetensors(dst / "model.safetensors", tensors)
    return dst


def _weight_error(model, f32_model) -> float:
    """Relative RMS error of all quantized matrices against the original weights."""
    num = den = 0.0
    for name, t in model.transformer.tensors.items():
        if len(t.shape) == 2:
            w0 = f32_model.transformer.tensors[name]
            w = dequantize_rows(w0.data, w0.ggml_type, t.shape[1]).astype(np.float64)
            num += float(((dequantize_rows(t.data, t.ggml_type, t.shape[1]) - w) ** 2).sum())
            den += float((w**2).sum())
    return (num / den) ** 0.5


def test_quantize_q4_k_whole_model(tmp_path):
    """Rows of 256 and 512 values: every matrix is Q4_K. (1) Exact dequantization reproduces the model of the
    dequantized weights within 1e-4: the blocks are wired right. (2) How far 4-bit weights move the logits is
    what their rounding implies: to first order the RMS logit change is linear in the weight error, so Q4_K's
    change over Q8_0's equals the ratio of their relative weight errors (~13x here) within 30%. (3) The fast
    kernels' 8-bit activations stay far below the weights' effect."""
    folder = make_synthetic_llama(tmp_path / "synthetic")
    seq = fixture_sequences("llama")[2]
    q4 = minfer.load(folder, n_ctx=64, quantize="q4_k", kernels="reference")
    assert {t.ggml_type.name for t in q4.transformer.tensors.values() if len(t.shape) == 2} == {"Q4_K"}
    plain = minfer.load(_dequantized_folder(q4, tmp_path / "deq"), n_ctx=64, kernels="reference")
    q4_logits = q4.logits(seq)
    assert float(np.abs(q4_logits - plain.logits(seq)).max()) <= TOL

    f32 = minfer.load(folder, n_ctx=64, kernels="reference")
    q8 = minfer.load(folder, n_ctx=64, quantize="q8_0", kernels="reference")
    ref = f32.logits(seq)

    def rms(a):
        return float(np.sqrt(np.mean(np.square(a))))

    logit_ratio = rms(q4_logits - ref) / rms(q8.logits(seq) - ref)
    weight_ratio = _weight_error(q4, f32) / _weight_error(q8, f32)
    assert 0.7 < logit_ratio / weight_ratio < 1.3, (logit_ratio, weight_ratio)
    fast = minfer.load(folder, n_ctx=64, quantize="q4_k").logits(seq)
    assert float(np.abs(fast - q4_logits).max()) <= 0.25 * float(np.abs(q4_logits - ref).max())


def test_quantized_gguf_tensors_are_left_alone(tmp_path):
    model = minfer.load(fixture_dir("qwen3") / "model-q8_0.gguf", n_ctx=16, quantize="q4_k")
    assert {t.ggml_type.name for t in model.transformer.tensors.values() if len(t.shape) == 2} == {"Q8_0"}
    f16 = derive_gguf(fixture_dir("qwen3") / "model-f32.gguf", tmp_path / "f16.gguf",
                      transform=lambda n, a: (a.astype(np.float16), None) if a.ndim == 2 else (a, None))
    q = minfer.load(f16, n_ctx=16, quantize="q8_0")
    ref = GGUFFile(fixture_dir("qwen3") / "model-q8_0.gguf")
    # f16-rounded weights quantize to the same blocks as the f32 ones in most rows, not all: only types here
    assert {q.transformer.tensors[t.name].ggml_type for t in ref} == {t.ggml_type for t in ref}
