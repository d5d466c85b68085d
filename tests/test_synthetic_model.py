"""bench/synthetic_model.py (``minfer.testing.synthetic_model``): real models' shapes and llama.cpp's
Q4_K_M mix (checked without writing GBs), and tiny variants of each architecture written, loaded by minfer and run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from minfer.testing import synthetic_model as sm

ROOT = Path(__file__).resolve().parents[1]

TOKENIZER = ROOT / "tests" / "fixtures" / "llama" / "model-f32.gguf"  # 512 tokens: tiny embeddings
SMOLLM_VOCAB = 49152


def _params(tensors) -> int:
    return sum(t.n_values for t in tensors)


QWEN_EXTRA_TOKENS = 151936 - SMOLLM_VOCAB


@pytest.mark.parametrize(("shape", "published"), [
    ("smollm2-360m", 361_821_120), ("smollm2-1.7b", 1_711_376_384),
    # the Qwen-like ones carry SmolLM2's vocabulary instead of Qwen's 151936 tokens (tied embeddings)
    ("qwen2.5-1.5b", 1_543_714_304 - QWEN_EXTRA_TOKENS * 1536), ("qwen3-4b", 4_022_468_096 - QWEN_EXTRA_TOKENS * 2560),
])
def test_real_shapes_have_the_models_parameter_counts(shape, published):
    tensors = sm.plan(sm.SHAPES[shape], SMOLLM_VOCAB, "f16")
    assert _params(tensors) == published
    assert "output.weight" not in {t.name for t in tensors}


def test_q4_k_m_mix_is_llamacpps():
    tensors = {t.name: t.ggml_type.name for t in sm.plan(sm.SHAPES["smollm2-1.7b"], SMOLLM_VOCAB, "q4_k_m")}
    assert tensors["token_embd.weight"] == "Q6_K"
    six = sorted(int(n.split(".")[1]) for n, t in tensors.items() if n.endswith("ffn_down.weight") and t == "Q6_K")
    # use_more_bits(i, 24): i < 3, i >= 21, or (i - 3) % 3 == 2
    assert six == [0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23]
    assert [n for n, t in tensors.items() if t == "Q6_K" and "attn_v" in n] == \
        [f"blk.{i}.attn_v.weight" for i in six]
    assert {t for n, t in tensors.items() if n.endswith(("attn_q.weight", "ffn_up.weight"))} == {"Q4_K"}
    # 960-wide rows are not whole super-blocks: llama.cpp's fallbacks
    small = {t.name: t.ggml_type.name for t in sm.plan(sm.SHAPES["smollm2-360m"], SMOLLM_VOCAB, "q4_k_m")}
    assert small["token_embd.weight"] == "Q8_0" and small["blk.0.attn_q.weight"] == "Q5_0"
    assert small["blk.0.ffn_down.weight"] == "Q6_K" and small["blk.5.ffn_down.weight"] == "Q4_K"  # 2560 wide


def test_q6_k_round_trip():
    from minfer.formats.kquants import dequantize_q6_k

    x = (0.02 * np.random.default_rng(3).standard_normal((8, 512))).astype(np.float32)
    x[2, :256] = 0  # an empty super-block
    back = dequantize_q6_k(sm.quantize_q6_k(x), 512)
    assert np.all(back[2, :256] == 0)
    assert np.linalg.norm(back - x) / np.linalg.norm(x) < 0.03  # 6-bit: ~1.8 %


@pytest.mark.parametrize(("shape", "file_type"), [("tiny", "q4_k_m"), ("tiny-qwen2", "q8_0"),
                                                  ("tiny-qwen3", "q4_0"), ("tiny", "f16")])
def test_tiny_model_loads_and_runs(tmp_path, shape, file_type):
    import minfer
    from minfer.formats.gguf_file import GGUFFile

    out = tmp_path / "m.gguf"
    assert sm.write_model(out, shape, file_type, TOKENIZER, quantizer="minfer", log=lambda _: None) == "minfer"
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]  # no temporary left
    planned = {t.name: t for t in sm.plan(sm.SHAPES[shape], 512, file_type)}
    f = GGUFFile(out)
    assert f.metadata["general.architecture"] == sm.SHAPES[shape].arch
    assert set(f.tensors) == set(planned)
    for name, t in f.tensors.items():
        assert (t.ggml_type.name, tuple(t.shape)) == (planned[name].ggml_type.name, planned[name].shape), name
    model = minfer.load(out, n_ctx=32, threads=1)
    logits = model.logits([1, 2, 3, 4])
    assert logits.shape[-1] == 512 and np.isfinite(logits).all()


@pytest.mark.parametrize(("shape", "q5_0"), [("tiny", False), ("tiny-q5", True), ("tiny-qwen2", False)])
def test_matmuls_reading_one_input_run_as_one_loop_with_the_same_logits(tmp_path, shape, q5_0):
    """In a Q4_K_M model, q and k (v too where it is Q4_K) and gate and up run in one parallel loop per
    layer: fewer parallel regions per token, the same logits bit for bit as each matmul on its own. With
    rows of no whole super-blocks they are Q5_0 (llama.cpp's fallback), quantized once by a shared node;
    Qwen2's q/k/v biases are added after all three matmuls."""
    import minfer
    from minfer.backends.cpu.backend import _computed_by_group, _GroupedMatmuls

    out = tmp_path / "m.gguf"
    sm.write_model(out, shape, "q4_k_m", TOKENIZER, quantizer="minfer", log=lambda _: None)
    grouped = minfer.load(out, n_ctx=32, threads=2)
    alone = minfer.load(out, n_ctx=32, threads=2)
    alone.runner.backend.group_kernels = lambda steps: [fn for _, fn, _, _ in steps]
    alone.runner._plans.clear()  # the plans load prepared were grouped
    ids = [1, 2, 3, 4, 5, 6, 7]
    # a prompt, then a decode step: (prefill logits, decode logits) of each
    runs = [(m.runner.forward(ids, range(len(ids))), m.runner.forward([9], [len(ids)])) for m in (grouped, alone)]
    steps = grouped.runner.plan(1, 1).steps
    firsts = [s.node.name for s in steps if isinstance(s.fn, _GroupedMatmuls)]
    absorbed = [s.node.name for s in steps if s.fn is _computed_by_group]
    assert {n.split(".")[-1] for n in firsts} == {"q", "ffn_gate"} and len(firsts) == 2 * sm.SHAPES[shape].n_layer
    blocks = {t.name: t.ggml_type.name for t in sm.plan(sm.SHAPES[shape], 512, "q4_k_m")}
    assert (blocks["blk.0.attn_q.weight"], blocks["blk.0.ffn_up.weight"]) == (("Q5_0",) * 2 if q5_0 else ("Q4_K",) * 2)
    assert {n.split(".")[-1] for n in absorbed} >= {"k", "ffn_up"}
    assert not any(isinstance(s.fn, _GroupedMatmuls) for s in alone.runner.plan(1, 1).steps)
    for got, own in zip(*runs, strict=True):
        assert got.view(np.uint32).tolist() == own.view(np.uint32).tolist()


def test_k_quant_matmuls_of_every_plan_share_one_set_of_q8_k_buffers(tmp_path):
    """Each bound K-quant matmul quantizes its activations and consumes them inside its own call, so every
    call of every plan shares the backend's one set of Q8_K buffers, sized for the largest call (at 1.7B a
    512-token plan held ~250 MiB of buffers of their own before). The logits are the same bits as with a
    set of each call's own."""
    import minfer

    out = tmp_path / "m.gguf"
    sm.write_model(out, "tiny", "q4_k_m", TOKENIZER, quantizer="minfer", log=lambda _: None)
    shared = minfer.load(out, n_ctx=32, threads=2)
    own = minfer.load(out, n_ctx=32, threads=2)
    own.runner.backend._q8k_scratch = None  # each bound call quantizes into buffers of its own
    own.runner._plans.clear()
    ids = list(range(1, 12))
    runs = [(m.runner.forward(ids, range(len(ids))), m.runner.forward([9], [len(ids)]),
             m.runner.forward(ids[:3], range(len(ids), len(ids) + 3))) for m in (shared, own)]
    for got, ref in zip(*runs, strict=True):
        assert got.view(np.uint32).tolist() == ref.view(np.uint32).tolist()
    # the widest K-quant input is ffn_down's (n_ff): q int8, one float32 d and 16 int16 sums per 256
    widest = len(ids) * sm.SHAPES["tiny"].n_ff
    assert shared.runner.backend._q8k_scratch.nbytes == widest + widest // 256 * (4 + 32)
