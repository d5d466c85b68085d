"""LoRA adapters (minfer.models.lora, the graph's LORA nodes, per-sequence scales) against transformers + peft.

The fixtures (``tests/fixtures/<model>/lora/<variant>/``, made by ``scripts/make_lora_fixtures.py``) are
random-initialised PEFT adapters on the llama, qwen3 and gemma3 fixtures, with the GGUF adapters that
llama.cpp's ``convert_lora_to_gguf.py`` made of them, and transformers + peft's fp32 logits. Each adapter moves
the base model's logits by 6.8 to 10.6, so the 1e-4 tolerance (DESIGN.md's for fp32 paths through several
matmuls) tells an adapter applied right from one applied wrong (transposed, unscaled, unpermuted)."""

from __future__ import annotations

import json
import shutil
import threading

import numpy as np
import pytest
from conftest import fixture_dir, fixture_sequences
from safetensors.numpy import load_file, save_file

import minfer
from minfer.errors import MinferError
from minfer.graph.ir import Op
from minfer.models.model import TransformerModel
from minfer.runtime.engine import EngineConfig
from minfer.runtime.engine_loop import EngineLoop
from minfer.runtime.requests import Failed, Finished, GenerationRequest, Started, Token

TOL = 1e-4
VARIANTS = [("llama", "r4-attn"), ("llama", "r16-all-rslora"), ("qwen3", "r16-all"), ("gemma3", "r4-all"),
            ("gemma3", "r16-all-rslora")]
BASES = ["hf", "model-f32.gguf"]


def lora_dir(model: str, variant: str):
    return fixture_dir(model) / "lora" / variant


def adapter_cases():
    for model, variant in VARIANTS:
        for base in BASES:
            yield pytest.param(model, variant, base, "peft", id=f"{model}-{variant}-{base}-peft")
            if (lora_dir(model, variant) / "adapter-f32.gguf").exists():
                yield pytest.param(model, variant, base, "adapter-f32.gguf", id=f"{model}-{variant}-{base}-gguf")


@pytest.mark.parametrize("model_name,variant,base,adapter", list(adapter_cases()))
def test_logits_equal_transformers_with_peft_at_every_position(model_name, variant, base, adapter):
    """Both base formats (HF: unpermuted W_q/W_k rows; GGUF llama: llama.cpp's permuted ones) with both adapter
    formats (PEFT: unpermuted B rows; llama.cpp's GGUF adapter: permuted for llama), at scale 1 and 0.5."""
    d = lora_dir(model_name, variant)
    tokens = fixture_sequences(model_name)[2]
    model = minfer.load(fixture_dir(model_name) / base, n_ctx=64, threads=2, lora=[(d / adapter, 1.0)])
    np.testing.assert_allclose(model.logits(tokens), np.load(d / "logits_2.npy"), atol=TOL, rtol=0)
    model.set_lora([{"id": 0, "scale": 0.5}])
    np.testing.assert_allclose(model.logits(tokens), np.load(d / "logits_2_half.npy"), atol=TOL, rtol=0)


def test_reference_kernels_apply_the_adapter_too():
    d = lora_dir("qwen3", "r16-all")
    model = minfer.load(fixture_dir("qwen3") / "hf", n_ctx=64, threads=1, kernels="reference", lora=d / "peft")
    np.testing.assert_allclose(model.logits(fixture_sequences("qwen3")[2]), np.load(d / "logits_2.npy"), atol=TOL,
                               rtol=0)


def test_a_zero_b_adapter_and_scale_zero_give_the_base_models_bits(tmp_path):
    d = lora_dir("llama", "r16-all-rslora") / "peft"
    zero = tmp_path / "zero-b"
    shutil.copytree(d, zero)
    tensors = load_file(zero / "adapter_model.safetensors")
    save_file({k: np.zeros_like(v) if ".lora_B." in k else v for k, v in tensors.items()},
              zero / "adapter_model.safetensors")
    tokens = fixture_sequences("llama")[2]
    base = minfer.load(fixture_dir("llama") / "hf", n_ctx=64, threads=2).logits(tokens)
    assert np.array_equal(minfer.load(fixture_dir("llama") / "hf", n_ctx=64, threads=2, lora=zero).logits(tokens), base)
    off = minfer.load(fixture_dir("llama") / "hf", n_ctx=64, threads=2, lora=d, lora_init_without_apply=True)
    assert off.lora_adapters == [{"id": 0, "path": str(d), "scale": 0.0, "task_name": "", "prompt_prefix": ""}]
    assert np.array_equal(off.logits(tokens), base)


