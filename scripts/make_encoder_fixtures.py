"""Build the encoder (BERT) fixtures: a tiny random ``BertModel`` embedder (``tests/fixtures/bert``), a tiny
random ``BertForSequenceClassification`` cross-encoder reranker (``tests/fixtures/bert_rerank``) and the
all-MiniLM-L6-v2 sentence-embedding reference (``tests/data/minilm_sentences.json``,
``tests/data/minilm_reference.npz``).

Run in the reference environment (torch 2.13.0 CPU, transformers 5.24.0, tokenizers 0.23.3,
sentence-transformers 6.3.0; every number fp32, eager attention, CPU)::

    /tmp/refenv/bin/python scripts/make_encoder_fixtures.py --out DIR --minilm /tmp/minilm/w/folder

It writes ``DIR/nomic`` (alone with ``--only-nomic``), ``DIR/bert``, ``DIR/bert_rerank``, ``DIR/xlmr``,
``DIR/xlmr_rerank``, ``DIR/minilm_sentences.json`` and ``DIR/minilm_reference.npz`` (without ``--minilm`` only the
five tiny fixtures); copy the five folders over ``tests/fixtures/`` and the two ``minilm_*`` files into
``tests/data/``. At the end the script reloads every saved folder with transformers / sentence-transformers and
checks that it reproduces the stored references exactly (max abs diff 0). ``nomic/model-f32.gguf`` is written by
llama.cpp's converter (see ``nomic/README.md``).

Recipe:

1. Tokenizer (shared by both tiny fixtures): a ``tokenizers`` WordPiece model (prefix ``##``, special tokens
   ``[PAD] [UNK] [CLS] [SEP] [MASK]`` = ids 0..4) whose 600-entry vocabulary (``VOCAB_TARGET``) is learnt
   from ``CORPUS`` (fixed English text below, ASCII only, so accented letters are only seen after accent
   stripping and CJK characters are unknown) by ``wordpiece_vocab``: the merge loop of ``tokenizers``'
   ``WordPieceTrainer`` over the words its normalizer and pre-tokenizer give, but with deterministic
   tie-breaking (the trainer breaks ties in hash-map order, so its vocabulary changes from run to run);
   ``BertNormalizer(lowercase=True)``
   (clean text, CJK characters split, accents stripped as BERT-uncased does), ``BertPreTokenizer``,
   ``TemplateProcessing`` ``[CLS] $A [SEP]`` / ``[CLS] $A [SEP] $B:1 [SEP]:1``, WordPiece decoder; saved
   through ``transformers.BertTokenizerFast(tokenizer_object=...)`` (``tokenizer.json``,
   ``tokenizer_config.json``). ``vocab_size`` in the config = the tokenizer's vocabulary size.
2. Model: ``BertConfig`` hidden 32, 2 layers, 4 heads, intermediate 64, max_position_embeddings 128,
   type_vocab_size 2, ``gelu`` (exact), layer_norm_eps 1e-12, pad_token_id 0, initializer_range 0.2 (so the
   attention is far from uniform), eager attention. ``torch.manual_seed(seed)``, transformers' own random
   init, then (same generator, parameter order) every LayerNorm gain ``normal(1, 0.2)`` and every bias
   ``normal(0, 0.2)``, so a dropped bias or gain shows. ``save_pretrained`` (fp32 safetensors), reloaded
   with ``attn_implementation="eager"``; every reference comes from the reload.
3. ``bert/``: ``BertModel`` (with its pooler, seed ``BERT_SEED``) + sentence-transformers files
   (``modules.json``: Transformer, Pooling, Normalize; ``1_Pooling/config.json``: mean pooling;
   ``sentence_bert_config.json``: max_seq_length 64, do_lower_case false). ``texts.json`` holds
   ``BERT_TEXTS`` (6 texts, 1 word to ~50 tokens, accents, an unknown CJK character). ``reference.npz``:
   ``ids_<i>`` (the ``tokenizers`` tokenizer's ids with special tokens, int32), ``last_hidden_state_<i>``
   ([tokens, 32], the text alone, batch 1, no padding), ``pooler_output`` [6, 32] (alone),
   ``embedding`` [6, 32] (``SentenceTransformer(folder, device="cpu").encode(text)`` of each text alone:
   mean pooling + L2 normalization), ``batch_input_ids`` / ``batch_attention_mask`` /
   ``batch_last_hidden_state`` [6, L, 32] (one padded batch, right padding with id 0) and
   ``batch_embedding`` [6, 32] (``encode(texts, batch_size=6)``); the padded rows equal the single runs
   within float rounding (the differences are in ``meta.json``).
4. ``bert_rerank/``: ``BertForSequenceClassification`` with num_labels 1 (seed ``RERANK_SEED``; tensors
   ``bert.embeddings.*``, ``bert.encoder.layer.*``, ``bert.pooler.dense.*``, ``classifier.*``), the same
   tokenizer, no sentence-transformers files. ``texts.json``: ``RERANK_QUERY`` and ``RERANK_DOCS``.
   ``reference.npz``: ``pair_ids_<i>`` / ``pair_type_ids_<i>`` (``tokenizer.encode(query, doc)``: query as
   segment A with type 0, document as segment B with type 1), ``logits`` [5] (the raw score of each pair run
   alone, no activation), ``batch_logits`` [5] (one padded batch).
5. ``xlmr/`` (``XLMR_SEED``): ``XLMRobertaModel`` with ``XLMR_CONFIG`` (sizes of bert/, max_position_embeddings
   130 = 128 usable positions since RoBERTa's position ids start at pad_token_id + 1 = 2, type_vocab_size 1,
   layer_norm_eps 1e-5, pad 1 / bos 0 / eos 2), same init recipe. Tokenizer (``train_unigram_tokenizer``,
   shared with xlmr_rerank): a ``tokenizers`` Unigram model built by hand (``unigram_vocab``, deterministic:
   ``<s> <pad> </s> <unk>`` = ids 0..3, every character of the Metaspace-pretokenized ``CORPUS``, then its most
   frequent substrings of 2..8 characters seen at least twice ranked by count * (len - 1) then the string,
   scores log(count / total), ``<mask>`` last = id 599); no normalizer, ``Metaspace`` pre-tokenizer
   (prepend "\u2581" always), ``TemplateProcessing`` ``<s> $A </s>`` / ``<s> $A </s> </s> $B </s>`` (all type
   ids 0), Metaspace decoder; saved through ``transformers.XLMRobertaTokenizerFast(tokenizer_object=...)``.
   sentence-transformers files as bert/ but CLS pooling. ``texts.json`` = ``XLMR_TEXTS`` (bert's, the last one
   cut to a clause so it stays under 64 tokens); ``reference.npz`` as bert/ (batch padded with id 1).
6. ``xlmr_rerank/`` (``XLMR_RERANK_SEED``): ``XLMRobertaForSequenceClassification`` num_labels 1 (``roberta.*``
   without pooler, ``classifier.dense`` + tanh + ``classifier.out_proj``), same tokenizer; ``reference.npz``
   as bert_rerank/ (``tok.encode(query, doc)``, type ids all 0).
7. ``nomic/`` (``NOMIC_SEED``): ``NomicBertModel`` with ``NOMIC_CONFIG`` (bert/'s sizes, SwiGLU, rotary positions at
   base 1000, no projection biases), bert/'s tokenizer, sentence-transformers files as bert/ (mean pooling);
   init as above (LayerNorm gains matched case-insensitively: its layers' norms are ``post_*_layernorm``).
   ``reference.npz`` as bert/ without ``pooler_output``; ``config_nomic.json`` (``nomic_original_config``) is
   the same model in nomic's own config fields, for llama.cpp's converter and the tests of that config.
8. MiniLM: ``minilm_sentences.json`` = ``minilm_sentences()`` (200 strings built from templates with
   ``random.Random(MINILM_SEED)``: English 1 to ~330 tokens, accented French / German / Vietnamese, Greek,
   Cyrillic, Chinese, Japanese, Korean, Arabic, Hindi, emoji, very long words, digits and punctuation,
   mixed case, control characters, empty-ish strings). ``minilm_reference.npz``: ``embeddings`` [200, 384]
   float32 = ``SentenceTransformer(folder, device="cpu", model_kwargs={"attn_implementation": "eager"})
   .encode(sentences, batch_size=32, convert_to_numpy=True)`` (mean pooling, then Normalize);
   ``ids`` (flat int32) + ``lengths`` (int32, per sentence) = the ids ``model.tokenize(sentences)`` feeds the
   model (truncation at max_seq_length 256, padding removed); ``versions`` (0-d string: JSON of the
   package versions); ``sdpa_max_abs_diff`` (0-d float: the same encode with the default sdpa attention,
   how far it lands from the eager one).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np

VOCAB_TARGET = 600
BERT_SEED = 4101
RERANK_SEED = 4103
XLMR_SEED = 4109
NOMIC_SEED = 4113
XLMR_RERANK_SEED = 4111
XLMR_VOCAB_TARGET = 600
MINILM_SEED = 4107
ST_MAX_SEQ = 64  # the tiny embedder's sentence_bert_config.json

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]

BERT_CONFIG: dict[str, Any] = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "max_position_embeddings": 128,
    "type_vocab_size": 2,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-12,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
    "initializer_range": 0.2,
    "pad_token_id": 0,
}

# nomic-bert: bert/'s sizes, rotary positions at nomic's base 1000, SwiGLU, no projection biases
NOMIC_CONFIG: dict[str, Any] = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "max_position_embeddings": 128,
    "type_vocab_size": 2,
    "hidden_act": "silu",
    "layer_norm_eps": 1e-12,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
    "initializer_range": 0.2,
    "pad_token_id": 0,
    "rope_parameters": {"rope_theta": 1000.0, "rope_type": "default"},
}

# XLM-RoBERTa sizes: positions are offset by pad_token_id + 1 = 2 in transformers' RoBERTa, so 130 rows give
# 128 usable positions (llama.cpp's converter drops the first 2 rows and writes context_length 128).
XLMR_CONFIG: dict[str, Any] = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "max_position_embeddings": 130,
    "type_vocab_size": 1,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-5,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
    "initializer_range": 0.2,
    "pad_token_id": 1,
    "bos_token_id": 0,
    "eos_token_id": 2,
}
XLMR_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]  # ids 0..3; "<mask>" is the last id, as in XLM-R

# The tokenizer's training text: ASCII English only.
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A small model can still learn a useful vocabulary from a short text.",
    "Search engines rank documents by how well they answer the query.",
    "Sentence embeddings map every text to a single vector of fixed size.",
    "The cat sat on the mat, and the dog slept in the warm kitchen.",
    "Rain is expected tomorrow in the northern part of the country.",
    "She opened the window to let the fresh morning air into the room.",
    "Engineers measured the latency of the new inference server twice.",
    "Tokenizers split words into smaller pieces called subwords.",
    "The river flows through the old town before it reaches the sea.",
    "Children played football in the park until the sun went down.",
    "He bought bread, cheese, apples and a bottle of milk at the market.",
    "Learning a language takes patience, practice and a good teacher.",
    "The library opens at nine in the morning and closes at six.",
    "Mathematics describes patterns, numbers, shapes and change.",
    "Transformers use attention to mix information between tokens.",
    "The museum displays paintings, sculptures and ancient coins.",
    "Doctors recommend walking for thirty minutes every day.",
    "A reranker scores each pair of query and document with one number.",
    "The train to the capital leaves from platform four at noon.",
    "Coffee and tea are the most popular drinks in many offices.",
    "Mountains covered with snow surround the quiet valley.",
    "Please remember to save your work before you close the program.",
    "The committee approved the budget for the next three years.",
    "Birds build nests in spring and fly south when autumn comes.",
    "Numbers like 1, 2, 3, 42 and 2024 appear in many documents.",
    "Questions, answers, and explanations: what, why, where, when, how?",
    "The chef prepared a delicious meal with fresh vegetables and rice.",
    "Scientists observed the stars through a powerful telescope last night.",
    "Our team released a faster version of the software this week.",
    "Encoders read the whole input at once; decoders write one token at a time.",
    "Normalization, pooling and projection are common final steps.",
    "The student wrote a long essay about history, politics and culture.",
    "Every good story has a beginning, a middle and an end.",
    "Weather reports mention temperature, wind, clouds and humidity.",
    "Running, swimming and cycling are popular sports in summer.",
    "Hospitals, schools and roads were built by the local government.",
    "The singer performed her new songs at the concert hall.",
    "Farmers grow wheat, corn, potatoes and beans in the fields.",
    "Computers store information as long sequences of zeros and ones.",
    "Wow! The price (about $40, or 15% off) isn't bad - it's a \"deal\" @ home & work.",
    "Well, then, they were quickly worth it; the big city is whole again.",
]

BERT_TEXTS = [
    "hello",
    "The café served crème brûlée to Zoë.",
    "Tokyo 東 is a big city.",
    "Search engines rank documents by how well they answer the query.",
    "In 2024, the committee approved 3 budgets (worth $1,250,000) — quickly!",
    "Transformers use attention to mix information between tokens, while encoders read the whole input at "
    "once; pooling then averages the vectors into a single sentence embedding.",
]

# the xlmr fixture's texts: bert's, the last one cut to one clause (the 600-piece Unigram vocabulary needs 69
# tokens for the full text, more than max_seq_length 64)
XLMR_TEXTS = BERT_TEXTS[:-1] + ["Transformers use attention to mix information between tokens, while encoders read "
                                "the whole input at once."]

RERANK_QUERY = "how do search engines rank documents?"
RERANK_DOCS = [
    "Search engines rank documents by how well they answer the query.",
    "The cat sat on the mat.",
    "A reranker scores each pair of query and document with one number, and the best documents come first.",
    "Rain is expected tomorrow in the northern part of the country.",
    "Ranking",
]


# --------------------------------------------------------------------------------------------- tokenizer

def wordpiece_vocab(words: dict[str, int], size: int) -> list[str]:
    """A WordPiece vocabulary as ``tokenizers``' WordPieceTrainer builds it (BPE merges over the words, the
    continuation pieces prefixed ``##``), with deterministic tie-breaking: the most frequent pair, ties by
    the smaller (left, right) strings. The trainer itself breaks ties in hash-map order, which changes from
    run to run."""
    split = {w: [w[0]] + ["##" + c for c in w[1:]] for w in sorted(words)}
    vocab = list(SPECIALS) + sorted({p for pieces in split.values() for p in pieces})
    known = set(vocab)
    while len(vocab) < size:
        counts: dict[tuple[str, str], int] = {}
        for w, pieces in split.items():
            for a, b in zip(pieces, pieces[1:], strict=False):
                counts[(a, b)] = counts.get((a, b), 0) + words[w]
        if not counts:
            break
        (a, b), _ = min(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        merged = a + b[2:]
        for w, pieces in split.items():
            i, new = 0, []
            while i < len(pieces):
                if i + 1 < len(pieces) and pieces[i] == a and pieces[i + 1] == b:
                    new.append(merged)
                    i += 2
                else:
                    new.append(pieces[i])
                    i += 1
            split[w] = new
        if merged not in known:
            known.add(merged)
            vocab.append(merged)
    return vocab


def train_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                            lowercase=True)
    pre = pre_tokenizers.BertPreTokenizer()
    words: dict[str, int] = {}
    for line in CORPUS:
        for w, _ in pre.pre_tokenize_str(normalizer.normalize_str(line)):
            words[w] = words.get(w, 0) + 1
    vocab = wordpiece_vocab(words, VOCAB_TARGET)
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]",
                                     continuing_subword_prefix="##", max_input_chars_per_word=100))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    tok.decoder = decoders.WordPiece(prefix="##")
    assert [tok.token_to_id(t) for t in SPECIALS] == [0, 1, 2, 3, 4]
    return tok


def save_tokenizer(tok: Any, folder: Path) -> Any:
    from transformers import BertTokenizerFast

    hf = BertTokenizerFast(tokenizer_object=tok, do_lower_case=True, unk_token="[UNK]", sep_token="[SEP]",
                           pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]",
                           model_max_length=BERT_CONFIG["max_position_embeddings"])
    hf.save_pretrained(folder)
    return hf


def unigram_vocab(words: dict[str, int], size: int) -> list[tuple[str, float]]:
    """A Unigram (SentencePiece-style) vocabulary built by hand, deterministically: every character seen, then
    the most frequent substrings (2..8 characters, not starting inside a "\u2581"-prefixed word boundary rule)
    of the Metaspace-pretokenized words, ranked by (count * (len - 1)) then the string; score = log(count /
    total), specials 0.0."""
    import math

    counts: dict[str, int] = {}
    for w, n in words.items():
        for i in range(len(w)):
            for j in range(i + 1, min(len(w), i + 8) + 1):
                counts[w[i:j]] = counts.get(w[i:j], 0) + n
    total = sum(counts.values())
    chars = sorted(c for c in counts if len(c) == 1)
    multi = sorted((c for c in counts if len(c) > 1 and counts[c] >= 2), key=lambda c: (-counts[c] * (len(c) - 1), c))
    pieces = chars + multi[:size - len(XLMR_SPECIALS) - 1 - len(chars)]
    vocab = [(t, 0.0) for t in XLMR_SPECIALS]
    vocab += [(p, math.log(counts[p] / total)) for p in pieces]
    vocab.append(("<mask>", 0.0))
    return vocab


def train_unigram_tokenizer() -> Any:
    """XLM-R-shaped tokenizer: Unigram model, no normalizer, Metaspace pre-tokenizer (prepend "\u2581"),
    ``<s> $A </s>`` / ``<s> $A </s> </s> $B </s>`` (all type ids 0), Metaspace decoder."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    pre = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    words: dict[str, int] = {}
    for line in CORPUS:
        for w, _ in pre.pre_tokenize_str(line):
            words[w] = words.get(w, 0) + 1
    vocab = unigram_vocab(words, XLMR_VOCAB_TARGET)
    tok = Tokenizer(models.Unigram(vocab, unk_id=3, byte_fallback=False))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in XLMR_SPECIALS]
                           + [AddedToken("<mask>", special=True, normalized=False, lstrip=True)])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    assert [tok.token_to_id(t) for t in XLMR_SPECIALS] == [0, 1, 2, 3]
    assert tok.token_to_id("<mask>") == tok.get_vocab_size() - 1
    return tok


