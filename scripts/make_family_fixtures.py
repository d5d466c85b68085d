"""Build the tiny random-weight fixtures of the families added after the first five: ``granite``, ``phi3``,
``gemma2``, ``qwen3moe``, ``qwen2moe`` and ``mixtral``, in ``tests/fixtures/<name>``.

A sibling of ``make_fixtures.py`` (whose helpers it reuses: the q/k permutation of llama.cpp's converter, the
tokenizer as GGUF fields), run in the reference environment (torch 2.13.0 CPU, transformers 5.24.0, gguf 0.19.0)::

    /opt/refenv/bin/python scripts/make_family_fixtures.py --out DIR [--only granite,phi3,...]
        [--llamacpp /tmp/lcpenv/bin/python]

``--out DIR`` receives ``DIR/<name>``; copy it over ``tests/fixtures/<name>``. With ``--llamacpp`` (an
interpreter with ``llama_cpp`` installed), each F32 GGUF is also run by llama.cpp
(``scripts/llamacpp_logits.py``) and the comparison is written into the fixture's README.

Recipe (per fixture, the constants in ``SPECS``):

1. Config: the transformers config class with the fields in ``SPECS`` (tiny: hidden 32, 2-4 layers,
   4 query heads, 2 kv heads); the byte-level BPE tokenizer of ``tests/fixtures/llama`` (vocabulary 512).
2. Weights: ``torch.manual_seed(seed)``, then per parameter in order ``randn * std + mean``: matrices and
   expert stacks (0, 0.15), routers (0, ``router_std``), norm gains (1, 0.2) or for Gemma (0, 0.2) (its RMSNorm
   multiplies by 1 + w).
3. ``hf/``: ``save_pretrained`` (fp32 safetensors; transformers writes MoE experts one tensor per expert, as
   the hub checkpoints are), reloaded with ``attn_implementation="eager"``; every reference comes from the reload.
4. ``model-f32.gguf`` as llama.cpp's ``convert_hf_to_gguf.py`` writes the family (from the saved safetensors):
   tensor names from gguf's ``TensorNameMap``; granite and mixtral (``llama``) W_q/W_k rows permuted
   (``LlamaModel.permute``); gemma2 norm gains + 1 and no ``output.weight``; phi3's fused ``attn_qkv`` and
   gate_up ``ffn_up`` kept fused, LongRoPE as ``rope_factors_long/short.weight`` with
   ``rope.scaling.attn_factor`` and ``rope.scaling.original_context_length``; experts stacked into
   ``ffn_{gate,up,down}_exps`` (numpy shape [experts, rows, cols]) with ``expert_count``,
   ``expert_used_count`` (and qwen3moe's ``expert_feed_forward_length``); the family's own keys (granite's
   multipliers, gemma2's soft-capping and sliding window).
5. References: ``tokens.json`` (sequences of length 1, 7, 33: BOS + ``np.random.default_rng(seed)`` ids;
   phi3 also a 80-token ``long_sequence`` past its original context of 64, where transformers switches to
   the long factors), ``logits_<k>.npy`` (transformers' fp32 logits, full forward, no cache), phi3's
   ``logits_long.npy``, the MoE fixtures' ``routing.json`` (transformers' chosen experts per token and layer
   for the 33-token sequence, and the smallest probability gap between the last chosen and the first
   unchosen expert: routing near a tie would make a correct engine disagree), ``meta.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import make_fixtures as mf  # the script's own folder is on sys.path when it runs
import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = REPO_ROOT / "tests" / "fixtures" / "llama" / "hf"
SEQ_LENGTHS = (1, 7, 33)
LONG_LENGTH = 80  # phi3: past original_max_position_embeddings (64)


@dataclass(frozen=True)
class Spec:
    name: str
    config_class: str
    model_class: str
    gguf_arch: str  # general.architecture
    config: dict[str, Any]
    seed: int
    permute_qk: bool = False
    norm_offset: bool = False  # Gemma: RMSNorm multiplies by 1 + w; the GGUF stores 1 + w
    router_std: float = 0.3
    min_router_gap: float = 0.0  # MoE: seeds are tried from `seed` on until every routing choice is this clear
    extra: dict[str, Any] = field(default_factory=dict)


_BASE: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "vocab_size": 512,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "tie_word_embeddings": False,
}

_RNG = np.random.default_rng(7)
PHI3_SHORT = [round(float(v), 4) for v in _RNG.uniform(1.0, 3.0, 4)]  # head dim 8: 4 rotating pairs
PHI3_LONG = [round(float(v), 4) for v in _RNG.uniform(2.0, 12.0, 4)]

SPECS: dict[str, Spec] = {
    "granite": Spec(
        "granite", "GraniteConfig", "GraniteForCausalLM", "granite",
        {**_BASE, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "embedding_multiplier": 3.0,
         "residual_multiplier": 0.5, "attention_multiplier": 0.15, "logits_scaling": 2.5},
        seed=2301, permute_qk=True,
    ),
    "phi3": Spec(
        "phi3", "Phi3Config", "Phi3ForCausalLM", "phi3",
        {**_BASE, "rms_norm_eps": 1e-5, "original_max_position_embeddings": 64, "sliding_window": None,
         "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": PHI3_SHORT,
                             "long_factor": PHI3_LONG, "original_max_position_embeddings": 64}},
        seed=2303,
    ),
    "gemma2": Spec(
        "gemma2", "Gemma2Config", "Gemma2ForCausalLM", "gemma2",
        {**_BASE, "num_hidden_layers": 4, "head_dim": 16,
         "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "sliding_window": 6, "query_pre_attn_scalar": 16,
         "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0, "tie_word_embeddings": True,
         "hidden_activation": "gelu_pytorch_tanh"},
        seed=2305, norm_offset=True,
    ),
    "qwen3moe": Spec(
        "qwen3moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", "qwen3moe",
        {**_BASE, "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "num_experts": 8,
         "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True},
        seed=2307, min_router_gap=2e-3,
    ),
    "qwen2moe": Spec(
        "qwen2moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM", "qwen2moe",
        {**_BASE, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "num_experts": 8, "num_experts_per_tok": 2,
         "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, "norm_topk_prob": False},
        seed=2311, min_router_gap=2e-3,
    ),
    "mixtral": Spec(
        "mixtral", "MixtralConfig", "MixtralForCausalLM", "llama",
        {**_BASE, "intermediate_size": 32, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "num_local_experts": 4,
         "num_experts_per_tok": 2},
        seed=2309, permute_qk=True, min_router_gap=2e-3,
    ),
}


def build_model(spec: Spec) -> Any:
    import torch
    import transformers

    cfg = getattr(transformers, spec.config_class)(**spec.config)
    cfg._attn_implementation = "eager"
    torch.manual_seed(spec.seed)
    model = getattr(transformers, spec.model_class)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                mean = 0.0 if spec.norm_offset else 1.0
                p.copy_(torch.randn(p.shape) * 0.2 + mean)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape) * 0.3)
            elif name.endswith("gate.weight") and ("mlp" in name or "block_sparse_moe" in name):
                p.copy_(torch.randn(p.shape) * spec.router_std)
            else:
                p.copy_(torch.randn(p.shape) * 0.15)
    return model


def save_hf(spec: Spec, model: Any, hf_dir: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    hf_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(hf_dir)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_DIR / f, hf_dir / f)
    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()


def hf_logits(model: Any, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy().astype(np.float32)


def hf_routing(model: Any, ids: list[int], k: int) -> dict[str, Any]:
    """The experts transformers' routers choose for each token in each layer, and the closest call."""
    import torch

    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    layers, min_gap = [], math.inf
    for logits in out.router_logits:
        lg = logits.double().numpy()
        order = np.argsort(-lg, axis=1, kind="stable")
        layers.append(order[:, :k].tolist())
        top = np.take_along_axis(lg, order, axis=1)
        min_gap = min(min_gap, float((top[:, k - 1] - top[:, k]).min()))
    return {"experts": layers, "min_logit_gap_kth_vs_next": min_gap}