@pytest.mark.parametrize("model_name,variant,base", [("llama", "r4-attn", "hf"), ("qwen3", "r16-all", "model-f32.gguf"),
                                                     ("gemma3", "r16-all-rslora", "hf")])
def test_merged_adapters_equal_the_unmerged_ones(model_name, variant, base):
    d = lora_dir(model_name, variant) / "peft"
    path = fixture_dir(model_name) / base
    tokens = fixture_sequences(model_name)[2]
    unmerged = minfer.load(path, n_ctx=64, threads=2, lora=[(d, 0.7)]).logits(tokens)
    merged_model = minfer.load(path, n_ctx=64, threads=2, lora=[(d, 0.7)], lora_merge=True)
    assert merged_model.transformer.loras == [] and merged_model.lora_adapters == []
    np.testing.assert_allclose(merged_model.logits(tokens), unmerged, atol=1e-5, rtol=0)


def test_a_merged_adapter_far_larger_than_its_weights_is_within_the_fp32_tolerance():
    """llama r16-all-rslora's update is ~4x the base weights: merged and unmerged float32 products then differ by
    up to 1.1e-4 (the order of rounding), and each stays within 1e-4 of transformers + peft."""
    d = lora_dir("llama", "r16-all-rslora")
    merged = minfer.load(fixture_dir("llama") / "hf", n_ctx=64, threads=2, lora=d / "peft", lora_merge=True)
    np.testing.assert_allclose(merged.logits(fixture_sequences("llama")[2]), np.load(d / "logits_2.npy"), atol=TOL,
                               rtol=0)


def test_two_adapters_add_their_updates():
    """Two adapters of one model at once: the same logits as one adapter whose scale is their sum (the same
    adapter twice), and each adapter's own scale is data."""
    d = lora_dir("qwen3", "r16-all") / "peft"
    tokens = fixture_sequences("qwen3")[2]
    path = fixture_dir("qwen3") / "hf"
    twice = minfer.load(path, n_ctx=64, threads=2, lora=[(d, 0.25), (d, 0.25)])
    np.testing.assert_allclose(twice.logits(tokens), np.load(lora_dir("qwen3", "r16-all") / "logits_2_half.npy"),
                               atol=TOL, rtol=0)


@pytest.mark.parametrize(("n_rows", "n_in", "rank", "n_out"),
                         [(1, 96, 16, 160), (3, 96, 16, 160), (8, 96, 16, 160), (33, 96, 16, 160),
                          (1, 99, 5, 75), (9, 99, 5, 75), (2, 64, 24, 8), (4, 64, 24, 12), (21, 99, 5, 75)])