def save_xlmr_tokenizer(tok: Any, folder: Path) -> Any:
    from transformers import XLMRobertaTokenizerFast

    hf = XLMRobertaTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", sep_token="</s>",
                                 cls_token="<s>", unk_token="<unk>", pad_token="<pad>", mask_token="<mask>",
                                 model_max_length=XLMR_CONFIG["max_position_embeddings"] - 2)
    hf.save_pretrained(folder)
    return hf


# --------------------------------------------------------------------------------------------- models

def build_model(model_class: str, seed: int, vocab_size: int, config_class: str = "BertConfig",
                base: dict[str, Any] | None = None, **extra: Any) -> Any:
    import torch
    import transformers

    config = getattr(transformers, config_class)(vocab_size=vocab_size, **(base or BERT_CONFIG), **extra)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm.weight" in name.lower():  # BERT's LayerNorm, nomic-bert's post_*_layernorm
                p.copy_(torch.randn(p.shape) * 0.2 + 1.0)
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape) * 0.2)
    return model


def reload(model_class: str, folder: Path) -> Any:
    import transformers

    return getattr(transformers, model_class).from_pretrained(
        folder, attn_implementation="eager", dtype="float32").eval()


def write_st_files(folder: Path, pooling_mode: str = "mean") -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules, indent=2) + "\n")
    (folder / "1_Pooling").mkdir(exist_ok=True)
    pooling = {"word_embedding_dimension": BERT_CONFIG["hidden_size"],
               "pooling_mode_cls_token": pooling_mode == "cls",
               "pooling_mode_mean_tokens": pooling_mode == "mean", "pooling_mode_max_tokens": False,
               "pooling_mode_mean_sqrt_len_tokens": False}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2) + "\n")
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": ST_MAX_SEQ, "do_lower_case": False}, indent=2) + "\n")


