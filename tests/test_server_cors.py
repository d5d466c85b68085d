"""Preflight, CORS and API keys as llama-server answers them (issue 39), against real ``minfer serve``
processes on the tiny llama fixture, and the flags' bad values through the CLI.

What llama-server (tools/server/server-http.cpp, its pre-routing handler) does for the same requests:
- any ``OPTIONS`` is answered 200 before the key check and the routes, on every path, with
  ``Access-Control-Allow-Origin`` (the request's Origin, by default), ``-Credentials: true``,
  ``-Methods: GET, POST, DELETE, OPTIONS`` and ``-Headers: *`` (minfer answered 401 with a key, 405 without);
- ``--cors-origins localhost`` echoes loopback origins only, judged by the parsed host;
- a wrong or missing key is a 401 ``{"error": {"message": "Invalid API Key", "type": "authentication_error",
  "code": 401}}`` (minfer keeps its string code, ``invalid_api_key``, OpenAI's own);
- ``--api-key a,b`` and ``--api-key-file`` (one a line, ``#`` comments) each give keys that all work.

Checked against llama-server built from the llama-cpp-python 0.3.36 sdist, on the same fixture: the preflight
headers above, byte for byte; the localhost echoes (and nothing for ``http://localhost.evil.com``, still a
200); ``Authorization: k2`` without ``Bearer`` accepted. Where minfer differs on purpose: with no ``Origin``
llama-server sends an empty ``Access-Control-Allow-Origin`` (minfer: none); with ``--cors-origins a,b`` it
sends ``a,b`` itself to every origin, which browsers refuse (minfer: the request's origin when listed);
``bearer`` in lower case is a 401 there (an HTTP scheme is case-insensitive: minfer takes it); a wrong
``x-api-key`` on ``/v1/messages`` gets OpenAI's body there (minfer: Anthropic's, which its SDK reads).
"""

from __future__ import annotations

import time

import httpx
import pytest
from conftest import fixture_dir

from minfer.cli import main
from minfer.server.api_keys import read_api_key_file, resolve_api_keys, server_api_keys
from minfer.server.cors import CorsPolicy, is_loopback_origin, parse_origins
from minfer.testing.server_process import ServerProcess

TINY = fixture_dir("llama") / "model-f32.gguf"
BASE_ARGS = ["--parallel", "1", "--ctx-size", "128", "--batch-size", "32", "--alias", "tiny"]
PAGE = "http://editor.example"
LOOPBACK = ("http://localhost:8080", "http://127.0.0.1", "http://[::1]:3000")
PREFLIGHT_PATHS = ("/v1/chat/completions", "/completions", "/health")


def preflight(url: str, path: str, origin: str, **headers: str) -> httpx.Response:
    return httpx.options(url + path, headers={"Origin": origin, "Access-Control-Request-Method": "POST", **headers},
                         timeout=30)


# -- the rules, without a server -------------------------------------------------------------------


def test_loopback_origins_are_judged_by_their_parsed_host():
    assert all(is_loopback_origin(o) for o in LOOPBACK)
    for other in ("http://localhost.evil.com", "http://evil.com/localhost", "http://127.0.0.1.evil.com",
                  "http://evil.com#@localhost", "not a url", "http://[::1"):
        assert not is_loopback_origin(other), other


def test_allow_origin_by_policy():
    assert CorsPolicy().allow_origin(PAGE) == PAGE  # "*" with credentials: the origin echoed
    assert CorsPolicy().allow_origin(None) is None
    assert CorsPolicy(credentials=False).allow_origin(PAGE) == "*"
    listed = CorsPolicy(("http://a.example", "localhost"))
    assert listed.allow_origin("http://a.example") == "http://a.example"
    assert listed.allow_origin("http://127.0.0.1:5173") == "http://127.0.0.1:5173"
    assert listed.allow_origin("http://b.example") is None
    # "*" does not cover Authorization in browsers: the requested names follow it
    assert CorsPolicy().allow_headers("authorization, content-type") == "*, authorization, content-type"
    assert CorsPolicy().allow_headers(None) == "*"
    assert CorsPolicy(headers="Content-Type").allow_headers("authorization") == "Content-Type"