# ------------------------------------------------------------------------------------------------- GGUF


def _read_safetensors(hf_dir: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return dict(load_file(str(hf_dir / "model.safetensors")))


def gguf_tensors(spec: Spec, cfg: Any, hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The HF tensors as llama.cpp's converter writes them for the family (names, permutations, stacking)."""
    import gguf

    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == spec.gguf_arch)
    name_map = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for hf_name, t in hf.items():
        t = np.ascontiguousarray(t, dtype=np.float32)
        if spec.norm_offset and hf_name.endswith("norm.weight"):
            t = t + np.float32(1.0)
        if spec.permute_qk and hf_name.endswith("q_proj.weight"):
            t = mf.permute_qk(t, cfg.num_attention_heads, cfg.num_attention_heads)
        elif spec.permute_qk and hf_name.endswith("k_proj.weight"):
            t = mf.permute_qk(t, cfg.num_attention_heads, cfg.num_key_value_heads)
        parts = hf_name.split(".")
        if "experts" in parts and "shared_expert" not in parts:
            # model.layers.{il}.mlp.experts.{e}.gate_proj.weight: stacked by the converter
            il, e = int(parts[2]), int(parts[parts.index("experts") + 1])
            kind = parts[parts.index("experts") + 2]
            stacked = {"gate_proj": "ffn_gate_exps", "w1": "ffn_gate_exps", "up_proj": "ffn_up_exps",
                       "w3": "ffn_up_exps", "down_proj": "ffn_down_exps", "w2": "ffn_down_exps"}[kind]
            experts.setdefault(f"blk.{il}.{stacked}.weight", {})[e] = t
            continue
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"no GGUF name for {hf_name}")
        out[name] = t
    for name, by_e in experts.items():
        out[name] = np.ascontiguousarray(np.stack([by_e[e] for e in range(len(by_e))]))
    if spec.name == "phi3":
        out["rope_factors_long.weight"] = np.asarray(PHI3_LONG, np.float32)
        out["rope_factors_short.weight"] = np.asarray(PHI3_SHORT, np.float32)
    assert head_dim
    return out


