"""Regenerate the tiny-model reference fixtures in ``tests/fixtures/{llama,qwen2,qwen3,olmo2}``.

This is a test-data tool, not part of the engine: it needs a separate Python environment with
torch 2.13.0 (CPU), transformers 5.24.0, gguf 0.19.0, tokenizers, safetensors and numpy. The tests
themselves only read the committed files.

Usage::

    /opt/refenv/bin/python scripts/make_fixtures.py --out DIR [--only llama,qwen2,qwen3,olmo2]
        [--tokenizers tests/fixtures] [--compare tests/fixtures] [--variants-only]

Besides the base fixtures it writes their variants (``<name>/variants/<variant>/``: transformers'
references for the same weights with Llama 3 / YaRN RoPE scaling, or rounded to bf16 / f16; see the
"variants" section below) and ``rope_scaling_refs.json``; ``--variants-only`` writes just those.

``--out DIR`` receives one folder per fixture (``DIR/llama``, ...). Copy them over
``tests/fixtures/`` to update the committed fixtures. ``--compare REF`` compares every regenerated
file with ``REF/<name>/`` (bytes, JSON structure, GGUF tensors, array values) and prints a report.

Recipe (per fixture):

1. Config: the constants in ``SPECS`` below (the ``config`` section of each ``meta.json``): hidden 64,
   3 layers, 4 query heads, 2 kv heads, ffn 192; llama head dim 16 / rope 1e4 / untied; qwen2 q/k/v
   biases / rope 1e6 / tied embeddings; qwen3 per-head q/k RMSNorm / head dim 32 / rope 1e6 / untied;
   olmo2 (``Olmo2ForCausalLM``) 2 layers / ffn 64 / head dim 16 / no pre-norms / whole-width q/k RMSNorm /
   post norms / rope 5e5 / untied.
2. Weights: ``torch.manual_seed(seed)``, then for each tensor of ``model.named_parameters()`` in
   order ``torch.randn(shape) * std + mean`` with (mean, std) = (0, weight_std) for matrices,
   (1, norm_std) for norm gains and (0, bias_std) for biases (weight_std 0.15, norm_std 0.2,
   bias_std 0.3). This reproduces the committed weights bit for bit.
3. Tokenizer: the committed byte-level BPE ``tests/fixtures/<name>/hf/tokenizer.json`` is reused as
   input (it was trained once with ``tokenizers``; its vocabulary sizes are 512, 768 and 1000 and the
   special tokens ``<|bos|>``, ``<|eos|>``, ``<|pad|>`` are ids 0, 1, 2; a BOS is prepended); olmo2
   reuses llama's (``FixtureSpec.tokenizer_from``).
   Point ``--tokenizers`` at another folder of the same layout to use other tokenizers.
4. ``hf/``: ``save_pretrained`` of model (fp32 safetensors) and tokenizer; everything below is taken
   after reloading that folder with ``attn_implementation="eager"`` in float32.
5. GGUF (v3, gguf's ``GGUFWriter``): architecture keys as llama.cpp reads them, the tokenizer as a
   ``gpt2`` BPE vocabulary, tensors in safetensors order named with gguf's ``TensorNameMap``; llama
   q/k rows permuted like llama.cpp's ``convert_hf_to_gguf.py`` (so RoPE pairs (2i, 2i+1) in the GGUF).
   ``model-f32.gguf`` has every tensor F32, ``model-q8_0.gguf`` every 2-D tensor Q8_0
   (``gguf.quants.quantize``) and the 1-D tensors F32.
6. References: ``tokens.json`` (sequences of length 1, 7, 33: BOS + ``np.random.default_rng(seed)``
   ids in [3, vocab)), ``logits_<k>.npy`` (full forward, no cache), ``embeddings.npy``,
   ``layer_outputs.npy``, ``final_norm.npy``, ``hidden_states.npy`` (33-token sequence),
   ``greedy.json`` + ``greedy_logits.npy`` (16 greedy tokens of HF ``generate`` with the KV cache, EOS
   neither stopping nor suppressed; then the no-cache logits of prompt + generated[:-1]),
   ``q8_0_ref/`` (a float64 numpy forward over the dequantized Q8_0 GGUF weights: logits and greedy
   tokens by full recomputation) and ``meta.json``.

Self-check (always run): the float64 numpy forward in this file, applied to the F32 GGUF's weights and
to the safetensors weights, must reproduce transformers' logits within ``TOL`` and each plausible
engine bug (wrong RoPE pairing, missing q/k permutation, skipped QK-norm, wrong GQA mapping, dropped
biases; for olmo2 also a per-head instead of whole-width q/k norm, skipped post norms, an added unit-gain
pre-norm) must move the logits by more than ``MIN_BUG_EFFECT``; otherwise the script exits non-zero.

Reproducibility (checked with ``--compare tests/fixtures`` on an AVX2 CPU): ``hf/*``, both GGUF files,
``tokens.json``, ``embeddings.npy``, ``logits_0.npy``, ``logits_1.npy`` and ``q8_0_ref/logits_*.npy``
come out bit-equal to the committed ones. Outputs of longer fp32 transformers forwards
(``logits_2``, ``layer_outputs``, ``final_norm``, ``hidden_states``, ``greedy_logits``, greedy margins)
depend on the CPU's kernels and threads and may differ in the last bits (max 1e-5 observed, same
greedy tokens); ``meta.json`` and the ``min_margin`` values inherit that noise.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.metadata
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TOKENIZERS = REPO_ROOT / "tests" / "fixtures"

TOL = 2e-5  # float64 numpy forward vs transformers fp32 logits
MIN_BUG_EFFECT = 0.1  # smallest max |delta logits| a simulated engine bug must cause
SEQ_LENGTHS = (1, 7, 33)
N_GREEDY = 16
PROMPT_TEXT = "The capital of France is"
TOKENIZER_TEXTS = (
    PROMPT_TEXT,
    "Hello, world! 123",
    "  leading spaces and\nnewlines\ttabs",
    "unicode: café – naïve ✓",
)
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
GREEDY_SETTINGS = (
    "HF generate: do_sample=False, num_beams=1, use_cache=True, max_new_tokens=16, eos_token_id=None "
    "(EOS neither stops nor is suppressed: plain argmax every step)"
)
Q8_NOTE = "numpy float64 forward on dequantized Q8_0 weights, full recompute each step, plain argmax"

ROPE_NORM = "NORM (interleaved pairs 2i,2i+1)"
ROPE_NEOX = "NEOX (pairs i, i+d/2)"


@dataclass(frozen=True)
class FixtureSpec:
    """Everything that distinguishes one fixture from another."""

    name: str
    hf_class: str
    arch: str  # GGUF architecture name
    config: dict[str, Any]  # keyword arguments of the transformers config class
    seed: int
    weight_std: float = 0.15
    norm_std: float = 0.2
    bias_std: float = 0.3
    qk_permuted: bool = False  # llama: q/k rows permuted in the GGUF, RoPE pairs (2i, 2i+1)
    gguf_head_dims: bool = False  # write {arch}.attention.key_length / value_length
    gguf_llama_extras: bool = False  # write {arch}.vocab_size / rope.dimension_count
    tokenizer_from: str = ""  # the fixture whose tokenizer.json this one reuses (default: its own)


_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "hidden_act": "silu",
}

SPECS: dict[str, FixtureSpec] = {
    "llama": FixtureSpec(
        name="llama",
        hf_class="LlamaForCausalLM",
        arch="llama",
        config={
            **_COMMON,
            "vocab_size": 512,
            "head_dim": 16,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
        },
        seed=1001,
        qk_permuted=True,
        gguf_head_dims=True,
        gguf_llama_extras=True,
    ),
    "qwen2": FixtureSpec(
        name="qwen2",
        hf_class="Qwen2ForCausalLM",
        arch="qwen2",
        config={
            **_COMMON,
            "vocab_size": 768,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": True,
        },
        seed=1003,
    ),
    "qwen3": FixtureSpec(
        name="qwen3",
        hf_class="Qwen3ForCausalLM",
        arch="qwen3",
        config={
            **_COMMON,
            "vocab_size": 1000,
            "head_dim": 32,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": False,
        },
        seed=1013,
        gguf_head_dims=True,
    ),
    "olmo2": FixtureSpec(
        name="olmo2",
        hf_class="Olmo2ForCausalLM",
        arch="olmo2",
        config={
            **_COMMON,
            # smaller than the others (2 layers, ffn 64); hidden 64 because llama.cpp's olmo2 tensors assume
            # n_head x head_dim = hidden and q8_0 KV cells need 2 kv heads x head_dim >= 32
            "num_hidden_layers": 2,
            "intermediate_size": 64,
            "vocab_size": 512,
            "rms_norm_eps": 1e-6,
            "rope_theta": 500000.0,
            "tie_word_embeddings": False,
        },
        seed=1021,
        tokenizer_from="llama",
    ),
}


# ---------------------------------------------------------------------------------------------------
# float64 numpy reference forward (GGUF tensor names, GGUF row order)
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HParams:
    """Hyper-parameters of the numpy forward, as an engine would read them from the GGUF."""

    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    eps: float
    rope_base: float
    rope_interleaved: bool  # True: pairs (2i, 2i+1) (llama.cpp NORM); False: pairs (i, i+d/2) (NEOX)
    inv_freq: tuple[float, ...] | None = None  # scaled RoPE frequencies (variants); None: 1 / base^(2i/d)
    rope_mscale: float = 1.0  # cos/sin magnitude (YaRN attention factor)


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(
    x: np.ndarray, base: float, interleaved: bool, inv_freq: tuple[float, ...] | None = None, mscale: float = 1.0
) -> np.ndarray:
    """Rotate ``x`` of shape [tokens, heads, head_dim]; positions are 0..tokens-1."""
    n_tok, _, d = x.shape
    freqs = 1.0 / base ** (np.arange(0, d, 2, dtype=np.float64) / d) if inv_freq is None else np.asarray(inv_freq)
    ang = np.arange(n_tok, dtype=np.float64)[:, None] * freqs[None, :]
    cos, sin = mscale * np.cos(ang)[:, None, :], mscale * np.sin(ang)[:, None, :]
    out = np.empty_like(x)
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
    else:
        a, b = x[..., : d // 2], x[..., d // 2 :]
        out[..., : d // 2] = a * cos - b * sin
        out[..., d // 2 :] = b * cos + a * sin
    return out


def numpy_forward(
    w: dict[str, np.ndarray],
    hp: HParams,
    ids: list[int],
    *,
    skip_qk_norm: bool = False,
    drop_biases: bool = False,
    gqa_tiled: bool = False,
    qk_norm_per_head: bool = False,
    skip_post_norms: bool = False,
    unit_pre_norms: bool = False,
) -> np.ndarray:
    """Logits ``[tokens, vocab]`` (float64) of a llama/qwen2/qwen3/olmo2 decoder, causal, no cache.

    ``w`` maps GGUF tensor names to float64 arrays in GGUF row order (``[out, in]`` for matrices). The
    tensors decide the layout: pre-norms where ``attn_norm``/``ffn_norm`` exist (olmo2 has none), a q/k
    RMSNorm per head where its gain is head_dim wide and over the whole q / k width where it is that wide
    (olmo2), post norms of the attention and FFN outputs where ``post_attention_norm``/``post_ffw_norm``
    exist (olmo2). The keyword flags simulate engine bugs for the self-check.
    """
    x = w["token_embd.weight"][np.asarray(ids)]
    n_tok = len(ids)
    rep = hp.n_head // hp.n_head_kv
    kv_of_head = [(h % hp.n_head_kv) if gqa_tiled else (h // rep) for h in range(hp.n_head)]
    mask = np.triu(np.full((n_tok, n_tok), -np.inf), k=1)
    def pre_norm(x: np.ndarray, name: str) -> np.ndarray:
        if name in w:
            return _rms_norm(x, w[name], hp.eps)
        return _rms_norm(x, 1.0, hp.eps) if unit_pre_norms else x

    def post_norm(x: np.ndarray, name: str) -> np.ndarray:
        return x if skip_post_norms or name not in w else _rms_norm(x, w[name], hp.eps)

    def qk_norm(y: np.ndarray, name: str) -> np.ndarray:
        """``y`` [tokens, width] normalized as the gain's width says, then split into heads."""
        if skip_qk_norm or name not in w:
            return y.reshape(n_tok, -1, hp.head_dim)
        gain = w[name]
        if gain.shape[0] == hp.head_dim:
            return _rms_norm(y.reshape(n_tok, -1, hp.head_dim), gain, hp.eps)
        if qk_norm_per_head:
            return _rms_norm(y.reshape(n_tok, -1, hp.head_dim), gain.reshape(-1, hp.head_dim), hp.eps)
        return _rms_norm(y, gain, hp.eps).reshape(n_tok, -1, hp.head_dim)

    for i in range(hp.n_layer):
        p = f"blk.{i}."
        h = pre_norm(x, p + "attn_norm.weight")
        qkv = []
        for t in ("q", "k", "v"):
            y = h @ w[p + f"attn_{t}.weight"].T
            if not drop_biases and p + f"attn_{t}.bias" in w:
                y = y + w[p + f"attn_{t}.bias"]
            qkv.append(y)
        q = qk_norm(qkv[0], p + "attn_q_norm.weight")
        k = qk_norm(qkv[1], p + "attn_k_norm.weight")
        v = qkv[2].reshape(n_tok, -1, hp.head_dim)
        q = _rope(q, hp.rope_base, hp.rope_interleaved, hp.inv_freq, hp.rope_mscale)
        k = _rope(k, hp.rope_base, hp.rope_interleaved, hp.inv_freq, hp.rope_mscale)
        heads = []
        for hd in range(hp.n_head):
            kh, vh = k[:, kv_of_head[hd]], v[:, kv_of_head[hd]]
            s = q[:, hd] @ kh.T / math.sqrt(hp.head_dim) + mask
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            heads.append((s / s.sum(axis=-1, keepdims=True)) @ vh)
        attn = np.concatenate(heads, axis=-1) @ w[p + "attn_output.weight"].T
        x = x + post_norm(attn, p + "post_attention_norm.weight")
        h = pre_norm(x, p + "ffn_norm.weight")
        g = h @ w[p + "ffn_gate.weight"].T
        silu = g * (1.0 / (1.0 + np.exp(-g)))
        ffn = (silu * (h @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T
        x = x + post_norm(ffn, p + "post_ffw_norm.weight")
    x = _rms_norm(x, w["output_norm.weight"], hp.eps)
    return x @ w.get("output.weight", w["token_embd.weight"]).T


def numpy_greedy(
    w: dict[str, np.ndarray], hp: HParams, prompt: list[int], n: int
) -> tuple[list[int], list[float]]:
    """Greedy tokens by full recomputation each step, and the top1 - top2 margin of each step."""
    ids, margins = list(prompt), []
    for _ in range(n):
        last = numpy_forward(w, hp, ids)[-1]
        top2 = np.sort(last)[-2:]
        margins.append(float(top2[1] - top2[0]))
        ids.append(int(np.argmax(last)))
    return ids[len(prompt) :], margins


# ---------------------------------------------------------------------------------------------------
# GGUF conversion
# ---------------------------------------------------------------------------------------------------


def permute_qk(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """``LlamaModel.permute`` of llama.cpp's convert_hf_to_gguf.py (HF rotate-half rows -> interleaved)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def hf_to_gguf_tensors(
    spec: FixtureSpec, cfg: Any, hf_tensors: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Rename (and for llama permute) the safetensors tensors, keeping the safetensors order."""
    import gguf

    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == spec.arch)
    name_map = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    out: dict[str, np.ndarray] = {}
    for hf_name, t in hf_tensors.items():
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"no GGUF name for {hf_name}")
        t = np.ascontiguousarray(t, dtype=np.float32)
        if spec.qk_permuted and hf_name.endswith("q_proj.weight"):
            t = permute_qk(t, cfg.num_attention_heads, cfg.num_attention_heads)
        elif spec.qk_permuted and hf_name.endswith("k_proj.weight"):
            t = permute_qk(t, cfg.num_attention_heads, cfg.num_key_value_heads)
        out[name] = np.ascontiguousarray(t)
    return out


def tokenizer_gguf_fields(tokenizer_json: Path) -> dict[str, Any]:
    """The ``tokenizer.ggml.*`` contents (gpt2 BPE) of a byte-level BPE ``tokenizer.json`` (the shared writer's)."""
    from minfer.testing.gguf_writing import hf_tokenizer_fields

    return hf_tokenizer_fields(tokenizer_json)


def write_gguf(
    path: Path, spec: FixtureSpec, cfg: Any, tensors: dict[str, np.ndarray], tok: dict[str, Any], q8_0: bool
) -> None:
    import gguf

    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    wr = gguf.GGUFWriter(path, spec.arch)
    wr.add_type(gguf.GGUFType.MODEL)
    wr.add_name(f"tiny-{spec.name}")
    wr.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if q8_0 else gguf.LlamaFileType.ALL_F32)
    if q8_0:
        wr.add_quantization_version(gguf.GGML_QUANT_VERSION)
    wr.add_block_count(cfg.num_hidden_layers)
    wr.add_context_length(cfg.max_position_embeddings)
    wr.add_embedding_length(cfg.hidden_size)
    wr.add_feed_forward_length(cfg.intermediate_size)
    wr.add_head_count(cfg.num_attention_heads)
    wr.add_head_count_kv(cfg.num_key_value_heads)
    wr.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    wr.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if spec.gguf_head_dims:
        wr.add_key_length(head_dim)
        wr.add_value_length(head_dim)
    if spec.gguf_llama_extras:
        wr.add_vocab_size(cfg.vocab_size)
        wr.add_rope_dimension_count(head_dim)
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre("default")
    wr.add_token_list(tok["tokens"])
    wr.add_token_types(tok["token_types"])
    wr.add_token_merges(tok["merges"])
    wr.add_bos_token_id(cfg.bos_token_id)
    wr.add_eos_token_id(cfg.eos_token_id)
    wr.add_pad_token_id(cfg.pad_token_id)
    wr.add_add_bos_token(True)
    wr.add_add_eos_token(False)
    for name, t in tensors.items():
        if q8_0 and t.ndim == 2:
            q = gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0)
            wr.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            wr.add_tensor(name, t)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()


