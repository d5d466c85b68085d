"""Resumable streams (``X-Conversation-Id``, ``GET /v1/stream``, ``POST /v1/streams/lookup``, ``DELETE
/v1/stream``), against a real ``minfer serve`` on the tiny llama fixture, and the session buffer on its own.

What llama-server (llama-cpp-python 0.3.36's vendor/llama.cpp, on the same tiny model, ``--alias org/model``)
answered for the same requests:

- a streamed chat with ``X-Conversation-Id: c1::org/model``: the stream, then ``lookup {"conversation_ids":
  ["c1"]}`` -> 200 ``[{"conversation_id": "c1::org/model", "is_done": true, "total_bytes": 1930,
  "started_at": ..., "completed_at": ...}]``; ``GET /v1/stream?conv_id=c1%3A%3Aorg%2Fmodel&from=100`` -> 200,
  the stream's bytes from byte 100;
- ``GET /v1/stream`` (no id, or an empty one) -> 400 ``invalid_request_error`` "Missing conversation id in
  path"; an unknown id -> 404 ``not_found_error``; ``from=abc`` -> 400 "Invalid 'from' offset" (``from=-1``
  is 200 there, the C++ parse wraps it; minfer answers 400);
- ``DELETE /v1/stream?conv_id=...`` -> 204 (also for an unknown id), then the GET -> 404; no id -> 400;
- a whole (non-stream) answer with the header leaves no session: lookup -> ``[]``; ``/completion`` streams
  are kept too;
- lookup with an invalid JSON body -> 400 "invalid body: ..."; with ``{}`` -> 200 ``[]`` (minfer: 400 naming
  ``conversation_ids``, never silently ignored).
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from conftest import derive_gguf, fixture_dir
from fastapi import FastAPI
from fastapi.testclient import TestClient

from minfer.server.errors import install_error_handlers
from minfer.server.resumable_streams import OffsetLostError, StreamSession, StreamSessions, register
from minfer.testing.server_process import ServerProcess

slow = pytest.mark.slow
MODEL = "org/model"
CHAT = {"messages": [{"role": "user", "content": "Tell me a story"}], "stream": True, "temperature": 0,
        "max_tokens": 48}


TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = derive_gguf(fixture_dir("llama") / "model-f32.gguf", tmp_path_factory.mktemp("chat") / "tiny.gguf",
                        {"tokenizer.chat_template": TEMPLATE})
    args = ["--parallel", "2", "--ctx-size", "4096", "--alias", MODEL, "--slots"]
    with ServerProcess(model, args) as s:
        yield s


def events(raw: bytes) -> list[dict]:
    """The JSON events of a chat stream (``[DONE]`` left out); fails on a torn event."""
    out = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: ") and block != "data: [DONE]":
            out.append(json.loads(block[len("data: "):]))
    return out


def content(raw: bytes) -> str:
    return "".join(c["delta"].get("content") or "" for e in events(raw) for c in e["choices"])


def stream_whole(server, body: dict, conv_id: str | None = None, path: str = "/v1/chat/completions") -> bytes:
    headers = {"X-Conversation-Id": conv_id} if conv_id else {}
    with httpx.stream("POST", server.url + path, json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return r.read()


def replay(server, conv_id: str, offset: int | None = None) -> httpx.Response:
    params = {"conv_id": conv_id} | ({} if offset is None else {"from": str(offset)})
    return httpx.get(server.url + "/v1/stream", params=params, timeout=120)


def lookup(server, ids) -> list[dict]:
    r = httpx.post(server.url + "/v1/streams/lookup", json={"conversation_ids": ids}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def stream_then_drop(server, body: dict, conv_id: str, n_events: int) -> bytes:
    """The bytes of the first ``n_events`` events (whole reads, as a client had them), then the connection drops."""
    got = b""
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                      headers={"X-Conversation-Id": conv_id}, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for chunk in r.iter_raw():
            got += chunk
            if got.count(b"\n\n") >= n_events:
                break
    return got


def busy_slots(server) -> int:
    return sum(s["is_processing"] for s in httpx.get(server.url + "/slots", timeout=10).json())


# -- against a server -----------------------------------------------------------------------------


@slow
def test_replay_from_zero_is_the_stream_byte_for_byte(server):
    whole = stream_whole(server, CHAT, "whole-1")
    assert whole.endswith(b"data: [DONE]\n\n")
    for offset in (None, 0):
        r = replay(server, "whole-1", offset)
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.content == whole
    # and from any offset: the tail from there
    assert replay(server, "whole-1", 100).content == whole[100:]
    # past the end of a finished stream: nothing (llama-server: 200, empty)
    r = replay(server, "whole-1", len(whole) + 100)
    assert r.status_code == 200 and r.content == b""


@slow
def test_dropped_stream_runs_on_and_resumes_from_the_offset_the_client_had(server):
    body = {**CHAT, "max_tokens": 400, "ignore_eos": True}
    reference = stream_whole(server, body)  # the same request, uninterrupted, without the header
    got = stream_then_drop(server, body, "drop-1", n_events=3)
    rest = replay(server, "drop-1", len(got))
    assert rest.status_code == 200
    joined = got + rest.content
    assert joined.endswith(b"data: [DONE]\n\n")
    # ids and timestamps differ between the two requests; the text is the same, and no event is torn
    assert content(joined) == content(reference)
    assert len(events(joined)) == len(events(reference))
    assert events(joined)[-1]["choices"][0]["finish_reason"] == "length"
    assert replay(server, "drop-1", 0).content == joined


@slow
def test_lookup_lists_the_sessions_asked_for_and_their_model_keyed_forms(server):
    whole = stream_whole(server, CHAT, "look-1")
    stream_whole(server, CHAT, f"look-2::{MODEL}")
    found = lookup(server, ["look-1", "look-2", "not-there", ""])
    assert [f["conversation_id"] for f in found] == ["look-1", f"look-2::{MODEL}"]
    first = found[0]
    assert first["is_done"] is True and first["total_bytes"] == len(whole)
    assert 0 < first["started_at"] <= first["completed_at"]
    assert lookup(server, []) == []


@slow
def test_a_model_name_with_a_slash_inside_the_id(server):
    conv_id = f"conv-7::{MODEL}"
    whole = stream_whole(server, CHAT, conv_id)
    assert events(whole)[0]["model"] == MODEL
    r = replay(server, conv_id, 10)
    assert r.status_code == 200 and r.content == whole[10:]
    assert httpx.delete(server.url + "/v1/stream", params={"conv_id": conv_id}, timeout=10).status_code == 204
    assert replay(server, conv_id).status_code == 404


def cancelled(server) -> float:
    return server.metric("minfer_sequences_finished_total", 'reason="cancelled"')


def wait_cancelled(server, count: float) -> None:
    deadline = time.monotonic() + 10
    while cancelled(server) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cancelled(server) == count


@slow
def test_delete_stops_the_generation_and_forgets_the_session(server):
    body = {**CHAT, "max_tokens": 3800, "ignore_eos": True}
    before = cancelled(server)
    stream_then_drop(server, body, "del-1", n_events=2)
    time.sleep(0.3)
    assert busy_slots(server) == 1, "the generation goes on after the client left"
    assert lookup(server, ["del-1"])[0]["is_done"] is False
    assert cancelled(server) == before
    r = httpx.delete(server.url + "/v1/stream", params={"conv_id": "del-1"}, timeout=10)
    assert r.status_code == 204 and r.content == b""
    assert replay(server, "del-1").status_code == 404
    assert lookup(server, ["del-1"]) == []
    wait_cancelled(server, before + 1)  # stopped, not run to its end
    assert busy_slots(server) == 0


@slow
def test_a_reader_following_a_live_stream_ends_when_it_is_deleted(server):
    body = {**CHAT, "max_tokens": 3800, "ignore_eos": True}
    before = cancelled(server)
    stream_then_drop(server, body, "del-2", n_events=2)
    with httpx.stream("GET", server.url + "/v1/stream", params={"conv_id": "del-2"}, timeout=60) as r:
        assert r.status_code == 200
        chunks = r.iter_raw()
        got = next(chunks)
        assert got.startswith(b"data: ")
        assert httpx.delete(server.url + "/v1/stream", params={"conv_id": "del-2"}, timeout=10).status_code == 204
        got += b"".join(chunks)
    # it ended with the DELETE, not at the generation's natural end (which sends [DONE])
    assert not got.endswith(b"data: [DONE]\n\n")
    wait_cancelled(server, before + 1)


@slow
def test_a_new_request_on_the_same_id_replaces_the_old_session(server):
    body = {**CHAT, "max_tokens": 3800, "ignore_eos": True}
    before = cancelled(server)
    stream_then_drop(server, body, "same-1", n_events=2)
    whole = stream_whole(server, CHAT, "same-1")
    assert replay(server, "same-1").content == whole
    wait_cancelled(server, before + 1)  # the replaced generation was stopped (llama-server cancels it too)


@slow
def test_whole_answers_and_errors_leave_no_session(server):
    r = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "stream": False},
                   headers={"X-Conversation-Id": "whole-answer"}, timeout=60)
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"
    r = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "temperature": "hot"},
                   headers={"X-Conversation-Id": "bad-request"}, timeout=60)
    assert r.status_code == 400
    assert lookup(server, ["whole-answer", "bad-request"]) == []


@slow
def test_native_completion_unprefixed_chat_and_messages_streams_are_kept(server):
    whole = stream_whole(server, {"prompt": "Once", "stream": True, "n_predict": 8, "temperature": 0},
                         "native-1", path="/completion")
    assert replay(server, "native-1").content == whole
    whole = stream_whole(server, CHAT, "bare-1", path="/chat/completions")
    assert replay(server, "bare-1").content == whole
    messages = {"model": MODEL, "max_tokens": 8, "stream": True, "temperature": 0,
                "messages": [{"role": "user", "content": "Hi"}]}
    whole = stream_whole(server, messages, "anthropic-1", path="/v1/messages")
    assert whole.startswith(b"event: message_start") and replay(server, "anthropic-1").content == whole


@slow
@pytest.mark.parametrize(("method", "params", "status", "param"), [
    ("GET", {}, 400, "conv_id"),
    ("GET", {"conv_id": ""}, 400, "conv_id"),
    ("GET", {"conv_id": "nobody"}, 404, "conv_id"),
    ("DELETE", {}, 400, "conv_id"),
])
def test_bad_ids(server, method, params, status, param):
    r = httpx.request(method, server.url + "/v1/stream", params=params, timeout=10)
    assert r.status_code == status
    error = r.json()["error"]
    assert error["param"] == param
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


@slow
def test_delete_of_an_unknown_id_is_204(server):
    assert httpx.delete(server.url + "/v1/stream", params={"conv_id": "nobody"}, timeout=10).status_code == 204


@slow
@pytest.mark.parametrize("offset", ["abc", "-1", "1.5"])
def test_bad_offsets(server, offset):
    stream_whole(server, CHAT, "offsets-1")
    r = httpx.get(server.url + "/v1/stream", params={"conv_id": "offsets-1", "from": offset}, timeout=10)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "from"


@slow
@pytest.mark.parametrize("body", [b"not json", b"{}", b'{"conversation_ids": "a"}', b'{"conversation_ids": [1]}'])
def test_bad_lookup_bodies(server, body):
    r = httpx.post(server.url + "/v1/streams/lookup", content=body, timeout=10)
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"


@slow
def test_the_routes_want_the_key_and_shutdown_stops_streams_nobody_reads(tmp_path):
    """With --api-key the stream routes want it (llama-server: 401 too); SIGTERM with a generation running on
    for a client that left: the server exits cleanly."""
    model = derive_gguf(fixture_dir("llama") / "model-f32.gguf", tmp_path / "tiny.gguf",
                        {"tokenizer.chat_template": TEMPLATE})
    with ServerProcess(model, ["--ctx-size", "4096", "--api-key", "k", "--slots"]) as s:
        auth = {"Authorization": "Bearer k"}
        assert httpx.get(s.url + "/v1/stream", params={"conv_id": "x"}, timeout=10).status_code == 401
        assert httpx.post(s.url + "/v1/streams/lookup", json={"conversation_ids": []}, timeout=10).status_code == 401
        assert httpx.delete(s.url + "/v1/stream", params={"conv_id": "x"}, timeout=10).status_code == 401
        with httpx.stream("POST", s.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 3800, "ignore_eos": True},
                          headers={"X-Conversation-Id": "k-1", **auth}, timeout=60) as r:
            assert r.status_code == 200
            next(r.iter_raw())
        found = httpx.post(s.url + "/v1/streams/lookup", json={"conversation_ids": ["k-1"]}, headers=auth,
                           timeout=10).json()
        assert found and found[0]["is_done"] is False
        s.terminate()
        assert s.wait(20) == 0


# -- the buffer and the registry on their own -------------------------------------------------------


def collect(session: StreamSession, offset: int) -> bytes:
    import asyncio

    async def run() -> bytes:
        return b"".join([c async for c in session.read_from(offset)])

    return asyncio.run(run())


def test_the_buffer_keeps_its_last_bytes_and_refuses_an_offset_before_them():
    s = StreamSession("a", max_bytes=10)
    s.append(b"0123456789")
    s.append(b"abcd")
    s.finish()
    assert (s.total_bytes, s.dropped_bytes) == (14, 4)
    assert collect(s, 4) == b"456789abcd"
    assert collect(s, 12) == b"cd"
    with pytest.raises(OffsetLostError):
        collect(s, 3)
    s.append(b"late")  # a finished stream takes nothing more
    assert s.total_bytes == 14


def test_a_chunk_larger_than_the_buffer_keeps_its_tail():
    s = StreamSession("a", max_bytes=4)
    s.append(b"xy")
    s.append(b"0123456789")
    s.finish()
    assert (s.total_bytes, s.dropped_bytes) == (12, 8)
    assert collect(s, 8) == b"6789"


def test_finished_sessions_expire_and_are_capped():
    now = [1000.0]
    sessions = StreamSessions(ttl=300, max_finished=2, clock=lambda: now[0])
    live = sessions.create_or_replace("live")
    for i in range(3):
        sessions.create_or_replace(f"done-{i}").finish()
        now[0] += 1
    # the oldest finished one went beyond the cap of 2; the live one is never dropped
    assert [s.conversation_id for s in sessions.lookup(["live", "done-0", "done-1", "done-2"])] == [
        "live", "done-1", "done-2"]
    now[0] += 298  # done-1 finished 300 s ago, done-2 299 s ago
    assert sessions.get("done-1") is None and sessions.get("done-2") is not None
    now[0] += 10
    assert sessions.get("done-2") is None and sessions.get("live") is live


def test_the_offset_lost_answer():
    """The 400 a GET gets once its offset has left the buffer (4 MiB in a real server: too slow to reach)."""
    sessions = StreamSessions(max_bytes=8)
    app = FastAPI()
    install_error_handlers(app)
    register(app, sessions)
    with TestClient(app) as client:
        s = sessions.create_or_replace("c")
        s.append(b"data: 0123456789\n\n")
        s.finish()
        r = client.get("/v1/stream", params={"conv_id": "c", "from": "3"})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "from" and "offset lost" in r.json()["error"]["message"]
        r = client.get("/v1/stream", params={"conv_id": "c", "from": str(s.dropped_bytes)})
        assert r.status_code == 200 and r.content == b"0123456789\n\n"[-8:]
