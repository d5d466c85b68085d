"""The minfer command on HF folders: run, chat, inspect (text and JSON), bench, perplexity and trace, with and
without ``--quantize``."""

from __future__ import annotations

import json

from conftest import copy_hf_folder, fixture_dir, load_json, variant_dir
from test_cli import minfer

QWEN3_HF = str(fixture_dir("qwen3") / "hf")


def test_run_on_a_folder_is_the_gguf_run():
    a = minfer("run", QWEN3_HF, "The capital of France is", "-n", "8", "--temp", "0", "-q")
    b = minfer("run", str(fixture_dir("qwen3") / "model-f32.gguf"), "The capital of France is", "-n", "8",
               "--temp", "0", "-q")
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout and a.stdout.strip()


def test_run_with_quantize_and_chat(tmp_path):
    folder = copy_hf_folder(tmp_path / "chat", "qwen2")
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    tc["chat_template"] = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                           "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(tc))
    r = minfer("run", str(folder), "--chat", "hello", "-n", "4", "--temp", "0", "--quantize", "q8_0")
    assert r.returncode == 0, r.stderr
    assert "generated 4 tokens" in r.stderr
    r = subprocess_chat(str(folder))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()


def subprocess_chat(folder: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "minfer", "chat", folder, "--temp", "0", "-n", "4"],
                          input="hi there\n/exit\n", capture_output=True, text=True, timeout=300)


def test_inspect_names_what_it_found():
    r = minfer("inspect", QWEN3_HF, "--tensors")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "format: HF safetensors folder, 36 tensors" in out
    assert "architecture: qwen3 (HF model_type 'qwen3', Qwen3ForCausalLM)" in out
    assert "tensor types: F32: 36" in out
    assert "vocab: HF tokenizer.json (BPE, byte-level), 1000 tokens" in out
    assert "rope: neox pairs (i, i + n_rot/2), base 1e+06, scaling: none" in out
    assert "features: GQA (2 query heads per kv head), QK-norm" in out
    assert "blk.0.attn_q_norm.weight (model.layers.0.self_attn.q_norm.weight)" in out
    r = minfer("inspect", str(fixture_dir("llama") / "model-q8_0.gguf"))
    assert "format: GGUF v3, 30 tensors" in r.stdout and "tensor types: Q8_0: 23, F32: 7" in r.stdout
    assert "vocab: gpt2 BPE (byte-level), pre 'default', 512 tokens" in r.stdout
    assert "rope: normal pairs (2i, 2i+1)" in r.stdout


def test_inspect_json_with_quantize_and_scaling(tmp_path):
    r = minfer("inspect", str(fixture_dir("qwen2") / "hf"), "--format", "json", "--quantize", "q8_0")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["format"] == "HF safetensors folder" and s["architecture"] == "qwen2"
    assert s["tensor_types"] == {"Q8_0": 22, "F32": 16}
    assert {"qkv bias", "tied embeddings", "quantized at load (q8_0)"} <= set(s["features"])
    assert s["rope"]["style"] == "neox" and s["geometry"]["head_dim_k"] == 16
    config = load_json(variant_dir("llama", "llama3") / "config.json")
    folder = copy_hf_folder(tmp_path / "l3", "llama", config=config)
    s = json.loads(minfer("inspect", str(folder), "--format", "json").stdout)
    assert "rope scaling (llama3)" in s["features"]
    assert s["rope"]["scaling"].startswith("llama3, factor 8, low/high freq factor 1/4, original context 64")


def test_bench_perplexity_and_trace_on_a_folder(tmp_path):
    r = minfer("bench", QWEN3_HF, "-p", "8", "-n", "4", "-r", "1", "-t", "1", "--json", "--quantize", "q8_0")
    assert r.returncode == 0, r.stderr
    records = json.loads(r.stdout)
    assert {x["test"] for x in records} == {"pp8", "tg4"} and all(x["tokens_per_s"] > 0 for x in records)
    text = tmp_path / "text.txt"
    text.write_text("The capital of France is Paris. " * 20)
    r = minfer("perplexity", QWEN3_HF, "-f", str(text), "-c", "16")
    assert r.returncode == 0, r.stderr
    assert "Final estimate: PPL" in r.stdout
    page = tmp_path / "trace.html"
    r = minfer("trace", QWEN3_HF, "Hello", "--html", str(page))
    assert r.returncode == 0, r.stderr
    assert page.stat().st_size > 1000
    trace, dumps = tmp_path / "trace.jsonl", tmp_path / "dumps"
    r = minfer("run", QWEN3_HF, "Hello", "-n", "2", "--temp", "0", "--trace", str(trace), "--dump-dir", str(dumps),
               "--dump-filter", "blk.0.q_rope")
    assert r.returncode == 0, r.stderr
    assert any(json.loads(line).get("op") == "rope" for line in trace.read_text().splitlines())
    assert list(dumps.glob("call*/*blk.0.q_rope.npy"))
