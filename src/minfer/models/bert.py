"""BERT encoders (``model_type`` ``bert``: all-MiniLM, bge, e5, the BERT cross-encoder rerankers), from HF
folders: hyperparameters, tensors under llama.cpp's GGUF names, and the layer recipe as a compute graph.

    x = LN_embd(tok_embd[token] + pos_embd[position] + type_embd[token_type])
    per layer:  x = LN_attn(x + W_o · attn(W_q·x + b_q, W_k·x + b_k, W_v·x + b_v) + b_o)
                x = LN_out(x + W_down · gelu(W_up·x + b_up) + b_down)

``attn`` is bidirectional: each token reads every token of its own sequence (there is no KV cache; several
sequences share a pass, each a run of consecutive rows named by the ``spans`` input). ``gelu`` is the exact
(erf) GELU for ``hidden_act`` ``gelu``, the tanh one for ``gelu_new`` / ``gelu_pytorch_tanh``. The graph's
output is the last layer's hidden states ``[n_tokens, n_embd]`` (sentence-transformers pools them).

A ``BertForSequenceClassification`` folder (a cross-encoder reranker) also carries its pooler (``cls``:
``tanh(W·x[CLS] + b)``) and classifier (``cls.output``), which :meth:`BertModel.classify` applies to the
first row of each sequence.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from minfer.errors import FormatError, ModelError
from minfer.formats.safetensors_file import SAFETENSORS_TYPES, SafetensorsFolder, read_json
from minfer.formats.tensors import WeightTensor
from minfer.graph.builder import GraphBuilder
from minfer.graph.ir import AttnMeta, Graph

MODEL_TYPES = ("bert",)  # config.json model_type values this module runs
CLASSES = ("BertModel", "BertForSequenceClassification", "BertForMaskedLM", "BertForPreTraining")
ACTIVATIONS = {"gelu": "erf", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}

_GLOBAL = {
    "embeddings.word_embeddings.weight": "token_embd.weight",
    "embeddings.position_embeddings.weight": "position_embd.weight",
    "embeddings.token_type_embeddings.weight": "token_types.weight",
    "embeddings.LayerNorm.weight": "token_embd_norm.weight",
    "embeddings.LayerNorm.bias": "token_embd_norm.bias",
    "pooler.dense.weight": "cls.weight",
    "pooler.dense.bias": "cls.bias",
}
_HEAD = {"classifier.weight": "cls.output.weight", "classifier.bias": "cls.output.bias"}
_LAYER_TENSORS = {
    "attention.self.query": "attn_q",
    "attention.self.key": "attn_k",
    "attention.self.value": "attn_v",
    "attention.output.dense": "attn_output",
    "attention.output.LayerNorm": "attn_output_norm",
    "intermediate.dense": "ffn_up",
    "output.dense": "ffn_down",
    "output.LayerNorm": "layer_output_norm",
}
_LAYER = re.compile(r"encoder\.layer\.(\d+)\.(.+)\.(weight|bias)")
# buffers and heads the encoder does not compute: position ids, the masked-LM and next-sentence heads
_IGNORED = re.compile(r"(embeddings\.position_ids|cls\.predictions\..*|cls\.seq_relationship\..*)")


@dataclass(frozen=True)
class EncoderHParams:
    arch: str
    n_vocab: int
    n_ctx_train: int  # position embeddings: the longest sequence the model reads
    n_embd: int
    n_layer: int
    n_head: int
    n_ff: int
    n_token_types: int
    norm_eps: float
    activation: str  # "erf" (exact GELU) or "tanh"
    n_labels: int = 0  # classification outputs (a reranker's 1), 0 without a head

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def attn_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)


def is_encoder_folder(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is an HF folder whose ``config.json`` names an encoder this module runs."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return False
    try:
        content = read_json(cfg)
    except FormatError:
        return False
    return isinstance(content, dict) and content.get("model_type") in MODEL_TYPES


def _config_int(cfg: Mapping[str, Any], name: str, where: Path, default: int | None = None) -> int:
    value = cfg.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise FormatError(f"{where}: field {name!r} must be a positive integer, got {value!r}")
    return value


def hparams_from_config(cfg: Mapping[str, Any], where: Path, n_labels: int) -> EncoderHParams:
    """BERT's hyperparameters as transformers' ``BertConfig`` reads them; one-line errors naming the field."""
    classes = cfg.get("architectures")
    if isinstance(classes, list) and classes and not any(c in CLASSES for c in classes):
        raise ModelError(f"{where}: architectures {classes} is not an encoder minfer runs for model_type 'bert' "
                         f"(supported: {', '.join(CLASSES)})")
    act = cfg.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise ModelError(f"{where}: hidden_act {act!r} is not supported for bert (supported: "
                         f"{', '.join(ACTIVATIONS)})")
    kind = cfg.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise ModelError(f"{where}: position_embedding_type {kind!r} is not supported (only 'absolute')")
    n_embd = _config_int(cfg, "hidden_size", where)
    n_head = _config_int(cfg, "num_attention_heads", where)
    if n_embd % n_head:
        raise ModelError(f"{where}: hidden_size {n_embd} is not divisible by num_attention_heads {n_head}")
    eps = cfg.get("layer_norm_eps", 1e-12)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise FormatError(f"{where}: field 'layer_norm_eps' must be a positive number, got {eps!r}")
    return EncoderHParams(
        arch="bert",
        n_vocab=_config_int(cfg, "vocab_size", where),
        n_ctx_train=_config_int(cfg, "max_position_embeddings", where, 512),
        n_embd=n_embd,
        n_layer=_config_int(cfg, "num_hidden_layers", where),
        n_head=n_head,
        n_ff=_config_int(cfg, "intermediate_size", where),
        n_token_types=_config_int(cfg, "type_vocab_size", where, 2),
        norm_eps=float(eps),
        activation=ACTIVATIONS[act],
        n_labels=n_labels,
    )


def tensor_shapes(hp: EncoderHParams) -> dict[str, tuple[int, ...]]:
    """Every tensor the recipe reads, with its shape in numpy order ([out, in] for matrices)."""
    e, f = hp.n_embd, hp.n_ff
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (hp.n_vocab, e),
        "position_embd.weight": (hp.n_ctx_train, e),
        "token_types.weight": (hp.n_token_types, e),
        "token_embd_norm.weight": (e,),
        "token_embd_norm.bias": (e,),
    }
    for il in range(hp.n_layer):
        p = f"blk.{il}."
        for name, out, inp in (("attn_q", e, e), ("attn_k", e, e), ("attn_v", e, e), ("attn_output", e, e),
                               ("ffn_up", f, e), ("ffn_down", e, f)):
            shapes[f"{p}{name}.weight"] = (out, inp)
            shapes[f"{p}{name}.bias"] = (out,)
        for norm in ("attn_output_norm", "layer_output_norm"):
            shapes[f"{p}{norm}.weight"] = (e,)
            shapes[f"{p}{norm}.bias"] = (e,)
    if hp.n_labels:
        shapes |= {"cls.weight": (e, e), "cls.bias": (e,), "cls.output.weight": (hp.n_labels, e),
                   "cls.output.bias": (hp.n_labels,)}
    return shapes


class BertModel:
    """A BERT encoder loaded from an HF folder; the weights stay in the safetensors memory map."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        directory = Path(directory)
        cfg_path = directory / "config.json"
        cfg = read_json(cfg_path)
        if not isinstance(cfg, dict):
            raise FormatError(f"{cfg_path}: expected a JSON object")
        if cfg.get("model_type") not in MODEL_TYPES:
            raise ModelError(f"{cfg_path}: model_type {cfg.get('model_type')!r} is not an encoder minfer runs "
                             f"(supported: {', '.join(MODEL_TYPES)})")
        self.path = directory
        self.config = cfg
        folder = SafetensorsFolder(directory)
        self.tensors: dict[str, WeightTensor] = {}
        self.origin: dict[str, tuple[str, Path]] = {}
        for hf_name, info in folder.infos.items():
            name = self._engine_name(hf_name)
            if name is None:
                if _IGNORED.fullmatch(hf_name.removeprefix("bert.")):
                    continue
                raise ModelError(f"{info.file}: tensor {hf_name!r} has no place in the bert recipe")
            if info.dtype not in SAFETENSORS_TYPES:
                raise ModelError(f"{info.file}: tensor {hf_name!r} has dtype {info.dtype}, not supported "
                                 f"(supported: {', '.join(SAFETENSORS_TYPES)})")
            t = folder.tensors[hf_name]
            self.tensors[name] = WeightTensor(name, t.ggml_type, t.shape, t.data, t.file_rows)
            self.origin[name] = (hf_name, info.file)
        head = self.tensors.get("cls.output.weight")
        n_labels = head.shape[0] if head is not None and len(head.shape) == 2 else 0
        self.hparams = hparams_from_config(cfg, cfg_path, n_labels)
        layers = {int(m.group(1)) for n in folder.infos if (m := _LAYER.fullmatch(n.removeprefix("bert.")))}
        if layers and max(layers) >= self.hparams.n_layer:
            raise ModelError(f"{cfg_path}: num_hidden_layers is {self.hparams.n_layer} but the weights have layer "
                             f"{max(layers)}")
        self._validate()

    @staticmethod
    def _engine_name(hf_name: str) -> str | None:
        if hf_name in _HEAD:
            return _HEAD[hf_name]
        name = hf_name.removeprefix("bert.")
        if name in _GLOBAL:
            return _GLOBAL[name]
        m = _LAYER.fullmatch(name)
        if m is not None and m.group(2) in _LAYER_TENSORS:
            return f"blk.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}.{m.group(3)}"
        return None

    def describe_tensor(self, name: str) -> str:
        hf_name, file = self.origin.get(name, (name, self.path))
        return f"{file}: tensor {hf_name!r}"

    def _validate(self) -> None:
        by_engine = {v: k for k, v in {**_GLOBAL, **_HEAD}.items()}
        for name, shape in tensor_shapes(self.hparams).items():
            t = self.tensors.get(name)
            if t is None:
                hf = by_engine.get(name) or self._hf_layer_name(name)
                raise FormatError(f"{self.path}: missing tensor {hf!r} (bert, shape {shape})")
            if tuple(t.shape) != shape:
                raise ModelError(f"{self.describe_tensor(name)} has shape {t.shape}, expected {shape}")

    @staticmethod
    def _hf_layer_name(name: str) -> str:
        m = re.fullmatch(r"blk\.(\d+)\.(.+)\.(weight|bias)", name)
        if m is None:
            return name
        hf = {v: k for k, v in _LAYER_TENSORS.items()}[m.group(2)]
        return f"encoder.layer.{m.group(1)}.{hf}.{m.group(3)}"

    @property
    def has_head(self) -> bool:
        """Whether the folder carries a classification head (a cross-encoder reranker)."""
        return self.hparams.n_labels > 0

    @property
    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def tensor(self, name: str) -> WeightTensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise FormatError(f"{self.path}: missing tensor {name!r}") from None

    def build_graph(self, n_tokens: int) -> Graph:
        return build_bert_graph(self, n_tokens)


