"""``scripts/server_side_by_side.py``: send one fixed list of requests to two servers (say llama-server and
minfer serve, on the same model) and print where their answers differ, by group: status codes, a few headers,
and JSON shapes (key sets and value types, recursively; never the generated text, token ids or timings, which
depend on the model and the machine).

    python scripts/server_side_by_side.py http://127.0.0.1:18080 http://127.0.0.1:8080 [--key K] [--json OUT]

A streamed answer's shape is its first and last ``data:`` events'. A list's shape is its first item's (an empty list
matches any list: how many items there are is the model's business). Numbers are one type (llama-server writes 1.0
where Python writes 1 only sometimes). With --key, every request carries ``Authorization: Bearer K`` except the
keys group's, which try no key and a wrong one. The exit status is 1 when a request differs, else 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

GROUPS = ("preflight/keys", "metrics/props", "chat & completion", "anthropic", "embeddings", "errors")
# compared by value: CORS headers; by presence: the rest; Content-Type by its media type
HEADERS_BY_VALUE = ("access-control-allow-origin", "access-control-allow-credentials",
                    "access-control-allow-methods", "access-control-allow-headers")
HEADERS_BY_PRESENCE = ("process-start-time-unix", "www-authenticate", "retry-after")
ORIGIN = "http://localhost:8080"
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0}


@dataclass(frozen=True)
class Probe:
    group: str
    name: str
    method: str
    path: str
    body: Any = None  # JSON, or bytes sent as they are
    headers: Mapping[str, str] = field(default_factory=dict)
    key: str = "given"  # "given": --key if any; "none": no Authorization; "wrong": a wrong key


PROBES: tuple[Probe, ...] = (
    # -- preflight and keys ---------------------------------------------------------------------------------
    Probe("preflight/keys", "OPTIONS /v1/chat/completions preflight", "OPTIONS", "/v1/chat/completions",
          headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}, key="none"),
    Probe("preflight/keys", "OPTIONS /completions preflight", "OPTIONS", "/completions",
          headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}, key="none"),
    Probe("preflight/keys", "GET /v1/models with Origin", "GET", "/v1/models", headers={"Origin": ORIGIN}),
    Probe("preflight/keys", "GET /v1/models without a key", "GET", "/v1/models", key="none"),
    Probe("preflight/keys", "GET /v1/models with a wrong key", "GET", "/v1/models", key="wrong"),
    Probe("preflight/keys", "GET /health without a key", "GET", "/health", key="none"),
    # -- metrics, props, slots, models --------------------------------------------------------------------
    Probe("metrics/props", "GET /health", "GET", "/health"),
    Probe("metrics/props", "GET /props", "GET", "/props"),
    Probe("metrics/props", "GET /v1/models", "GET", "/v1/models"),
    Probe("metrics/props", "GET /models", "GET", "/models"),
    Probe("metrics/props", "GET /metrics", "GET", "/metrics"),
    Probe("metrics/props", "GET /slots", "GET", "/slots"),
    # -- chat and completion fields ----------------------------------------------------------------------------
    Probe("chat & completion", "POST /v1/chat/completions", "POST", "/v1/chat/completions", CHAT),
    Probe("chat & completion", "POST /v1/chat/completions stream", "POST", "/v1/chat/completions",
          {**CHAT, "stream": True}),
    Probe("chat & completion", "POST /v1/chat/completions logprobs", "POST", "/v1/chat/completions",
          {**CHAT, "logprobs": True, "top_logprobs": 2}),
    Probe("chat & completion", "POST /v1/completions", "POST", "/v1/completions",
          {"prompt": "hello", "max_tokens": 4, "temperature": 0}),
    Probe("chat & completion", "POST /completion", "POST", "/completion",
          {"prompt": "hello", "n_predict": 4, "temperature": 0}),
    Probe("chat & completion", "POST /completion stream", "POST", "/completion",
          {"prompt": "hello", "n_predict": 4, "temperature": 0, "stream": True}),
    Probe("chat & completion", "POST /completion n_probs", "POST", "/completion",
          {"prompt": "hello", "n_predict": 2, "n_probs": 2, "temperature": 0}),
    Probe("chat & completion", "POST /completion prompt as tokens", "POST", "/completion",
          {"prompt": [1, 2, 3], "n_predict": 2}),
    Probe("chat & completion", "POST /tokenize", "POST", "/tokenize", {"content": "hello world"}),
    Probe("chat & completion", "POST /detokenize", "POST", "/detokenize", {"tokens": [1, 2, 3]}),
    Probe("chat & completion", "POST /apply-template", "POST", "/apply-template", {"messages": CHAT["messages"]}),
    Probe("chat & completion", "POST /chat/completions/input_tokens", "POST", "/chat/completions/input_tokens",
          {"messages": CHAT["messages"]}),
    # -- Anthropic ------------------------------------------------------------------------------------------
    Probe("anthropic", "POST /v1/messages", "POST", "/v1/messages",
          {"model": "m", "max_tokens": 4, "messages": CHAT["messages"]}),
    Probe("anthropic", "POST /v1/messages stream", "POST", "/v1/messages",
          {"model": "m", "max_tokens": 4, "messages": CHAT["messages"], "stream": True}),
    Probe("anthropic", "POST /v1/messages/count_tokens", "POST", "/v1/messages/count_tokens",
          {"model": "m", "messages": CHAT["messages"]}),
    Probe("anthropic", "POST /v1/messages empty messages", "POST", "/v1/messages",
          {"model": "m", "max_tokens": 4, "messages": []}),
    # -- embeddings ---------------------------------------------------------------------------------------------
    Probe("embeddings", "POST /v1/embeddings", "POST", "/v1/embeddings", {"input": "hello"}),
    Probe("embeddings", "POST /v1/embeddings content parts", "POST", "/v1/embeddings",
          {"input": [{"content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]}]}),
    Probe("embeddings", "POST /embedding", "POST", "/embedding", {"content": "hello"}),
    Probe("embeddings", "POST /v1/embeddings pooling none", "POST", "/v1/embeddings",
          {"input": "hello", "pooling": "none"}),
    # -- errors ---------------------------------------------------------------------------------------------
    Probe("errors", "POST /v1/chat/completions without messages", "POST", "/v1/chat/completions", {}),
    Probe("errors", "POST /v1/chat/completions bad JSON", "POST", "/v1/chat/completions", b"{not json"),
    Probe("errors", "GET an unknown path", "GET", "/no/such/path"),
    Probe("errors", "continue_final_message with add_generation_prompt", "POST", "/v1/chat/completions",
          {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}],
           "continue_final_message": True, "add_generation_prompt": True, "max_tokens": 2}),
    Probe("errors", "context overflow", "POST", "/completion", {"prompt": "hello " * 40000, "n_predict": 1}),
    Probe("errors", "POST /v1/completions bad max_tokens", "POST", "/v1/completions",
          {"prompt": "hi", "max_tokens": "many"}),
)


@dataclass
class Answer:
    status: int
    headers: dict[str, str]  # lower-cased names
    body: Any = None  # the JSON, or None
    events: list[Any] = field(default_factory=list)  # a stream's JSON data: events
    error: str = ""  # the request failed (connection refused, timeout)


# -- shapes ----------------------------------------------------------------------------------------------------


def type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "list"
    return "object"


def shape_diff(a: Any, b: Any, path: str = "$") -> list[str]:
    """Where two JSON values differ in shape: keys only one side has, values of different types. Lists compare
    their first items (an empty list matches any list)."""
    ta, tb = type_name(a), type_name(b)
    if ta != tb:
        return [f"{path}: {ta} vs {tb}"]
    if ta == "object":
        out = [f"{path}.{k}: only in A" for k in sorted(a.keys() - b.keys())]
        out += [f"{path}.{k}: only in B" for k in sorted(b.keys() - a.keys())]
        for k in sorted(a.keys() & b.keys()):
            out += shape_diff(a[k], b[k], f"{path}.{k}")
        return out
    if ta == "list" and a and b:
        return shape_diff(a[0], b[0], f"{path}[0]")
    return []


def media_type(headers: Mapping[str, str]) -> str:
    return headers.get("content-type", "").split(";")[0].strip().lower()


def compare(a: Answer, b: Answer) -> list[str]:
    """The differences of two answers to one request: status, headers, body shape, a stream's first and last
    events' shapes."""
    if a.error or b.error:
        return [f"request failed: A {a.error or 'ok'}, B {b.error or 'ok'}"] if a.error != b.error else []
    out = [] if a.status == b.status else [f"status: {a.status} vs {b.status}"]
    for name in HEADERS_BY_VALUE:  # an empty one is none (llama-server sends an empty Allow-Origin without Origin)
        va, vb = a.headers.get(name) or None, b.headers.get(name) or None
        if va != vb:
            out.append(f"header {name}: {va!r} vs {vb!r}")
    for name in HEADERS_BY_PRESENCE:
        if (name in a.headers) != (name in b.headers):
            out.append(f"header {name}: {'present' if name in a.headers else 'absent'} vs "
                       f"{'present' if name in b.headers else 'absent'}")
    if media_type(a.headers) != media_type(b.headers):
        out.append(f"content-type: {media_type(a.headers)!r} vs {media_type(b.headers)!r}")
    if a.events or b.events:
        if bool(a.events) != bool(b.events):
            out.append(f"stream: {len(a.events)} vs {len(b.events)} JSON events")
        else:
            out += shape_diff(a.events[0], b.events[0], "first event")
            out += shape_diff(a.events[-1], b.events[-1], "last event")
    elif a.body is not None or b.body is not None:
        out += shape_diff(a.body, b.body)
    return out