def write_gguf(path: Path, spec: Spec, cfg: Any, tensors: dict[str, np.ndarray]) -> dict[str, Any]:
    import gguf

    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    wr = gguf.GGUFWriter(path, spec.gguf_arch)
    kv: dict[str, Any] = {}
    wr.add_type(gguf.GGUFType.MODEL)
    wr.add_name(f"tiny-{spec.name}")
    wr.add_file_type(gguf.LlamaFileType.ALL_F32)
    wr.add_block_count(cfg.num_hidden_layers)
    wr.add_context_length(cfg.max_position_embeddings)
    wr.add_embedding_length(cfg.hidden_size)
    wr.add_feed_forward_length(cfg.intermediate_size)
    wr.add_head_count(cfg.num_attention_heads)
    wr.add_head_count_kv(cfg.num_key_value_heads)
    wr.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    wr.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if spec.name in ("granite", "mixtral"):  # LlamaModel: vocab size and rotary dims
        wr.add_vocab_size(cfg.vocab_size)
        wr.add_rope_dimension_count(head_dim)
    if spec.name == "granite":
        wr.add_embedding_scale(cfg.embedding_multiplier)
        wr.add_residual_scale(cfg.residual_multiplier)
        wr.add_attention_scale(cfg.attention_multiplier)
        wr.add_logit_scale(cfg.logits_scaling)
    if spec.name == "phi3":
        orig = cfg.original_max_position_embeddings
        scale = cfg.max_position_embeddings / orig
        attn_factor = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0
        wr.add_rope_dimension_count(head_dim)
        wr.add_rope_scaling_orig_ctx_len(orig)
        wr.add_rope_scaling_attn_factors(attn_factor)
        kv["attn_factor"] = attn_factor
    if spec.name == "gemma2":
        wr.add_key_length(head_dim)
        wr.add_value_length(head_dim)
        wr.add_sliding_window(cfg.sliding_window)
        wr.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        wr.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if spec.name == "qwen3moe":
        wr.add_key_length(head_dim)
        wr.add_value_length(head_dim)
        wr.add_expert_count(cfg.num_experts)
        wr.add_expert_used_count(cfg.num_experts_per_tok)
        wr.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if spec.name == "qwen2moe":
        wr.add_expert_count(cfg.num_experts)
        wr.add_expert_used_count(cfg.num_experts_per_tok)
        wr.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        wr.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if spec.name == "mixtral":
        wr.add_expert_count(cfg.num_local_experts)
        wr.add_expert_used_count(cfg.num_experts_per_tok)
    tok = mf.tokenizer_gguf_fields(TOKENIZER_DIR / "tokenizer.json")
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre("default")
    wr.add_token_list(tok["tokens"])
    wr.add_token_types(tok["token_types"])
    wr.add_token_merges(tok["merges"])
    wr.add_bos_token_id(0)
    wr.add_eos_token_id(1)
    wr.add_pad_token_id(2)
    wr.add_add_bos_token(True)
    wr.add_add_eos_token(False)
    for name, t in tensors.items():
        wr.add_tensor(name, t)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return kv


