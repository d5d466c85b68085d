"""Build the tiny random-weight Gemma 3 fixture in ``tests/fixtures/gemma3``.

A sibling of ``make_fixtures.py`` (whose helpers it reuses) for the ``gemma3`` architecture, run in the
reference environment (torch 2.13.0 CPU, transformers 5.24.0, gguf 0.19.0, tokenizers, safetensors)::

    /opt/refenv/bin/python scripts/make_gemma3_fixture.py --out DIR [--compare tests/fixtures]

``--out DIR`` receives ``DIR/gemma3``; copy it over ``tests/fixtures/gemma3``. ``--compare REF`` reports
how each regenerated file compares with ``REF/gemma3``.

Recipe:

1. Tokenizer: a SentencePiece-style vocabulary laid out like Gemma's: control tokens ``<pad> <eos> <bos>
   <unk> <mask> <start_of_turn> <end_of_turn>`` (ids 0..6), user-defined ``"\\n"``, ``"\\n\\n"`` and a
   run of two real spaces (as Gemma stores it), the 256 byte tokens ``<0x00>``..``<0xFF>``, then the
   pieces of a byte-pair vocabulary that ``tokenizers``' ``BpeTrainer`` learns from ``CORPUS`` (▁ marks a
   space; alphabet first, then merge results in merge order, so that the file order is the merge order,
   which is what transformers and llama.cpp rebuild the merges from). Scores: minus the id for pieces,
   -1000 for control tokens, 0 for bytes. The HF ``tokenizer.json`` is what transformers builds from that
   GGUF vocabulary (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``), with Gemma 3's chat template.
2. Config (``CONFIG``): ``Gemma3TextConfig``, hidden 32, 7 layers (the 6-layer pattern: layers 0-4 and 6
   sliding-window, 5 global), 4 query heads, 2 kv heads, head dim 16 (n_head x head_dim = 64 != hidden),
   ffn 64, sliding window 6, query_pre_attn_scalar = head_dim (the scale llama.cpp assumes), global RoPE
   theta 1e6 with linear scaling x8 (as the 4B+ models), local theta 1e4, tied embeddings, eager attention.
3. Weights: ``torch.manual_seed(SEED)``, then per parameter in order ``randn * std + mean``: matrices
   (0, 0.15), embeddings (0, 0.3), norm weights (0, 0.2) (Gemma's RMSNorm multiplies by 1 + w).
4. ``hf/``: ``save_pretrained`` (fp32 safetensors), reloaded with ``attn_implementation="eager"``; all
   references are taken from the reload.
5. GGUF as llama.cpp's ``convert_hf_to_gguf.py`` ``Gemma3Model`` writes it: every ``*norm.weight`` + 1,
   tensor names from gguf's ``TensorNameMap``, no ``output.weight`` (tied), keys ``gemma3.*`` including
   ``attention.sliding_window``, ``attention.key_length``/``value_length``, ``rope.freq_base`` (global),
   ``rope.scaling.type`` linear / ``rope.scaling.factor``; the tokenizer as ``tokenizer.ggml.model =
   "llama"`` with ``add_space_prefix`` false. ``model-f32.gguf`` all F32; ``model-q8_0.gguf`` 2-D tensors
   Q8_0.
6. References (layout of the other fixtures, see tests/fixtures/README.md): ``tokens.json``, ``logits_<k>
   .npy``, ``embeddings.npy`` (the scaled embeddings, input of layer 0), ``layer_outputs.npy``,
   ``final_norm.npy``, ``hidden_states.npy``, ``greedy.json`` + ``greedy_logits.npy``, ``q8_0_ref/``
   (float64 numpy forward over the dequantized Q8_0 weights), ``chat.json`` (transformers'
   ``apply_chat_template`` of a few conversations), ``meta.json``; and ``variants/bf16/`` (transformers'
   logits of the 33-token sequence with the HF weights rounded to bf16, as make_fixtures.py's variants).

Self-check (the script exits non-zero when it fails): a float64 numpy Gemma 3 forward written here from
the GGUF's weights reproduces transformers' logits within ``TOL``; each plausible engine bug (window off by
one, every layer global, local RoPE base = global, no embedding scale, no post norms, exact instead of tanh
GELU, wrong attention scale, wrong RoPE pairing, global RoPE scaling ignored or applied to local layers)
moves the logits by more than ``MIN_BUG_EFFECT`` (exact GELU: ``MIN_GELU_EFFECT``, ten times the engine's
1e-4 contract).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import make_fixtures as mf  # the script's own folder is on sys.path when it runs
import numpy as np

NAME = "gemma3"
SEED = 3303
TOL = 2e-5
MIN_BUG_EFFECT = 0.1
# tanh vs exact (erf) GELU differ by at most ~5e-4 per activation: its effect on the logits is small, but it
# must still be far above the engine's 1e-4 contract to be caught by it
MIN_GELU_EFFECT = 1e-3
SEQ_LENGTHS = (1, 7, 33)
N_GREEDY = 16
PROMPT_TEXT = "The capital of France is"
WEIGHT_STD, EMBED_STD, NORM_STD = 0.15, 0.3, 0.2
ROPE_LINEAR_FACTOR = 8.0

CONFIG: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 7,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "query_pre_attn_scalar": 16,
    "sliding_window": 6,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh",
    "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": ROPE_LINEAR_FACTOR, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    },
    "tie_word_embeddings": True,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "pad_token_id": 0,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
}

CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
USER_DEFINED = ["\n", "\n\n", "  "]
CORPUS = [
    "The capital of France is Paris. The capital of Japan is Tokyo. The capital of Italy is Rome.",
    "Hello, world! How are you doing today? I am fine, thank you, and you?",
    "Once upon a time, in a small village, there lived a cat and a dog who were the best of friends.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
    "She sells sea shells by the sea shore; the shells she sells are surely sea shells.",
    "1234567890 3.14159 2026-11-29 the theory of everything, in theory and in practice.",
    "What is the answer? The answer is forty-two. Questions and answers, again and again.",
]
BPE_VOCAB = 120  # alphabet + merges learned from CORPUS
TOKENIZER_TEXTS = (
    PROMPT_TEXT,
    "Hello, world! 123",
    "  leading spaces and\nnewlines\ttabs",
    "unicode: café – naïve ✓ 日本",
    "<start_of_turn>user\nhi<end_of_turn>\n",
)
CONVERSATIONS = [
    {"messages": [{"role": "user", "content": "Hi there!"}], "add_generation_prompt": True},
    {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": " What is 2+2? "},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3?"},
        ],
        "add_generation_prompt": True,
    },
]

# Gemma 3's chat template as published with google/gemma-3-*-it (tokenizer_config.json)
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    '    {%- set first_user_prefix = "" -%}\n'
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    '        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}\n'
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    '        {%- set role = "model" -%}\n'
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    '        {{ raise_exception("Invalid content type") }}\n'
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n"
)


# ---------------------------------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------------------------------


def build_vocabulary() -> dict[str, Any]:
    """The ``tokenizer.ggml.*`` contents of the fixture's SentencePiece-style vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never", split=True)
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, show_progress=False, special_tokens=[])
    bpe.train_from_iterator(CORPUS, trainer)
    learned = json.loads(bpe.to_str())["model"]
    merged = ["".join(m) if isinstance(m, list) else m.replace(" ", "") for m in learned["merges"]]
    alphabet = sorted((p for p in learned["vocab"] if p not in set(merged)), key=learned["vocab"].get)
    pieces: list[str] = []
    for p in alphabet + merged:
        if p not in pieces and p not in USER_DEFINED:
            pieces.append(p)
    tokens = CONTROL + USER_DEFINED + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [3] * len(CONTROL) + [4] * len(USER_DEFINED) + [6] * 256 + [1] * len(pieces)
    offset = len(tokens) - len(pieces)
    scores = (
        [-1000.0] * len(CONTROL) + [0.0] * (offset - len(CONTROL)) + [-float(i) for i in range(offset, len(tokens))]
    )
    return {"tokens": tokens, "token_types": types, "scores": scores}