def load_st(folder: Path, eager: bool = True) -> Any:
    from sentence_transformers import SentenceTransformer

    kwargs = {"model_kwargs": {"attn_implementation": "eager"}} if eager else {}
    return SentenceTransformer(str(folder), device="cpu", **kwargs)


def bert_references(folder: Path, tok: Any, model_class: str = "BertModel", pad_id: int = 0,
                    pooling_mode: str = "mean",
                    texts: list[str] = BERT_TEXTS) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    import torch

    model = reload(model_class, folder)
    ref: dict[str, np.ndarray] = {}
    pooled, hidden = [], []
    with torch.no_grad():
        for i, text in enumerate(texts):
            enc = tok.encode(text)
            ids = np.asarray(enc.ids, dtype=np.int32)
            assert len(ids) <= ST_MAX_SEQ
            ref[f"ids_{i}"] = ids
            out = model(input_ids=torch.tensor(ids[None], dtype=torch.long),
                        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                        token_type_ids=torch.zeros(1, len(ids), dtype=torch.long))
            h = out.last_hidden_state[0].numpy().astype(np.float32)
            ref[f"last_hidden_state_{i}"] = h
            hidden.append(h)
            if out.pooler_output is not None:  # NomicBertModel has none
                pooled.append(out.pooler_output[0].numpy())
        if pooled:
            ref["pooler_output"] = np.stack(pooled).astype(np.float32)
        n = max(len(ref[f"ids_{i}"]) for i in range(len(texts)))
        bids = np.full((len(texts), n), pad_id, dtype=np.int32)
        mask = np.zeros((len(texts), n), dtype=np.int32)
        for i in range(len(texts)):
            k = len(ref[f"ids_{i}"])
            bids[i, :k] = ref[f"ids_{i}"]
            mask[i, :k] = 1
        out = model(input_ids=torch.tensor(bids, dtype=torch.long),
                    attention_mask=torch.tensor(mask, dtype=torch.long),
                    token_type_ids=torch.zeros(bids.shape, dtype=torch.long))
        ref["batch_input_ids"], ref["batch_attention_mask"] = bids, mask
        ref["batch_last_hidden_state"] = out.last_hidden_state.numpy().astype(np.float32)
    batch_diff = max(float(np.abs(ref["batch_last_hidden_state"][i, :len(h)] - h).max())
                     for i, h in enumerate(hidden))

    st = load_st(folder)
    # the ids sentence-transformers feeds the model must be the tokenizers tokenizer's
    feats = st.tokenize(texts)
    for i in range(len(texts)):
        k = int(feats["attention_mask"][i].sum())
        assert feats["input_ids"][i, :k].tolist() == ref[f"ids_{i}"].tolist(), i
    emb = np.stack([st.encode([t], batch_size=1, convert_to_numpy=True)[0] for t in texts])
    ref["embedding"] = emb.astype(np.float32)
    ref["batch_embedding"] = st.encode(texts, batch_size=len(texts), convert_to_numpy=True)
    # the same by hand: mean over the tokens (or the first token), then L2 normalization
    pool = (lambda h: h.mean(0)) if pooling_mode == "mean" else (lambda h: h[0])
    manual = np.stack([pool(h) / np.linalg.norm(pool(h)) for h in hidden])
    stats = {
        "tokens_per_text": [len(ref[f"ids_{i}"]) for i in range(len(texts))],
        "batch_vs_single_last_hidden_max_abs_diff": batch_diff,
        "batch_vs_single_embedding_max_abs_diff": float(np.abs(ref["batch_embedding"] - emb).max()),
        f"manual_{pooling_mode}_pool_normalize_vs_st_max_abs_diff": float(np.abs(manual - emb).max()),
        "last_hidden_state_std": float(np.concatenate(hidden).std()),
        "pooler_output_std": float(ref["pooler_output"].std()) if pooled else None,
    }
    return ref, stats