# ------------------------------------------------------------------------------------------------ main


def make_fixture(spec: Spec, out: Path, llamacpp: str | None) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    for attempt in range(100):
        spec = dataclasses.replace(spec, seed=spec.seed + (attempt > 0))
        model = save_hf(spec, build_model(spec), out / "hf")
        cfg = model.config
        rng = np.random.default_rng(spec.seed)
        seqs = [[0] + rng.integers(3, cfg.vocab_size, n - 1).tolist() for n in SEQ_LENGTHS]
        if not spec.min_router_gap:
            break
        routing = hf_routing(model, seqs[2], cfg.num_experts_per_tok)
        if routing["min_logit_gap_kth_vs_next"] >= spec.min_router_gap:
            break
    else:
        raise SystemExit(f"[{spec.name}] no seed gives routing choices {spec.min_router_gap} apart")
    tokens: dict[str, Any] = {"sequences": seqs}
    for k, s in enumerate(seqs):
        np.save(out / f"logits_{k}.npy", hf_logits(model, s))
    meta: dict[str, Any] = {"name": spec.name, "hf_class": spec.model_class, "gguf_arch": spec.gguf_arch,
                            "config": json.loads((out / "hf" / "config.json").read_text()),
                            "init": {"seed": spec.seed, "weight_std": 0.15, "norm_std": 0.2,
                                     "router_std": spec.router_std}}
    if spec.name == "phi3":
        long_seq = [0] + rng.integers(3, cfg.vocab_size, LONG_LENGTH - 1).tolist()
        tokens["long_sequence"] = long_seq
        np.save(out / "logits_long.npy", hf_logits(model, long_seq))
    if spec.name in ("qwen3moe", "qwen2moe", "mixtral"):
        mf._dump_json(out / "routing.json", routing)
        meta["routing_min_logit_gap"] = routing["min_logit_gap_kth_vs_next"]
    mf._dump_json(out / "tokens.json", tokens)
    tensors = gguf_tensors(spec, cfg, _read_safetensors(out / "hf"))
    meta["gguf"] = {"kv": write_gguf(out / "model-f32.gguf", spec, cfg, tensors),
                    "tensors": {n: list(t.shape) for n, t in tensors.items()}}
    if llamacpp:
        meta["llamacpp"] = llamacpp_crosscheck(llamacpp, out, tokens)
    meta["versions"] = mf._versions()
    mf._dump_json(out / "meta.json", meta)
    write_readme(spec, out, meta)
    return meta