def add_tokenizer_keys(wr: Any, vocab: dict[str, Any], with_template: bool) -> None:
    wr.add_tokenizer_model("llama")
    wr.add_tokenizer_pre("default")
    wr.add_token_list(vocab["tokens"])
    wr.add_token_scores(vocab["scores"])
    wr.add_token_types(vocab["token_types"])
    wr.add_bos_token_id(CONFIG["bos_token_id"])
    wr.add_eos_token_id(CONFIG["eos_token_id"])
    wr.add_unk_token_id(CONTROL.index("<unk>"))
    wr.add_pad_token_id(CONFIG["pad_token_id"])
    wr.add_add_bos_token(True)
    wr.add_add_eos_token(False)
    wr.add_add_space_prefix(False)
    if with_template:
        wr.add_chat_template(GEMMA3_CHAT_TEMPLATE)


def transformers_tokenizer(vocab: dict[str, Any], tmp: Path) -> Any:
    """What transformers builds from a GGUF holding this vocabulary (a metadata-only file)."""
    import gguf
    from transformers import AutoTokenizer

    path = tmp / "vocab.gguf"
    wr = gguf.GGUFWriter(path, "gemma3")
    write_hparams(wr)
    add_tokenizer_keys(wr, vocab, with_template=True)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    tok = AutoTokenizer.from_pretrained(str(tmp), gguf_file=path.name)
    tok.chat_template = GEMMA3_CHAT_TEMPLATE
    return tok


