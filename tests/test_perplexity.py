"""Perplexity by the llama-perplexity method: the method on a fixture, and the real model vs references."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from conftest import FIXTURES, fixture_dir

import minfer
from minfer.errors import BadRequestError
from minfer.runtime.perplexity import perplexity, token_nll

DATA = FIXTURES.parent / "data"


def test_method_matches_a_direct_computation():
    model = minfer.load(fixture_dir("qwen3") / "model-f32.gguf", n_ctx=64)
    tokens = np.random.default_rng(0).integers(3, model.hparams.n_vocab, 3 * 32 + 5).tolist()
    result = perplexity(model.runner, tokens, n_ctx=32, n_batch=8, bos_id=model.tokenizer.bos_id)
    nll = []
    for c in range(3):  # the 5 tokens left over do not make a chunk
        chunk = tokens[c * 32 : (c + 1) * 32]
        logits = model.logits([model.tokenizer.bos_id, *chunk[1:]])
        nll.extend(token_nll(logits[16:31], np.array(chunk[17:32])))
    assert result.n_chunks == 3 and result.tokens_scored == len(nll) == 45
    assert result.ppl == pytest.approx(math.exp(np.mean(nll)), rel=1e-5)
    sd = math.sqrt(np.mean(np.square(nll)) - np.mean(nll) ** 2)
    assert result.error == pytest.approx(result.ppl * sd / math.sqrt(len(nll) - 1), rel=1e-4)


def test_batch_size_does_not_change_the_result():
    model = minfer.load(fixture_dir("llama") / "model-f32.gguf", n_ctx=64)
    tokens = np.random.default_rng(1).integers(3, model.hparams.n_vocab, 128).tolist()
    a = perplexity(model.runner, tokens, n_ctx=64, n_batch=64)
    b = perplexity(model.runner, tokens, n_ctx=64, n_batch=16)
    assert a.ppl == pytest.approx(b.ppl, rel=1e-6)


def test_bad_arguments():
    model = minfer.load(fixture_dir("llama") / "model-f32.gguf", n_ctx=64)
    with pytest.raises(BadRequestError, match="fewer than one chunk"):
        model.perplexity("short text", n_ctx=64)
    with pytest.raises(BadRequestError, match="larger than the model's context"):
        model.perplexity("x " * 300, n_ctx=128)


@pytest.mark.slow
def test_smollm2_gpl3_within_one_percent_of_transformers_and_llamacpp(smollm2_path):
    hf = json.loads((DATA / "smollm2_gpl3_ppl_hf.json").read_text())
    llama = json.loads((DATA / "smollm2_llamacpp.json").read_text())["perplexity_gpl3_c256"]
    r = subprocess.run([sys.executable, "-m", "minfer", "perplexity", str(smollm2_path), "-f", str(DATA / "GPL-3"),
                        "-c", "256"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    line = r.stdout.strip().splitlines()[-1]
    ppl = float(line.split("PPL = ")[1].split()[0])
    print(f"minfer {ppl:.4f}, transformers {hf['ppl']:.4f}, llama.cpp {llama['ppl']:.4f}")
    assert abs(ppl / hf["ppl"] - 1) < 0.01
    assert abs(ppl / llama["ppl"] - 1) < 0.01
