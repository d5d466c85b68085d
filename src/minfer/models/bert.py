"""BERT-family encoders: BERT (``model_type`` ``bert``: all-MiniLM, bge, e5, the BERT cross-encoder rerankers),
XLM-RoBERTa / RoBERTa (``xlm-roberta``, ``roberta``: bge-m3, bge-reranker, jina-reranker) and nomic-bert
(``nomic_bert``: nomic-embed-text; its own fields and names in :mod:`minfer.models.nomic_bert`), from HF folders and
from GGUF files as llama.cpp's converter writes them (``general.architecture`` ``bert``, ``nomic-bert``):
hyperparameters, tensors under llama.cpp's GGUF names, and the layer recipe as a compute graph. A GGUF encoder
carries a WordPiece vocabulary (``tokenizer.ggml.model`` "bert") or XLM-R's SentencePiece Unigram one ("t5"),
rebuilt as a ``tokenizers`` tokenizer by :func:`~minfer.formats.encoder_tokenizer.tokenizer_from_gguf`
(``remove_extra_whitespaces`` true merges and strips spaces as llama.cpp does).

    x = LN_embd(tok_embd[token] + pos_embd[position] + type_embd[token_type])
    per layer:  x = LN_attn(x + W_o · attn(W_q·x + b_q, W_k·x + b_k, W_v·x + b_v) + b_o)
                x = LN_out(x + W_down · gelu(W_up·x + b_up) + b_down)

nomic-bert drops ``pos_embd`` and every bias, rotates q and k (RoPE, NeoX pairs, before ``attn``) and has a gated
FFN, ``W_down · (silu(W_gate·x) * W_up·x)``; its fused ``W_qkv`` is split into q/k/v views at load.

``attn`` is bidirectional: each token reads every token of its own sequence (there is no KV cache; several
sequences share a pass, each a run of consecutive rows named by the ``spans`` input). ``gelu`` is the exact
(erf) GELU for ``hidden_act`` ``gelu``, the tanh one for ``gelu_new`` / ``gelu_pytorch_tanh``. The graph's
output is the last layer's hidden states ``[n_tokens, n_embd]`` (sentence-transformers pools them).

RoBERTa's position embeddings start at row ``pad_token_id + 1`` (transformers numbers a sequence's positions from
there): ``position_offset`` rows are skipped. llama.cpp's converter drops those rows from its GGUF files instead.

A ``*ForSequenceClassification`` checkpoint (a cross-encoder reranker) also carries a head, which
:func:`classification_head` applies to the first row of each sequence: ``cls.output · tanh(cls · x + b) + b``
(BERT's pooler then classifier; RoBERTa's ``classifier.dense`` then ``out_proj``). llama.cpp's converter leaves
BERT's pooler out of its GGUF files, whose head is then ``cls.output · x + b``, as llama.cpp computes it.
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
from minfer.formats.encoder_tokenizer import EncoderTokenizer, tokenizer_from_gguf
from minfer.formats.gguf_file import GGUFFile
from minfer.formats.quants import is_supported
from minfer.formats.safetensors_file import SAFETENSORS_TYPES, SafetensorsFolder, read_json
from minfer.formats.sentence_config import SentenceConfig, read_sentence_config
from minfer.formats.tensors import WeightTensor, tensor_rows
from minfer.graph.builder import GraphBuilder
from minfer.graph.ir import AttnMeta, Graph, RopeMeta, RopeStyle
from minfer.models import nomic_bert

MODEL_TYPES = ("bert", "xlm-roberta", "roberta", nomic_bert.MODEL_TYPE)  # config.json model_types it runs
CLASSES = ("BertModel", "BertForSequenceClassification", "BertForMaskedLM", "BertForPreTraining",
           "XLMRobertaModel", "XLMRobertaForSequenceClassification", "XLMRobertaForMaskedLM",
           "RobertaModel", "RobertaForSequenceClassification", "RobertaForMaskedLM")
# the prefix of the encoder's tensors in a checkpoint with a head (BertForSequenceClassification's "bert.")
PREFIXES = {"bert": "bert.", "xlm-roberta": "roberta.", "roberta": "roberta."}
GGUF_ARCHS = ("bert", nomic_bert.GGUF_ARCH)
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
_HEAD = {"classifier.weight": "cls.output.weight", "classifier.bias": "cls.output.bias",  # BERT's
         "classifier.dense.weight": "cls.weight", "classifier.dense.bias": "cls.bias",  # RoBERTa's
         "classifier.out_proj.weight": "cls.output.weight", "classifier.out_proj.bias": "cls.output.bias"}
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
_IGNORED = re.compile(r"(embeddings\.position_ids|embeddings\.token_type_ids|cls\.predictions\..*|"
                      r"cls\.seq_relationship\..*|lm_head\..*)")


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
    activation: str  # the FFN's: "erf" (exact GELU), "tanh" (GELU's tanh form) or "swiglu" (gated, nomic-bert)
    n_labels: int = 0  # classification outputs (a reranker's 1), 0 without a head
    position_offset: int = 0  # the position embeddings' first row of position 0 (RoBERTa: pad_token_id + 1)
    rope_base: float = 0.0  # rotary positions at this base (nomic-bert); 0: a table of position embeddings
    biases: bool = True  # the projections have biases (nomic-bert's have none)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def attn_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def rotary(self) -> bool:
        return self.rope_base > 0


def gguf_architecture(path: Path) -> str | None:
    """The ``general.architecture`` of a GGUF file, read from its first metadata pair (llama.cpp's converter and
    gguf's writer put it there), without parsing the rest of the header; None for anything else."""
    try:
        with open(path, "rb") as f:
            head = f.read(4 + 4 + 8 + 8 + 8 + 64 + 4 + 8 + 64)
    except OSError:
        return None
    if len(head) < 40 or head[:4] != b"GGUF":
        return None
    n = int.from_bytes(head[24:32], "little")
    if n != len("general.architecture") or head[32:32 + n] != b"general.architecture":
        return None
    at = 32 + n
    if int.from_bytes(head[at:at + 4], "little") != 8:  # GGUF_TYPE_STRING
        return None
    length = int.from_bytes(head[at + 4:at + 12], "little")
    return head[at + 12:at + 12 + length].decode("utf-8", "replace") if length <= 64 else None


def is_encoder_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is an encoder this module runs: an HF folder whose ``config.json`` names one of
    :data:`MODEL_TYPES`, or a GGUF file of one of :data:`GGUF_ARCHS`."""
    p = Path(path)
    if p.is_file():
        return gguf_architecture(p) in GGUF_ARCHS
    cfg = p / "config.json"
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
    """The hyperparameters as transformers' ``BertConfig`` / ``XLMRobertaConfig`` read them; one-line errors
    naming the field."""
    model_type = cfg.get("model_type")
    classes = cfg.get("architectures")
    if isinstance(classes, list) and classes and not any(c in CLASSES for c in classes):
        raise ModelError(f"{where}: architectures {classes} is not an encoder minfer runs for model_type "
                         f"{model_type!r} (supported: {', '.join(CLASSES)})")
    act = cfg.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise ModelError(f"{where}: hidden_act {act!r} is not supported for {model_type} (supported: "
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
    offset = 0
    if model_type != "bert":  # RoBERTa numbers positions from pad_token_id + 1
        pad = cfg.get("pad_token_id", 1)
        if isinstance(pad, bool) or not isinstance(pad, int) or pad < 0:
            raise FormatError(f"{where}: field 'pad_token_id' must be a non-negative integer, got {pad!r}")
        offset = pad + 1
    n_positions = _config_int(cfg, "max_position_embeddings", where, 512)
    if n_positions <= offset:
        raise ModelError(f"{where}: max_position_embeddings {n_positions} leaves no position after the "
                         f"{offset} that {model_type} skips (pad_token_id + 1)")
    return EncoderHParams(
        arch=str(model_type),
        n_vocab=_config_int(cfg, "vocab_size", where),
        n_ctx_train=n_positions - offset,
        n_embd=n_embd,
        n_layer=_config_int(cfg, "num_hidden_layers", where),
        n_head=n_head,
        n_ff=_config_int(cfg, "intermediate_size", where),
        n_token_types=_config_int(cfg, "type_vocab_size", where, 2),
        norm_eps=float(eps),
        activation=ACTIVATIONS[act],
        n_labels=n_labels,
        position_offset=offset,
    )


def _gguf_int(f: GGUFFile, key: str) -> int:
    value = f.require(key, int)
    if isinstance(value, bool) or value <= 0:
        raise FormatError(f"{f.path}: metadata key {key!r} must be a positive integer, got {value!r}")
    return int(value)


def hparams_from_gguf(f: GGUFFile, tensors: Mapping[str, WeightTensor]) -> EncoderHParams:
    """The hyperparameters of a GGUF file as llama.cpp's converter writes a BERT (``bert.*`` keys)."""
    arch = f.architecture
    if f.get(f"{arch}.attention.causal", False):
        raise ModelError(f"{f.path}: {arch}.attention.causal is true: not an encoder")
    embd, types = tensors.get("token_embd.weight"), tensors.get("token_types.weight")
    if embd is None or len(embd.shape) != 2:
        raise FormatError(f"{f.path}: missing tensor 'token_embd.weight' (or it is not 2-D)")
    head = tensors.get("cls.output.weight")
    eps = f.require(f"{arch}.attention.layer_norm_epsilon", (int, float))
    n_types = int(f.get("tokenizer.ggml.token_type_count", types.shape[0] if types is not None else 2))
    nomic = arch == nomic_bert.GGUF_ARCH
    rope_base = float(f.require(f"{arch}.rope.freq_base", (int, float))) if nomic else 0.0
    if nomic and not rope_base > 0:
        raise FormatError(f"{f.path}: metadata key '{arch}.rope.freq_base' must be positive, got {rope_base}")
    return EncoderHParams(
        arch=arch,
        n_vocab=embd.shape[0],
        n_ctx_train=_gguf_int(f, f"{arch}.context_length"),
        n_embd=_gguf_int(f, f"{arch}.embedding_length"),
        n_layer=_gguf_int(f, f"{arch}.block_count"),
        n_head=_gguf_int(f, f"{arch}.attention.head_count"),
        n_ff=_gguf_int(f, f"{arch}.feed_forward_length"),
        n_token_types=max(n_types, 1),
        norm_eps=float(eps),
        # BERT's "gelu" is the exact one (llama.cpp computes the tanh form: a 1e-3-size difference it has)
        activation="swiglu" if nomic else "erf",
        n_labels=head.shape[0] if head is not None and len(head.shape) == 2 else 0,
        rope_base=rope_base,
        biases=not nomic,
    )


def tensor_shapes(hp: EncoderHParams, pooler: bool = True) -> dict[str, tuple[int, ...]]:
    """Every tensor the recipe reads, with its shape in numpy order ([out, in] for matrices); ``pooler``: the head
    has its dense layer (``cls``; llama.cpp's BERT files do not)."""
    e, f = hp.n_embd, hp.n_ff
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (hp.n_vocab, e),
        "token_types.weight": (hp.n_token_types, e),
        "token_embd_norm.weight": (e,),
        "token_embd_norm.bias": (e,),
    }
    if not hp.rotary:
        shapes["position_embd.weight"] = (hp.n_ctx_train + hp.position_offset, e)
    gate = (("ffn_gate", f, e),) if hp.activation == "swiglu" else ()
    for il in range(hp.n_layer):
        p = f"blk.{il}."
        for name, out, inp in (("attn_q", e, e), ("attn_k", e, e), ("attn_v", e, e), ("attn_output", e, e),
                               ("ffn_up", f, e), *gate, ("ffn_down", e, f)):
            shapes[f"{p}{name}.weight"] = (out, inp)
            if hp.biases:
                shapes[f"{p}{name}.bias"] = (out,)
        for norm in ("attn_output_norm", "layer_output_norm"):
            shapes[f"{p}{norm}.weight"] = (e,)
            shapes[f"{p}{norm}.bias"] = (e,)
    if hp.n_labels:
        shapes |= {"cls.output.weight": (hp.n_labels, e), "cls.output.bias": (hp.n_labels,)}
        if pooler:
            shapes |= {"cls.weight": (e, e), "cls.bias": (e,)}
    return shapes