# ---------------------------------------------------------------------------------------------------
# GGUF
# ---------------------------------------------------------------------------------------------------


def write_hparams(wr: Any) -> None:
    import gguf

    c = CONFIG
    wr.add_context_length(c["max_position_embeddings"])
    wr.add_embedding_length(c["hidden_size"])
    wr.add_block_count(c["num_hidden_layers"])
    wr.add_feed_forward_length(c["intermediate_size"])
    wr.add_head_count(c["num_attention_heads"])
    wr.add_head_count_kv(c["num_key_value_heads"])
    wr.add_layer_norm_rms_eps(c["rms_norm_eps"])
    wr.add_key_length(c["head_dim"])
    wr.add_value_length(c["head_dim"])
    wr.add_rope_freq_base(c["rope_parameters"]["full_attention"]["rope_theta"])
    wr.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    wr.add_rope_scaling_factor(ROPE_LINEAR_FACTOR)
    wr.add_sliding_window(c["sliding_window"])


def gguf_tensors(hf_tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """convert_hf_to_gguf.py's Gemma3Model: names mapped, ``*norm.weight`` + 1, lm_head dropped."""
    import gguf

    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, CONFIG["num_hidden_layers"])
    out: dict[str, np.ndarray] = {}
    for hf_name, t in hf_tensors.items():
        if hf_name == "lm_head.weight":
            continue
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"no GGUF name for {hf_name}")
        t = np.asarray(t, dtype=np.float32)
        if hf_name.endswith("norm.weight"):
            t = t + np.float32(1.0)
        out[name] = np.ascontiguousarray(t)
    return out


def write_gguf(path: Path, tensors: dict[str, np.ndarray], vocab: dict[str, Any], q8_0: bool) -> None:
    import gguf

    wr = gguf.GGUFWriter(path, "gemma3")
    wr.add_type(gguf.GGUFType.MODEL)
    wr.add_name("tiny-gemma3")
    wr.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if q8_0 else gguf.LlamaFileType.ALL_F32)
    if q8_0:
        wr.add_quantization_version(gguf.GGML_QUANT_VERSION)
    write_hparams(wr)
    add_tokenizer_keys(wr, vocab, with_template=True)
    for name, t in tensors.items():
        if q8_0 and t.ndim == 2:
            wr.add_tensor(
                name, gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0
            )
        else:
            wr.add_tensor(name, t)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()