def build_bert_graph(model: BertModel, n_tokens: int) -> Graph:
    """The forward pass of ``n_tokens`` tokens (one or several sequences, see the module docstring): inputs
    ``tokens``, ``positions``, ``token_types``, ``spans``; output every row's last hidden state."""
    hp = model.hparams
    b = GraphBuilder()
    w = lambda name: b.weight(model.tensor(name))  # noqa: E731
    tokens = b.input("tokens", n_tokens)
    positions = b.input("positions", n_tokens)
    types = b.input("token_types", n_tokens)
    spans = b.input("spans", n_tokens)  # each token's sequence's first row in this pass

    def norm(x, p: str, name: str, layer: int | None):
        return b.layer_norm(x, w(p + ".weight"), w(p + ".bias"), hp.norm_eps, name=name, layer=layer)

    def linear(x, p: str, name: str, layer: int):
        return b.add(b.matmul(x, w(p + ".weight"), name=name, layer=layer), w(p + ".bias"), name=name + ".bias",
                     layer=layer)

    x = b.get_rows(w("token_embd.weight"), tokens, name="embd")
    x = b.add(x, b.get_rows(w("position_embd.weight"), positions, name="embd.position"), name="embd.plus_position")
    x = b.add(x, b.get_rows(w("token_types.weight"), types, name="embd.type"), name="embd.plus_type")
    x = norm(x, "token_embd_norm", "embd_norm", None)
    meta = lambda il: AttnMeta(il, hp.n_head, hp.n_head, hp.head_dim, hp.head_dim, hp.attn_scale)  # noqa: E731
    for il in range(hp.n_layer):
        p = f"blk.{il}."
        q, k, v = (linear(x, f"{p}attn_{c}", f"{p}{c}", il) for c in "qkv")
        a = b.encoder_attn(q, k, v, spans, meta(il), name=p + "attn")
        o = linear(a, p + "attn_output", p + "attn_out", il)
        x = norm(b.add(x, o, name=p + "attn_residual", layer=il), p + "attn_output_norm", p + "attn_norm", il)
        up = linear(x, p + "ffn_up", p + "ffn_up", il)
        act = b.gelu_erf(up, name=p + "ffn_gelu", layer=il) if hp.activation == "erf" else \
            b.gelu(up, name=p + "ffn_gelu", layer=il)
        down = linear(act, p + "ffn_down", p + "ffn_down", il)
        x = norm(b.add(x, down, name=p + "ffn_residual", layer=il), p + "layer_output_norm", p + "out_norm", il)
    return b.build(x)


def classification_head(model: BertModel, first_rows: np.ndarray, dequantize) -> np.ndarray:
    """``cls.output · tanh(cls · x + b) + b``: the classifier's outputs ``[n, n_labels]`` of each sequence's
    first ([CLS]) row, in float32 as transformers' head (``dequantize``: the backend's, a tensor as float32)."""
    pooled = np.tanh(first_rows @ dequantize(model.tensor("cls.weight")).T + dequantize(model.tensor("cls.bias")))
    out = pooled.astype(np.float32) @ dequantize(model.tensor("cls.output.weight")).T
    return (out + dequantize(model.tensor("cls.output.bias"))).astype(np.float32)
