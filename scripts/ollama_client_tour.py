"""The official ``ollama`` client against ``minfer serve`` of several real models, as a user runs it: every call
the client has for a server of several models, printed with what it answered and how long it took.

    python scripts/ollama_client_tour.py                     # smollm2, gemma3-270m and all-minilm (minfer pull)
    python scripts/ollama_client_tour.py --models-max 2 A.gguf B.gguf EMBEDDER

The first two models generate, the last one embeds. Each answer is checked as it comes (a failed check stops the
tour with its reason); the times are a user's view of one run, not a benchmark.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

import ollama

from minfer.testing.server_process import ServerProcess

TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
OPTIONS = {"temperature": 0, "num_predict": 24}


def step(what: str, call: Callable[[], Any]) -> Any:
    t0 = time.perf_counter()
    out = call()
    print(f"{time.perf_counter() - t0:7.2f} s  {what}", flush=True)
    return out


def tour(client: ollama.Client, chat_a: str, chat_b: str, embedder: str) -> None:
    names = {m.model for m in step("list", client.list).models}
    assert {f"{n}:latest" for n in (chat_a, chat_b, embedder)} <= names, names
    show = step(f"show {chat_b}", lambda: client.show(chat_b))
    print(f"           family {show.details.family}, {show.details.quantization_level}, "
          f"capabilities {show.capabilities}")
    ask = [{"role": "user", "content": "What is the capital of France? One word."}]
    for name in (chat_a, chat_b, chat_a):  # each switch loads the model (and, at --models-max 1, unloads the other)
        answer = step(f"chat {name} (loads it if need be)", lambda n=name: client.chat(model=n, messages=ask,
                                                                                         options=OPTIONS))
        print(f"           {answer.message.content!r}; ps: {[m.model for m in client.ps().models]}")
    parts = step(f"chat {chat_a}, streamed", lambda: list(client.chat(model=chat_a, messages=ask, options=OPTIONS,
                                                                        stream=True)))
    assert parts[-1].done and "".join(p.message.content for p in parts) == answer.message.content
    called = step(f"chat {chat_a} with a tool", lambda: client.chat(
        model=chat_a, messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=[TOOL],
        options=OPTIONS))
    print(f"           tool_calls {called.message.tool_calls}, content {called.message.content!r}")
    gen = step(f"generate {chat_b}", lambda: client.generate(model=chat_b, prompt="Once upon a time",
                                                             options=OPTIONS))
    print(f"           {gen.response!r} ({gen.eval_count} tokens, done_reason {gen.done_reason})")
    vectors = step(f"embed {embedder}", lambda: client.embed(model=embedder, input=["a cat", "a dog"]))
    print(f"           {len(vectors.embeddings)} vectors of {len(vectors.embeddings[0])}")
    statuses = step("pull smollm2 (a name minfer pull knows)", lambda: [p.status for p in client.pull("smollm2",
                                                                                                   stream=True)])
    assert statuses[-1] == "success", statuses
    unloaded = step(f"unload {chat_b} (keep_alive 0)", lambda: client.generate(model=chat_b, keep_alive=0))
    assert unloaded.done_reason == "unload"
    print(f"           ps: {[m.model for m in client.ps().models]}")
    try:
        client.chat(model="no-such-model", messages=ask)
        raise AssertionError("an unknown model was answered")
    except ollama.ResponseError as e:
        print(f"           unknown model: ResponseError {e.status_code}: {e.error}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", default=["smollm2", "gemma3-270m", "all-minilm"],
                        help="two generating models, then an embedding model (files, folders or known names)")
    parser.add_argument("--models-max", type=int, default=1)
    args = parser.parse_args(argv)
    if len(args.models) != 3:
        parser.error("give two generating models and one embedding model")
    from pathlib import Path

    def served_name(ref: str) -> str:
        return Path(ref).name.removesuffix(".gguf") if Path(ref).exists() else ref

    first, *more = args.models
    with ServerProcess(first, [*more, "--models-max", str(args.models_max), "--ctx-size", "2048"],
                       health_timeout=600) as server:
        tour(ollama.Client(host=server.url), *(served_name(m) for m in args.models))
    return 0


if __name__ == "__main__":
    sys.exit(main())