class BertModel:
    """An encoder loaded from an HF folder (:meth:`from_folder`) or a GGUF file (:meth:`from_gguf`); the weights
    stay in the memory map. ``open`` picks by what ``path`` is."""

    def __init__(self, path: Path, tensors: dict[str, WeightTensor], hparams: EncoderHParams,
                 origin: Mapping[str, tuple[str, Path]], gguf: GGUFFile | None = None) -> None:
        self.path = path
        self.tensors = tensors
        self.hparams = hparams
        self.origin = dict(origin)
        self.gguf = gguf
        self._validate()

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> BertModel:
        p = Path(path)
        return cls.from_gguf(p) if p.is_file() else cls.from_folder(p)

    @classmethod
    def from_folder(cls, directory: str | os.PathLike[str]) -> BertModel:
        directory = Path(directory)
        cfg_path = directory / "config.json"
        cfg = read_json(cfg_path)
        if not isinstance(cfg, dict):
            raise FormatError(f"{cfg_path}: expected a JSON object")
        model_type = cfg.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ModelError(f"{cfg_path}: model_type {model_type!r} is not an encoder minfer runs "
                             f"(supported: {', '.join(MODEL_TYPES)})")
        folder = SafetensorsFolder(directory)
        tensors: dict[str, WeightTensor] = {}
        origin: dict[str, tuple[str, Path]] = {}
        nomic = model_type == nomic_bert.MODEL_TYPE
        prefix = PREFIXES.get(model_type, "")
        for hf_name, info in folder.infos.items():
            name = nomic_bert.engine_name(hf_name) if nomic else _engine_name(hf_name, prefix)
            if name is None:
                if _IGNORED.fullmatch(hf_name.removeprefix(prefix)):
                    continue
                raise ModelError(f"{info.file}: tensor {hf_name!r} has no place in the {model_type} recipe")
            if info.dtype not in SAFETENSORS_TYPES:
                raise ModelError(f"{info.file}: tensor {hf_name!r} has dtype {info.dtype}, not supported "
                                 f"(supported: {', '.join(SAFETENSORS_TYPES)})")
            t = folder.tensors[hf_name]
            tensors[name] = WeightTensor(name, t.ggml_type, t.shape, t.data, t.file_rows)
            origin[name] = (hf_name, info.file)
        head = tensors.get("cls.output.weight")
        if nomic:
            hparams = EncoderHParams(**nomic_bert.config_hparams(cfg, cfg_path), biases=False)
            split_fused_qkv(tensors, origin, hparams.n_embd)
        else:
            hparams = hparams_from_config(cfg, cfg_path, head.shape[0] if head is not None and len(head.shape) == 2
                                          else 0)
        pattern = nomic_bert.LAYER if nomic else _LAYER
        layers = {int(m.group(1)) for n in folder.infos if (m := pattern.fullmatch(n.removeprefix(prefix)))}
        if layers and max(layers) >= hparams.n_layer:
            raise ModelError(f"{cfg_path}: num_hidden_layers is {hparams.n_layer} but the weights have layer "
                             f"{max(layers)}")
        return cls(directory, tensors, hparams, origin)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> BertModel:
        f = GGUFFile(path)
        if f.architecture not in GGUF_ARCHS:
            raise ModelError(f"{f.path}: architecture {f.architecture!r} is not an encoder minfer runs "
                             f"(supported: {', '.join(GGUF_ARCHS)})")
        tensors = dict(f.tensors)
        hparams = hparams_from_gguf(f, tensors)
        origin = {name: (name, f.path) for name in tensors}
        split_fused_qkv(tensors, origin, hparams.n_embd)
        return cls(f.path, tensors, hparams, origin, gguf=f)

    def describe_tensor(self, name: str) -> str:
        hf_name, file = self.origin.get(name, (name, self.path))
        return f"{file}: tensor {hf_name!r}"

    def _stored_name(self, name: str) -> str:
        if self.gguf is not None:
            return name.replace(".attn_q.", ".attn_qkv.").replace(".attn_k.", ".attn_qkv.").replace(
                ".attn_v.", ".attn_qkv.") if self.hparams.arch == nomic_bert.GGUF_ARCH else name
        if self.hparams.arch == nomic_bert.MODEL_TYPE:
            return nomic_bert.stored_name(name)
        by_engine = {v: k for k, v in {**_GLOBAL, **_HEAD}.items()}
        if name in by_engine:
            return by_engine[name]
        m = re.fullmatch(r"blk\.(\d+)\.(.+)\.(weight|bias)", name)
        if m is None:
            return name
        hf = {v: k for k, v in _LAYER_TENSORS.items()}[m.group(2)]
        return f"encoder.layer.{m.group(1)}.{hf}.{m.group(3)}"

    def _validate(self) -> None:
        hp = self.hparams
        # llama.cpp's BERT files carry no pooler: their head is the classifier alone
        pooler = self.gguf is None or "cls.weight" in self.tensors
        for name, shape in tensor_shapes(hp, pooler).items():
            t = self.tensors.get(name)
            if t is None:
                raise FormatError(f"{self.path}: missing tensor {self._stored_name(name)!r} ({hp.arch}, shape {shape})")
            if tuple(t.shape) != shape:
                raise ModelError(f"{self.describe_tensor(name)} has shape {t.shape}, expected {shape}")
            if not is_supported(t.ggml_type):
                raise ModelError(f"{self.describe_tensor(name)} has type {t.ggml_type.name}, not supported")
        extra = set(self.tensors) - set(tensor_shapes(hp, pooler))
        if self.gguf is None:
            extra -= {"cls.weight", "cls.bias"}  # a BertModel's pooler: what embeddings do not read
        if extra:
            raise ModelError(f"{self.describe_tensor(min(extra))} has no place in the {hp.arch} recipe")

    @property
    def has_head(self) -> bool:
        """Whether the checkpoint carries a classification head (a cross-encoder reranker)."""
        return self.hparams.n_labels > 0

    @property
    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def tensor(self, name: str) -> WeightTensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise FormatError(f"{self.path}: missing tensor {name!r}") from None

    def has_tensor(self, name: str) -> bool:
        return name in self.tensors

    def build_graph(self, n_tokens: int) -> Graph:
        return build_bert_graph(self, n_tokens)

    # -- what comes with the weights ---------------------------------------------------------------

    def sentence_config(self) -> SentenceConfig:
        """The pooling, normalisation and longest input: a folder's sentence-transformers modules, a GGUF's
        ``pooling_type`` (normalised, as llama.cpp's default ``embd_normalize``); a reranker pools ``cls``."""
        hp = self.hparams
        default = "cls" if self.has_head else "mean"
        if self.gguf is None:
            return read_sentence_config(self.path, default, hp.n_ctx_train)
        raw = self.gguf.get(f"{hp.arch}.pooling_type")
        pooling = {0: "none", 1: "mean", 2: "cls", 3: "last"}.get(int(raw), default) if raw is not None else default
        return SentenceConfig(pooling, True, hp.n_ctx_train, declared=raw is not None)

    def load_tokenizer(self, max_length: int) -> EncoderTokenizer:
        if self.gguf is None:
            return EncoderTokenizer.from_file(self.path / "tokenizer.json", max_length)
        return EncoderTokenizer(tokenizer_from_gguf(self.gguf), max_length)