ABOUT = {
    "granite": "`GraniteForCausalLM`: hidden 32, 2 layers, 4 query / 2 kv heads of 8, ffn 64, embedding "
               "multiplier 3, residual multiplier 0.5, attention multiplier 0.15 (instead of 1/sqrt(8)), "
               "logits scaling 2.5, "
               "rope 1e4, untied. GGUF as `GraniteModel` (a `LlamaModel`) writes it: q/k rows permuted, "
               "`granite.embedding_scale` / `residual_scale` / `attention.scale` / `logit_scale`.",
    "phi3": "`Phi3ForCausalLM`: hidden 32, 2 layers, 4 query / 2 kv heads of 8, ffn 64 (fused gate_up), fused "
            "qkv, LongRoPE with 4 short factors in [1, 3] and 4 long ones in [2, 12], original context 64 of 256 "
            "(attention factor sqrt(1 + ln 4 / ln 64)), rope 1e4, untied. GGUF as `Phi3MiniModel` writes it: "
            "`attn_qkv` and the gate_up `ffn_up` kept fused, `rope_factors_long/short.weight`, "
            "`rope.scaling.attn_factor`, `rope.scaling.original_context_length`. `long_sequence` / "
            "`logits_long.npy`: 80 tokens, past the original context, where transformers uses the long factors "
            "(and minfer does in a context of 128 > 64).",
    "gemma2": "`Gemma2ForCausalLM`: hidden 32, 4 layers (0 and 2 sliding-window with window 6, 1 and 3 global), "
              "4 query / 2 kv heads of 16, ffn 64, query_pre_attn_scalar 16 (= head dim, the scale llama.cpp "
              "assumes), attention soft-capping 5, final soft-capping 3, embeddings x sqrt(32), post norms, tanh "
              "GELU, tied. GGUF as `Gemma2Model` writes it: norm gains + 1, `gemma2.attention.sliding_window`, "
              "`gemma2.attn_logit_softcapping`, `gemma2.final_logit_softcapping`.",
    "qwen3moe": "`Qwen3MoeForCausalLM`: hidden 32, 2 layers, 4 query / 2 kv heads of 16, per-head q/k RMSNorm, "
                "8 experts of width 32, 2 per token, `norm_topk_prob` true, rope 1e6, untied. GGUF as "
                "`Qwen3MoeModel` writes it: experts stacked into `ffn_{gate,up,down}_exps`, `expert_count`, "
                "`expert_used_count`, `expert_feed_forward_length`. The HF folder has one tensor per expert "
                "(`mlp.experts.{e}.gate_proj.weight`, ...).",
    "qwen2moe": "`Qwen2MoeForCausalLM`: hidden 32, 2 layers, 4 query / 2 kv heads of 8 with q/k/v biases, 8 experts "
                "of width 32, 2 per token with their softmax weights as they are (`norm_topk_prob` false, as "
                "llama.cpp's qwen2moe assumes), a shared expert of width 48 gated by sigmoid(w · x), rope 1e6, "
                "untied. GGUF as `Qwen2MoeModel` writes it: experts stacked, `ffn_{gate,up,down}_shexp`, "
                "`ffn_gate_inp_shexp`, `expert_shared_feed_forward_length`.",
    "mixtral": "`MixtralForCausalLM`: hidden 32, 2 layers, 4 query / 2 kv heads of 8, 4 experts of width 32, 2 per "
               "token (weights renormalized), rope 1e6, untied. GGUF as `LlamaModel` writes it (architecture "
               "`llama`): q/k rows permuted, experts stacked, `llama.expert_count` / `expert_used_count`. The HF "
               "folder has `block_sparse_moe.experts.{e}.w1/w2/w3.weight`.",
}