def make_bert(out: Path, tok: Any) -> dict[str, Any]:
    folder = out / "bert"
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    model = build_model("BertModel", BERT_SEED, tok.get_vocab_size())
    model.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(tok, folder)
    write_st_files(folder)
    ref, stats = bert_references(folder, tok)
    np.savez(folder / "reference.npz", **ref)
    (folder / "texts.json").write_text(json.dumps(BERT_TEXTS, ensure_ascii=False, indent=1) + "\n")
    meta = {"model_class": "BertModel", "seed": BERT_SEED, "config": BERT_CONFIG,
            "vocab_size": tok.get_vocab_size(),
            "init": "transformers init (initializer_range 0.2) after torch.manual_seed(seed); then LayerNorm "
                    "gains normal(1, 0.2), biases normal(0, 0.2)",
            "tensors": {k: list(v.shape) for k, v in model.state_dict().items()}, **stats}
    (folder / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    (folder / "README.md").write_text(README_BERT)
    return meta


def nomic_original_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config.json nomic's own checkpoints carry (nomic-ai/nomic-embed-text-v1.5's fields, this model's
    sizes): what llama.cpp's converter reads (it asserts n_positions 8192 with max_trained_positions 2048)."""
    return {
        "architectures": ["NomicBertModel"], "model_type": "nomic_bert", "activation_function": "swiglu",
        "n_embd": cfg["hidden_size"], "n_head": cfg["num_attention_heads"], "n_layer": cfg["num_hidden_layers"],
        "n_inner": cfg["intermediate_size"], "n_positions": 8192, "max_trained_positions": 2048,
        "vocab_size": cfg["vocab_size"], "type_vocab_size": cfg["type_vocab_size"],
        "layer_norm_epsilon": cfg["layer_norm_eps"], "rotary_emb_base": cfg["rope_parameters"]["rope_theta"],
        "rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False, "rotary_emb_scale_base": None,
        "rotary_scaling_factor": None, "causal": False, "prenorm": False, "qkv_proj_bias": False,
        "mlp_fc1_bias": False, "mlp_fc2_bias": False, "parallel_block": False, "use_rms_norm": False,
        "pad_token_id": cfg["pad_token_id"], "bos_token_id": None, "eos_token_id": None,
    }