# -- sending -----------------------------------------------------------------------------------------------------


def stream_events(text: str) -> list[Any]:
    """The JSON of each ``data:`` line of a server-sent event stream (``[DONE]`` and others left out)."""
    events = []
    for line in text.splitlines():
        if line.startswith("data:"):
            data = line[5:].strip()
            try:
                events.append(json.loads(data))
            except ValueError:
                pass
    return events


def send(client: Any, base: str, probe: Probe, key: str | None) -> Answer:
    import httpx

    headers = dict(probe.headers)
    if probe.key == "given" and key:
        headers["Authorization"] = f"Bearer {key}"
    elif probe.key == "wrong":
        headers["Authorization"] = "Bearer not-the-key"
    content = probe.body if isinstance(probe.body, bytes) else None
    body = None if content is not None or probe.body is None else probe.body
    if content is not None:
        headers["Content-Type"] = "application/json"
    try:
        r = client.request(probe.method, base.rstrip("/") + probe.path, json=body, content=content, headers=headers)
    except httpx.HTTPError as e:
        return Answer(0, {}, error=type(e).__name__)
    answer = Answer(r.status_code, {k.lower(): v for k, v in r.headers.items()})
    if media_type(answer.headers) == "text/event-stream":
        answer.events = stream_events(r.text)
    else:
        try:
            answer.body = r.json()
        except ValueError:
            answer.body = None
    return answer