def read_gguf_weights(path: Path) -> dict[str, np.ndarray]:
    """All tensors of a GGUF file, dequantized to float64, in GGUF row order."""
    import gguf

    reader = gguf.GGUFReader(path)
    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        data = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        out[t.name] = np.asarray(data, dtype=np.float64).reshape([int(d) for d in reversed(t.shape)])
    return out


def gguf_hparams(path: Path) -> HParams:
    """Hyper-parameters as an engine reads them from GGUF metadata (head dim n_embd / n_head if absent)."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()

    def get(key: str, default: Any = None) -> Any:
        f = reader.fields.get(f"{arch}.{key}")
        return default if f is None else f.contents()

    n_head = int(get("attention.head_count"))
    return HParams(
        n_layer=int(get("block_count")),
        n_head=n_head,
        n_head_kv=int(get("attention.head_count_kv")),
        head_dim=int(get("attention.key_length", int(get("embedding_length")) // n_head)),
        eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_base=float(get("rope.freq_base")),
        rope_interleaved=arch == "llama",  # llama.cpp: LLAMA_ROPE_TYPE_NORM; qwen2/qwen3: NEOX
    )


# ---------------------------------------------------------------------------------------------------
# transformers side
# ---------------------------------------------------------------------------------------------------


def build_model(spec: FixtureSpec) -> Any:
    import torch
    import transformers

    cls = getattr(transformers, spec.hf_class)
    model = cls(cls.config_class(**spec.config)).float()
    torch.manual_seed(spec.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                mean, std = 0.0, spec.bias_std
            elif p.ndim == 1:
                mean, std = 1.0, spec.norm_std
            else:
                mean, std = 0.0, spec.weight_std
            p.copy_(torch.randn(p.shape) * std + mean)
    return model.eval()


def save_hf_dir(spec: FixtureSpec, model: Any, tokenizer_json: Path, hf_dir: Path) -> tuple[Any, Any]:
    """Write ``hf/`` and reload it (fp32, eager attention): the references are taken from the reload.

    ``tokenizer.json`` is a byte copy of the input; ``config.json`` also carries the legacy keys
    ``rope_theta`` and ``torch_dtype`` and ``tokenizer_config.json`` names the fast tokenizer class
    and the BOS/EOS flags, for readers other than transformers 5.
    """
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast

    model.generation_config = GenerationConfig(
        bos_token_id=spec.config["bos_token_id"],
        eos_token_id=spec.config["eos_token_id"],
        pad_token_id=spec.config["pad_token_id"],
    )
    tokenizer_bytes = tokenizer_json.read_bytes()  # read first: --out may be the input folder itself
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tokenizer_bytes.decode("utf-8")),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
    )
    model.save_pretrained(hf_dir, safe_serialization=True)
    tok.save_pretrained(hf_dir)
    (hf_dir / "tokenizer.json").write_bytes(tokenizer_bytes)

    cfg_path = hf_dir / "config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["rope_theta"] = cfg["rope_parameters"]["rope_theta"]
    cfg["torch_dtype"] = "float32"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tc_path = hf_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text(encoding="utf-8"))
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc["add_bos_token"] = True
    tc["add_eos_token"] = False
    tc_path.write_text(json.dumps(tc, indent=2) + "\n", encoding="utf-8")

    reloaded = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    return reloaded.eval(), AutoTokenizer.from_pretrained(hf_dir)


def hf_logits(model: Any, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=False)
    return out.logits[0].float().numpy().copy()


def hf_intermediates(model: Any, ids: list[int]) -> dict[str, np.ndarray]:
    """Input of layer 0, residual stream after each layer, final norm output, output_hidden_states."""
    import torch

    inner = model.model
    captured: dict[str, Any] = {"layers": []}

    def first_in(_m: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        captured["embeddings"] = (args[0] if args else kwargs["hidden_states"]).detach().clone()

    def layer_out(_m: Any, _a: Any, out: Any) -> None:
        captured["layers"].append((out[0] if isinstance(out, tuple) else out).detach().clone())

    def norm_out(_m: Any, _a: Any, out: Any) -> None:
        captured["final_norm"] = out.detach().clone()

    hooks = [inner.layers[0].register_forward_pre_hook(first_in, with_kwargs=True)]
    hooks += [layer.register_forward_hook(layer_out) for layer in inner.layers]
    hooks.append(inner.norm.register_forward_hook(norm_out))
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), use_cache=False, output_hidden_states=True)
    finally:
        for hk in hooks:
            hk.remove()
    return {
        "embeddings": captured["embeddings"][0].numpy(),
        "layer_outputs": torch.stack([t[0] for t in captured["layers"]]).numpy(),
        "final_norm": captured["final_norm"][0].numpy(),
        "hidden_states": torch.stack([t[0] for t in out.hidden_states]).numpy(),
        "logits": out.logits[0].numpy(),
    }


def hf_greedy(model: Any, prompt: list[int]) -> tuple[list[int], list[float]]:
    """HF ``generate`` greedy with the KV cache; EOS is not an end condition."""
    import torch
    from transformers import GenerationConfig

    gen_cfg = GenerationConfig(
        do_sample=False,
        num_beams=1,
        use_cache=True,
        max_new_tokens=N_GREEDY,
        min_new_tokens=0,
        eos_token_id=None,
        bos_token_id=model.config.bos_token_id,
        pad_token_id=model.config.pad_token_id,
        output_logits=True,
        return_dict_in_generate=True,
    )
    saved_eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                generation_config=gen_cfg,
            )
    finally:
        model.generation_config.eos_token_id = saved_eos
    generated = [int(t) for t in out.sequences[0, len(prompt) :]]
    if len(generated) != N_GREEDY:
        raise RuntimeError(f"generate stopped after {len(generated)} tokens")
    margins = []
    for step in out.logits:
        top2 = torch.topk(step[0].float(), 2).values
        margins.append(float(top2[0] - top2[1]))
    return generated, margins


# ---------------------------------------------------------------------------------------------------
# fixture assembly
# ---------------------------------------------------------------------------------------------------


def _dump_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=1) + "\n", encoding="utf-8")


def _versions() -> dict[str, str]:
    import torch
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "gguf": importlib.metadata.version("gguf"),
        "numpy": np.__version__,
    }


def _bug_checks(
    spec: FixtureSpec,
    w: dict[str, np.ndarray],
    w_hf: dict[str, np.ndarray],
    hp: HParams,
    ids: list[int],
    base: np.ndarray,
) -> dict[str, float]:
    """Max |delta logits| caused by each simulated engine bug that applies to this architecture."""
    swapped = dataclasses.replace(hp, rope_interleaved=not hp.rope_interleaved)
    runs: dict[str, Callable[[], np.ndarray]] = {
        "wrong_rope_pairing": lambda: numpy_forward(w, swapped, ids),
        "wrong_gqa_mapping": lambda: numpy_forward(w, hp, ids, gqa_tiled=True),
    }
    if spec.qk_permuted:
        runs["missing_qk_permutation"] = lambda: numpy_forward(w_hf, hp, ids)
    if any(k.endswith("attn_q_norm.weight") for k in w):
        runs["skipped_qk_norm"] = lambda: numpy_forward(w, hp, ids, skip_qk_norm=True)
    if w.get("blk.0.attn_q_norm.weight", np.zeros(hp.head_dim)).shape[0] != hp.head_dim:
        runs["qk_norm_per_head"] = lambda: numpy_forward(w, hp, ids, qk_norm_per_head=True)
    if "blk.0.post_attention_norm.weight" in w:
        runs["skipped_post_norms"] = lambda: numpy_forward(w, hp, ids, skip_post_norms=True)
    if "blk.0.attn_norm.weight" not in w:
        runs["unit_pre_norms"] = lambda: numpy_forward(w, hp, ids, unit_pre_norms=True)
    if any(k.endswith(".bias") for k in w):
        runs["dropped_biases"] = lambda: numpy_forward(w, hp, ids, drop_biases=True)
    return {k: float(np.abs(f() - base).max()) for k, f in runs.items()}


def make_fixture(spec: FixtureSpec, out_dir: Path, tokenizer_json: Path) -> dict[str, Any]:
    """Write one fixture folder; return the self-check numbers."""
    from safetensors.numpy import load_file

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "q8_0_ref").mkdir(exist_ok=True)
    model, tok = save_hf_dir(spec, build_model(spec), tokenizer_json, out_dir / "hf")
    cfg = model.config
    config_dict = json.loads((out_dir / "hf" / "config.json").read_text(encoding="utf-8"))
    vocab = cfg.vocab_size

    # tokens.json
    rng = np.random.default_rng(spec.seed)
    bos = cfg.bos_token_id
    sequences = [[bos] + [int(t) for t in rng.integers(3, vocab, size=n - 1)] for n in SEQ_LENGTHS]
    prompt_ids = [int(t) for t in tok(PROMPT_TEXT)["input_ids"]]
    cases = []
    for text in TOKENIZER_TEXTS:
        ids = [int(t) for t in tok(text)["input_ids"]]
        cases.append(
            {
                "text": text,
                "ids_with_bos": ids,
                "decoded_without_specials": tok.decode(ids, skip_special_tokens=True),
            }
        )
    _dump_json(
        out_dir / "tokens.json",
        {
            "sequences": sequences,
            "prompt_text": PROMPT_TEXT,
            "prompt_ids": prompt_ids,
            "tokenizer_cases": cases,
            "special_ids": {"bos": bos, "eos": cfg.eos_token_id, "pad": cfg.pad_token_id},
            "add_bos": True,
        },
    )

    # transformers references
    stats: dict[str, Any] = {}
    logits = [hf_logits(model, s) for s in sequences]
    for k, lg in enumerate(logits):
        np.save(out_dir / f"logits_{k}.npy", lg)
        stats[f"logits_{k}"] = {
            "shape": list(lg.shape),
            "std_over_vocab_mean": float(lg.std(axis=-1).mean()),
            "absmax": float(np.abs(lg).max()),
        }
    inter = hf_intermediates(model, sequences[-1])
    for key in ("embeddings", "layer_outputs", "final_norm", "hidden_states"):
        np.save(out_dir / f"{key}.npy", inter[key])
    hs = inter["hidden_states"]
    stats["hidden_states"] = {
        "shape": list(hs.shape),
        "last_equals_final_norm": bool(np.array_equal(hs[-1], inter["final_norm"])),
        "inner_equal_layer_outputs": bool(np.array_equal(hs[1:-1], inter["layer_outputs"][:-1])),
    }
    generated, margins = hf_greedy(model, prompt_ids)
    greedy_logits = hf_logits(model, prompt_ids + generated[:-1])
    np.save(out_dir / "greedy_logits.npy", greedy_logits)
    argmax_no_cache = [int(t) for t in greedy_logits[len(prompt_ids) - 1 :].argmax(axis=-1)]
    _dump_json(
        out_dir / "greedy.json",
        {
            "prompt_ids": prompt_ids,
            "generated_ids": generated,
            "argmax_no_cache": argmax_no_cache,
            "cache_matches_no_cache": argmax_no_cache == generated,
            "top1_minus_top2": [round(m, 6) for m in margins],
            "min_margin": min(margins),
            "settings": GREEDY_SETTINGS,
        },
    )
    stats["greedy_min_margin"] = min(margins)
    stats["greedy_cache_matches_no_cache"] = argmax_no_cache == generated

    # GGUF files
    hf_tensors = load_file(out_dir / "hf" / "model.safetensors")
    tensors = hf_to_gguf_tensors(spec, cfg, hf_tensors)
    tok_fields = tokenizer_gguf_fields(out_dir / "hf" / "tokenizer.json")
    write_gguf(out_dir / "model-f32.gguf", spec, cfg, tensors, tok_fields, q8_0=False)
    write_gguf(out_dir / "model-q8_0.gguf", spec, cfg, tensors, tok_fields, q8_0=True)

    # float64 numpy reference over the dequantized Q8_0 weights
    hp = gguf_hparams(out_dir / "model-q8_0.gguf")
    w_q8 = read_gguf_weights(out_dir / "model-q8_0.gguf")
    q8_meta: dict[str, Any] = {}
    for k, s in enumerate(sequences):
        ref = numpy_forward(w_q8, hp, s)
        np.save(out_dir / "q8_0_ref" / f"logits_{k}.npy", ref.astype(np.float32))
        q8_meta[f"max_abs_diff_vs_hf_f32_seq{k}"] = float(np.abs(ref - logits[k]).max())
    q8_generated, q8_margins = numpy_greedy(w_q8, hp, prompt_ids, N_GREEDY)
    _dump_json(
        out_dir / "q8_0_ref" / "greedy.json",
        {
            "prompt_ids": prompt_ids,
            "generated_ids": q8_generated,
            "top1_minus_top2": [round(m, 6) for m in q8_margins],
            "min_margin": min(q8_margins),
            "same_as_hf_f32_greedy": q8_generated == generated,
            "note": Q8_NOTE,
        },
    )
    q8_meta["greedy_same_as_hf_f32"] = q8_generated == generated
    q8_meta["greedy_min_margin"] = min(q8_margins)

    _dump_json(
        out_dir / "meta.json",
        {
            "name": spec.name,
            "hf_class": spec.hf_class,
            "config": config_dict,
            "init": {
                "weight_std": spec.weight_std,
                "norm_std": spec.norm_std,
                "bias_std": spec.bias_std,
                "seed": spec.seed,
            },
            "gguf": {
                "arch": spec.arch,
                "tensors": {name: list(t.shape) for name, t in tensors.items()},
                "q8_0_ref": q8_meta,
                "has_output_weight": "output.weight" in tensors,
                "qk_permuted": spec.qk_permuted,
                "rope_style": ROPE_NORM if hp.rope_interleaved else ROPE_NEOX,
            },
            "stats": stats,
            "versions": _versions(),
        },
    )

    # self-check: the numpy forward reproduces transformers from both weight files; bugs are visible
    w_f32 = read_gguf_weights(out_dir / "model-f32.gguf")
    hp_f32 = gguf_hparams(out_dir / "model-f32.gguf")
    unpermuted = hf_to_gguf_tensors(dataclasses.replace(spec, qk_permuted=False), cfg, hf_tensors)
    w_hf = {n: np.asarray(t, dtype=np.float64) for n, t in unpermuted.items()}
    hp_hf = dataclasses.replace(hp_f32, rope_interleaved=False)
    diffs_gguf, diffs_hf = [], []
    for s, lg in [*zip(sequences, logits, strict=True), (prompt_ids + generated[:-1], greedy_logits)]:
        diffs_gguf.append(float(np.abs(numpy_forward(w_f32, hp_f32, s) - lg).max()))
        diffs_hf.append(float(np.abs(numpy_forward(w_hf, hp_hf, s) - lg).max()))
    base = numpy_forward(w_f32, hp_f32, sequences[-1])
    return {
        "numpy_vs_hf_from_gguf_f32": max(diffs_gguf),
        "numpy_vs_hf_from_safetensors": max(diffs_hf),
        "hidden_states_consistent": stats["hidden_states"]["last_equals_final_norm"]
        and stats["hidden_states"]["inner_equal_layer_outputs"],
        "greedy_cache_matches_no_cache": stats["greedy_cache_matches_no_cache"],
        "bugs": _bug_checks(spec, w_f32, w_hf, hp_f32, sequences[-1], base),
    }


# ---------------------------------------------------------------------------------------------------
# comparison with a committed fixture folder
# ---------------------------------------------------------------------------------------------------


def _json_structure(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _json_structure(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_structure(v) for v in obj]
    return type(obj).__name__


def _compare_gguf(new: Path, ref: Path) -> str:
    import gguf

    a, b = gguf.GGUFReader(new), gguf.GGUFReader(ref)
    if list(a.fields) != list(b.fields):
        return f"metadata keys differ: {sorted(set(a.fields) ^ set(b.fields))}"
    bad_kv = [k for k in a.fields if a.fields[k].contents() != b.fields[k].contents()]
    if bad_kv:
        return f"metadata values differ: {bad_kv}"
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    if list(ta) != list(tb):
        return "tensor names/order differ"
    worst = 0.0
    for n, t in ta.items():
        u = tb[n]
        if t.tensor_type != u.tensor_type or list(t.shape) != list(u.shape):
            return f"{n}: type/shape differ"
        if not np.array_equal(np.asarray(t.data), np.asarray(u.data)):
            da = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
            db = gguf.quants.dequantize(np.asarray(u.data), u.tensor_type)
            worst = max(worst, float(np.abs(da.astype(np.float64) - db).max()))
    return "same metadata, tensors bit-equal" if worst == 0.0 else f"same structure, max |dw| {worst:.3g}"


def compare_dirs(new: Path, ref: Path) -> bool:
    """Print a per-file comparison of ``new`` against ``ref``; True when every file is bit-equal."""
    all_equal = True
    new_files = sorted(p.relative_to(new) for p in new.rglob("*") if p.is_file())
    ref_files = sorted(p.relative_to(ref) for p in ref.rglob("*") if p.is_file())
    for rel in sorted(set(new_files) | set(ref_files)):
        pn, pr = new / rel, ref / rel
        if not pn.exists() or not pr.exists():
            print(f"    {rel}: only in {'reference' if pr.exists() else 'output'}")
            all_equal = False
            continue
        if pn.read_bytes() == pr.read_bytes():
            print(f"    {rel}: bit-equal")
            continue
        all_equal = False
        if rel.suffix == ".npy":
            a, b = np.load(pn), np.load(pr)
            if a.shape != b.shape or a.dtype != b.dtype:
                detail = f"shape/dtype {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
            else:
                detail = f"max |diff| {float(np.abs(a.astype(np.float64) - b).max()):.3g}"
        elif rel.suffix == ".json":
            ja, jb = json.loads(pn.read_text(encoding="utf-8")), json.loads(pr.read_text(encoding="utf-8"))
            same_struct = _json_structure(ja) == _json_structure(jb)
            detail = "same structure, values differ" if same_struct else "STRUCTURE DIFFERS"
            if same_struct and isinstance(ja, dict):
                detail += f" in keys {[k for k in ja if ja[k] != jb[k]]}"
        elif rel.suffix == ".gguf":
            detail = _compare_gguf(pn, pr)
        else:
            detail = "bytes differ"
        print(f"    {rel}: {detail}")
    return all_equal


# ---------------------------------------------------------------------------------------------------
# variants: the same weights with a scaled RoPE, or rounded to bf16 / f16. Only references are written
# (``<name>/variants/<variant>/``); the tests derive the HF folder and the GGUF file of a variant from the
# base fixture's files at test time, so the weights are not committed twice.
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RopeVariant:
    base: str  # the fixture whose weights it reuses
    name: str
    rope_parameters: dict[str, Any]  # config.json rope_parameters (transformers 5)


ROPE_VARIANTS = (
    # a short original context so that all three Llama 3 regimes occur with head dim 16 (pair 0 kept,
    # pairs 1-2 smoothed, pairs 3-7 divided by 8) and the scaling visibly changes 33-token logits
    RopeVariant("llama", "llama3", {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 64}),
    # YaRN as Qwen3 long-context checkpoints use it, with a short original context and a non-default beta
    RopeVariant("qwen3", "yarn", {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                                  "original_max_position_embeddings": 64, "beta_fast": 16.0, "beta_slow": 1.0}),
)
# variant -> (torch dtype, fixtures): bf16 for every architecture, f16 (the same code path) for one
DTYPE_VARIANTS = {"bf16": ("bfloat16", ("llama", "qwen2", "qwen3", "olmo2")), "f16": ("float16", ("llama",))}


def llama3_rope_freqs(rope: dict[str, Any], head_dim: int) -> list[float]:
    """``rope_freqs.weight`` as llama.cpp's convert_hf_to_gguf.py computes it for ``rope_type: llama3``
    (float32 torch), except that the original context comes from the rope parameters: the converter reads a
    top-level ``original_max_position_embeddings`` (default 8192), which would describe another model here."""
    import torch

    base = rope["rope_theta"]
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context_len = rope["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            out.append(1.0)
        elif wavelen > low_freq_wavelen:
            out.append(factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            out.append(float(1 / ((1 - smooth) / factor + smooth)))
    return [float(np.float32(v)) for v in out]


def yarn_llamacpp(n_rot: int, base: float, factor: float, n_ctx_orig: int, beta_fast: float,
                  beta_slow: float) -> tuple[np.ndarray, float]:
    """Per-pair frequencies and cos/sin magnitude of llama.cpp's YaRN (``rope_yarn``,
    ``ggml_rope_yarn_corr_dims``, ``yarn_attn_factor``), in float64: independent of transformers' code."""

    def corr_dim(n_rotations: float) -> float:
        return n_rot * math.log(n_ctx_orig / (n_rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(0.0, math.floor(corr_dim(beta_fast)))
    high = min(n_rot - 1.0, math.ceil(corr_dim(beta_slow)))
    i = np.arange(n_rot // 2, dtype=np.float64)
    extrap = base ** (-2.0 * i / n_rot)
    interp = extrap / factor
    ramp = 1.0 - np.clip((i - low) / max(0.001, high - low), 0.0, 1.0)
    return interp * (1 - ramp) + extrap * ramp, 1.0 + 0.1 * math.log(factor)


def _weights_equal_base(model: Any, base_hf: Path) -> bool:
    from safetensors.numpy import load_file

    saved = load_file(base_hf / "model.safetensors")
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return all(np.array_equal(state[k], v) for k, v in saved.items())


def make_rope_variant(variant: RopeVariant, base_dir: Path, out_dir: Path) -> dict[str, Any]:
    """References for the base fixture's weights with ``variant.rope_parameters``; returns the self-check."""
    import tempfile

    spec = SPECS[variant.base]
    vspec = dataclasses.replace(spec, config={**spec.config, "rope_parameters": dict(variant.rope_parameters)})
    model = build_model(vspec)
    if not _weights_equal_base(model, base_dir / "hf"):
        raise RuntimeError(f"{variant.name}: the weights differ from {base_dir / 'hf'}")
    with tempfile.TemporaryDirectory() as tmp:
        model, _ = save_hf_dir(vspec, model, base_dir / "hf" / "tokenizer.json", Path(tmp) / "hf")
        config_text = (Path(tmp) / "hf" / "config.json").read_text(encoding="utf-8")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(config_text, encoding="utf-8")
    sequences = json.loads((base_dir / "tokens.json").read_text(encoding="utf-8"))["sequences"]
    logits = [hf_logits(model, seq) for seq in sequences]
    np.save(out_dir / "logits_2.npy", logits[-1])  # the 33-token sequence: every position 0..32
    rotary = model.model.rotary_emb
    inv_freq = rotary.inv_freq.double().numpy()
    mscale = float(rotary.attention_scaling)

    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = variant.rope_parameters
    base_freqs = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    gguf_kv: dict[str, Any] = {}
    rope_freqs = None
    if rope["rope_type"] == "llama3":
        rope_freqs = llama3_rope_freqs(rope, head_dim)
        gguf_freqs, gguf_mscale = base_freqs / np.asarray(rope_freqs, dtype=np.float64), 1.0
    else:
        arch = spec.arch
        gguf_kv = {f"{arch}.rope.scaling.type": "yarn", f"{arch}.rope.scaling.factor": rope["factor"],
                   f"{arch}.rope.scaling.original_context_length": rope["original_max_position_embeddings"],
                   f"{arch}.rope.scaling.yarn_beta_fast": rope["beta_fast"],
                   f"{arch}.rope.scaling.yarn_beta_slow": rope["beta_slow"]}
        gguf_freqs, gguf_mscale = yarn_llamacpp(head_dim, rope["rope_theta"], rope["factor"],
                                                rope["original_max_position_embeddings"], rope["beta_fast"],
                                                rope["beta_slow"])

    # independent checks: the numpy forward with transformers' frequencies from the HF weights, and with
    # llama.cpp's (rope_freqs.weight / YaRN keys) from the GGUF-layout weights, both reproduce the logits
    hf_tensors = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        hf_tensors.pop("lm_head.weight", None)
    w_hf = {n: t.astype(np.float64) for n, t in
            hf_to_gguf_tensors(dataclasses.replace(spec, qk_permuted=False), cfg, hf_tensors).items()}
    w_gguf = {n: t.astype(np.float64) for n, t in hf_to_gguf_tensors(spec, cfg, hf_tensors).items()}
    hp = HParams(n_layer=cfg.num_hidden_layers, n_head=cfg.num_attention_heads, n_head_kv=cfg.num_key_value_heads,
                 head_dim=head_dim, eps=cfg.rms_norm_eps, rope_base=rope["rope_theta"], rope_interleaved=False,
                 inv_freq=tuple(inv_freq), rope_mscale=mscale)
    hp_gguf = dataclasses.replace(hp, rope_interleaved=spec.qk_permuted, inv_freq=tuple(gguf_freqs),
                                  rope_mscale=gguf_mscale)
    unscaled = dataclasses.replace(hp, inv_freq=None, rope_mscale=1.0)
    check = {
        "numpy_vs_hf_transformers_freqs": max(float(np.abs(numpy_forward(w_hf, hp, s) - lg).max())
                                              for s, lg in zip(sequences, logits, strict=True)),
        "numpy_vs_hf_llamacpp_freqs_gguf_layout": max(float(np.abs(numpy_forward(w_gguf, hp_gguf, s) - lg).max())
                                                      for s, lg in zip(sequences, logits, strict=True)),
        "llamacpp_vs_transformers_freqs_max_rel": float(np.abs(gguf_freqs / inv_freq - 1).max()),
        "llamacpp_vs_transformers_mscale": gguf_mscale - mscale,
        "scaling_effect_vs_unscaled": float(np.abs(numpy_forward(w_hf, unscaled, sequences[-1]) - logits[-1]).max()),
    }
    _dump_json(out_dir / "meta.json", {
        "base": variant.base,
        "rope_parameters": rope,
        "transformers": {"inv_freq": inv_freq.tolist(), "attention_scaling": mscale},
        "gguf": {"metadata": gguf_kv, "rope_freqs": rope_freqs},
        "self_check": check,
        "versions": _versions(),
    })
    return check


def make_dtype_variant(name: str, dtype: str, base_dir: Path, out_dir: Path) -> dict[str, Any]:
    """transformers' fp32 logits of the 33-token sequence with every weight rounded to ``dtype`` first."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir / "hf", dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(getattr(torch, dtype)).float())
    seq = json.loads((base_dir / "tokens.json").read_text(encoding="utf-8"))["sequences"][-1]
    lg = hf_logits(model.eval(), seq)
    out_dir.mkdir(parents=True, exist_ok=True)
    np.save(out_dir / "logits_2.npy", lg)
    w = {n: t.astype(np.float64) for n, t in read_gguf_weights(base_dir / "model-f32.gguf").items()}
    rounded = {n: torch.from_numpy(t.astype(np.float32)).to(getattr(torch, dtype)).double().numpy()
               for n, t in w.items()}
    hp = gguf_hparams(base_dir / "model-f32.gguf")
    check = {
        "numpy_vs_hf": float(np.abs(numpy_forward(rounded, hp, seq) - lg).max()),
        "vs_fp32_logits": float(np.abs(lg - np.load(base_dir / "logits_2.npy")).max()),
        "max_rel_weight_rounding": max(float((np.abs(rounded[n] - t) / np.maximum(np.abs(t), 1e-30)).max())
                                       for n, t in w.items()),
    }
    _dump_json(out_dir / "meta.json", {"base": name, "dtype": dtype, "self_check": check, "versions": _versions()})
    return check


ROPE_REF_CASES: tuple[dict[str, Any], ...] = (
    {"head_dim": 16, "max_position_embeddings": 256, "rope_parameters": {"rope_type": "linear", "rope_theta": 1e4,
                                                                          "factor": 2.0}},
    {"head_dim": 16, "max_position_embeddings": 256, "rope_parameters": ROPE_VARIANTS[0].rope_parameters},
    {"head_dim": 128, "max_position_embeddings": 131072,
     "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    {"head_dim": 32, "max_position_embeddings": 256, "rope_parameters": ROPE_VARIANTS[1].rope_parameters},
    {"head_dim": 128, "max_position_embeddings": 131072,
     "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                         "original_max_position_embeddings": 32768}},
    {"head_dim": 64, "max_position_embeddings": 16384,
     "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                         "original_max_position_embeddings": 4096, "truncate": False, "attention_factor": 0.9}},
    {"head_dim": 64, "max_position_embeddings": 163840,
     "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 0.707, "mscale_all_dim": 0.707}},
    {"head_dim": 64, "max_position_embeddings": 163840,
     "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 0.5}},
)


def make_rope_refs(path: Path) -> None:
    """transformers' ``ROPE_INIT_FUNCTIONS`` (inverse frequencies, attention factor) for a few configs."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cases = []
    for case in ROPE_REF_CASES:
        cfg = LlamaConfig(hidden_size=4 * case["head_dim"], num_attention_heads=4, head_dim=case["head_dim"],
                          max_position_embeddings=case["max_position_embeddings"],
                          rope_parameters=dict(case["rope_parameters"]))
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[case["rope_parameters"]["rope_type"]](cfg)
        cases.append({"config": case, "inv_freq": inv_freq.double().tolist(), "attention_factor": attention_factor})
    _dump_json(path, {"note": "transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS on LlamaConfig(**config)",
                      "cases": cases, "versions": _versions()})


# ---------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, required=True, help="output folder (one sub-folder per fixture)")
    ap.add_argument("--only", default=",".join(SPECS), help="comma-separated subset of: " + ",".join(SPECS))
    ap.add_argument(
        "--tokenizers",
        type=Path,
        default=DEFAULT_TOKENIZERS,
        help="folder holding <name>/hf/tokenizer.json (default: tests/fixtures)",
    )
    ap.add_argument(
        "--compare",
        type=Path,
        default=None,
        help="compare the output with this fixture folder (e.g. tests/fixtures)",
    )
    ap.add_argument(
        "--variants-only",
        action="store_true",
        help="skip the base fixtures; write the variants (and rope_scaling_refs.json) from the base fixtures "
        "already in --out (or in tests/fixtures when --out has none)",
    )
    args = ap.parse_args(argv)

    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in SPECS]
    if unknown:
        ap.error(f"unknown fixture(s) {unknown}; choose from {list(SPECS)}")
    ok = True
    for name in [] if args.variants_only else names:
        tokenizer_json = args.tokenizers / (SPECS[name].tokenizer_from or name) / "hf" / "tokenizer.json"
        print(f"[{name}] building into {args.out / name} (tokenizer {tokenizer_json})")
        check = make_fixture(SPECS[name], args.out / name, tokenizer_json)
        bugs = check.pop("bugs")
        print(
            f"[{name}] numpy float64 vs transformers logits, max |diff|: "
            f"from GGUF F32 {check['numpy_vs_hf_from_gguf_f32']:.3g}, "
            f"from safetensors {check['numpy_vs_hf_from_safetensors']:.3g} (tolerance {TOL:g})"
        )
        print(
            f"[{name}] simulated bugs, max |delta logits|: "
            + ", ".join(f"{k} {v:.3g}" for k, v in bugs.items())
        )
        good = (
            check["numpy_vs_hf_from_gguf_f32"] <= TOL
            and check["numpy_vs_hf_from_safetensors"] <= TOL
            and check["hidden_states_consistent"]
            and check["greedy_cache_matches_no_cache"]
            and min(bugs.values()) > MIN_BUG_EFFECT
        )
        print(f"[{name}] self-check {'passed' if good else 'FAILED'}: {check}")
        ok = ok and good
        if args.compare is not None:
            print(f"[{name}] comparison with {args.compare / name}:")
            same = compare_dirs(args.out / name, args.compare / name)
            print(f"[{name}] {'all files bit-equal' if same else 'some files differ (see above)'}")
    ok = make_variants(names, args.out, args.compare) and ok
    return 0 if ok else 1


def make_variants(names: list[str], out: Path, compare: Path | None) -> bool:
    ok = True
    for name in names:
        base_dir = out / name if (out / name / "hf").is_dir() else DEFAULT_TOKENIZERS / name
        jobs: list[tuple[str, Callable[[Path], dict[str, Any]]]] = [
            (v.name, functools.partial(make_rope_variant, v, base_dir)) for v in ROPE_VARIANTS if v.base == name
        ]
        jobs += [(v, functools.partial(make_dtype_variant, name, t, base_dir))
                 for v, (t, bases) in DTYPE_VARIANTS.items() if name in bases]
        for vname, job in jobs:
            vdir = out / name / "variants" / vname
            check = job(vdir)
            if "numpy_vs_hf" in check:
                good = check["numpy_vs_hf"] <= TOL
            else:
                good = (check["numpy_vs_hf_transformers_freqs"] <= TOL
                        and check["numpy_vs_hf_llamacpp_freqs_gguf_layout"] <= TOL
                        and check["scaling_effect_vs_unscaled"] > MIN_BUG_EFFECT)
            print(f"[{name}/{vname}] self-check {'passed' if good else 'FAILED'}: {check}")
            ok = ok and good
            if compare is not None and (compare / name / "variants" / vname).is_dir():
                same = compare_dirs(vdir, compare / name / "variants" / vname)
                print(f"[{name}/{vname}] {'all files bit-equal' if same else 'some files differ (see above)'}")
    make_rope_refs(out / "rope_scaling_refs.json")
    print(f"[rope] transformers' RoPE scaling references written to {out / 'rope_scaling_refs.json'}")
    return ok


if __name__ == "__main__":
    sys.exit(main())