@pytest.mark.parametrize("half", [False, True], ids=["f32", "f16"])
def test_the_compiled_lora_kernel_equals_the_numpy_reference(n_rows, n_in, rank, n_out, half):
    """The kernel's contract (lora_kernels): the reference's values within float32 rounding, rows with scale 0 are
    y's bits, in place equals out of place, and a row's bits do not depend on the batch around it. Shapes with
    tails: inputs not a multiple of 4, a rank not a multiple of 8, outputs not a multiple of 8 or 32. An adapter
    whose values are float16 exactly is read as float16 and gives the bits of its float32 copy."""
    from minfer.backends.cpu import lora_kernels
    from minfer.backends.cpu import reference as ref

    rng = np.random.default_rng(n_rows + n_in)
    x = rng.standard_normal((n_rows, n_in), dtype=np.float32)
    y = rng.standard_normal((n_rows, n_out), dtype=np.float32)
    a = rng.standard_normal((rank, n_in), dtype=np.float32) * 0.1
    b = rng.standard_normal((n_out, rank), dtype=np.float32) * 0.1
    if half:
        a, b = a.astype(np.float16).astype(np.float32), b.astype(np.float16).astype(np.float32)
    scales = rng.standard_normal(n_rows).astype(np.float32)
    scales[::3] = 0
    at, bt = lora_kernels.operands(a, b)
    assert (at.dtype, bt.dtype) == ((np.uint16, np.uint16) if half else (np.float32, np.float32))
    want, got = np.empty_like(y), np.empty_like(y)
    ref.lora(y, x, a, b, scales, 0.5, want)
    lora_kernels.lora(y, x, at, bt, scales, 0.5, got)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
    assert np.array_equal(got[scales == 0], y[scales == 0])
    in_place = y.copy()
    lora_kernels.lora(in_place, x, at, bt, scales, 0.5, in_place)
    assert np.array_equal(in_place, got)
    for i in range(n_rows):  # each row alone: its bits in the batch (a prompt's rows go four at a time)
        alone = np.empty_like(y[i : i + 1])
        lora_kernels.lora(y[i : i + 1], x[i : i + 1], at, bt, scales[i : i + 1], 0.5, alone)
        assert np.array_equal(alone, got[i : i + 1]), i
    if half:  # the float32 copy of the same values: the same bits
        at32, bt32 = (np.ascontiguousarray(m.view(np.float16).astype(np.float32)) for m in (at, bt))
        from32 = np.empty_like(y)
        lora_kernels.lora(y, x, at32, bt32, scales, 0.5, from32)
        assert np.array_equal(from32, got)


def test_the_adapter_matrices_lie_in_one_mapping_in_the_order_a_pass_reads_them():
    """The fast kernels' A^T and B^T of every adapted matrix are laid out one after the other, each on a cache
    line, in the order the decode plan's nodes run (one stream through memory per pass, on huge pages)."""
    d = lora_dir("llama", "r16-all-rslora") / "peft"
    model = minfer.load(fixture_dir("llama") / "model-f32.gguf", n_ctx=64, threads=2, lora=[(d, 1.0)])
    model.logits(fixture_sequences("llama")[2][:3])
    held = model.backend._lora_operands
    nodes = [s.node for s in model.runner.plan(1, 1).steps if s.node.op.value == "lora"]
    arrays = [m for n in nodes for m in held[(id(n.inputs[2].source), id(n.inputs[3].source))][2:]]
    assert len(arrays) == 2 * 7 * model.hparams.n_layer
    for first, then in zip(arrays[:-1], arrays[1:], strict=True):
        assert then.ctypes.data == first.ctypes.data + (first.nbytes + 63) // 64 * 64


def test_an_adapter_of_the_output_projection_of_tied_embeddings(tmp_path):
    """qwen2's fixture ties its output projection to the embeddings: PEFT's lm_head adapter adapts the projection
    alone (known answer: the base's logits plus (alpha / r) · B·A·h, h the final norm's output); merging it would
    change the embeddings too, so it is refused."""
    base_path = fixture_dir("qwen2") / "model-f32.gguf"
    base = minfer.load(base_path, n_ctx=64, threads=1)
    assert base.transformer.tied_output
    n_vocab, n_embd = base.hparams.n_vocab, base.hparams.n_embd
    rng = np.random.default_rng(3)
    a = (rng.standard_normal((4, n_embd)) * 0.3).astype(np.float32)
    b = (rng.standard_normal((n_vocab, 4)) * 0.3).astype(np.float32)
    d = tmp_path / "lm-head"
    d.mkdir()
    save_file({"base_model.model.lm_head.lora_A.weight": a, "base_model.model.lm_head.lora_B.weight": b},
              d / "adapter_model.safetensors")
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                       "target_modules": ["lm_head"]}))
    tokens = fixture_sequences("qwen2")[2]
    logits, hidden = base.runner.forward_hidden(tokens, range(len(tokens)), np.arange(len(tokens)))
    adapted = minfer.load(base_path, n_ctx=64, threads=1, lora=d).logits(tokens)
    want = logits + 2.0 * (hidden.astype(np.float64) @ a.T @ b.T)
    np.testing.assert_allclose(adapted, want, atol=1e-4, rtol=0)
    assert np.abs(adapted - logits).max() > 0.5
    with pytest.raises(MinferError, match="shares with its token embeddings"):
        minfer.load(base_path, n_ctx=64, threads=1, lora=d, lora_merge=True)


