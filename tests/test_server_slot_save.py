"""llama-server's slot actions (``POST /slots/{id}?action=save|restore|erase``, ``--slot-save-path``) and
``--cache-idle-slots``, against real ``minfer serve`` processes on the tiny llama fixture.

What llama-server (llama.cpp b0.3.36's tools/server, started on the same fixture with ``--slot-save-path``)
answered: save ``{"id_slot", "filename", "n_saved", "n_written", "timings": {"save_ms"}}``, restore
``{"id_slot", "filename", "n_restored", "n_read", "timings": {"restore_ms"}}``, erase ``{"id_slot",
"n_erased"}``; the same prompt after save, erase, restore had ``timings.cache_n`` = its tokens but the last
and the same text; ``../a.bin``, ``a/b.bin`` and ``""`` a 400 "Invalid filename"; slot ``x`` a 400 "Invalid
slot ID"; an unknown or missing action a 400 "Invalid action"; a missing or damaged file a 400 "Unable to
restore slot: ..."; without ``--slot-save-path`` every action a 501 ``not_supported_error``. Where minfer
differs on purpose: a missing or non-string ``filename`` is a 400 naming it (llama-server: a 500 from its JSON
library), and a slot id outside the slots (9, -1) is a 400 (llama-server acted on some other slot).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import httpx
import pytest
from conftest import drive, fixture_dir

import minfer
from minfer.errors import BadRequestError
from minfer.runtime.engine import EngineConfig, build_engine
from minfer.runtime.requests import GenerationRequest, Started
from minfer.runtime.session_file import load_session, save_session
from minfer.runtime.slot_file import SlotBusyError
from minfer.testing.server_process import ServerProcess

pytestmark = pytest.mark.slow

MODEL = fixture_dir("llama") / "model-f32.gguf"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("slots")


@pytest.fixture(scope="module")
def server(folder):
    with ServerProcess(MODEL, ["--parallel", "2", "--ctx-size", "512", "--batch-size", "32",
                               "--slot-save-path", str(folder)]) as s:
        yield s


def post(server, path, body=None, **kw):
    return httpx.post(server.url + path, json=body, timeout=60, **kw)


def complete(server, prompt: str) -> dict:
    r = post(server, "/completion", {"prompt": prompt, "n_predict": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def cached_tokens(server) -> dict[int, int]:
    return {s["id"]: s["n_cached"] for s in httpx.get(server.url + "/slots", timeout=10).json()}


def test_save_erase_restore_then_the_prompt_is_cached(server, folder):
    prompt = "Once upon a time a slot was saved to a file, and read back into another slot later on."
    first = complete(server, prompt)
    slot = first["id_slot"]
    n_held = cached_tokens(server)[slot]
    assert n_held > 0

    saved = post(server, f"/slots/{slot}?action=save", {"filename": "story.bin"})
    assert saved.status_code == 200, saved.text
    body = saved.json()
    assert {k: body[k] for k in ("id_slot", "filename", "n_saved")} == {"id_slot": slot, "filename": "story.bin",
                                                                      "n_saved": n_held}
    assert body["n_written"] == (folder / "story.bin").stat().st_size > 0
    assert body["timings"]["save_ms"] >= 0
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith("story")) == ["story.bin"]  # no temp left

    erased = post(server, f"/slots/{slot}?action=erase")
    assert erased.status_code == 200, erased.text
    assert erased.json() == {"id_slot": slot, "n_erased": n_held}
    assert cached_tokens(server)[slot] == 0

    other = 1 - slot  # read back into the other slot: the next request finds the prompt there
    restored = post(server, f"/slots/{other}?action=restore", {"filename": "story.bin"})
    assert restored.status_code == 200, restored.text
    body = restored.json()
    assert {k: body[k] for k in ("id_slot", "filename", "n_restored", "n_read")} == {
        "id_slot": other, "filename": "story.bin", "n_restored": n_held, "n_read": saved.json()["n_written"]}
    assert body["timings"]["restore_ms"] >= 0
    assert cached_tokens(server)[other] == n_held

    again = complete(server, prompt)  # (in whichever slot: one references another's cached blocks)
    assert again["tokens_cached"] == again["timings"]["cache_n"] == again["tokens_evaluated"] - 1
    assert again["content"] == first["content"]


def test_a_busy_slot_is_saved_once_its_request_is_done(server):
    """Saved while a stream generates in it: the answer waits for the end (llama-server defers the task), so
    the file holds the whole sequence, not the part generated so far."""
    body = {"prompt": "A long story begins here", "n_predict": 120, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", server.url + "/completion", json=body, timeout=60) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        first = json.loads(next(lines)[6:])
        saved = post(server, f"/slots/{first['id_slot']}?action=save", {"filename": "busy.bin"}).json()
        last = [json.loads(line[6:]) for line in lines][-1]
    assert last["stop"] is True
    # every prompt token and every generated one but the last (never evaluated) are in the file
    assert saved["n_saved"] == last["tokens_evaluated"] + last["tokens_predicted"] - 1


def test_erase_forgets_the_prompt(server):
    prompt = "Zebras: a prompt that is erased from its slot is evaluated again from its first token."
    first = complete(server, prompt)
    assert post(server, f"/slots/{first['id_slot']}?action=erase").status_code == 200
    # (the other slot holds an older prompt, sharing the first token, BOS, at most)
    assert complete(server, prompt)["timings"]["cache_n"] <= 1


@pytest.mark.parametrize("name", ["../escape.bin", "a/b.bin", "a\\b.bin", "", ".", "..", " lead.bin",
                                  "trail.", "nul\x00.bin", "x" * 256, 3, None])
def test_bad_file_names_are_refused(server, folder, name):
    body = {} if name is None else {"filename": name}
    for action in ("save", "restore"):
        r = post(server, f"/slots/0?action={action}", body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "filename"
    assert not (folder.parent / "escape.bin").exists()


def test_body_must_be_an_object(server):
    r = post(server, "/slots/0?action=save", ["story.bin"])
    assert r.status_code == 400 and r.json()["error"]["param"] == "filename"


@pytest.mark.parametrize("slot", ["x", "9", "-1", "1.0", " 0"])
def test_bad_slot_ids_are_refused(server, slot):
    for action in ("save", "erase"):
        r = post(server, f"/slots/{slot}?action={action}", {"filename": "s.bin"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "id_slot"


@pytest.mark.parametrize("query", ["?action=load", "?action=", ""])
def test_bad_actions_are_refused(server, query):
    r = post(server, f"/slots/0{query}", {"filename": "s.bin"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "action"


def _restore_refused(server, folder, name: str) -> str:
    r = post(server, "/slots/0?action=restore", {"filename": name})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "filename" and name in error["message"]
    assert str(folder) not in error["message"]  # the server's folder is not the client's business
    return error["message"]


def test_missing_file_is_refused_by_name(server, folder):
    assert "does not exist" in _restore_refused(server, folder, "never-saved.bin")


def test_other_models_file_is_refused(server, folder):
    complete(server, "The file of another model is never loaded.")
    assert post(server, "/slots/0?action=save", {"filename": "mine.bin"}).status_code == 200
    data = load_session(folder / "mine.bin")
    data.model_fingerprint = "llama:other-model.gguf:0123456789abcdef01234567"
    save_session(folder / "theirs.bin", data)
    held = cached_tokens(server)[0]
    message = _restore_refused(server, folder, "theirs.bin")
    assert "fingerprint" in message or "model" in message
    assert cached_tokens(server)[0] == held  # refused before the slot was touched


def test_other_cell_type_is_refused(server, folder):
    complete(server, "A file of f16 cells does not go into an f32 cache.")
    assert post(server, "/slots/1?action=save", {"filename": "f32.bin"}).status_code == 200
    data = load_session(folder / "f32.bin")
    data.cache_type = "f16"
    data.arrays = {k: v.astype("float16") for k, v in data.arrays.items()}
    save_session(folder / "f16.bin", data)
    assert "f16" in _restore_refused(server, folder, "f16.bin")


def test_damaged_file_is_refused(server, folder):
    complete(server, "A damaged file is refused whole.")
    assert post(server, "/slots/0?action=save", {"filename": "good.bin"}).status_code == 200
    raw = bytearray((folder / "good.bin").read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    (folder / "bad.bin").write_bytes(bytes(raw))
    assert "corrupted" in _restore_refused(server, folder, "bad.bin")
    (folder / "short.bin").write_bytes(bytes(raw[: len(raw) // 3]))
    assert "truncated" in _restore_refused(server, folder, "short.bin")
    (folder / "text.bin").write_text("not a slot at all")
    assert "not a minfer session" in _restore_refused(server, folder, "text.bin")


def test_a_conversation_session_is_not_a_slot(server, folder):
    complete(server, "A saved conversation is not a saved slot.")
    assert post(server, "/slots/0?action=save", {"filename": "slot.bin"}).status_code == 200
    data = load_session(folder / "slot.bin")
    data.meta = {"system": None, "messages": []}
    save_session(folder / "conversation.bin", data)
    assert "not a saved slot" in _restore_refused(server, folder, "conversation.bin")


def test_save_never_replaces_a_file_that_is_not_a_slot(server, folder):
    (folder / "notes.txt").write_text("the user's own notes")
    r = post(server, "/slots/0?action=save", {"filename": "notes.txt"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "filename"
    assert (folder / "notes.txt").read_text() == "the user's own notes"


def test_save_replaces_an_earlier_save(server, folder):
    complete(server, "first contents")
    first = post(server, "/slots/0?action=save", {"filename": "again.bin"}).json()
    post(server, "/slots/0?action=erase")
    second = post(server, "/slots/0?action=save", {"filename": "again.bin"}).json()
    assert first["n_saved"] > 0 and second["n_saved"] == 0
    assert len(load_session(folder / "again.bin").tokens) == 0


# -- without --slot-save-path; --cache-idle-slots ---------------------------------------------------

# A unified cache of 128 positions (4 blocks of 32) shared by 2 slots: a prompt of 56..88 tokens and its 8 new
# ones take 3 blocks, so a second such prompt makes the first one's idle slot give its blocks way; when the
# first returns, the one block left free takes its first block back from --cache-ram.
PRESSED = ["--parallel", "2", "--ctx-size", "128", "--batch-size", "32", "--cache-ram", "16"]


def _long_prompt(server, words: str) -> str:
    text = words
    while len(post(server, "/tokenize", {"content": text}).json()["tokens"]) < 56:
        text += " " + words
    return text


def _returning_conversation_cached(server) -> int:
    a = _long_prompt(server, "rivers and mountains")
    b = _long_prompt(server, "the stars")
    assert all(len(post(server, "/tokenize", {"content": p}).json()["tokens"]) <= 88 for p in (a, b))
    complete(server, a)
    complete(server, b)  # a's idle slot gives its blocks to b
    return complete(server, a)["timings"]["cache_n"]


def test_without_slot_save_path_actions_are_not_supported():
    # (also: --cache-idle-slots, the default, keeps an idle slot's blocks in --cache-ram)
    with ServerProcess(MODEL, PRESSED) as s:
        for action, body in (("save", {"filename": "a.bin"}), ("restore", {"filename": "a.bin"}), ("erase", None)):
            r = post(s, f"/slots/0?action={action}", body)
            assert r.status_code == 501, r.text
            assert r.json()["error"]["type"] == "not_supported_error"
            assert "--slot-save-path" in r.json()["error"]["message"]
        assert _returning_conversation_cached(s) >= 32


def test_no_cache_idle_slots_drops_an_idle_slots_blocks():
    with ServerProcess(MODEL, [*PRESSED, "--no-cache-idle-slots"]) as s:
        assert _returning_conversation_cached(s) <= 1  # (the first token, BOS, is in the other slot)


def test_slot_save_path_must_be_a_folder(tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    with pytest.raises(RuntimeError, match="--slot-save-path"):
        with ServerProcess(MODEL, ["--slot-save-path", str(not_a_folder)], startup_timeout=120):
            pass


# -- a model that takes images ------------------------------------------------------------------------

VISION = Path(__file__).parent / "fixtures" / "gemma3_vision"


def test_a_slot_holding_an_image_is_saved_and_restored(tmp_path):
    """An image's rows have negative ids (its digest): they are saved as they are, and the same image in the
    same prompt reuses them after a restore."""
    png = base64.b64encode((VISION / "images" / "rgb_64x64.png").read_bytes()).decode()
    body = {"prompt": "<start_of_turn>user\n<__media__>Describe.<end_of_turn>\n<start_of_turn>model\n",
            "multimodal_data": [png], "n_predict": 6, "temperature": 0}
    args = ["--parallel", "1", "--ctx-size", "1024", "--batch-size", "64", "--mmproj",
            str(VISION / "gguf" / "mmproj-f32.gguf"), "--slot-save-path", str(tmp_path)]
    with ServerProcess(VISION / "gguf" / "model-f32.gguf", args) as s:
        first = post(s, "/completion", body).json()
        saved = post(s, "/slots/0?action=save", {"filename": "image.bin"}).json()
        assert min(load_session(tmp_path / "image.bin").tokens) < -1  # the image's rows
        assert post(s, "/slots/0?action=erase").json()["n_erased"] == saved["n_saved"]
        assert post(s, "/slots/0?action=restore", {"filename": "image.bin"}).json()["n_restored"] == saved["n_saved"]
        again = post(s, "/completion", body).json()
        assert again["timings"]["cache_n"] == again["tokens_evaluated"] - 1
        assert again["content"] == first["content"]


# -- the engine's side ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    return minfer.load(MODEL, n_ctx=256, threads=1)


def _engine(tiny, n_ctx: int):
    config = EngineConfig(n_slots=2, batch_size=16, end_of_context="length")
    return build_engine(tiny.transformer, tiny.backend, tiny.tokenizer, n_ctx, tiny.cache_type, config)


def _greedy(tiny, prompt, n):
    return GenerationRequest(prompt, tiny.sampler(temperature=0), n, stop_ids=frozenset())


def test_a_busy_slot_waits_and_a_bad_one_is_refused(tiny, tmp_path):
    engine = _engine(tiny, 256)
    request = _greedy(tiny, list(range(1, 40)), 4)
    request.emit = lambda event: None
    engine.add(request)
    slot = engine.running[0].slot
    for act in (lambda: engine.save_slot(slot, tmp_path / "x.bin"), lambda: engine.erase_slot(slot),
                lambda: engine.restore_slot(slot, tmp_path / "x.bin")):
        with pytest.raises(SlotBusyError):
            act()
    with pytest.raises(BadRequestError, match="slot 2 does not exist"):
        engine.erase_slot(2)
    while engine.running:
        engine.step()
    assert engine.save_slot(slot, tmp_path / "x.bin")[0] == len(engine.kv.tokens(slot)) > 0


def test_a_restore_into_a_full_unified_cache_takes_idle_slots_blocks(tiny, tmp_path):
    """128 positions (4 blocks) in all: 100 tokens are saved and erased, 100 others then fill the pool; restoring
    the first into the other slot takes the idle one's blocks, and the request that follows reuses them."""
    engine = _engine(tiny, 128)
    first, second = [1 + i % 50 for i in range(100)], [60 + i % 40 for i in range(100)]
    drive(engine, [_greedy(tiny, first, 4)])
    slot = next(s for s in range(2) if engine.kv.tokens(s))
    n, _ = engine.save_slot(slot, tmp_path / "first.bin")
    engine.erase_slot(slot)
    drive(engine, [_greedy(tiny, second, 4)])
    holder = next(s for s in range(2) if engine.kv.tokens(s))
    assert engine.kv.blocks_free == 0
    assert engine.restore_slot(1 - holder, tmp_path / "first.bin")[0] == n
    assert engine.kv.tokens(holder) == []  # gave its blocks way
    assert engine.kv.tokens(1 - holder)[:100] == first
    events = drive(engine, [_greedy(tiny, first, 4)])
    assert next(e.cached_tokens for e in events[0] if isinstance(e, Started)) == 99