def run(url_a: str, url_b: str, key: str | None, probes: Sequence[Probe] = PROBES) -> list[dict[str, Any]]:
    import httpx

    results = []
    with httpx.Client(timeout=120) as client:
        for probe in probes:
            a, b = send(client, url_a, probe, key), send(client, url_b, probe, key)
            results.append({"group": probe.group, "name": probe.name, "status": [a.status, b.status],
                            "differences": compare(a, b)})
    return results


def beyond_b_extras(differences: Sequence[str]) -> list[str]:
    """The differences a client of A could trip on in B: all but keys only B has (B's extras)."""
    return [d for d in differences if not d.endswith(": only in B")]


def counts_by_group(results: Sequence[Mapping[str, Any]]) -> dict[str, tuple[int, int, int]]:
    """Each group's (requests that differ, requests that differ beyond keys only B has, requests sent)."""
    out: dict[str, tuple[int, int, int]] = {}
    for r in results:
        differ, beyond, total = out.get(r["group"], (0, 0, 0))
        out[r["group"]] = (differ + bool(r["differences"]), beyond + bool(beyond_b_extras(r["differences"])),
                           total + 1)
    return out


def report(results: Sequence[Mapping[str, Any]], url_a: str, url_b: str) -> str:
    lines = [f"A = {url_a}", f"B = {url_b}", ""]
    for group in GROUPS:
        rows = [r for r in results if r["group"] == group]
        if not rows:
            continue
        lines.append(f"== {group}")
        for r in rows:
            if r["differences"]:
                lines.append(f"  {r['name']} ({r['status'][0]} vs {r['status'][1]})")
                lines += [f"    {d}" for d in r["differences"]]
    lines.append("")
    counts = counts_by_group(results)
    lines.append(f"{'group':<20} {'differ':>6} {'beyond B extras':>15} {'sent':>4}")
    for group in [*GROUPS, "all"]:
        if group == "all":
            row = tuple(sum(c[i] for c in counts.values()) for i in range(3))
        elif group in counts:
            row = counts[group]
        else:
            continue
        lines.append(f"{group:<20} {row[0]:>6} {row[1]:>15} {row[2]:>4}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="server_side_by_side.py", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("url_a", help="the first server, e.g. llama-server's http://127.0.0.1:18080")
    parser.add_argument("url_b", help="the second server, e.g. minfer serve's http://127.0.0.1:8080")
    parser.add_argument("--key", default=None, help="the API key both servers were started with")
    parser.add_argument("--json", default=None, metavar="OUT", help="also write the results as JSON to OUT")
    args = parser.parse_args(argv)
    results = run(args.url_a, args.url_b, args.key)
    print(report(results, args.url_a, args.url_b))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"a": args.url_a, "b": args.url_b, "counts": {g: list(c) for g, c in
                                                                     counts_by_group(results).items()},
                       "results": results}, f, indent=1)
    return 1 if any(r["differences"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