def test_the_graph_has_an_adapter_node_beside_each_adapted_matmul():
    model = TransformerModel.from_path(fixture_dir("llama") / "hf")
    model.add_lora(lora_dir("llama", "r4-attn") / "peft")
    graph = model.build_graph(4, 1, 16)
    lora = [n for n in graph.nodes if n.op is Op.LORA]
    # q, k, v and o of 3 layers; nothing of the FFN (not targeted)
    assert sorted({n.name.split(".")[2] for n in lora}) == ["attn_out", "k", "q", "v"] and len(lora) == 12
    q = next(n for n in lora if n.name == "blk.0.q.lora[0]")
    assert q.inputs[0].op is Op.MATMUL and q.inputs[2].name == "blk.0.attn_q.weight.lora_a[0]"
    assert q.inputs[4].name == "lora_scale.0" and q.meta.factor == 8 / 4  # alpha / r


def test_inspect_graph_shows_the_adapter_nodes(capsys):
    from minfer.cli import main

    assert main(["inspect", str(fixture_dir("llama") / "hf"), "--graph", "--lora",
                 str(lora_dir("llama", "r4-attn") / "adapter-f32.gguf")]) == 0
    out = capsys.readouterr().out
    assert "blk.0.q.lora[0]" in out and "lora" in out


def test_the_trace_explorer_traces_the_adapter_nodes():
    model = minfer.load(fixture_dir("llama") / "hf", n_ctx=64, threads=2, lora=lora_dir("llama", "r4-attn") / "peft")
    trace = model.trace_forward(fixture_sequences("llama")[2][:6])
    nodes = {n["name"]: n for n in trace.layer_graph(0)["nodes"]}
    assert nodes["blk.0.q.lora[0]"]["op"] == "lora" and nodes["blk.0.q.lora[0]"]["stats"] is not None
    assert "blk.0.attn_q.weight.lora_a[0]" in nodes and "blk.0.attn_out.lora[0]" in nodes


def test_a_saved_conversation_loads_only_under_the_adapters_it_was_computed_with(tmp_path):
    d = lora_dir("llama", "r4-attn") / "peft"
    path = fixture_dir("llama") / "hf"
    model = minfer.load(path, n_ctx=64, threads=1, lora=d)
    conv = model.conversation()
    conv.messages.append({"role": "user", "content": "hi"})  # the fixture has no chat template: no reply needed
    session = tmp_path / "s.session"
    conv.save(session)
    type(conv).load(minfer.load(path, n_ctx=64, threads=1, lora=d), session)  # same adapter and scale: loads
    for other in (minfer.load(path, n_ctx=64, threads=1), minfer.load(path, n_ctx=64, threads=1, lora=[(d, 0.5)]),
                  minfer.load(path, n_ctx=64, threads=1, lora=d, lora_merge=True)):
        with pytest.raises(MinferError, match="was saved with model fingerprint"):
            type(conv).load(other, session)


# -- several adapters in one batch --------------------------------------------------------------------------


class Collector:
    def __init__(self, n: int) -> None:
        self.events: list[list] = [[] for _ in range(n)]
        self._left = n
        self.done = threading.Event()

    def emit(self, i: int):
        def push(ev) -> None:
            self.events[i].append(ev)
            if isinstance(ev, Finished | Failed):
                self._left -= 1
                if self._left == 0:
                    self.done.set()

        return push

    def tokens(self, i: int) -> list[int]:
        return [e.step.token for e in self.events[i] if isinstance(e, Token) and e.step.token is not None]

    def cached(self, i: int) -> int:
        return next(e.cached_tokens for e in self.events[i] if isinstance(e, Started))