def write_readme(spec: Spec, out: Path, meta: dict[str, Any]) -> None:
    lines = [f"# `{spec.name}` fixture", "",
             "Made by `scripts/make_family_fixtures.py` (see its docstring for the recipe): "
             + ABOUT[spec.name], ""]
    lines += ["Files: `hf/` (fp32 safetensors, config, the llama fixture's tokenizer), `model-f32.gguf`, "
              "`tokens.json`, `logits_<k>.npy` (transformers fp32, eager attention, every position of the sequences "
              "of 1, 7 and 33 "
              "tokens)" + (", `routing.json` (transformers' chosen experts per layer and token of the 33-token "
                           f"sequence; smallest logit gap between the last chosen and the first unchosen expert "
                           f"{meta['routing_min_logit_gap']:.3g}: no near-ties)" if "routing_min_logit_gap" in meta
                           else "") + ", `meta.json`.", ""]
    cc = meta.get("llamacpp")
    lines += ["## Cross-check with llama.cpp", ""]
    if not cc:
        lines += ["Not run (no `llama_cpp`)."]
    else:
        version = cc.get("_version", {}).get("llama_cpp", "?")
        lines += [f"llama.cpp (llama-cpp-python {version}, f32 KV cache, 1 thread) "
                  "on `model-f32.gguf`, max |logit - transformers'| over every position:", ""]
        for name, r in cc.items():
            if name.startswith("_"):
                continue
            if "error" in r:
                lines.append(f"- `{name}`: llama.cpp could not load the file: `{r['error'][-200:]}`")
            else:
                lines.append(f"- `{name}` (context {r['n_ctx']}): {r['max_abs_diff_vs_transformers']:.3g}")
        if spec.name == "phi3":
            lines += ["", "llama.cpp's phi3 loader looks up Phi-3's own special tokens in the vocabulary, which this "
                      "fixture (the llama fixture's 512-token BPE vocabulary) does not have; renaming a few ids to "
                      "`<|end|>`, `<|endoftext|>`, `<|user|>`, `<|assistant|>`, `<|system|>` did not satisfy it, "
                      "so there is no llama.cpp figure for phi3. Its GGUF layout follows `Phi3MiniModel` as described "
                      "above; minfer reads it and the HF folder to the same logits."]
    if spec.name == "gemma2" and cc:
        lines += ["", "llama.cpp's CPU GELU reads a float16 lookup table (ggml's `GGML_GELU_FP16`): that, not the "
                  "layout, is the ~1e-3 (already for the one-token sequence, where attention and its soft-capping "
                  "are trivial); the other families here agree with transformers to ~1e-5."]
    lines += ["", "minfer's own figures against the same references are held by `tests/test_family_models.py` "
              "(GGUF F32 and `hf/`, fast and reference kernels, 1 and 2 threads, within 1e-4).", ""]
    (out / "README.md").write_text("\n".join(lines), encoding="utf-8")


def llamacpp_crosscheck(python: str, out: Path, tokens: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's logits of the F32 GGUF (every position of every sequence) against transformers'."""
    script = Path(__file__).resolve().parent / "llamacpp_logits.py"
    result: dict[str, Any] = {}
    runs = [(f"logits_{k}", s, 64) for k, s in enumerate(tokens["sequences"])]
    if "long_sequence" in tokens:
        runs.append(("logits_long", tokens["long_sequence"], 128))
    for name, seq, n_ctx in runs:
        dst = out / f".llamacpp_{name}.npy"
        proc = subprocess.run([python, str(script), str(out / "model-f32.gguf"), json.dumps(seq), str(n_ctx),
                               str(dst)], capture_output=True, text=True)
        if proc.returncode:
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            cause = [ln for ln in lines if "error loading model" in ln] or lines[-1:]
            result[name] = {"error": cause[0].strip()}
            continue
        got, want = np.load(dst), np.load(out / f"{name}.npy")
        dst.unlink()
        result[name] = {"max_abs_diff_vs_transformers": float(np.abs(got - want).max()), "n_ctx": n_ctx}
    version = subprocess.run([python, "-c", "import llama_cpp; print(llama_cpp.__version__)"], capture_output=True,
                             text=True).stdout.strip()
    result["_version"] = {"llama_cpp": version} if version else {}
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", default=",".join(SPECS))
    ap.add_argument("--llamacpp", default=None, help="a Python interpreter with llama_cpp, for the cross-check")
    args = ap.parse_args(argv)
    for name in [n for n in args.only.split(",") if n]:
        meta = make_fixture(SPECS[name], args.out / name, args.llamacpp)
        print(f"[{name}] written to {args.out / name}; llama.cpp: {meta.get('llamacpp')}; "
              f"seed {meta['init']['seed']}, routing gap: {meta.get('routing_min_logit_gap')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
