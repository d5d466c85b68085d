"""Dumps of node outputs, compared with transformers' hidden states and with each other."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
from conftest import ARCHS, fixture_dir, fixture_sequences

import minfer
from minfer.graph.ir import RopeStyle
from minfer.trace.dump import compare_dumps, first_divergence, load_manifest


@pytest.mark.parametrize("arch", ARCHS)
def test_layer_outputs_match_transformers_hidden_states(arch, tmp_path):
    """The residual stream after each layer (the ffn_residual nodes) and the final norm, dumped, against
    transformers' output_hidden_states for the 33-token sequence: within 1e-4."""
    model = minfer.load(fixture_dir(arch) / "model-f32.gguf", n_ctx=64, dump_dir=tmp_path,
                        dump_filter="embd,embd.scale,blk.*.ffn_residual,output_norm.gain")
    model.logits(fixture_sequences(arch)[2])
    hidden = np.load(fixture_dir(arch) / "hidden_states.npy")  # [layers + 1, tokens, hidden]
    files = {e["name"]: np.load(tmp_path / e["file"]) for e in load_manifest(tmp_path)}
    n_layer = model.hparams.n_layer
    scaled = model.hparams.embd_scale != 1.0  # Gemma: layer 0 reads the embeddings times sqrt(n_embd)
    assert len(files) == n_layer + 2 + scaled
    np.testing.assert_allclose(files["embd.scale" if scaled else "embd"], hidden[0], atol=1e-4)
    for il in range(n_layer - 1):
        np.testing.assert_allclose(files[f"blk.{il}.ffn_residual"], hidden[il + 1], atol=1e-4)
    np.testing.assert_allclose(files["output_norm.gain"], hidden[n_layer], atol=1e-4)  # after the final norm


def test_compare_dumps_pinpoints_a_wrong_rope_layout(tmp_path):
    """A deliberately wrong RoPE pairing (a test switch on the architecture) is found at the first RoPE
    node, by the API and by `minfer compare-dumps`."""
    seq = fixture_sequences("qwen3")[1]
    good = minfer.load(fixture_dir("qwen3") / "model-f32.gguf", n_ctx=64, dump_dir=tmp_path / "good")
    good.logits(seq)
    bad = minfer.load(fixture_dir("qwen3") / "model-f32.gguf", n_ctx=64, dump_dir=tmp_path / "bad")
    bad.transformer.arch = dataclasses.replace(bad.transformer.arch, rope_style=RopeStyle.NORMAL)
    bad.logits(seq)
    first = first_divergence(compare_dumps(tmp_path / "good", tmp_path / "bad"))
    assert first is not None and first["name"] == "blk.0.q_rope" and first["op"] == "rope"
    r = subprocess.run([sys.executable, "-m", "minfer", "compare-dumps", str(tmp_path / "good"),
                        str(tmp_path / "bad")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr  # the runs part: non-zero, so a script or CI notices
    assert r.stdout.strip().splitlines()[-1].endswith("blk.0.q_rope (rope)")
    same = subprocess.run([sys.executable, "-m", "minfer", "compare-dumps", str(tmp_path / "good"),
                           str(tmp_path / "good")], capture_output=True, text=True, timeout=120)
    assert same.returncode == 0, same.stderr
    assert same.stdout.strip().splitlines()[-1].startswith("all ")


def test_compare_dumps_of_a_non_dump_folder_is_a_clear_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "minfer", "compare-dumps", str(tmp_path), str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "not a minfer dump folder" in r.stderr and "Traceback" not in r.stderr