def test_origin_and_key_parsing(tmp_path):
    assert parse_origins(["http://a.example/, localhost", "*"]) == ("http://a.example", "localhost", "*")
    keys = tmp_path / "keys.txt"
    keys.write_text("# the team's keys\nk1\n\n  k2  \r\n#k3\n")
    assert read_api_key_file(keys) == ("k1", "k2")
    assert server_api_keys("a, b,", str(keys)) == ("a", "b", "k1", "k2")
    assert server_api_keys(None, None) == ()
    # $MINFER_API_KEY (a list too) only when no flag gives keys; empty: no key, as before
    assert resolve_api_keys((), {"MINFER_API_KEY": "x, y"}) == ("x", "y")
    assert resolve_api_keys(("a",), {"MINFER_API_KEY": "x"}) == ("a",)
    assert resolve_api_keys((), {"MINFER_API_KEY": ""}) == resolve_api_keys((), {}) == ()


@pytest.mark.parametrize(("flags", "named"), [
    (["--cors-origins", "example.com"], "--cors-origins"),  # no scheme: not an origin
    (["--cors-origins", "http://a.example/path"], "--cors-origins"),
    (["--cors-origins", ","], "--cors-origins"),
    (["--cors-methods", "GET,PO ST"], "--cors-methods"),
    (["--cors-headers", ""], "--cors-headers"),
    (["--no-cors", "--cors-origins", "localhost"], "--no-cors"),
    (["--api-key", ","], "--api-key"),  # no key at all would leave the server open
    (["--api-key-file", "/nonexistent/keys.txt"], "--api-key-file"),
])
def test_a_bad_flag_value_is_a_one_line_error(flags, named, capsys):
    assert main(["serve", str(TINY), "--port", "0", *flags]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("minfer: error: ") and "\n" not in err and named in err, err


def test_an_empty_key_file_is_an_error(tmp_path, capsys):
    empty = tmp_path / "keys.txt"
    empty.write_text("# no keys yet\n\n")
    assert main(["serve", str(TINY), "--port", "0", "--api-key-file", str(empty)]) == 1
    err = capsys.readouterr().err.strip()
    assert "--api-key-file" in err and "no key" in err and "\n" not in err


# -- real servers ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """llama-server's defaults for CORS, keys from both flags: a, b and c."""
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text("# comment\nc\n")
    with ServerProcess(TINY, [*BASE_ARGS, "--api-key", "a,b", "--api-key-file", str(key_file)]) as s:
        yield s


@pytest.fixture(scope="module")
def open_server():
    """No key, and llama-server's defaults for CORS."""
    with ServerProcess(TINY, BASE_ARGS) as s:
        yield s


@pytest.mark.slow
@pytest.mark.parametrize("path", PREFLIGHT_PATHS)
@pytest.mark.parametrize("which", ["keyed", "open_server"])
def test_preflight_is_200_with_llama_servers_headers(which, path, request):
    server = request.getfixturevalue(which)
    r = preflight(server.url, path, PAGE)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == PAGE
    assert r.headers["access-control-allow-credentials"] == "true"
    assert r.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
    assert r.headers["access-control-allow-headers"] == "*"
    assert r.content == b""
    # what a page sending its key asks for is listed after the "*", which does not cover Authorization
    r = preflight(server.url, path, PAGE, **{"Access-Control-Request-Headers": "authorization,content-type"})
    assert r.status_code == 200 and r.headers["access-control-allow-headers"] == "*, authorization, content-type"


@pytest.mark.slow
def test_every_answer_echoes_the_origin_by_default(keyed):
    r = httpx.get(keyed.url + "/v1/models", headers={"Origin": PAGE, "Authorization": "Bearer a"}, timeout=30)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == PAGE
    assert "Origin" in r.headers["vary"]
    # as llama-server: credentials are allowed in the preflight only, so a page cannot read a cookie-credentialed
    # answer (what a proxy authenticating by cookie in front would let through) from any origin echoed
    assert "access-control-allow-credentials" not in r.headers
    # the 401 carries it too, so that the page can read why it was refused
    r = httpx.get(keyed.url + "/v1/models", headers={"Origin": PAGE}, timeout=30)
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == PAGE
    # no Origin (not a browser): nothing to echo
    r = httpx.get(keyed.url + "/health", timeout=30)
    assert "access-control-allow-origin" not in r.headers


@pytest.mark.slow
def test_a_wrong_or_missing_key_is_an_authentication_error(keyed):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}, {"Authorization": "Bearer"}):
        r = httpx.post(keyed.url + "/v1/completions", json={"prompt": "a", "max_tokens": 1}, headers=headers,
                       timeout=30)
        assert r.status_code == 401, headers
        error = r.json()["error"]
        assert error["type"] == "authentication_error" and error["message"].startswith("Invalid API Key")
        assert error["code"] == "invalid_api_key"
    # Anthropic's route answers in Anthropic's shape, with the same type
    r = httpx.post(keyed.url + "/v1/messages", json={}, headers={"x-api-key": "wrong"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(keyed.url + "/health", timeout=30).status_code == 200  # open, as llama-server's


@pytest.mark.slow
def test_every_key_of_both_flags_works(keyed):
    # a and b from --api-key a,b; c from --api-key-file; as Bearer, bare (llama-server takes it) or x-api-key
    for headers in ({"Authorization": "Bearer a"}, {"Authorization": "bearer b"}, {"Authorization": "Bearer c"},
                    {"Authorization": "c"}, {"x-api-key": "b"}):
        r = httpx.post(keyed.url + "/v1/completions", json={"prompt": "a", "max_tokens": 1}, headers=headers,
                       timeout=60)
        assert r.status_code == 200, (headers, r.text)
    # the comment line of the file is not a key
    r = httpx.get(keyed.url + "/v1/models", headers={"Authorization": "Bearer # comment"}, timeout=30)
    assert r.status_code == 401


@pytest.mark.slow
def test_cors_origins_localhost_echoes_loopback_pages_only():
    with ServerProcess(TINY, [*BASE_ARGS, "--cors-origins", "localhost"]) as s:
        for origin in LOOPBACK:
            r = preflight(s.url, "/v1/chat/completions", origin)
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
            r = httpx.get(s.url + "/v1/models", headers={"Origin": origin}, timeout=30)
            assert r.headers["access-control-allow-origin"] == origin
        for origin in ("http://localhost.evil.com", PAGE):
            r = preflight(s.url, "/v1/chat/completions", origin)
            # still answered 200 (as llama-server), but without the header the browser refuses the page
            assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
            r = httpx.get(s.url + "/v1/models", headers={"Origin": origin}, timeout=30)
            assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


@pytest.mark.slow
def test_listed_origins_and_the_other_flags():
    args = [*BASE_ARGS, "--cors-origin", "http://a.example", "--cors-origins", "http://b.example:8000/",
            "--cors-methods", "GET,POST", "--cors-headers", "Content-Type, Authorization", "--no-cors-credentials"]
    with ServerProcess(TINY, args) as s:
        for origin in ("http://a.example", "http://b.example:8000"):
            r = preflight(s.url, "/completions", origin, **{"Access-Control-Request-Headers": "x-other"})
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
            assert r.headers["access-control-allow-methods"] == "GET, POST"
            assert r.headers["access-control-allow-headers"] == "Content-Type, Authorization"
            assert r.headers["access-control-allow-credentials"] == "false"
        for origin in ("http://c.example", "http://a.example:8080", "https://a.example"):
            r = preflight(s.url, "/completions", origin)
            assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        r = httpx.get(s.url + "/v1/models", headers={"Origin": "http://a.example"}, timeout=30)
        assert r.headers["access-control-allow-origin"] == "http://a.example"
        assert "access-control-allow-credentials" not in r.headers


def test_options_reach_ray_replicas_whole():
    """``--ray`` hands each replica its options as JSON: the keys and origins come back as tuples."""
    from minfer.server import ServeOptions
    from minfer.server.cluster.engine_process import options_from_json, options_to_json

    opts = ServeOptions(model="m.gguf", api_keys=("a", "b"), cors_origins=("localhost", "http://a.example"),
                        cors_credentials=False)
    assert options_from_json(options_to_json(opts)) == opts


@pytest.mark.slow
def test_several_models_answer_cors_once_in_front(tmp_path):
    """The model router answers the preflight before its key check; a proxied answer carries the header once
    (the models' own servers run with --no-cors)."""
    (tmp_path / "tiny.gguf").symlink_to(TINY)
    args = ["--ctx-size", "128", "--api-key", "a", "--cors-origins", "localhost"]
    with ServerProcess(f"--models-dir={tmp_path}", args) as s:
        r = preflight(s.url, "/v1/completions", "http://localhost:3000")
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
        r = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 1},
                       headers={"Origin": "http://localhost:3000", "Authorization": "Bearer a"}, timeout=300)
        assert r.status_code == 200, r.text
        assert r.headers.get_list("access-control-allow-origin") == ["http://localhost:3000"]
        r = httpx.get(s.url + "/v1/models", headers={"Origin": "http://localhost.evil.com"}, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert "access-control-allow-origin" not in r.headers


@pytest.mark.slow
def test_an_encoder_server_answers_cors_and_keys_alike():
    with ServerProcess(fixture_dir("bert_rerank"), ["--api-key", "a,b", "--cors-origins", "localhost"]) as s:
        r = preflight(s.url, "/v1/rerank", "http://localhost:5173")
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:5173"
        assert r.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
        r = httpx.get(s.url + "/v1/models", headers={"Origin": "http://localhost:5173"}, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert r.headers["access-control-allow-origin"] == "http://localhost:5173"
        assert httpx.get(s.url + "/v1/models", headers={"Authorization": "Bearer b"}, timeout=30).status_code == 200


@pytest.mark.slow
def test_a_sleeping_server_answers_preflights_without_waking():
    """``--sleep-idle-seconds``: the front answers CORS (its own answers while asleep included) and the key;
    a preflight neither needs the key nor wakes the model; a woken model's answer carries the header once."""
    args = [*BASE_ARGS, "--sleep-idle-seconds", "1", "--api-key", "a", "--cors-origins", "localhost"]
    origin = {"Origin": "http://localhost:3000"}
    with ServerProcess(TINY, args) as s:
        def asleep() -> bool:
            return httpx.get(s.url + "/props", headers={"Authorization": "Bearer a"}, timeout=30).json()["is_sleeping"]

        deadline = time.monotonic() + 60
        while not asleep():
            assert time.monotonic() < deadline, "the server never went to sleep"
            time.sleep(0.2)
        r = preflight(s.url, "/v1/completions", "http://localhost:3000")
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
        r = httpx.get(s.url + "/v1/models", headers=origin, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert r.headers.get_list("access-control-allow-origin") == ["http://localhost:3000"]
        assert asleep()  # neither woke it
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "a", "max_tokens": 1},
                       headers={**origin, "Authorization": "Bearer a"}, timeout=300)
        assert r.status_code == 200, r.text
        assert r.headers.get_list("access-control-allow-origin") == ["http://localhost:3000"]
        r = httpx.get(s.url + "/health", headers={"Origin": "http://localhost.evil.com"}, timeout=30)
        assert "access-control-allow-origin" not in r.headers