def split_fused_qkv(tensors: dict[str, WeightTensor], origin: dict[str, tuple[str, Path]], n_embd: int) -> None:
    """Each fused ``blk.N.attn_qkv.weight`` (nomic-bert's ``Wqkv``) replaced by ``attn_q``/``attn_k``/``attn_v``:
    views of its three thirds of rows, whose ``origin`` is the fused tensor's."""
    for name in [n for n in tensors if n.endswith(".attn_qkv.weight")]:
        t, where = tensors.pop(name), origin.pop(name)
        if len(t.shape) != 2 or t.shape[0] != 3 * n_embd:
            raise ModelError(f"{where[1]}: tensor {where[0]!r} has shape {t.shape}, expected "
                             f"({3 * n_embd}, {n_embd}): q, k and v of width {n_embd}")
        for i, part in enumerate("qkv"):
            part_name = name.replace(".attn_qkv.", f".attn_{part}.")
            tensors[part_name] = tensor_rows(t, i * n_embd, (i + 1) * n_embd, part_name)
            origin[part_name] = where


def _engine_name(hf_name: str, prefix: str) -> str | None:
    if hf_name in _HEAD:
        return _HEAD[hf_name]
    name = hf_name.removeprefix(prefix)
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = _LAYER.fullmatch(name)
    if m is not None and m.group(2) in _LAYER_TENSORS:
        return f"blk.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}.{m.group(3)}"
    return None


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
        y = b.matmul(x, w(p + ".weight"), name=name, layer=layer, whole_sequences=True)
        return b.add(y, w(p + ".bias"), name=name + ".bias", layer=layer) if hp.biases else y

    x = b.get_rows(w("token_embd.weight"), tokens, name="embd")
    if not hp.rotary:
        x = b.add(x, b.get_rows(w("position_embd.weight"), positions, name="embd.position"),
                  name="embd.plus_position")
    x = b.add(x, b.get_rows(w("token_types.weight"), types, name="embd.type"), name="embd.plus_type")
    x = norm(x, "token_embd_norm", "embd_norm", None)
    meta = lambda il: AttnMeta(il, hp.n_head, hp.n_head, hp.head_dim, hp.head_dim, hp.attn_scale)  # noqa: E731
    rope = RopeMeta(hp.n_head, hp.head_dim, hp.head_dim, hp.rope_base, 1.0, RopeStyle.NEOX)
    for il in range(hp.n_layer):
        p = f"blk.{il}."
        q, k, v = (linear(x, f"{p}attn_{c}", f"{p}{c}", il) for c in "qkv")
        if hp.rotary:
            q = b.rope(q, positions, rope, name=p + "q_rope", layer=il)
            k = b.rope(k, positions, rope, name=p + "k_rope", layer=il)
        a = b.encoder_attn(q, k, v, spans, meta(il), name=p + "attn")
        o = linear(a, p + "attn_output", p + "attn_out", il)
        x = norm(b.add(x, o, name=p + "attn_residual", layer=il), p + "attn_output_norm", p + "attn_norm", il)
        up = linear(x, p + "ffn_up", p + "ffn_up", il)
        if hp.activation == "swiglu":  # the fusion pass makes silu(gate) * up one SWIGLU node
            gate = b.silu(linear(x, p + "ffn_gate", p + "ffn_gate", il), name=p + "ffn_silu", layer=il)
            act = b.mul(gate, up, name=p + "ffn_swiglu", layer=il)
        elif hp.activation == "erf":
            act = b.gelu_erf(up, name=p + "ffn_gelu", layer=il)
        else:
            act = b.gelu(up, name=p + "ffn_gelu", layer=il)
        down = linear(act, p + "ffn_down", p + "ffn_down", il)
        x = norm(b.add(x, down, name=p + "ffn_residual", layer=il), p + "layer_output_norm", p + "out_norm", il)
    return b.build(x)


def attention_inputs(hp: EncoderHParams, layer: int) -> tuple[str, str, str]:
    """The names of the graph nodes that give layer ``layer``'s attention its q, k and v (the trace reads them)."""
    p = f"blk.{layer}."
    if hp.rotary:
        return p + "q_rope", p + "k_rope", p + "v"
    return p + "q.bias", p + "k.bias", p + "v.bias"


def classification_head(model: BertModel, first_rows: np.ndarray, dequantize) -> np.ndarray:
    """``cls.output · tanh(cls · x + b) + b``: the classifier's outputs ``[n, n_labels]`` of each sequence's
    first row ([CLS], ``<s>``), in float32 as transformers' head (``dequantize``: the backend's, a tensor as
    float32). Without ``cls`` (llama.cpp's BERT files) the classifier reads the row itself."""
    x = first_rows.astype(np.float32)
    if model.has_tensor("cls.weight"):
        x = np.tanh(x @ dequantize(model.tensor("cls.weight")).T + dequantize(model.tensor("cls.bias")))
    out = x.astype(np.float32) @ dequantize(model.tensor("cls.output.weight")).T
    return (out + dequantize(model.tensor("cls.output.bias"))).astype(np.float32)
