"""The OpenAI request bodies the server accepts, checked field by field into plain objects.

A bad field raises :class:`ApiError` (HTTP 400) whose message and ``param`` name it, the way the OpenAI
API reports it. Sampling fields that OpenAI does not have but llama.cpp's server does (``top_k``,
``min_p``, ``repeat_penalty``, ``top_n_sigma``, ...) are accepted under the same names: every
``SamplingParams`` field its metadata marks as a request field, checked as the metadata says.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from minfer.errors import BadRequestError
from minfer.runtime.sampling.params import PARAMS

MAX_N = 16
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16


class ApiError(Exception):
    """An error answered with an OpenAI-style body: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self, message: str, status: int = 400, type: str = "invalid_request_error", param: str | None = None,
        code: str | None = None, headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class GenerationParams:
    """What both endpoints share once parsed."""

    model: str | None
    max_tokens: int | None
    n: int
    stream: bool
    include_usage: bool
    stop: list[str]
    seed: int | None
    sampling: dict[str, Any]  # SamplingParams keywords (without seed)
    logprobs: int | None  # None: off; N: the chosen token plus N alternatives
    grammar: str | None
    json_schema: Any  # None, True (any JSON object) or a schema dict
    timings: bool = False  # llama-server's timings_per_token: answer with its "timings" object too


@dataclass
class ChatRequest:
    messages: list[dict[str, Any]]
    params: GenerationParams


@dataclass
class CompletionRequest:
    prompts: list[str | list[int]]
    echo: bool
    params: GenerationParams


@dataclass
class _Reader:
    body: Mapping[str, Any]
    seen: set[str] = field(default_factory=set)

    def get(self, name: str, default: Any = None) -> Any:
        self.seen.add(name)
        value = self.body.get(name, default)
        return default if value is None else value

    def integer(self, name: str, default: int | None, lo: int | None = None, hi: int | None = None) -> int | None:
        v = self.get(name, default)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            raise ApiError(f"'{name}' must be an integer, got {v!r}", param=name)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise ApiError(f"'{name}' must be {_range(lo, hi)}, got {v}", param=name)
        return v

    def number(self, name: str, lo: float | None = None, hi: float | None = None) -> float | None:
        v = self.get(name)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise ApiError(f"'{name}' must be a finite number, got {v!r}", param=name)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise ApiError(f"'{name}' must be {_range(lo, hi)}, got {v}", param=name)
        return float(v)

    def boolean(self, name: str, default: bool = False) -> bool:
        v = self.get(name, default)
        if not isinstance(v, bool):
            raise ApiError(f"'{name}' must be true or false, got {v!r}", param=name)
        return v


def _range(lo: float | None, hi: float | None) -> str:
    if lo is not None and hi is not None:
        return f"between {lo} and {hi}"
    return f">= {lo}" if lo is not None else f"<= {hi}"