def test_a_batch_mixing_adapters_gives_each_sequence_its_solo_tokens():
    """Four sequences in one engine step: two with adapter A, one with B, one with none; greedy tokens equal each
    sequence's run alone with the same adapter (the issue's server batch, at the engine)."""
    a, b = lora_dir("qwen3", "r16-all") / "peft", lora_dir("qwen3", "r16-all") / "adapter-f32.gguf"
    path = fixture_dir("qwen3") / "model-f32.gguf"
    adapters = [(a, 1.0), (b, 1.0)]
    prompt = fixture_sequences("qwen3")[2]
    prompts = [prompt[:9], prompt[:14], prompt[:11], prompt[:12]]
    # B is A in llama.cpp's file at scale -0.8: a different update, so the sequences' texts differ
    choices = [[{"id": 0, "scale": 1.0}], [{"id": 1, "scale": -0.8}], [{"id": 0, "scale": 1.0}], []]
    solo = minfer.load(path, n_ctx=64, threads=2, lora=adapters)
    expected = [solo.complete(p, 10, temperature=0, lora=c).tokens for p, c in zip(prompts, choices, strict=True)]
    assert len({tuple(t) for t in expected}) >= 3  # the adapters change the text
    served = minfer.load(path, n_ctx=256, threads=2, lora=adapters,
                         engine_config=EngineConfig(n_slots=4, batch_size=64, end_of_context="length"))
    loop = EngineLoop(served.engine, max_queue=8)
    loop.start()
    try:
        c = Collector(4)
        scales = [[1.0, 0.0], [0.0, -0.8], [1.0, 0.0], [0.0, 0.0]]  # the choices, as each adapter's scale
        loop.submit([GenerationRequest(p, served.sampler(temperature=0), 10, c.emit(i), lora=scales[i])
                     for i, p in enumerate(prompts)])
        assert c.done.wait(60)
        assert [c.tokens(i) for i in range(4)] == expected
    finally:
        loop.stop()


def test_a_cached_prefix_is_reused_only_under_the_same_adapter_scales():
    d = lora_dir("qwen3", "r16-all") / "peft"
    model = minfer.load(fixture_dir("qwen3") / "model-f32.gguf", n_ctx=128, threads=2, lora=d,
                        engine_config=EngineConfig(n_slots=2, batch_size=32, end_of_context="length"))
    prompt = fixture_sequences("qwen3")[2][:20]
    loop = EngineLoop(model.engine, max_queue=4)
    loop.start()
    try:
        def run(lora) -> tuple[int, list[int]]:
            c = Collector(1)
            loop.submit([GenerationRequest(prompt, model.sampler(temperature=0), 4, c.emit(0), lora=lora)])
            assert c.done.wait(60)
            return c.cached(0), c.tokens(0)

        assert run([1.0])[0] == 0
        with_a = run([1.0])
        assert with_a[0] == len(prompt) - 1  # the same adapter: the prefix is reused
        without = run([0.0])
        assert without[0] == 0  # computed under the adapter: never reused without it
        assert without[1] != with_a[1]
    finally:
        loop.stop()


# -- bad adapters --------------------------------------------------------------------------------------------