# ---------------------------------------------------------------------------------------------------
# float64 numpy forward (GGUF names and gains)
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Gemma3HParams:
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    eps: float
    window: int  # 0: every layer global
    rope_global: float
    rope_local: float
    global_freq_scale: float
    local_freq_scale: float = 1.0
    attn_scale: float = 0.0  # 0: 1 / sqrt(head_dim)
    embd_scale: bool = True
    post_norms: bool = True
    gelu_tanh: bool = True
    neox: bool = True

    def is_local(self, il: int) -> bool:
        return self.window > 0 and il % 6 < 5


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, base: float, freq_scale: float, neox: bool) -> np.ndarray:
    n_tok, _, d = x.shape
    inv = freq_scale / base ** (np.arange(0, d, 2, dtype=np.float64) / d)
    ang = np.arange(n_tok, dtype=np.float64)[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = np.empty_like(x)
    if neox:
        a, b = x[..., : d // 2], x[..., d // 2 :]
        out[..., : d // 2] = a * cos - b * sin
        out[..., d // 2 :] = b * cos + a * sin
    else:
        a, b = x[..., 0::2], x[..., 1::2]
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
    return out


def _gelu(x: np.ndarray, tanh: bool) -> np.ndarray:
    if tanh:
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    from math import erf

    return 0.5 * x * (1 + np.vectorize(erf)(x / math.sqrt(2)))


def numpy_forward(w: dict[str, np.ndarray], hp: Gemma3HParams, ids: list[int]) -> np.ndarray:
    """Logits ``[tokens, vocab]`` (float64) of the Gemma 3 decoder, no cache; flags in ``hp`` simulate bugs."""
    n = len(ids)
    x = w["token_embd.weight"][np.asarray(ids)]
    if hp.embd_scale:
        x = x * math.sqrt(x.shape[1])
    rep = hp.n_head // hp.n_head_kv
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    scale = hp.attn_scale or 1 / math.sqrt(hp.head_dim)
    for il in range(hp.n_layer):
        p = f"blk.{il}."
        local = hp.is_local(il)
        mask = np.where((j > i) | (local & (i - j >= hp.window)), -np.inf, 0.0)
        base, fs = (hp.rope_local, hp.local_freq_scale) if local else (hp.rope_global, hp.global_freq_scale)
        h = _rms(x, w[p + "attn_norm.weight"], hp.eps)
        q = (h @ w[p + "attn_q.weight"].T).reshape(n, hp.n_head, hp.head_dim)
        k = (h @ w[p + "attn_k.weight"].T).reshape(n, hp.n_head_kv, hp.head_dim)
        v = (h @ w[p + "attn_v.weight"].T).reshape(n, hp.n_head_kv, hp.head_dim)
        q = _rope(_rms(q, w[p + "attn_q_norm.weight"], hp.eps), base, fs, hp.neox)
        k = _rope(_rms(k, w[p + "attn_k_norm.weight"], hp.eps), base, fs, hp.neox)
        heads = []
        for hd in range(hp.n_head):
            s = q[:, hd] @ k[:, hd // rep].T * scale + mask
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            heads.append((s / s.sum(axis=-1, keepdims=True)) @ v[:, hd // rep])
        o = np.concatenate(heads, axis=-1) @ w[p + "attn_output.weight"].T
        if hp.post_norms:
            o = _rms(o, w[p + "post_attention_norm.weight"], hp.eps)
        x = x + o
        h = _rms(x, w[p + "ffn_norm.weight"], hp.eps)
        a = _gelu(h @ w[p + "ffn_gate.weight"].T, hp.gelu_tanh) * (h @ w[p + "ffn_up.weight"].T)
        d = a @ w[p + "ffn_down.weight"].T
        if hp.post_norms:
            d = _rms(d, w[p + "post_ffw_norm.weight"], hp.eps)
        x = x + d
    x = _rms(x, w["output_norm.weight"], hp.eps)
    return x @ w["token_embd.weight"].T


def numpy_greedy(
    w: dict[str, np.ndarray], hp: Gemma3HParams, prompt: list[int], n: int
) -> tuple[list[int], list[float]]:
    ids, margins = list(prompt), []
    for _ in range(n):
        last = numpy_forward(w, hp, ids)[-1]
        top2 = np.sort(last)[-2:]
        margins.append(float(top2[1] - top2[0]))
        ids.append(int(np.argmax(last)))
    return ids[len(prompt) :], margins


def fixture_hparams() -> Gemma3HParams:
    c = CONFIG
    return Gemma3HParams(
        n_layer=c["num_hidden_layers"],
        n_head=c["num_attention_heads"],
        n_head_kv=c["num_key_value_heads"],
        head_dim=c["head_dim"],
        eps=c["rms_norm_eps"],
        window=c["sliding_window"],
        rope_global=c["rope_parameters"]["full_attention"]["rope_theta"],
        rope_local=c["rope_parameters"]["sliding_attention"]["rope_theta"],
        global_freq_scale=1 / ROPE_LINEAR_FACTOR,
    )


def bug_checks(w: dict[str, np.ndarray], hp: Gemma3HParams, ids: list[int], base: np.ndarray) -> dict[str, float]:
    r = dataclasses.replace
    runs: dict[str, Callable[[], np.ndarray]] = {
        "window_off_by_one": lambda: numpy_forward(w, r(hp, window=hp.window + 1), ids),
        "all_layers_global": lambda: numpy_forward(w, r(hp, window=0), ids),
        "local_rope_base_as_global": lambda: numpy_forward(w, r(hp, rope_local=hp.rope_global), ids),
        "global_rope_scaling_ignored": lambda: numpy_forward(w, r(hp, global_freq_scale=1.0), ids),
        "rope_scaling_on_local_layers": lambda: numpy_forward(w, r(hp, local_freq_scale=hp.global_freq_scale), ids),
        "no_embedding_scale": lambda: numpy_forward(w, r(hp, embd_scale=False), ids),
        "no_post_norms": lambda: numpy_forward(w, r(hp, post_norms=False), ids),
        "exact_gelu": lambda: numpy_forward(w, r(hp, gelu_tanh=False), ids),
        "scale_by_hidden_over_heads": lambda: numpy_forward(
            w, r(hp, attn_scale=1 / math.sqrt(CONFIG["hidden_size"] / hp.n_head)), ids
        ),
        "wrong_rope_pairing": lambda: numpy_forward(w, r(hp, neox=False), ids),
    }
    return {k: float(np.abs(f() - base).max()) for k, f in runs.items()}


# ---------------------------------------------------------------------------------------------------
# transformers side
# ---------------------------------------------------------------------------------------------------


def build_model(vocab_size: int) -> Any:
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    model = Gemma3ForCausalLM(Gemma3TextConfig(vocab_size=vocab_size, **CONFIG)).float()
    torch.manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                mean, std = 0.0, NORM_STD  # Gemma3RMSNorm: x_normed * (1 + w)
            elif "embed_tokens" in name:
                mean, std = 0.0, EMBED_STD
            else:
                mean, std = 0.0, WEIGHT_STD
            p.copy_(torch.randn(p.shape) * std + mean)
    return model.eval()


def save_hf_dir(model: Any, tok: Any, hf_dir: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model.generation_config = GenerationConfig(
        bos_token_id=CONFIG["bos_token_id"], eos_token_id=CONFIG["eos_token_id"], pad_token_id=CONFIG["pad_token_id"]
    )
    model.save_pretrained(hf_dir, safe_serialization=True)
    tok.save_pretrained(hf_dir)
    reloaded = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    cfg = reloaded.config
    want = ["sliding_attention" if il % 6 < 5 else "full_attention" for il in range(cfg.num_hidden_layers)]
    if list(cfg.layer_types) != want or cfg.sliding_window != CONFIG["sliding_window"]:
        raise RuntimeError(f"layer types {cfg.layer_types} / window {cfg.sliding_window} are not llama.cpp's layout")
    return reloaded.eval()


def hf_intermediates(model: Any, ids: list[int]) -> dict[str, np.ndarray]:
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
        "hidden_states": torch.stack([h[0] for h in out.hidden_states]).numpy(),
    }


# ---------------------------------------------------------------------------------------------------
# assembly
# ---------------------------------------------------------------------------------------------------


def make_fixture(out_dir: Path) -> dict[str, Any]:
    from safetensors.numpy import load_file

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "q8_0_ref").mkdir(exist_ok=True)
    vocab = build_vocabulary()
    with tempfile.TemporaryDirectory() as tmp:
        tok = transformers_tokenizer(vocab, Path(tmp))
    model = save_hf_dir(build_model(len(vocab["tokens"])), tok, out_dir / "hf")
    config_dict = json.loads((out_dir / "hf" / "config.json").read_text(encoding="utf-8"))
    n_vocab = len(vocab["tokens"])

    bos = CONFIG["bos_token_id"]
    rng = np.random.default_rng(SEED)
    first_piece = len(CONTROL)  # random ids over everything but the control tokens
    sequences = [[bos] + [int(t) for t in rng.integers(first_piece, n_vocab, size=n - 1)] for n in SEQ_LENGTHS]
    prompt_ids = [int(t) for t in tok(PROMPT_TEXT)["input_ids"]]
    cases = []
    for text in TOKENIZER_TEXTS:
        ids = [int(t) for t in tok(text)["input_ids"]]
        cases.append(
            {"text": text, "ids_with_bos": ids, "decoded_without_specials": tok.decode(ids, skip_special_tokens=True)}
        )
    mf._dump_json(
        out_dir / "tokens.json",
        {
            "sequences": sequences,
            "prompt_text": PROMPT_TEXT,
            "prompt_ids": prompt_ids,
            "tokenizer_cases": cases,
            "special_ids": {"bos": bos, "eos": CONFIG["eos_token_id"], "pad": CONFIG["pad_token_id"]},
            "add_bos": True,
        },
    )
    chats = [
        {
            **c,
            "rendered": tok.apply_chat_template(
                c["messages"], tokenize=False, add_generation_prompt=c["add_generation_prompt"]
            ),
        }
        for c in CONVERSATIONS
    ]
    mf._dump_json(out_dir / "chat.json", {"template": GEMMA3_CHAT_TEMPLATE, "conversations": chats})

    stats: dict[str, Any] = {}
    logits = [mf.hf_logits(model, s) for s in sequences]
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
    generated, margins = mf.hf_greedy(model, prompt_ids)
    greedy_logits = mf.hf_logits(model, prompt_ids + generated[:-1])
    np.save(out_dir / "greedy_logits.npy", greedy_logits)
    argmax_no_cache = [int(t) for t in greedy_logits[len(prompt_ids) - 1 :].argmax(axis=-1)]
    mf._dump_json(
        out_dir / "greedy.json",
        {
            "prompt_ids": prompt_ids,
            "generated_ids": generated,
            "argmax_no_cache": argmax_no_cache,
            "cache_matches_no_cache": argmax_no_cache == generated,
            "top1_minus_top2": [round(m, 6) for m in margins],
            "min_margin": min(margins),
            "settings": mf.GREEDY_SETTINGS,
        },
    )

    tensors = gguf_tensors(load_file(out_dir / "hf" / "model.safetensors"))
    write_gguf(out_dir / "model-f32.gguf", tensors, vocab, q8_0=False)
    write_gguf(out_dir / "model-q8_0.gguf", tensors, vocab, q8_0=True)

    hp = fixture_hparams()
    w_q8 = mf.read_gguf_weights(out_dir / "model-q8_0.gguf")
    q8_meta: dict[str, Any] = {}
    for k, s in enumerate(sequences):
        ref = numpy_forward(w_q8, hp, s)
        np.save(out_dir / "q8_0_ref" / f"logits_{k}.npy", ref.astype(np.float32))
        q8_meta[f"max_abs_diff_vs_hf_f32_seq{k}"] = float(np.abs(ref - logits[k]).max())
    q8_generated, q8_margins = numpy_greedy(w_q8, hp, prompt_ids, N_GREEDY)
    mf._dump_json(
        out_dir / "q8_0_ref" / "greedy.json",
        {
            "prompt_ids": prompt_ids,
            "generated_ids": q8_generated,
            "top1_minus_top2": [round(m, 6) for m in q8_margins],
            "min_margin": min(q8_margins),
            "same_as_hf_f32_greedy": q8_generated == generated,
            "note": mf.Q8_NOTE,
        },
    )

    w = mf.read_gguf_weights(out_dir / "model-f32.gguf")
    diffs = [
        float(np.abs(numpy_forward(w, hp, s) - lg).max())
        for s, lg in [*zip(sequences, logits, strict=True), (prompt_ids + generated[:-1], greedy_logits)]
    ]
    base = numpy_forward(w, hp, sequences[-1])
    bugs = bug_checks(w, hp, sequences[-1], base)
    mf._dump_json(
        out_dir / "meta.json",
        {
            "name": NAME,
            "hf_class": "Gemma3ForCausalLM",
            "config": config_dict,
            "init": {"weight_std": WEIGHT_STD, "embed_std": EMBED_STD, "norm_std": NORM_STD, "seed": SEED},
            "gguf": {
                "arch": "gemma3",
                "tensors": {name: list(t.shape) for name, t in tensors.items()},
                "q8_0_ref": q8_meta,
                "has_output_weight": False,
                "rope_style": mf.ROPE_NEOX,
                "sliding_window_layers": [il for il in range(hp.n_layer) if hp.is_local(il)],
            },
            "stats": {
                **stats,
                "greedy_min_margin": min(margins),
                "greedy_cache_matches_no_cache": argmax_no_cache == generated,
            },
            "self_check": {"numpy_vs_hf_from_gguf_f32": max(diffs), "simulated_bugs": bugs},
            "versions": mf._versions(),
        },
    )
    return {
        "numpy_vs_hf_from_gguf_f32": max(diffs),
        "greedy_cache_matches_no_cache": argmax_no_cache == generated,
        "bugs": bugs,
        "logit_std": stats["logits_2"]["std_over_vocab_mean"],
        "vocab": n_vocab,
    }


def make_bf16_variant(out_dir: Path) -> dict[str, Any]:
    """``variants/bf16``: transformers' fp32 logits of the 33-token sequence with every HF weight rounded to
    bf16 first (Gemma's norm weights w rounded, then 1 + w in float32, as an HF bf16 folder gives them)."""
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out_dir / "hf", dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    seq = json.loads((out_dir / "tokens.json").read_text(encoding="utf-8"))["sequences"][-1]
    lg = mf.hf_logits(model.eval(), seq)
    vdir = out_dir / "variants" / "bf16"
    vdir.mkdir(parents=True, exist_ok=True)
    np.save(vdir / "logits_2.npy", lg)
    hf = load_file(out_dir / "hf" / "model.safetensors")
    rounded = {n: torch.from_numpy(t).to(torch.bfloat16).float().numpy() for n, t in hf.items()}
    w = {n: t.astype(np.float64) for n, t in gguf_tensors(rounded).items()}
    check = {
        "numpy_vs_hf": float(np.abs(numpy_forward(w, fixture_hparams(), seq) - lg).max()),
        "vs_fp32_logits": float(np.abs(lg - np.load(out_dir / "logits_2.npy")).max()),
        "max_rel_weight_rounding": max(
            float((np.abs(rounded[n] - t) / np.maximum(np.abs(t), 1e-30)).max()) for n, t in hf.items()
        ),
    }
    mf._dump_json(
        vdir / "meta.json", {"base": NAME, "dtype": "bfloat16", "self_check": check, "versions": mf._versions()}
    )
    return check


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="output folder (gets a gemma3/ sub-folder)")
    ap.add_argument("--compare", type=Path, default=None, help="compare with this fixture folder")
    args = ap.parse_args(argv)
    check = make_fixture(args.out / NAME)
    bugs = check.pop("bugs")
    print(
        f"[{NAME}] numpy float64 vs transformers logits, max |diff| {check['numpy_vs_hf_from_gguf_f32']:.3g} "
        f"(tolerance {TOL:g})"
    )
    print(f"[{NAME}] simulated bugs, max |delta logits|: " + ", ".join(f"{k} {v:.3g}" for k, v in bugs.items()))
    bf16 = make_bf16_variant(args.out / NAME)
    print(
        f"[{NAME}] bf16 variant: numpy vs transformers {bf16['numpy_vs_hf']:.3g}, "
        f"vs fp32 logits {bf16['vs_fp32_logits']:.3g}"
    )
    good = check["numpy_vs_hf_from_gguf_f32"] <= TOL and check["greedy_cache_matches_no_cache"]
    good = good and bf16["numpy_vs_hf"] <= TOL
    good = good and all(v > (MIN_GELU_EFFECT if k == "exact_gelu" else MIN_BUG_EFFECT) for k, v in bugs.items())
    print(f"[{NAME}] self-check {'passed' if good else 'FAILED'}: {check}")
    if args.compare is not None:
        same = mf.compare_dirs(args.out / NAME, args.compare / NAME)
        print(f"[{NAME}] {'all files bit-equal' if same else 'some files differ (see above)'}")
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
