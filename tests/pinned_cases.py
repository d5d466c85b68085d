"""The cases ``test_pinned_outputs.py`` pins (and ``scripts/make_pinned_outputs.py`` records): greedy and
seeded generations of the tiny fixtures and of SmolLM2, through every path a user drives (``generate``,
``complete`` with logprobs and a stop string, ``chat``, a ``Conversation`` of two turns, and a real
server with concurrent requests). Only public interfaces are used, so the pin survives any refactor."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures"
FIXTURE_ARCHS = ["llama", "qwen2", "qwen3", "gemma3"]
SAMPLINGS = {"greedy": {"temperature": 0}, "seed7": {"temperature": 0.8, "seed": 7}}
SMOLLM2_PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):"]
SMOLLM2_CHAT = [{"role": "user", "content": "What is 2+2? Answer briefly."}]


def fixture_cases(arch: str) -> dict[str, list[int]]:
    import json

    import minfer

    seqs = json.loads((FIXTURES / arch / "tokens.json").read_text())["sequences"]
    model = minfer.load(str(FIXTURES / arch / "model-f32.gguf"), n_ctx=128, threads=2)
    out = {}
    for i, prompt in enumerate(seqs[1:]):
        for name, sampling in SAMPLINGS.items():
            done = model.complete(prompt, max_tokens=12, **sampling)
            out[f"{arch}/{i}/{name}"] = done.tokens
    return out


def smollm2_cases(path: Path) -> dict[str, object]:
    import minfer

    model = minfer.load(path, n_ctx=512, threads=2)
    out: dict[str, object] = {}
    for i, prompt in enumerate(SMOLLM2_PROMPTS):
        for name, sampling in SAMPLINGS.items():
            out[f"smollm2/generate/{i}/{name}"] = model.generate(prompt, max_tokens=20, **sampling)
    done = model.complete(SMOLLM2_PROMPTS[0], max_tokens=16, logprobs=2, stop=["."], temperature=0.8, seed=7)
    out["smollm2/complete/seed7"] = {
        "text": done.text, "tokens": done.tokens, "finish_reason": done.finish_reason,
        "logprobs": [round(lp.logprob, 4) for lp in done.logprobs],
    }
    for name, sampling in SAMPLINGS.items():
        out[f"smollm2/chat/{name}"] = model.chat(SMOLLM2_CHAT, max_tokens=24, **sampling)
    conv = model.conversation(system="Be brief.", seed=7, temperature=0.8)
    out["smollm2/conversation/seed7"] = [conv.send("Name a colour.", max_tokens=12),
                                         conv.send("Another one?", max_tokens=12)]
    return out


def server_cases(path: Path) -> dict[str, str]:
    import httpx

    from minfer.testing.server_process import ServerProcess

    bodies = {f"server/{i}/{name}": {"prompt": p, "max_tokens": 20, **s}
              for i, p in enumerate(SMOLLM2_PROMPTS) for name, s in SAMPLINGS.items()}
    with ServerProcess(path, ["--parallel", "8", "--ctx-size", "4096", "--threads", "2"]) as server:
        def ask(body: dict) -> str:
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=300)
            r.raise_for_status()
            return r.json()["choices"][0]["text"]

        with ThreadPoolExecutor(len(bodies)) as pool:  # all at once: one batch
            texts = list(pool.map(ask, bodies.values()))
    return dict(zip(bodies, texts, strict=True))


def run_all() -> dict[str, object]:
    from minfer.pull import pull

    smollm2 = pull("smollm2", progress=False)
    out: dict[str, object] = {}
    for arch in FIXTURE_ARCHS:
        out.update(fixture_cases(arch))
    out.update(smollm2_cases(smollm2))
    out.update(server_cases(smollm2))
    return out
