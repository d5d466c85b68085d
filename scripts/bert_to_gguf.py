"""Write a GGUF file from a Hugging Face BERT or XLM-RoBERTa folder, in llama.cpp's layout (what llama.cpp's
``convert_hf_to_gguf.py`` writes for ``BertModel`` / ``BertForMaskedLM`` / ``BertForSequenceClassification`` and
``XLMRobertaModel`` / ``XLMRobertaForSequenceClassification``: bge-m3, bge-reranker-v2-m3).

    python scripts/bert_to_gguf.py HF_FOLDER OUT.gguf [--outtype f32|f16] [--name NAME]

Needs only numpy, tokenizers and gguf (no torch, no transformers). It mirrors llama.cpp's converter as vendored in
llama-cpp-python 0.3.36 (``conversion/bert.py`` ``BertModel``, ``conversion/base.py`` ``TextModel``,
``gguf-py/gguf/vocab.py`` ``SpecialVocab``):

- keys, in llama.cpp's order: ``general.architecture`` bert, ``general.type`` model, ``general.name``,
  ``general.size_label``; ``bert.block_count``, ``bert.context_length`` (max_position_embeddings),
  ``bert.embedding_length``, ``bert.feed_forward_length``, ``bert.attention.head_count``,
  ``bert.attention.layer_norm_epsilon``, ``general.file_type`` (0 f32, 1 f16), ``bert.attention.causal`` false,
  ``bert.pooling_type`` (only when modules.json names a Pooling module: MEAN 1 / CLS 2 / LAST 3, as
  ``_try_set_pooling_type``; llama.cpp writes NO pooling type for a *ForSequenceClassification folder without
  modules.json, so neither do we: the engine must pick RANK itself when ``cls.output.weight`` is present),
  ``bert.classifier.output_labels`` (config ``id2label`` values sorted by key, unless it is the 2-label
  LABEL_0/LABEL_1 default), ``general.quantization_version`` 2; then the vocabulary: ``tokenizer.ggml.token_type_count``
  (type_vocab_size), ``tokenizer.ggml.model`` "bert", ``tokenizer.ggml.pre`` (always "jina-v2-en": what llama.cpp
  writes for all-MiniLM-L6-v2's WordPiece tokenizer; llama.cpp only reads this key for BPE vocabularies),
  ``tokenizer.ggml.tokens`` (phantom-space: CONTROL tokens as is, "##x" -> "x", others "\\u2581" + token),
  ``tokenizer.ggml.token_type`` (NORMAL 1, CONTROL 3 for special added tokens, USER_DEFINED 4, UNUSED 5 for holes),
  the special token ids and add flags as ``SpecialVocab`` derives them (bos/eos/unk/seperator/padding/mask ids,
  add_bos/add_eos/add_sep) and ``tokenizer.ggml.normalizer.lowercase`` / ``.strip_accents`` from tokenizer.json's
  normalizer (written only when set: BertNormalizer with strip_accents null writes no strip_accents key).
- tensors in llama.cpp's order (safetensors names sorted) and names: ``bert.`` prefix stripped, ``gamma``/``beta``
  renamed, ``embeddings.position_ids``, ``pooler.dense.*``, ``cls.predictions.*``, ``cls.seq_relationship.*``
  DROPPED; for a classifier (config ``id2label`` kept) ``classifier.weight/bias`` -> ``classifier.out_proj.*`` ->
  ``cls.output.weight/bias`` (``classifier.dense.*`` -> ``cls.weight/bias``); the rest through gguf's
  TensorNameMap for BERT (``token_embd``, ``position_embd``, ``token_types``, ``token_embd_norm``,
  ``blk.N.attn_q/attn_k/attn_v/attn_output``, ``attn_output_norm``, ``ffn_up``, ``ffn_down``, ``layer_output_norm``).
  With ``--outtype f16`` every tensor is F16 except: 1-D tensors (biases, norm gains), ``*_norm.weight``,
  ``position_embd.weight`` and ``token_types.weight`` (kept F32 as llama.cpp does); ``token_embd.weight`` and
  ``cls.output.weight`` become F16. Source tensors in BF16/other dtypes are read as F32 first, as llama.cpp does.

XLM-RoBERTa (``conversion/bert.py`` ``XLMRobertaModel``, ``BertModel._xlmroberta_tokenizer_init`` /
``_xlmroberta_set_vocab``), the differences from BERT:

- ``pad_token_id + 1`` rows cut off ``position_embd.weight`` (RoBERTa numbers positions from there) and
  ``bert.context_length`` = max_position_embeddings - (pad_token_id + 1); tensors' ``roberta.`` prefix stripped;
  ``classifier.dense.*`` -> ``cls.*``, ``classifier.out_proj.*`` -> ``cls.output.*`` (no pooler).
- the vocabulary, after ``general.quantization_version``: ``tokenizer.ggml.model`` "t5", ``tokenizer.ggml.pre``
  "default", ``tokenizer.ggml.tokens`` (the Unigram pieces as they are, ``[PAD<i>]`` for holes up to config
  ``vocab_size``), ``tokenizer.ggml.scores`` (tokenizer.json's, as float32; -10000 for holes),
  ``tokenizer.ggml.token_type`` (UNKNOWN 2 for the unk token, CONTROL 3 for transformers' special tokens: those
  named in tokenizer_config.json, XLMRobertaTokenizer's defaults <s> </s> <unk> <pad> <mask> otherwise; USER_DEFINED
  4 for other added tokens; UNUSED 5 for holes), ``tokenizer.ggml.add_space_prefix`` (tokenizer_config
  ``add_prefix_space``, default true), ``tokenizer.ggml.token_type_count``, ``tokenizer.ggml.remove_extra_whitespaces``
  (tokenizer_config ``clean_up_tokenization_spaces``, default false: what llama.cpp reads through transformers),
  ``tokenizer.ggml.precompiled_charsmap`` (the ``Precompiled`` normalizer's bytes; written only when non-empty),
  then ``SpecialVocab`` as for BERT.
- read from ``tokenizer.json`` only. Refused: a folder with ``sentencepiece.bpe.model`` (llama.cpp reads that file
  instead, through sentencepiece and protobuf, and writes its scores, remove_extra_whitespaces true and the fairseq
  id realignment; the real bge-m3 has one), a normalizer other than ``Precompiled`` or none, jina-embeddings-v3
  (``lora_adaptations``).

Not supported (refused): RoBERTa (``RobertaModel``: llama.cpp has no such registration either),
pytorch_model.bin-only folders, chat templates.

Verified (llama.cpp converter from llama-cpp-python 0.3.36 in /tmp/refenv: torch 2.13.0, transformers 5.24.0):

- all-MiniLM-L6-v2 (sentence-transformers folder), ``--outtype f32`` and ``f16``: llama.cpp writes 30 keys, we write 29
  (no ``general.organization``), otherwise in the same order; every non-``general.*`` key and value equal (token list
  30522 entries, token types,
  ids 101/102/100/102/0/103, add_bos/add_eos true, add_sep false, lowercase true, pooling_type 1, context 512,
  eps 1e-12). ``general.*`` differences: llama.cpp writes ``general.name`` "MiniLM L6 H384 Uncased" and
  ``general.organization`` "Nreimers" (its model-card heuristics); we write ``general.name`` = the folder name
  (or ``--name``) and no ``general.organization``. ``general.size_label`` (23M), ``general.type``,
  ``general.file_type``, ``general.quantization_version`` equal. 101 / 101 tensors: names, order, types (f16
  file: 37 F16, 64 F32), shapes and data bytes all equal.
- the tiny fixtures ``tests/fixtures/bert`` (f32, f16) and ``tests/fixtures/bert_rerank`` (f32), against
  llama.cpp's converter with ``get_vocab_base_pre`` patched to return "jina-v2-en" (unpatched it refuses them:
  "BPE pre-tokenizer was not recognized"): every key and value equal except ``general.name`` (llama.cpp: "Bert" /
  "Bert_Rerank"; with ``--name Bert`` / ``--name Bert_Rerank`` the three files are byte-identical to
  llama.cpp's, which is how the fixtures' ``model-f32.gguf`` / ``model-f16.gguf`` were written), every tensor equal
  (37 / 39 tensors; the reranker has ``cls.output.weight`` [1, 32] and
  ``cls.output.bias`` [1], ``bert.classifier.output_labels`` ["LABEL_0"], no ``bert.pooling_type``).
- the tiny XLM-R fixtures ``tests/fixtures/xlmr`` and ``tests/fixtures/xlmr_rerank`` (f32), against llama.cpp's
  converter (run with ``PYTHONPATH=<vendor>/llama.cpp/gguf-py``) patched twice: its
  ``b64decode(tokenizer_json["normalizer"]["precompiled_charsmap"])`` fails on these folders, whose
  tokenizer.json has no normalizer (``null``: patched to an empty charsmap, so no charsmap key), and its
  ``from sentencepiece import sentencepiece_model_pb2`` needs protobuf, which the reference environment lacks
  (patched out; only the sentencepiece.bpe.model route uses it). 31 keys each, in the same order, every key and value
  equal except ``general.name`` (llama.cpp: "Xlmr" / "Xlmr_Rerank"); with ``--name Xlmr`` / ``--name Xlmr_Rerank``
  both files are byte-identical to llama.cpp's (how the fixtures' ``model-f32.gguf`` were written): 37 / 41 tensors,
  ``position_embd.weight`` [128, 32] (130 - 2 rows), ``bert.context_length`` 128, ``add_space_prefix`` true,
  ``remove_extra_whitespaces`` false, ids bos 0 / eos 2 / unk 3 / sep 2 / pad 1 / mask 599, add_bos/eos/sep true;
  the reranker: ``cls.weight`` [32, 32], ``cls.bias``, ``cls.output.weight`` [1, 32], ``cls.output.bias``.
  Not compared against llama.cpp: a folder with a real Precompiled charsmap (none offline); the charsmap bytes are
  copied from tokenizer.json as llama.cpp does (base64-decoded, a UINT8 array).
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np

ARCH = "bert"
PHANTOM = "\u2581"

# gguf token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
POOLING = {"mean": 1, "cls": 2, "lasttoken": 3}
BERT_ARCHS = ("BertModel", "BertForMaskedLM", "BertForSequenceClassification")
XLMR_ARCHS = ("XLMRobertaModel", "XLMRobertaForSequenceClassification")


# --------------------------------------------------------------------------------------------- safetensors

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I64": np.int64, "I32": np.int32,
              "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """All tensors of one safetensors file (BF16 widened to float32), in the file's header order."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    base = 8 + n
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        buf = raw[base + a:base + b]
        if info["dtype"] == "BF16":
            arr = (np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            arr = np.frombuffer(buf, dtype=np.dtype(_ST_DTYPES[info["dtype"]]).newbyteorder("<"))
        out[name] = arr.reshape(info["shape"])
    return out


def load_tensors(folder: Path) -> list[tuple[str, np.ndarray]]:
    """(name, array) in llama.cpp's order: per safetensors part, names sorted."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        parts = sorted(set(weight_map.values()))
    elif (folder / "model.safetensors").is_file():
        parts = ["model.safetensors"]
    else:
        raise SystemExit(f"{folder}: no model.safetensors (pytorch_model.bin is not supported)")
    out: list[tuple[str, np.ndarray]] = []
    for part in parts:
        tensors = _read_safetensors(folder / part)
        out += [(k, tensors[k]) for k in sorted(tensors)]
    return out


# --------------------------------------------------------------------------------------------- tensors

def map_tensors(tensors: list[tuple[str, np.ndarray]], n_layers: int, classifier: bool,
                position_offset: int = 0) -> list[tuple[str, np.ndarray]]:
    """llama.cpp's names; ``position_offset`` (XLM-R: pad_token_id + 1) rows cut off the position embeddings."""
    import gguf

    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, n_layers)
    out = []
    for name, data in tensors:
        # XLMRobertaModel.filter_tensors
        if name.startswith("roberta."):
            name = name[8:]
        if ".parametrizations." in name:
            raise SystemExit(f"tensor {name!r}: jina-embeddings-v3's LoRA parametrizations are not supported")
        # BertModel.filter_tensors
        if name.startswith("bert."):
            name = name[5:]
        if name.endswith(".gamma"):
            name = name[:-6] + ".weight"
        if name.endswith(".beta"):
            name = name[:-5] + ".bias"
        if name in ("embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias"):
            continue
        if name.startswith(("cls.predictions", "cls.seq_relationship")):
            continue
        # ModelBase.prepare_tensors
        if name.endswith((".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")):
            continue
        # BertModel.modify_tensors
        if classifier and name in ("classifier.weight", "classifier.bias"):
            name = "classifier.out_proj." + name.split(".")[-1]
        # XLMRobertaModel.modify_tensors
        if name == "embeddings.position_embeddings.weight" and position_offset:
            data = data[position_offset:, :]
        new = tmap.get_name(key=name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise SystemExit(f"can not map tensor {name!r}")
        if data.dtype not in (np.float16, np.float32):
            data = data.astype(np.float32)
        out.append((new, data))
    return out


def out_type(name: str, data: np.ndarray, f16: bool) -> int:
    """GGML type llama.cpp picks (prepare_tensors): F32 for 1-D, *_norm.weight, position_embd, token_types and
    anything not ending in .weight; the outtype otherwise."""
    import gguf

    F32, F16 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16
    if data.ndim <= 1 or name.endswith("_norm.weight"):
        return F32
    if name in ("position_embd.weight", "token_types.weight") or not name.endswith(".weight"):
        return F32
    return F16 if f16 else F32


# --------------------------------------------------------------------------------------------- vocab

def does_token_look_special(t: str) -> bool:
    return (t in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (t.startswith("<|") and t.endswith("|>"))
            or (t.startswith("<\uff5c") and t.endswith("\uff5c>")) or (t.startswith("<unused") and t.endswith(">")))


def vocab_base(folder: Path, hparams: dict[str, Any]) -> tuple[list[str], list[int]]:
    """TextModel.get_vocab_base with the tokenizers library in place of transformers' AutoTokenizer."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    vocab = tok.get_vocab(with_added_tokens=True)
    added = tok.get_added_tokens_decoder()  # id -> AddedToken
    added_ids = {t.content: i for i, t in added.items()}
    vocab_size = hparams.get("vocab_size", len(vocab))
    assert max(vocab.values()) < vocab_size
    reverse = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
            continue
        token = reverse[i]
        if token in added_ids:
            at = added[added_ids[token]]
            if not at.normalized:
                token = tok.decode(tok.encode(token, add_special_tokens=False).ids, skip_special_tokens=False)
            if at.special or does_token_look_special(token):
                types.append(CONTROL)
            else:
                token = token.replace(PHANTOM, " ")
                types.append(USER_DEFINED)
        else:
            types.append(NORMAL)
        tokens.append(token)
    return tokens, types


XLMR_SPECIAL_DEFAULTS = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "sep_token": "</s>",
                         "pad_token": "<pad>", "cls_token": "<s>", "mask_token": "<mask>"}


def _token_content(entry: Any) -> str | None:
    return entry.get("content") if isinstance(entry, dict) else entry if isinstance(entry, str) else None


def xlmr_vocab(folder: Path, hparams: dict[str, Any]) -> dict[str, Any]:
    """BertModel._xlmroberta_set_vocab for a folder with a Unigram ``tokenizer.json`` (transformers'
    XLMRobertaTokenizer read from the files by hand): tokens, scores, types, add_space_prefix,
    remove_extra_whitespaces and the precompiled charsmap."""
    from base64 import b64decode

    if (folder / "sentencepiece.bpe.model").is_file():
        raise SystemExit(f"{folder}: has sentencepiece.bpe.model, which llama.cpp's converter reads instead of "
                         "tokenizer.json; not supported here (it needs the sentencepiece package)")
    tj = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
    model = tj.get("model") or {}
    if model.get("type") != "Unigram":
        raise SystemExit(f"{folder}/tokenizer.json: model type {model.get('type')!r}, expected Unigram (XLM-R)")
    normalizer = tj.get("normalizer")
    if normalizer is None:
        # llama.cpp's converter stops here (tokenizer_json["normalizer"] is None): no charsmap is the only reading
        charsmap = b""
    elif normalizer.get("type") == "Precompiled":
        charsmap = b64decode(normalizer["precompiled_charsmap"] or "")
    else:
        raise SystemExit(f"{folder}/tokenizer.json: normalizer {normalizer.get('type')!r}; llama.cpp's converter "
                         "reads only a Precompiled one")
    pieces: list[list[Any]] = model["vocab"]
    added = {t["content"]: t["id"] for t in tj.get("added_tokens", [])}
    special_strings = {_token_content(cfg.get(k, d)) for k, d in XLMR_SPECIAL_DEFAULTS.items()}
    for extra in cfg.get("additional_special_tokens") or cfg.get("extra_special_tokens") or []:
        special_strings.add(_token_content(extra))
    by_piece = {p[0]: i for i, p in enumerate(pieces)} | added
    special_ids = {by_piece[t] for t in special_strings if t in by_piece}
    unk_id = added.get(_token_content(cfg.get("unk_token")), model.get("unk_id", 3))
    # transformers' vocab_size for this tokenizer: the model's pieces and the added tokens
    n_tok = len(set(range(len(pieces))) | set(added.values()))
    vocab_size = max(hparams.get("vocab_size", 0), n_tok)
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    scores = [-10000.0] * vocab_size
    types = [UNUSED] * vocab_size
    id_to_added = {i: t for t, i in added.items()}
    for i in range(n_tok):
        piece = pieces[i][0] if i < len(pieces) else id_to_added.get(i)
        if piece is None:
            continue
        tokens[i] = piece
        scores[i] = pieces[i][1] if i < len(pieces) else 0.0  # llama.cpp reads the model's vocab by id
        types[i] = (UNKNOWN if i == unk_id else CONTROL if i in special_ids else USER_DEFINED
                    if i in added.values() else NORMAL)
    return {"tokens": tokens, "scores": scores, "types": types,
            "add_prefix": bool(cfg.get("add_prefix_space", True)),
            "remove_whitespaces": bool(cfg.get("clean_up_tokenization_spaces", False)), "charsmap": charsmap}


class SpecialVocab:
    """gguf-py's SpecialVocab (llama.cpp's vendored copy, which also parses the normalizer), merges and chat
    templates left out."""

    def __init__(self, folder: Path, n_vocab: int) -> None:
        self.n_vocab = n_vocab
        self.special_token_types: tuple[str, ...] = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")
        self.special_token_ids: dict[str, int] = {}
        self.add_special_token: dict[str, bool] = {}
        self.lowercase: bool | None = None
        self.strip_accents: bool | None = None
        self._from_tokenizer_json(folder)
        self._from_config_json(folder)

    def _set(self, typ: str, tid: Any) -> None:
        if not isinstance(tid, int):
            return
        if tid < 0:
            raise ValueError(f"invalid value for special token type {typ}: {tid}")
        if tid < self.n_vocab and typ not in self.special_token_ids:
            self.special_token_ids[typ] = tid

    def _normalizer(self, n: dict[str, Any]) -> None:
        t = n.get("type")
        if t == "Lowercase":
            self.lowercase = True
        elif t == "StripAccents":
            self.strip_accents = True
        elif t == "BertNormalizer":
            if "lowercase" in n:
                self.lowercase = n["lowercase"]
            if "strip_accents" in n:
                self.strip_accents = n["strip_accents"]
        elif t == "Sequence":
            for m in n.get("normalizers", []):
                self._normalizer(m)

    def _from_tokenizer_json(self, folder: Path) -> None:  # noqa: C901 (mirrors gguf-py)
        tokenizer = None
        if (folder / "tokenizer.json").is_file():
            tokenizer = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
            if normalizer := tokenizer.get("normalizer"):
                self._normalizer(normalizer)
            added_tokens = tokenizer.get("added_tokens", {})
        else:
            added_tokens = {}
        cfg = None
        if (folder / "tokenizer_config.json").is_file():
            cfg = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        if tokenizer:
            bos, cls_ = (cfg or {}).get("bos_token"), (cfg or {}).get("cls_token")
            eos, sep = (cfg or {}).get("eos_token"), (cfg or {}).get("sep_token")
            if not bos and cls_ and cfg:
                cfg["bos_token"] = bos = cls_
            if not eos and sep and cfg:
                cfg["eos_token"] = eos = sep
            if post := tokenizer.get("post_processor"):
                for proc in post.get("processors", [post]):
                    ptype = proc.get("type")
                    if ptype == "ByteLevel":
                        self.add_special_token.setdefault("bos", False)
                        self.add_special_token.setdefault("eos", False)
                    elif ptype == "RobertaProcessing":
                        self.add_special_token.update(bos=True, eos=True, sep=True)
                        if not cls_ and cfg:
                            cls_ = cfg["cls_token"] = proc.get("cls", [bos])[0]
                        if not sep and cfg:
                            sep = cfg["sep_token"] = proc.get("sep", [eos])[0]
                    elif ptype == "TemplateProcessing":
                        single, pair = proc.get("single", []), proc.get("pair", [])
                        first = last = None
                        if len(single) > 1:
                            if first := single[0].get("SpecialToken", {}).get("id"):
                                if not cfg:
                                    bos = first
                                elif first not in (bos, cls_):
                                    if not bos:
                                        cfg["bos_token"] = bos = first
                                    if not cls_:
                                        cfg["cls_token"] = cls_ = first
                                self.add_special_token["bos"] = first in (bos, cls_)
                            if last := single[-1].get("SpecialToken", {}).get("id"):
                                if not cfg:
                                    eos = last
                                elif last != eos:
                                    if "eot" not in self.special_token_types:
                                        self.special_token_types += ("eot",)
                                        cfg["eot_token"] = eos
                                    elif "eom" not in self.special_token_types:
                                        self.special_token_types += ("eom",)
                                        cfg["eom_token"] = eos
                                    cfg["eos_token"] = eos = last
                                self.add_special_token["eos"] = last == eos
                        if pair:
                            start = 1 if first and pair[0].get("SpecialToken", {}).get("id") == first else 0
                            stop = -1 if last and pair[-1].get("SpecialToken", {}).get("id") == last else None
                            if pair := pair[slice(start, stop)]:
                                a = pair[0].get("Sequence", {}).get("id")
                                b = pair[-1].get("Sequence", {}).get("id")
                                if a == "A" and b == "B" and (pair := pair[1:-1]):
                                    add_sep = False
                                    if entry := pair[0].get("SpecialToken", {}).get("id"):
                                        if entry in (sep, eos) and not last:
                                            add_sep = True
                                    if len(pair) == 2:
                                        if entry := pair[1].get("SpecialToken", {}).get("id"):
                                            if entry in (sep, eos):
                                                add_sep = True
                                    self.add_special_token["sep"] = add_sep
                                    if add_sep and not sep and cfg:
                                        cfg["sep_token"] = eos
        if not cfg:
            return
        for typ in self.special_token_types:
            add_entry = cfg.get(f"add_{typ}_token")
            if isinstance(add_entry, bool) and typ not in self.add_special_token:
                self.add_special_token[typ] = add_entry
            entry = cfg.get(f"{typ}_token")
            if isinstance(entry, dict):
                entry = entry.get("content")
            if not isinstance(entry, str):
                continue
            self._set(typ, next((t.get("id") for t in added_tokens if t.get("content") == entry), None))

    def _from_config_json(self, folder: Path) -> None:
        if not (folder / "config.json").is_file():
            return
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        for typ in self.special_token_types:
            tid = config.get(f"{typ}_token_id")
            if tid is None and "text_config" in config:
                tid = config["text_config"].get(f"{typ}_token_id")
            self._set(typ, tid)

    def add_to_gguf(self, w: Any) -> None:
        key = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id", "sep": "seperator_token_id",
               "pad": "padding_token_id", "mask": "mask_token_id", "eot": "eot_token_id", "eom": "eom_token_id"}
        for typ, tid in self.special_token_ids.items():
            if typ in key:  # gguf has no add_cls_token_id: llama.cpp skips "cls" with a warning
                w.add_uint32(f"tokenizer.ggml.{key[typ]}", tid)
        for typ, value in self.add_special_token.items():
            if typ in ("bos", "eos", "sep"):  # GGUFWriter has add_add_{bos,eos,sep}_token only
                w.add_bool(f"tokenizer.ggml.add_{typ}_token", value)
        if self.lowercase is not None:
            w.add_bool("tokenizer.ggml.normalizer.lowercase", self.lowercase)
        if self.strip_accents is not None:
            w.add_bool("tokenizer.ggml.normalizer.strip_accents", self.strip_accents)


# --------------------------------------------------------------------------------------------- main

def pooling_type(folder: Path) -> int | None:
    """TextModel._try_set_pooling_type (sentence-transformers modules.json / Pooling config)."""
    path = None
    if (folder / "modules.json").is_file():
        for mod in json.loads((folder / "modules.json").read_text(encoding="utf-8")):
            if mod["type"].endswith("Pooling"):
                path = mod["path"]
                break
    if path is None:
        return None
    p = json.loads((folder / path / "config.json").read_text(encoding="utf-8"))
    if p.get("pooling_mode_mean_tokens"):
        return POOLING["mean"]
    if p.get("pooling_mode_cls_token"):
        return POOLING["cls"]
    if p.get("pooling_mode_lasttoken"):
        return POOLING["lasttoken"]
    if p.get("pooling_mode") in POOLING:
        return POOLING[p["pooling_mode"]]
    raise SystemExit("only MEAN, CLS and LAST pooling are supported")


def size_label(n_params: int) -> str:
    import gguf

    return gguf.size_label(n_params, 0, 0, 0)


def write_wordpiece_vocab(w: Any, folder: Path, hp: dict[str, Any]) -> None:
    """BertModel.set_vocab: the WordPiece vocabulary with phantom spaces."""
    tokens, types = vocab_base(folder, hp)
    w.add_uint32("tokenizer.ggml.token_type_count", hp.get("type_vocab_size", 1))
    tokens = [t if ty == CONTROL else t[2:] if t.startswith("##") else PHANTOM + t
              for t, ty in zip(tokens, types, strict=True)]
    w.add_tokenizer_model("bert")
    w.add_tokenizer_pre("jina-v2-en")
    w.add_token_list(tokens)
    w.add_token_types(types)
    SpecialVocab(folder, len(tokens)).add_to_gguf(w)


def convert(folder: Path, out: Path, outtype: str = "f32", name: str | None = None) -> None:
    import gguf

    hp = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    archs = hp.get("architectures") or ["BertModel"]
    if archs[0] not in BERT_ARCHS + XLMR_ARCHS:
        raise SystemExit(f"unsupported architecture {archs[0]!r} (supported: {', '.join(BERT_ARCHS + XLMR_ARCHS)})")
    xlmr = archs[0] in XLMR_ARCHS
    offset = 0
    if xlmr:
        if hp.get("lora_adaptations"):
            raise SystemExit("jina-embeddings-v3 (lora_adaptations) is not supported")
        # XLMRobertaModel._xlmroberta_tokenizer_init: RoBERTa's positions start at pad_token_id + 1
        if (pad := hp.get("pad_token_id")) is not None:
            offset = 1 + pad
            if "max_position_embeddings" in hp:
                hp["max_position_embeddings"] -= offset
    labels = hp.get("id2label")
    if labels and len(labels) == 2 and labels.get("0", labels.get(0)) == "LABEL_0":
        labels = None
    f16 = outtype == "f16"
    n_layers = hp["num_hidden_layers"]

    tensors = map_tensors(load_tensors(folder), n_layers, bool(labels), offset)
    # gguf-py's total parameter count: every tensor's element count (no expert / shared split here)
    n_params = sum(int(d.size) for _, d in tensors)

    w = gguf.GGUFWriter(str(out), ARCH)
    w.add_type("model")
    w.add_name(name or folder.name)
    w.add_size_label(size_label(n_params))
    # TextModel.set_gguf_parameters
    w.add_block_count(n_layers)
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    if (eps := hp.get("layer_norm_eps", hp.get("layer_norm_epsilon"))) is not None:
        w.add_layer_norm_eps(eps)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if f16 else gguf.LlamaFileType.ALL_F32)
    # BertModel.set_gguf_parameters
    w.add_causal_attention(False)
    if (pt := pooling_type(folder)) is not None:
        w.add_uint32(f"{ARCH}.pooling_type", pt)
    if labels:
        w.add_array(f"{ARCH}.classifier.output_labels", [v for _, v in sorted(labels.items())])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if xlmr:  # XLMRobertaModel.set_vocab: BertModel._xlmroberta_set_vocab
        v = xlmr_vocab(folder, hp)
        w.add_tokenizer_model("t5")
        w.add_tokenizer_pre("default")
        w.add_token_list(v["tokens"])
        w.add_token_scores(v["scores"])
        w.add_token_types(v["types"])
        w.add_add_space_prefix(v["add_prefix"])
        w.add_uint32("tokenizer.ggml.token_type_count", hp.get("type_vocab_size", 1))
        w.add_remove_extra_whitespaces(v["remove_whitespaces"])
        if v["charsmap"]:
            w.add_precompiled_charsmap(v["charsmap"])
        SpecialVocab(folder, len(v["tokens"])).add_to_gguf(w)
    else:
        write_wordpiece_vocab(w, folder, hp)

    for tname, data in tensors:
        qtype = out_type(tname, data, f16)
        arr = np.ascontiguousarray(data, dtype=np.float16 if qtype == gguf.GGMLQuantizationType.F16 else np.float32)
        w.add_tensor(tname, arr, raw_dtype=qtype)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--outtype", choices=("f32", "f16"), default="f32")
    ap.add_argument("--name", default=None, help="general.name (default: the folder's name)")
    args = ap.parse_args(argv)
    convert(args.folder, args.out, args.outtype, args.name)
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