def make_nomic(out: Path, tok: Any) -> dict[str, Any]:
    folder = out / "nomic"
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    model = build_model("NomicBertModel", NOMIC_SEED, tok.get_vocab_size(), "NomicBertConfig", NOMIC_CONFIG)
    model.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(tok, folder)
    write_st_files(folder)
    ref, stats = bert_references(folder, tok, "NomicBertModel")
    np.savez(folder / "reference.npz", **ref)
    (folder / "texts.json").write_text(json.dumps(BERT_TEXTS, ensure_ascii=False, indent=1) + "\n")
    saved = json.loads((folder / "config.json").read_text())
    (folder / "config_nomic.json").write_text(json.dumps(nomic_original_config(saved), indent=2) + "\n")
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "np") as f:
        names = sorted(f.keys())
    meta = {"model_class": "NomicBertModel", "seed": NOMIC_SEED, "config": NOMIC_CONFIG,
            "vocab_size": tok.get_vocab_size(),
            "init": "transformers init (initializer_range 0.2) after torch.manual_seed(seed); then LayerNorm "
                    "gains normal(1, 0.2), biases normal(0, 0.2)",
            "saved_tensors": names, **stats}
    (folder / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    (folder / "README.md").write_text(README_NOMIC)
    return meta


def make_rerank(out: Path, tok: Any) -> dict[str, Any]:
    import torch

    folder = out / "bert_rerank"
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    model = build_model("BertForSequenceClassification", RERANK_SEED, tok.get_vocab_size(), num_labels=1)
    model.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(tok, folder)
    model = reload("BertForSequenceClassification", folder)
    ref: dict[str, np.ndarray] = {}
    logits = []
    with torch.no_grad():
        for i, doc in enumerate(RERANK_DOCS):
            enc = tok.encode(RERANK_QUERY, doc)
            ids = np.asarray(enc.ids, dtype=np.int32)
            types = np.asarray(enc.type_ids, dtype=np.int32)
            ref[f"pair_ids_{i}"], ref[f"pair_type_ids_{i}"] = ids, types
            o = model(input_ids=torch.tensor(ids[None], dtype=torch.long),
                      attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                      token_type_ids=torch.tensor(types[None], dtype=torch.long))
            assert o.logits.shape == (1, 1)
            logits.append(float(o.logits[0, 0]))
        ref["logits"] = np.asarray(logits, dtype=np.float32)
        hf = save_tokenizer(tok, folder)  # same files again; used here for a padded batch
        b = hf([RERANK_QUERY] * len(RERANK_DOCS), RERANK_DOCS, padding=True, return_tensors="pt")
        for i in range(len(RERANK_DOCS)):
            k = int(b["attention_mask"][i].sum())
            assert b["input_ids"][i, :k].tolist() == ref[f"pair_ids_{i}"].tolist()
            assert b["token_type_ids"][i, :k].tolist() == ref[f"pair_type_ids_{i}"].tolist()
        ref["batch_logits"] = model(**b).logits[:, 0].numpy().astype(np.float32)
    np.savez(folder / "reference.npz", **ref)
    (folder / "texts.json").write_text(
        json.dumps({"query": RERANK_QUERY, "documents": RERANK_DOCS}, ensure_ascii=False, indent=1) + "\n")
    meta = {"model_class": "BertForSequenceClassification", "num_labels": 1, "seed": RERANK_SEED,
            "config": BERT_CONFIG, "vocab_size": tok.get_vocab_size(),
            "init": "as bert/ (classifier.bias and pooler bias included in the normal(0, 0.2) biases)",
            "tensors": {k: list(v.shape) for k, v in model.state_dict().items()},
            "pair_lengths": [len(ref[f"pair_ids_{i}"]) for i in range(len(RERANK_DOCS))],
            "logits": [float(v) for v in ref["logits"]],
            "batch_vs_single_logits_max_abs_diff": float(np.abs(ref["batch_logits"] - ref["logits"]).max())}
    (folder / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    (folder / "README.md").write_text(README_RERANK)
    return meta


def make_xlmr(out: Path, tok: Any) -> dict[str, Any]:
    folder = out / "xlmr"
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    model = build_model("XLMRobertaModel", XLMR_SEED, tok.get_vocab_size(), "XLMRobertaConfig", XLMR_CONFIG)
    model.save_pretrained(folder, safe_serialization=True)
    save_xlmr_tokenizer(tok, folder)
    write_st_files(folder, pooling_mode="cls")
    ref, stats = bert_references(folder, tok, "XLMRobertaModel", pad_id=XLMR_CONFIG["pad_token_id"],
                                 pooling_mode="cls", texts=XLMR_TEXTS)
    np.savez(folder / "reference.npz", **ref)
    (folder / "texts.json").write_text(json.dumps(XLMR_TEXTS, ensure_ascii=False, indent=1) + "\n")
    meta = {"model_class": "XLMRobertaModel", "seed": XLMR_SEED, "config": XLMR_CONFIG,
            "vocab_size": tok.get_vocab_size(),
            "init": "as bert/: transformers init (initializer_range 0.2) after torch.manual_seed(seed); then "
                    "LayerNorm gains normal(1, 0.2), biases normal(0, 0.2)",
            "tensors": {k: list(v.shape) for k, v in model.state_dict().items()}, **stats}
    (folder / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    (folder / "README.md").write_text(README_XLMR)
    return meta


def make_xlmr_rerank(out: Path, tok: Any) -> dict[str, Any]:
    import torch

    folder = out / "xlmr_rerank"
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    model = build_model("XLMRobertaForSequenceClassification", XLMR_RERANK_SEED, tok.get_vocab_size(),
                        "XLMRobertaConfig", XLMR_CONFIG, num_labels=1)
    model.save_pretrained(folder, safe_serialization=True)
    hf = save_xlmr_tokenizer(tok, folder)
    model = reload("XLMRobertaForSequenceClassification", folder)
    ref: dict[str, np.ndarray] = {}
    logits = []
    with torch.no_grad():
        for i, doc in enumerate(RERANK_DOCS):
            enc = tok.encode(RERANK_QUERY, doc)
            ids = np.asarray(enc.ids, dtype=np.int32)
            types = np.asarray(enc.type_ids, dtype=np.int32)
            assert not types.any()  # type_vocab_size 1
            ref[f"pair_ids_{i}"], ref[f"pair_type_ids_{i}"] = ids, types
            o = model(input_ids=torch.tensor(ids[None], dtype=torch.long),
                      attention_mask=torch.ones(1, len(ids), dtype=torch.long))
            assert o.logits.shape == (1, 1)
            logits.append(float(o.logits[0, 0]))
        ref["logits"] = np.asarray(logits, dtype=np.float32)
        b = hf([RERANK_QUERY] * len(RERANK_DOCS), RERANK_DOCS, padding=True, return_tensors="pt")
        for i in range(len(RERANK_DOCS)):
            k = int(b["attention_mask"][i].sum())
            assert b["input_ids"][i, :k].tolist() == ref[f"pair_ids_{i}"].tolist()
        ref["batch_logits"] = model(**b).logits[:, 0].numpy().astype(np.float32)
    np.savez(folder / "reference.npz", **ref)
    (folder / "texts.json").write_text(
        json.dumps({"query": RERANK_QUERY, "documents": RERANK_DOCS}, ensure_ascii=False, indent=1) + "\n")
    meta = {"model_class": "XLMRobertaForSequenceClassification", "num_labels": 1, "seed": XLMR_RERANK_SEED,
            "config": XLMR_CONFIG, "vocab_size": tok.get_vocab_size(),
            "init": "as xlmr/ (classifier.dense.bias and classifier.out_proj.bias in the normal(0, 0.2) biases)",
            "tensors": {k: list(v.shape) for k, v in model.state_dict().items()},
            "pair_lengths": [len(ref[f"pair_ids_{i}"]) for i in range(len(RERANK_DOCS))],
            "logits": [float(v) for v in ref["logits"]],
            "batch_vs_single_logits_max_abs_diff": float(np.abs(ref["batch_logits"] - ref["logits"]).max())}
    (folder / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    (folder / "README.md").write_text(README_XLMR_RERANK)
    return meta


README_BERT = """\
# bert: tiny random BertModel embedder

Made by `scripts/make_encoder_fixtures.py` (its docstring is the recipe). transformers `BertModel` with
random weights (hidden 32, 2 layers, 4 heads, intermediate 64, exact GELU, 128 positions, 2 token types,
LayerNorm eps 1e-12, LayerNorm gains ~N(1, 0.2), biases ~N(0, 0.2)), a WordPiece `tokenizer.json`
(lowercasing, accent stripping, CJK split, `[CLS] $A [SEP]`), and the sentence-transformers files
(mean pooling, Normalize, max_seq_length 64).

- `texts.json`: the 6 texts.
- `reference.npz`: `ids_<i>` (int32, with [CLS]/[SEP]), `last_hidden_state_<i>` [tokens, 32] (text alone,
  no padding), `pooler_output` [6, 32], `embedding` [6, 32] (sentence-transformers encode of each text
  alone), `batch_input_ids` / `batch_attention_mask` / `batch_last_hidden_state` [6, L, 32] (one
  right-padded batch), `batch_embedding` [6, 32].
- `meta.json`: config, seed, tensor shapes, padded-vs-single differences.
"""

README_RERANK = """\
# bert_rerank: tiny random cross-encoder reranker

Made by `scripts/make_encoder_fixtures.py`. transformers `BertForSequenceClassification` with num_labels 1
(tensors `bert.embeddings.*`, `bert.encoder.layer.*`, `bert.pooler.dense.*`, `classifier.*`), the sizes and
the tokenizer of `../bert`.

- `texts.json`: the query and 5 documents.
- `reference.npz`: `pair_ids_<i>` / `pair_type_ids_<i>` (`[CLS] query [SEP] doc [SEP]`, types 0 then 1),
  `logits` [5] (raw score of each pair run alone, no sigmoid), `batch_logits` [5] (one padded batch).
- `meta.json`: config, seed, tensor shapes, the scores.
"""


README_XLMR = """\
# xlmr: tiny random XLMRobertaModel embedder

Made by `scripts/make_encoder_fixtures.py` (its docstring is the recipe). transformers `XLMRobertaModel` with
random weights (hidden 32, 2 layers, 4 heads, intermediate 64, exact GELU, max_position_embeddings 130 =
128 usable positions, since RoBERTa's position ids start at pad_token_id + 1 = 2, 1 token type, LayerNorm eps
1e-5, LayerNorm gains ~N(1, 0.2), biases ~N(0, 0.2)), a Unigram `tokenizer.json` shaped like XLM-R's
(`<s>`=0 `<pad>`=1 `</s>`=2 `<unk>`=3, `<mask>` last; no normalizer, Metaspace pre-tokenizer,
`<s> $A </s>` / `<s> $A </s> </s> $B </s>`, all type ids 0), and the sentence-transformers files
(CLS pooling, Normalize, max_seq_length 64).

- `texts.json`: the 6 texts (those of `../bert`, the last one cut to its first clause).
- `reference.npz`: `ids_<i>` (int32, with `<s>`/`</s>`), `last_hidden_state_<i>` [tokens, 32] (text alone,
  no padding: position ids 2..n+1), `pooler_output` [6, 32], `embedding` [6, 32] (sentence-transformers
  encode of each text alone: hidden state of `<s>`, L2-normalized), `batch_input_ids` /
  `batch_attention_mask` / `batch_last_hidden_state` [6, L, 32] (one batch right-padded with id 1),
  `batch_embedding` [6, 32].
- `meta.json`: config, seed, tensor shapes, padded-vs-single differences.
"""

README_XLMR_RERANK = """\
# xlmr_rerank: tiny random XLM-R cross-encoder reranker (bge-reranker / jina-reranker shape)

Made by `scripts/make_encoder_fixtures.py`. transformers `XLMRobertaForSequenceClassification` with num_labels
1 (tensors `roberta.embeddings.*`, `roberta.encoder.layer.*`, no pooler, head `classifier.dense` [32, 32] +
tanh + `classifier.out_proj` [1, 32] on the `<s>` token), the sizes and the tokenizer of `../xlmr`.

- `texts.json`: the query and 5 documents (those of `../bert_rerank`).
- `reference.npz`: `pair_ids_<i>` / `pair_type_ids_<i>` (`<s> query </s> </s> doc </s>`, types all 0),
  `logits` [5] (raw score of each pair run alone, no sigmoid), `batch_logits` [5] (one padded batch).
- `meta.json`: config, seed, tensor shapes, the scores.
"""

README_NOMIC = """\
# nomic: tiny random nomic-bert embedder (nomic-embed-text's recipe)

Made by `scripts/make_encoder_fixtures.py` (its docstring is the recipe). transformers `NomicBertModel` with
random weights (hidden 32, 2 layers, 4 heads, intermediate 64, SwiGLU, rotary positions at base 1000 over the
whole head, no position table, 2 token types, no projection biases, LayerNorm eps 1e-12, LayerNorm gains
~N(1, 0.2) and biases ~N(0, 0.2)), the tokenizer of `../bert`, and the sentence-transformers files (mean
pooling, Normalize, max_seq_length 64). `save_pretrained` writes the original checkpoint's tensor names
(`emb_ln`, `encoder.layers.N.attn.Wqkv`, `mlp.fc11`/`fc12`/`fc2`, `norm1`/`norm2`) with transformers'
`NomicBertConfig` in `config.json`; `config_nomic.json` is the same model in the config nomic's own hub
folders carry (`n_embd`, `rotary_emb_base`, `activation_function` swiglu, ...).

- `model-f32.gguf`: llama.cpp's `convert_hf_to_gguf.py` (llama-cpp-python 0.3.36) of this folder with
  `config_nomic.json` as its config (`general.architecture` nomic-bert, context 2048), run by
  `scripts/llama_cpp_convert.py --outtype f32 --model-name Nomic`.
- `texts.json`, `reference.npz`, `meta.json`: as `../bert` (no `pooler_output`).
"""


# --------------------------------------------------------------------------------------------- MiniLM

EN_SUBJECTS = ["The old man", "A young student", "My neighbour", "The committee", "Our small team", "The doctor",
               "A tired engineer", "The children", "Every visitor", "The new manager", "She", "They"]
EN_VERBS = ["bought", "painted", "described", "forgot", "repaired", "discussed", "found", "sold", "measured",
            "explained", "visited", "photographed"]
EN_OBJECTS = ["a red bicycle", "the broken window", "three old maps", "the quarterly report", "a tiny garden",
              "the museum downtown", "an expensive laptop", "the recipe for bread", "the train schedule",
              "a strange noise in the attic", "the results of the experiment", "two cups of coffee"]
EN_TAILS = ["yesterday.", "before lunch.", "in the rain.", "without telling anyone.", "at the weekend.",
            "for the third time this year.", "because nobody else would.", "and then went home.",
            "while the radio was playing.", "near the harbour."]
EN_WORDS = ["search", "engine", "vector", "cat", "ocean", "quantum", "bread", "mountain", "river", "python",
            "database", "music", "history", "garden", "window", "inference", "latency", "memory", "planet",
            "library", "winter", "coffee", "language", "network", "theory", "silver"]
FRENCH = ["Le café était délicieux ce matin à Paris.", "Où se trouve la bibliothèque municipale ?",
          "Les élèves ont étudié l'histoire de la Révolution française.", "Je préfère les crêpes au chocolat.",
          "Noël approche et les rues sont décorées de lumières.", "Ça dépend de la météo, évidemment.",
          "L'été dernier, nous avons visité la côte méditerranéenne.", "Garçon, l'addition s'il vous plaît !",
          "Le théâtre présente une pièce de Molière cette semaine.", "Cœur, œuvre, naïf, Noël, maïs, façade."]
GERMAN = ["Die Straße ist heute wegen Bauarbeiten gesperrt.", "Über den Wolken muss die Freiheit grenzenlos sein.",
          "Ich möchte ein Stück Käsekuchen, bitte.", "Die Größe des Gebäudes überraschte alle Besucher.",
          "Grüße aus München und einen schönen Tag!", "Fußgänger müssen die Brücke benutzen.",
          "Das Mädchen übte täglich Klavier.", "Donaudampfschifffahrtsgesellschaftskapitän ist ein langes Wort."]
VIETNAMESE = ["Tôi yêu Việt Nam.", "Hôm nay trời đẹp quá, chúng ta đi dạo nhé.",
              "Phở bò Hà Nội rất ngon và nổi tiếng.", "Cảm ơn bạn rất nhiều vì sự giúp đỡ.",
              "Thành phố Hồ Chí Minh là thành phố lớn nhất Việt Nam.", "Tiếng Việt có sáu thanh điệu.",
              "Học sinh đang đọc sách trong thư viện.", "Người nông dân trồng lúa trên cánh đồng."]
GREEK = ["Καλημέρα σας, τι κάνετε;", "Η Αθήνα είναι η πρωτεύουσα της Ελλάδας.",
         "Το φεγγάρι λάμπει πάνω από τη θάλασσα.", "Μου αρέσει πολύ η ελληνική μουσική.",
         "Ο Σωκράτης ήταν φιλόσοφος.", "ΑΒΓΔ αβγδ άέήίόύώ ϊϋΐΰ"]
CYRILLIC = ["Привет, как дела?", "Москва — столица России.", "Я люблю читать книги по вечерам.",
            "Съешь же ещё этих мягких французских булок, да выпей чаю.", "Київ — столиця України.",
            "Здравствуйте! Меня зовут Анна.", "Зима в Сибири очень холодная.", "ЁЖИК в тумане, ёжик в ТУМАНЕ."]
CHINESE = ["我喜欢学习自然语言处理。", "今天天气很好，我们去公园散步吧。", "北京是中国的首都。",
           "这本书非常有意思，我已经读了三遍。", "机器学习模型需要大量的数据。", "你好，世界！",
           "他每天早上六点起床跑步。", "春眠不觉晓，处处闻啼鸟。"]
JAPANESE = ["こんにちは、元気ですか？", "東京は日本の首都です。", "私は毎朝コーヒーを飲みます。",
            "カタカナとひらがなと漢字を使います。", "この映画はとても面白かったです。",
            "ラーメンを食べに行きましょう！", "吾輩は猫である。名前はまだ無い。", "ｶﾀｶﾅ　全角スペースと半角ｶﾅ"]
KOREAN = ["안녕하세요, 만나서 반갑습니다.", "서울은 한국의 수도입니다.", "저는 음악을 듣는 것을 좋아해요.",
          "오늘 날씨가 정말 좋네요.", "한국어는 한글로 씁니다.", "김치찌개가 맛있어요!"]
ARABIC = ["مرحبا بالعالم", "اللغة العربية جميلة جدا.", "القاهرة هي عاصمة مصر.",
          "أحب قراءة الكتب في المساء.", "شكرا جزيلا على مساعدتك.", "الذكاء الاصطناعي يغير العالم."]
HINDI = ["नमस्ते, आप कैसे हैं?", "भारत की राजधानी नई दिल्ली है।", "मुझे हिंदी सीखना पसंद है।",
         "आज मौसम बहुत अच्छा है।", "यह किताब बहुत रोचक है।", "धन्यवाद!"]
EMOJI = ["😀", "I love pizza 🍕🍕🍕!", "🚀 Launch day! 🎉🎉", "Good morning ☀️ have a nice day 🌻",
         "👩‍💻 coding late at night 🌙", "Flags: 🇫🇷 🇩🇪 🇯🇵 🇺🇸", "❤️🔥💯", "thumbs 👍🏽 and 👎🏿 skin tones"]
LONG_WORDS = ["Pneumonoultramicroscopicsilicovolcanoconiosis",
              "supercalifragilisticexpialidocious antidisestablishmentarianism",
              "Rindfleischetikettierungsüberwachungsaufgabenübertragungsgesetz",
              "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
              "https://www.example.com/a/very/long/path/with_many_segments/and-query?x=1&y=two&z=%20three#frag",
              "thisisaverylongwordwithoutanyspacesthatkeepsgoingandgoingforeverandeverandever"]
DIGITS = ["3.14159265358979323846", "Call 555-0123 or +1 (800) 555-0199.", "2024-06-01T12:34:56Z",
          "1,234,567.89 USD vs 1.234.567,89 EUR", "!!!???...", "#hashtag @user $100 50% a&b <tag> {json: [1, 2]}",
          "(((nested))) [[brackets]] {{braces}}", "0000000000000000000000", "x = (a + b) * c / d - e ^ f;",
          "-- ... ;; :: ,, '' \"\" `` ~~ __ ||"]
MIXED_CASE = ["THIS SENTENCE IS WRITTEN IN CAPITAL LETTERS.", "tHiS sEnTeNcE hAs AlTeRnAtInG cAsE.",
              "iPhone, eBay, McDonald's and YouTube", "NASA and the FBI met at the UN HQ.",
              "CamelCaseIdentifierNamesLikeThis", "snake_case_identifier_names_like_this",
              "ÉCOLE Élève ÜBER Über ÑANDÚ Ñandú", "HeLLo WoRLD"]
CONTROL = ["tab\tseparated\tvalues", "null\u0000byte inside", "zero\u200bwidth\u200bspace", "delete\x7fchar",
           "line one\nline two\r\nline three", "bell\x07 and escape\x1b[0m", "soft\u00adhyphen and nbsp\u00a0here",
           "\ufeffbyte order mark at start"]
EMPTYISH = ["", " ", "   ", "\t", "\n", "\u200b"]
MIXED_SCRIPTS = ["Hello 世界, Привет мир, مرحبا!", "The word for cat: 猫 (Japanese), 고양이 (Korean), кошка (Russian).",
                 "Café 咖啡 кофе قهوة कॉफ़ी ☕", "Tokyo 東京 Seoul 서울 Moscow Москва Athens Αθήνα",
                 "Python 🐍 y Español: ¿Dónde está la biblioteca?", "Ωmega ∑ ∫ √2 ≈ 1.414 ≠ π ∞"]


def minilm_sentences() -> list[str]:
    rng = random.Random(MINILM_SEED)

    def en_sentence() -> str:
        return f"{rng.choice(EN_SUBJECTS)} {rng.choice(EN_VERBS)} {rng.choice(EN_OBJECTS)} {rng.choice(EN_TAILS)}"

    def paragraph(n_sent: int) -> str:
        return " ".join(en_sentence() for _ in range(n_sent))

    out: list[str] = []
    out += [" ".join(rng.choice(EN_WORDS) for _ in range(rng.randint(1, 4))) for _ in range(20)]  # 1-4 words
    out += [en_sentence() for _ in range(30)]
    out += [paragraph(rng.randint(2, 4)) for _ in range(10)]
    out += [paragraph(rng.randint(8, 18)) for _ in range(10)]      # ~80-190 tokens
    out += [paragraph(rng.randint(26, 32)) for _ in range(6)]     # ~270-330 tokens: truncated at 256
    out += FRENCH + GERMAN + VIETNAMESE                           # 26
    out += GREEK + CYRILLIC + CHINESE + JAPANESE + KOREAN + ARABIC + HINDI  # 48
    out += EMOJI + LONG_WORDS + DIGITS + MIXED_CASE + CONTROL + EMPTYISH + MIXED_SCRIPTS  # 52
    # fill up to 200 with English sentences mixed with a random foreign one
    foreign = FRENCH + GERMAN + VIETNAMESE + GREEK + CYRILLIC + CHINESE + JAPANESE + KOREAN + ARABIC + HINDI
    while len(out) < 200:
        out.append(f"{en_sentence()} {rng.choice(foreign)} {rng.choice(EMOJI)}")
    out = out[:200]
    rng.shuffle(out)
    return out


def make_minilm(out: Path, folder: Path) -> dict[str, Any]:
    import sentence_transformers
    import tokenizers
    import torch
    import transformers

    sentences = minilm_sentences()
    assert len(sentences) == 200
    (out / "minilm_sentences.json").write_text(json.dumps(sentences, ensure_ascii=False, indent=0) + "\n")
    st = load_st(folder)
    assert st.max_seq_length == 256, st.max_seq_length
    feats = st.tokenize(sentences)
    mask = feats["attention_mask"].numpy()
    lengths = mask.sum(1).astype(np.int32)
    assert (mask == (np.arange(mask.shape[1])[None] < lengths[:, None])).all()  # right padding
    ids = np.concatenate([feats["input_ids"][i, :lengths[i]].numpy() for i in range(len(sentences))]).astype(np.int32)
    emb = st.encode(sentences, batch_size=32, convert_to_numpy=True).astype(np.float32)
    sdpa = load_st(folder, eager=False).encode(sentences, batch_size=32, convert_to_numpy=True)
    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "sentence_transformers": sentence_transformers.__version__, "tokenizers": tokenizers.__version__,
                "numpy": np.__version__, "python": sys.version.split()[0],
                "attn_implementation": "eager", "model": "sentence-transformers/all-MiniLM-L6-v2"}
    sdpa_diff = float(np.abs(sdpa - emb).max())
    np.savez(out / "minilm_reference.npz", embeddings=emb, ids=ids, lengths=lengths,
             versions=np.array(json.dumps(versions)), sdpa_max_abs_diff=np.array(sdpa_diff))
    return {"n": len(sentences), "min_len": int(lengths.min()), "max_len": int(lengths.max()),
            "truncated": int((lengths == 256).sum()), "total_ids": int(ids.size), "sdpa_max_abs_diff": sdpa_diff,
            "versions": versions}


# --------------------------------------------------------------------------------------------- check

def check_nomic(out: Path) -> None:
    """Reload nomic/ and recompute its references; they must be equal (max abs diff 0)."""
    import torch
    from tokenizers import Tokenizer

    ref = dict(np.load(out / "nomic" / "reference.npz"))
    tok = Tokenizer.from_file(str(out / "nomic" / "tokenizer.json"))
    model = reload("NomicBertModel", out / "nomic")
    with torch.no_grad():
        for i, text in enumerate(BERT_TEXTS):
            ids = np.asarray(tok.encode(text).ids, dtype=np.int32)
            assert ids.tolist() == ref[f"ids_{i}"].tolist(), i
            h = model(input_ids=torch.tensor(ids[None], dtype=torch.long)).last_hidden_state[0].numpy()
            assert np.array_equal(h, ref[f"last_hidden_state_{i}"]), i
    print("check: nomic's references reproduced from the saved folder (max abs diff 0)")


def check(out: Path, minilm: Path | None) -> None:
    """Reload every folder and recompute the references; they must be equal (max abs diff 0)."""
    import torch
    from tokenizers import Tokenizer

    def same(a: np.ndarray, b: np.ndarray, what: str) -> None:
        assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
        d = float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max()) if a.size else 0.0
        assert d == 0.0, (what, d)

    ref = dict(np.load(out / "bert" / "reference.npz"))
    tok = Tokenizer.from_file(str(out / "bert" / "tokenizer.json"))
    model = reload("BertModel", out / "bert")
    with torch.no_grad():
        for i, text in enumerate(BERT_TEXTS):
            ids = np.asarray(tok.encode(text).ids, dtype=np.int32)
            same(ids, ref[f"ids_{i}"], f"bert ids {i}")
            h = model(input_ids=torch.tensor(ids[None], dtype=torch.long)).last_hidden_state[0].numpy()
            same(h, ref[f"last_hidden_state_{i}"], f"bert hidden {i}")
        h = model(input_ids=torch.tensor(ref["batch_input_ids"], dtype=torch.long),
                  attention_mask=torch.tensor(ref["batch_attention_mask"], dtype=torch.long)).last_hidden_state
        same(h.numpy(), ref["batch_last_hidden_state"], "bert batch")
    st = load_st(out / "bert")
    emb = np.stack([st.encode([t], batch_size=1, convert_to_numpy=True)[0] for t in BERT_TEXTS])
    same(emb, ref["embedding"], "bert st embedding")

    ref = dict(np.load(out / "bert_rerank" / "reference.npz"))
    tok = Tokenizer.from_file(str(out / "bert_rerank" / "tokenizer.json"))
    model = reload("BertForSequenceClassification", out / "bert_rerank")
    with torch.no_grad():
        logits = []
        for i, doc in enumerate(RERANK_DOCS):
            enc = tok.encode(RERANK_QUERY, doc)
            same(np.asarray(enc.ids, dtype=np.int32), ref[f"pair_ids_{i}"], f"rerank ids {i}")
            same(np.asarray(enc.type_ids, dtype=np.int32), ref[f"pair_type_ids_{i}"], f"rerank types {i}")
            logits.append(model(input_ids=torch.tensor([enc.ids]), token_type_ids=torch.tensor([enc.type_ids]))
                          .logits[0, 0].item())
        same(np.asarray(logits, dtype=np.float32), ref["logits"], "rerank logits")

    xtok = Tokenizer.from_file(str(out / "xlmr" / "tokenizer.json"))
    for sub in ("xlmr", "xlmr_rerank"):  # the saved tokenizer.json is the one the references were made with
        assert Tokenizer.from_file(str(out / sub / "tokenizer.json")).to_str() == xtok.to_str(), sub
    ref = dict(np.load(out / "xlmr" / "reference.npz"))
    model = reload("XLMRobertaModel", out / "xlmr")
    with torch.no_grad():
        for i, text in enumerate(XLMR_TEXTS):
            ids = np.asarray(xtok.encode(text).ids, dtype=np.int32)
            same(ids, ref[f"ids_{i}"], f"xlmr ids {i}")
            h = model(input_ids=torch.tensor(ids[None], dtype=torch.long)).last_hidden_state[0].numpy()
            same(h, ref[f"last_hidden_state_{i}"], f"xlmr hidden {i}")
        h = model(input_ids=torch.tensor(ref["batch_input_ids"], dtype=torch.long),
                  attention_mask=torch.tensor(ref["batch_attention_mask"], dtype=torch.long)).last_hidden_state
        same(h.numpy(), ref["batch_last_hidden_state"], "xlmr batch")
    st = load_st(out / "xlmr")
    emb = np.stack([st.encode([t], batch_size=1, convert_to_numpy=True)[0] for t in XLMR_TEXTS])
    same(emb, ref["embedding"], "xlmr st embedding")

    ref = dict(np.load(out / "xlmr_rerank" / "reference.npz"))
    model = reload("XLMRobertaForSequenceClassification", out / "xlmr_rerank")
    with torch.no_grad():
        logits = []
        for i, doc in enumerate(RERANK_DOCS):
            enc = xtok.encode(RERANK_QUERY, doc)
            same(np.asarray(enc.ids, dtype=np.int32), ref[f"pair_ids_{i}"], f"xlmr rerank ids {i}")
            same(np.asarray(enc.type_ids, dtype=np.int32), ref[f"pair_type_ids_{i}"], f"xlmr rerank types {i}")
            logits.append(model(input_ids=torch.tensor([enc.ids])).logits[0, 0].item())
        same(np.asarray(logits, dtype=np.float32), ref["logits"], "xlmr rerank logits")

    if minilm is not None:
        sentences = json.loads((out / "minilm_sentences.json").read_text())
        ref = dict(np.load(out / "minilm_reference.npz"))
        st = load_st(minilm)
        same(st.encode(sentences, batch_size=32, convert_to_numpy=True), ref["embeddings"], "minilm embeddings")
        fast = Tokenizer.from_file(str(minilm / "tokenizer.json"))
        fast.enable_truncation(256)
        fast.no_padding()
        flat = np.concatenate([np.asarray(e.ids, dtype=np.int32) for e in fast.encode_batch(sentences)])
        same(flat, ref["ids"], "minilm ids (tokenizers' tokenizer.json, truncation 256)")
    print("check: every reference reproduced from the saved folders (max abs diff 0)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--minilm", type=Path, default=None, help="all-MiniLM-L6-v2 sentence-transformers folder")
    ap.add_argument("--only-nomic", action="store_true", help="write and check nomic/ alone")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    print(f"tokenizer: vocab {tok.get_vocab_size()}")
    meta = make_nomic(args.out, tok)
    print(f"[nomic] tokens {meta['tokens_per_text']}, padded-vs-single hidden diff "
          f"{meta['batch_vs_single_last_hidden_max_abs_diff']:.2e}, manual pooling vs ST "
          f"{meta['manual_mean_pool_normalize_vs_st_max_abs_diff']:.2e}")
    check_nomic(args.out)
    if args.only_nomic:
        return 0
    meta = make_bert(args.out, tok)
    print(f"[bert] tokens {meta['tokens_per_text']}, padded-vs-single hidden diff "
          f"{meta['batch_vs_single_last_hidden_max_abs_diff']:.2e}, manual pooling vs ST "
          f"{meta['manual_mean_pool_normalize_vs_st_max_abs_diff']:.2e}")
    meta = make_rerank(args.out, tok)
    print(f"[bert_rerank] pair lengths {meta['pair_lengths']}, logits {meta['logits']}, "
          f"batch diff {meta['batch_vs_single_logits_max_abs_diff']:.2e}")
    xtok = train_unigram_tokenizer()
    print(f"unigram tokenizer: vocab {xtok.get_vocab_size()}")
    meta = make_xlmr(args.out, xtok)
    print(f"[xlmr] tokens {meta['tokens_per_text']}, padded-vs-single hidden diff "
          f"{meta['batch_vs_single_last_hidden_max_abs_diff']:.2e}, manual cls pooling vs ST "
          f"{meta['manual_cls_pool_normalize_vs_st_max_abs_diff']:.2e}")
    meta = make_xlmr_rerank(args.out, xtok)
    print(f"[xlmr_rerank] pair lengths {meta['pair_lengths']}, logits {meta['logits']}, "
          f"batch diff {meta['batch_vs_single_logits_max_abs_diff']:.2e}")
    if args.minilm is not None:
        info = make_minilm(args.out, args.minilm)
        print(f"[minilm] {info}")
    check(args.out, args.minilm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
