"""Conversations: turn-by-turn continuation, sessions saved and resumed."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from conftest import fixture_dir

import minfer
from minfer.errors import BadRequestError, FormatError
from minfer.runtime.conversation import Conversation


def chat_template_model(tmp_path, cache_type="f32", threads=1):
    """The qwen3 fixture has no chat template; give it ChatML so conversations can be rendered."""
    model = minfer.load(fixture_dir("qwen3") / "model-f32.gguf", n_ctx=256, threads=threads, cache_type=cache_type)
    from minfer.formats.chat_template import ChatTemplate

    model.chat_template = ChatTemplate(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return model


def test_turns_reuse_the_cache_and_match_a_full_prefill(tmp_path):
    model = chat_template_model(tmp_path)
    conv = model.conversation(system="be brief", temperature=0)
    conv.send("hello there", max_tokens=6)
    evaluated = []
    forward = model.runner.forward
    model.runner.forward = lambda t, p, *a, **k: evaluated.append(len(t)) or forward(t, p, *a, **k)
    try:
        conv.send("and again", max_tokens=6)
    finally:
        model.runner.forward = forward
    transcript = model.tokenize(model.render_chat(conv.messages[:-1]), add_special=False)
    # only the new turn's tokens were prefilled (plus the reply tokens the first turn sampled last)
    assert evaluated[0] < len(transcript) // 2
    # the cached rows give the logits a full prefill of the whole transcript gives: bit-equal at the same
    # thread count (DESIGN: within 1e-5 for the f32 cache)
    cached = model.kv.tokens(0)
    step = model.runner.forward([cached[-1]], [len(cached) - 1])[0]
    full = minfer.load(fixture_dir("qwen3") / "model-f32.gguf", n_ctx=256, threads=1).logits(cached)[-1]
    np.testing.assert_array_equal(step, full)


def test_session_round_trip_in_a_new_process(tmp_path):
    model = chat_template_model(tmp_path, cache_type="q8_0")
    conv = model.conversation(temperature=0)
    conv.send("first question", max_tokens=5)
    conv.send("second question", max_tokens=5)
    path = tmp_path / "chat.session"
    conv.save(path)
    expected = conv.send("third question", max_tokens=8)
    script = f"""
from test_conversation import chat_template_model
from minfer.runtime.conversation import Conversation
model = chat_template_model(None, cache_type="q8_0")
conv = Conversation.load(model, {str(path)!r})
print(conv.send("third question", max_tokens=8), end="")
"""
    # run from tests/, where ``python -c`` finds the test modules
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                       cwd=fixture_dir("qwen3").parent.parent)
    assert r.returncode == 0, r.stderr
    assert r.stdout == expected


def test_sessions_for_another_cache_type_or_model_are_refused(tmp_path):
    model = chat_template_model(tmp_path, cache_type="f16")
    conv = model.conversation(temperature=0)
    conv.send("hi", max_tokens=3)
    path = tmp_path / "s.session"
    conv.save(path)
    with pytest.raises(BadRequestError, match="cache type f16"):
        Conversation.load(chat_template_model(tmp_path, cache_type="f32"), path)
    other = minfer.load(fixture_dir("llama") / "model-f32.gguf", n_ctx=64, cache_type="f16")
    with pytest.raises(BadRequestError, match="fingerprint|model"):
        Conversation.load(other, path)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(FormatError):
        Conversation.load(model, path)


def test_regenerate_and_clear(tmp_path):
    model = chat_template_model(tmp_path)
    conv = model.conversation(system="sys")
    first = conv.send("hello", max_tokens=5, seed=1, temperature=1.0)
    again = conv.regenerate(max_tokens=5, seed=1, temperature=1.0)
    assert again == first and [m["role"] for m in conv.messages] == ["system", "user", "assistant"]
    conv.clear()
    assert conv.messages == [{"role": "system", "content": "sys"}]
    with pytest.raises(BadRequestError, match="no reply"):
        conv.regenerate()