def edited_peft(tmp_path, edit_config=None, edit_tensors=None):
    src = lora_dir("llama", "r4-attn") / "peft"
    dst = tmp_path / "adapter"
    shutil.copytree(src, dst)
    if edit_config is not None:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        edit_config(cfg)
        (dst / "adapter_config.json").write_text(json.dumps(cfg))
    if edit_tensors is not None:
        tensors = load_file(dst / "adapter_model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, dst / "adapter_model.safetensors")
    return dst


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def _set(d, k, v):
    d[k] = v


BAD_PEFT = {
    "dora": (lambda c: _set(c, "use_dora", True), None, "DoRA (use_dora) is not supported"),
    "not-lora": (lambda c: _set(c, "peft_type", "IA3"), None, "peft_type is 'IA3'"),
    "modules-to-save": (lambda c: _set(c, "modules_to_save", ["lm_head"]), None, "modules_to_save"),
    "rank-vs-config": (lambda c: _set(c, "r", 8), None, "has rank 4, but adapter_config.json says r = 8"),
    "bad-alpha": (lambda c: _set(c, "lora_alpha", "x"), None, "lora_alpha is 'x'"),
    "rank-a-vs-b": (None, lambda t: _set(t, Q_B, t[Q_B][:, :3].copy()), "lora_A.weight has rank 4 but"),
    "missing-b": (None, lambda t: t.pop(Q_B), "q_proj.lora_B.weight' is missing"),
    "unknown-target": (None, lambda t: _set(t, Q_A.replace("q_proj", "x_proj"), t[Q_A]),
                       "adapts 'model.layers.0.self_attn.x_proj', which has no place in the llama recipe"),
    "shape": (None, lambda t: _set(t, Q_A, np.zeros((4, 32), np.float32)),
              "the adapter of 'blk.0.attn_q.weight' is [64, 32]"),
    "nan": (None, lambda t: t[Q_A].__setitem__((0, 0), np.nan), "'blk.0.attn_q.weight' has NaN or infinite"),
}


@pytest.mark.parametrize("case", list(BAD_PEFT))
def test_bad_peft_adapters_get_one_line_naming_the_problem(tmp_path, case):
    edit_config, edit_tensors, message = BAD_PEFT[case]
    d = edited_peft(tmp_path, edit_config, edit_tensors)
    model = TransformerModel.from_path(fixture_dir("llama") / "hf")
    with pytest.raises(MinferError) as e:
        model.add_lora(d)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_bad_gguf_adapters_get_one_line(tmp_path):
    model = TransformerModel.from_path(fixture_dir("llama") / "model-f32.gguf")
    with pytest.raises(MinferError, match="a LoRA adapter for architecture 'qwen3', but the model is 'llama'"):
        model.add_lora(lora_dir("qwen3", "r16-all") / "adapter-f32.gguf")
    with pytest.raises(MinferError, match="not a LoRA adapter"):
        model.add_lora(fixture_dir("llama") / "model-f32.gguf")
    with pytest.raises(MinferError, match="no such adapter"):
        model.add_lora(tmp_path / "missing.gguf")


def test_merging_into_quantized_weights_is_refused():
    with pytest.raises(MinferError, match="'blk.0.attn_k.weight' is Q8_0; merging needs float weights"):
        minfer.load(fixture_dir("llama") / "model-q8_0.gguf", n_ctx=32, threads=1,
                    lora=lora_dir("llama", "r4-attn") / "peft", lora_merge=True)


def test_bad_scales_are_refused_by_name():
    model = minfer.load(fixture_dir("llama") / "hf", n_ctx=32, threads=1, lora=lora_dir("llama", "r4-attn") / "peft")
    with pytest.raises(MinferError, match="adapter id 3 is not loaded"):
        model.set_lora([{"id": 3, "scale": 1.0}])
    with pytest.raises(MinferError, match="scale of adapter 0 must be a finite number"):
        model.set_lora({0: float("nan")})
    with pytest.raises(MinferError, match="lora: the scale of .* must be a finite number"):
        minfer.load(fixture_dir("llama") / "hf", n_ctx=32, threads=1,
                    lora=[(lora_dir("llama", "r4-attn") / "peft", "big")])


# -- the CLI -------------------------------------------------------------------------------------------------


def test_cli_lora_flags(capsys):
    from minfer.cli import main

    d = lora_dir("llama", "r4-attn")
    hf = str(fixture_dir("llama") / "hf")
    argv = ["run", hf, "hello", "-n", "6", "--temp", "0"]
    outputs = {}
    for name, extra in [("base", []), ("half", ["--lora", f"{d / 'peft'}:0.5"]),
                        ("scaled", ["--lora-scaled", str(d / "adapter-f32.gguf"), "0.5"]),
                        ("merged", ["--lora", f"{d / 'peft'}:0.5", "--lora-merge"])]:
        assert main(argv + extra) == 0
        outputs[name] = capsys.readouterr().out
    assert outputs["half"] == outputs["scaled"] == outputs["merged"] != outputs["base"]
    assert main(argv + ["--lora-merge"]) == 1
    assert "--lora-merge needs an adapter" in capsys.readouterr().err
