"""Tiny random-weight llama / qwen2 / qwen3 models against HF transformers' fp32 references.

DESIGN.md's contract: max |logit - reference| <= 1e-4 at every position, from GGUF F32, with the f32
KV cache, at 1 and 2 threads; the same greedy continuation. The Q8_0 GGUF is held to the float64
reference forward over its dequantized weights (see tests/fixtures/README.md).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ARCHS, fixture_dir, fixture_logits, fixture_sequences, load_json

import minfer

TOL = 1e-4


@pytest.fixture(scope="module", params=ARCHS)
def arch(request):
    return request.param


@pytest.mark.parametrize("kernels", ["fast", "reference"])
@pytest.mark.parametrize("threads", [1, 2])
def test_f32_logits_match_transformers(arch, threads, kernels):
    model = minfer.load(fixture_dir(arch) / "model-f32.gguf", n_ctx=64, threads=threads, kernels=kernels)
    for k, seq in enumerate(fixture_sequences(arch)):
        got = model.logits(seq)
        want = fixture_logits(arch, k)
        assert got.shape == want.shape
        diff = float(np.abs(got - want).max())
        assert diff <= TOL, f"{arch} sequence {k}: max |dlogit| = {diff:.3g}"


@pytest.mark.parametrize("kernels", ["fast", "reference"])
@pytest.mark.parametrize("variant", ["model-f32.gguf", "model-q8_0.gguf"])
def test_thread_count_does_not_change_results(arch, variant, kernels):
    seq = fixture_sequences(arch)[2]
    a = minfer.load(fixture_dir(arch) / variant, n_ctx=64, threads=1, kernels=kernels).logits(seq)
    b = minfer.load(fixture_dir(arch) / variant, n_ctx=64, threads=2, kernels=kernels).logits(seq)
    assert np.array_equal(a, b)


def test_q8_0_logits_match_float64_reference(arch):
    """The reference kernels dequantize exactly: the float64 forward over the same weights within 1e-4."""
    model = minfer.load(fixture_dir(arch) / "model-q8_0.gguf", n_ctx=64, kernels="reference")
    for k, seq in enumerate(fixture_sequences(arch)):
        diff = float(np.abs(model.logits(seq) - fixture_logits(arch, k, q8_0=True)).max())
        assert diff <= TOL, f"{arch} q8_0 sequence {k}: max |dlogit| = {diff:.3g}"


def test_q8_0_fast_kernels_equal_their_numpy_reference(arch):
    """The fast kernels quantize matmul inputs to 8-bit blocks (as llama.cpp does); ``reference-q8`` is the
    numpy reference of exactly that arithmetic. The two agree within the f32 contract."""
    fast = minfer.load(fixture_dir(arch) / "model-q8_0.gguf", n_ctx=64, kernels="fast")
    sim = minfer.load(fixture_dir(arch) / "model-q8_0.gguf", n_ctx=64, kernels="reference-q8")
    for seq in fixture_sequences(arch):
        diff = float(np.abs(fast.logits(seq) - sim.logits(seq)).max())
        assert diff <= TOL, f"{arch}: max |dlogit| fast vs reference-q8 = {diff:.3g}"


def test_q8_0_fast_kernels_keep_clear_greedy_choices(arch):
    """8-bit activations move these tiny models' logits by up to ~0.26 against the float64 forward
    (measured; all of it is the activation rounding, see above): every greedy step whose top-2 margin
    is larger than twice that keeps its token."""
    model = minfer.load(fixture_dir(arch) / "model-q8_0.gguf", n_ctx=64, kernels="fast")
    ref = load_json(fixture_dir(arch) / "q8_0_ref/greedy.json")
    ids = ref["prompt_ids"] + ref["generated_ids"]
    logits = model.logits(ids)[len(ref["prompt_ids"]) - 1 : -1]
    for i, (tok, margin) in enumerate(zip(ref["generated_ids"], ref["top1_minus_top2"], strict=True)):
        if margin > 0.6:
            assert int(np.argmax(logits[i])) == tok, f"{arch} step {i}: margin {margin:.3f}"


@pytest.mark.parametrize("variant,ref_dir,kernels",
                         [("model-f32.gguf", "", "fast"), ("model-f32.gguf", "", "reference"),
                          ("model-q8_0.gguf", "q8_0_ref/", "reference")])
def test_greedy_continuation_matches(arch, variant, ref_dir, kernels):
    ref = load_json(fixture_dir(arch) / f"{ref_dir}greedy.json")
    model = minfer.load(fixture_dir(arch) / variant, n_ctx=64, kernels=kernels)
    from minfer.runtime.generate import generate
    from minfer.runtime.sampler import Sampler, SamplingParams

    # EOS does not stop, as in the reference
    steps = generate(model.runner, model.tokenizer, ref["prompt_ids"], Sampler(SamplingParams(temperature=0)),
                     max_tokens=len(ref["generated_ids"]), stop_ids=frozenset())
    assert [s.token for s in steps if s.token is not None] == ref["generated_ids"]


@pytest.mark.parametrize("variant", ["model-f32.gguf", "model-q8_0.gguf"])
def test_incremental_decode_equals_full_prefill(arch, variant):
    """Prefill a prefix, then feed tokens one at a time at their positions: bit-equal to one pass (same
    thread count), since decode and prefill kernels run the same float operations per row."""
    model = minfer.load(fixture_dir(arch) / variant, n_ctx=64, threads=1)
    seq = fixture_sequences(arch)[2]
    full = model.logits(seq)
    runner = model.runner
    rows = [runner.forward(seq[:10], range(10))]
    for p in range(10, len(seq)):
        rows.append(runner.forward([seq[p]], [p]))
    np.testing.assert_array_equal(np.concatenate(rows), full)


def test_hparams_from_metadata():
    hp = minfer.load(fixture_dir("qwen3") / "model-f32.gguf", n_ctx=16).hparams
    assert (hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim_k, hp.n_layer) == (64, 4, 2, 32, 3)
    assert hp.rope_freq_base == 1e6 and hp.attn_scale == pytest.approx(32**-0.5)
    qwen2 = minfer.load(fixture_dir("qwen2") / "model-f32.gguf", n_ctx=16)
    assert qwen2.transformer.tied_output and qwen2.hparams.head_dim_k == 16


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_other_block_types_through_the_whole_model(tmp_path, qtype):
    """The llama fixture requantized (every 2-D tensor) to another block type, through the whole model.

    Each fast matmul equals the numpy reference of its arithmetic to ~1e-6 relative (tests/test_quant_matmul.py,
    tests/test_kquants.py), but over a whole model a 1e-7 difference can flip the rounding of one activation
    to 8 bits, which then moves logits by ~1e-2: so here the fast kernels must stay far closer to the
    rounded-activation reference than that reference is to exact f32 activations."""
    import gguf

    from minfer.formats.gguf_file import GGUFFile

    t = gguf.GGMLQuantizationType[qtype]
    src = GGUFFile(fixture_dir("llama") / "model-f32.gguf")
    path = tmp_path / f"llama-{qtype}.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    reader = gguf.GGUFReader(fixture_dir("llama") / "model-f32.gguf")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        value = field.contents()
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, vtype)
    for tensor in src:
        arr = tensor.data.view(np.float32).reshape(tensor.shape)
        if len(tensor.shape) == 2:
            q = gguf.quants.quantize(arr, t)
            w.add_tensor(tensor.name, q, raw_shape=q.shape, raw_dtype=t)
        else:
            w.add_tensor(tensor.name, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    seq = fixture_sequences("llama")[2]
    fast = minfer.load(path, n_ctx=64, kernels="fast").logits(seq)
    sim = minfer.load(path, n_ctx=64, kernels="reference-q8").logits(seq)
    exact = minfer.load(path, n_ctx=64, kernels="reference").logits(seq)
    kernel_diff, rounding_effect = float(np.abs(fast - sim).max()), float(np.abs(sim - exact).max())
    assert float(np.abs(fast[:3] - sim[:3]).max()) <= TOL  # before any flip has had room to happen
    assert kernel_diff <= 0.25 * rounding_effect, (kernel_diff, rounding_effect)
    types = {x.ggml_type.name for x in GGUFFile(path) if len(x.shape) == 2}
    assert types == {qtype}