def _check_body(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise ApiError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _generation_params(r: _Reader, default_max_tokens: int | None, chat: bool) -> GenerationParams:
    model = r.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(f"'model' must be a string, got {model!r}", param="model")
    if chat and r.body.get("max_completion_tokens") is not None:
        max_tokens = r.integer("max_completion_tokens", None, lo=0)
    else:
        max_tokens = r.integer("max_tokens", default_max_tokens, lo=0)
    n = r.integer("n", 1, lo=1, hi=MAX_N)
    assert n is not None
    stream = r.boolean("stream")
    opts = r.get("stream_options", {})
    if not isinstance(opts, Mapping):
        raise ApiError(f"'stream_options' must be an object, got {opts!r}", param="stream_options")
    if opts and not stream:
        raise ApiError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    include_usage = opts.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise ApiError("'stream_options.include_usage' must be true or false", param="stream_options.include_usage")
    stop = r.get("stop", [])
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError("'stop' must be a non-empty string or a list of non-empty strings", param="stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise ApiError(f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}", param="stop")
    seed = r.integer("seed", None)
    if seed is not None and seed < 0:
        seed &= (1 << 64) - 1  # OpenAI seeds may be negative; the sampler wants a non-negative one

    sampling = _sampling_fields(r)
    bias = r.get("logit_bias")
    if bias is not None:
        sampling["logit_bias"] = _logit_bias(bias)

    if chat:
        want = r.boolean("logprobs")
        top = r.integer("top_logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
        if top is not None and not want:
            raise ApiError("'top_logprobs' needs 'logprobs' set to true", param="top_logprobs")
        logprobs = (top or 0) if want else None
    else:
        logprobs = r.integer("logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)

    grammar = r.get("grammar")
    if grammar is not None and not isinstance(grammar, str):
        raise ApiError("'grammar' must be a GBNF grammar string", param="grammar")
    json_schema = _response_format(r.get("response_format"))
    if grammar is not None and json_schema is not None:
        raise ApiError("'grammar' and 'response_format' cannot be used together", param="grammar")
    return GenerationParams(model, max_tokens, n, stream, include_usage, stop, seed, sampling, logprobs, grammar,
                            json_schema, timings=r.boolean("timings_per_token"))


def _sampling_fields(r: _Reader) -> dict[str, Any]:
    """The request fields of SamplingParams that the body sets, each checked as its metadata says: an
    OpenAI field within OpenAI's range first, then every field by SamplingParams' own check."""
    sampling: dict[str, Any] = {}
    for name, param in PARAMS.items():
        if not param.request:
            continue
        value = r.number(name, *param.openai_range) if param.openai_range is not None else r.get(name)
        if value is not None:
            try:
                sampling[name] = param.check(name, value)
            except BadRequestError as e:
                raise ApiError(str(e), param=name) from None
    return sampling


def _logit_bias(bias: Any) -> dict[int, float]:
    if not isinstance(bias, Mapping):
        raise ApiError("'logit_bias' must be an object mapping token ids to biases", param="logit_bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ApiError(f"'logit_bias' keys must be token ids, got {key!r}", param="logit_bias") from None
        if isinstance(value, bool) or not isinstance(value, int | float) or not -100 <= value <= 100:
            raise ApiError(f"'logit_bias' values must be numbers in [-100, 100], got {value!r} for token {key}",
                           param="logit_bias")
        out[token] = float(value)
    return out


def _response_format(fmt: Any) -> Any:
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping) or "type" not in fmt:
        raise ApiError("'response_format' must be an object with a 'type'", param="response_format")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return True
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("schema", {}), Mapping):
            raise ApiError("'response_format.json_schema' must be an object with a 'schema' object",
                           param="response_format.json_schema")
        return dict(spec.get("schema") or {}) or True
    raise ApiError(f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                   param="response_format.type")


def _message_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(f"messages[{i}].content: only text parts are supported, got {part!r}",
                               param=f"messages[{i}].content")
            parts.append(part["text"])
        return "".join(parts)
    raise ApiError(f"messages[{i}].content must be a string or a list of text parts", param=f"messages[{i}].content")


def parse_chat(body: Any) -> ChatRequest:
    r = _Reader(_check_body(body))
    messages = r.get("messages")
    if messages is None:
        raise ApiError("'messages' is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' must be a non-empty list of messages", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ApiError(f"messages[{i}] must be an object with 'role' and 'content'", param=f"messages[{i}]")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise ApiError(f"messages[{i}].role must be 'system', 'developer', 'user' or 'assistant', got {role!r}",
                           param=f"messages[{i}].role")
        if "content" not in m or m["content"] is None:
            raise ApiError(f"messages[{i}].content is required", param=f"messages[{i}].content")
        out.append({"role": "system" if role == "developer" else role, "content": _message_text(m["content"], i)})
    for unsupported in ("tools", "functions"):
        if r.body.get(unsupported):
            raise ApiError(f"'{unsupported}' is not supported by this server", param=unsupported)
    return ChatRequest(out, _generation_params(r, None, chat=True))


def parse_completion(body: Any) -> CompletionRequest:
    r = _Reader(_check_body(body))
    prompt = r.get("prompt")
    if prompt is None:
        raise ApiError("'prompt' is required", param="prompt")
    prompts: list[str | list[int]]
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt):
        prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(
        isinstance(p, list) and p and all(_is_token(t) for t in p) for p in prompt
    ):
        prompts = [list(p) for p in prompt]
    else:
        raise ApiError("'prompt' must be a string, a list of strings, a list of token ids or a list of such lists",
                       param="prompt")
    if r.body.get("suffix"):
        raise ApiError("'suffix' is not supported by this server", param="suffix")
    params = _generation_params(r, 16, chat=False)
    best_of = r.integer("best_of", None, lo=1)
    if best_of is not None and best_of != params.n:
        raise ApiError("'best_of' is not supported except equal to 'n'", param="best_of")
    return CompletionRequest(prompts, r.boolean("echo"), params)


def _is_token(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)
