"""The OpenAI request bodies the server accepts, checked field by field into plain objects.

A bad field raises :class:`ApiError` (HTTP 400) whose message and ``param`` name it, the way the OpenAI
API reports it. Sampling fields that OpenAI does not have but llama.cpp's server does (``top_k``,
``min_p``, ``repeat_penalty``, ``top_n_sigma``, ...) are accepted under the same names: every
``SamplingParams`` field its metadata marks as a request field, checked as the metadata says.
``speculative`` (minfer's own) sets the request's speculative decoding: ``"off"``, ``"lookup"``,
``"draft"`` or ``{"mode": ..., "draft_max": K, ...}`` (:class:`SpeculativeSettings` fields).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from minfer.errors import BadRequestError
from minfer.runtime.chat import (
    REASONING_FORMATS,
    ChatOptions,
    check_json_schema,
    check_messages,
    parse_tool_choice,
    parse_tools,
)
from minfer.runtime.sampling.params import PARAMS
from minfer.runtime.speculative import SpeculativeSettings
from minfer.runtime.speculative import resolve as resolve_speculative
from minfer.runtime.vision import ImageInput, extract_images
from minfer.server.errors import ApiError
from minfer.server.json_body import INT64

MAX_N = 16
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16


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
    # llama-server's post_sampling_probs: the log-probabilities reported are the sampler chain's (answered as
    # probabilities, "prob" / "top_probs"), not the model's
    post_sampling_probs: bool = False
    return_progress: bool = False  # llama-server's: a stream sends prompt_progress chunks before the tokens
    speculative: Any = None  # None: the server's; a mode name or an object of SpeculativeSettings fields
    lora: list[dict[str, Any]] | None = None  # llama-server's [{"id", "scale"}]; None: the server's default scales
    # logit_bias entries given as text: each of the text's tokens gets the bias (-inf: banned), once the route
    # tokenizes them (resolve_text_bias)
    logit_bias_text: list[tuple[str, float]] = field(default_factory=list)

    def resolve_text_bias(self, tokenize: Callable[[str], list[int]]) -> None:
        """Move the text entries of ``logit_bias`` into ``sampling["logit_bias"]``, by their tokens (llama-server
        tokenizes such a key without special tokens and biases every token of it)."""
        if not self.logit_bias_text:
            return
        bias = dict(self.sampling.get("logit_bias", {}))
        for text, value in self.logit_bias_text:
            for token in tokenize(text):
                bias[token] = value
        self.sampling["logit_bias"] = bias
        self.logit_bias_text = []


@dataclass
class ChatRequest:
    """A chat request: checked messages (see :func:`minfer.runtime.chat.check_messages`), its sampling and
    output settings, and what it asks of the chat turn (tools, tool choice, template variables)."""

    messages: list[dict[str, Any]]
    params: GenerationParams
    options: ChatOptions = field(default_factory=ChatOptions)
    # the images of the messages, in order: each one's place in a message's text is a MEDIA_MARKER
    images: list[ImageInput] = field(default_factory=list)
    # continue_final_message: the text of the last assistant message, which the reply continues (not repeats)
    prefill: str = ""


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
    bias_text: list[tuple[str, float]] = []
    if bias is not None:
        sampling["logit_bias"], bias_text = _logit_bias(bias)

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
    speculative = r.get("speculative")
    if speculative is not None:
        try:  # the fields checked here; the server's own settings fill in the rest when it is submitted
            resolve_speculative(speculative, SpeculativeSettings(), "'speculative'")
        except BadRequestError as e:
            raise ApiError(str(e), param="speculative") from None
    return GenerationParams(model, max_tokens, n, stream, include_usage, stop, seed, sampling, logprobs, grammar,
                            json_schema, timings=r.boolean("timings_per_token"),
                            post_sampling_probs=r.boolean("post_sampling_probs"),
                            return_progress=r.boolean("return_progress"), speculative=speculative,
                            lora=_lora(r.get("lora")), logit_bias_text=bias_text)


def _lora(value: Any) -> list[dict[str, Any]] | None:
    """llama-server's per-request adapters, ``[{"id": 0, "scale": 0.5}]``, checked for shape here (the ids against
    the loaded adapters when the request is submitted)."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise ApiError(f"'lora' must be a list of {{\"id\": ..., \"scale\": ...}}, got {value!r:.60}", param="lora")
    for i, item in enumerate(value):
        ok = isinstance(item, Mapping) and set(item) <= {"id", "scale"} and "id" in item and "scale" in item
        if not ok or isinstance(item["id"], bool) or not isinstance(item["id"], int) or \
                isinstance(item["scale"], bool) or not isinstance(item["scale"], int | float) or \
                not math.isfinite(item["scale"]):
            raise ApiError(f"'lora[{i}]' must be {{\"id\": <adapter id>, \"scale\": <finite number>}}, got "
                           f"{item!r:.60}", param="lora")
    return value


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


def _logit_bias(bias: Any) -> tuple[dict[int, float], list[tuple[str, float]]]:
    """``logit_bias`` as OpenAI writes it (``{"15043": -100}``) or as llama-server also takes it: text keys
    (``{"hello": -100}``), a list of ``[token id or text, bias]`` pairs, and ``false`` for a bias that bans the
    token. Returns the biases by token id and the ones by text (tokenized by the route); a bad entry is a 400
    (llama-server skips it silently)."""
    if isinstance(bias, Mapping):
        pairs = list(bias.items())
    elif isinstance(bias, list):
        pairs = []
        for i, pair in enumerate(bias):
            if not isinstance(pair, list) or len(pair) != 2:
                raise ApiError(f"'logit_bias[{i}]' must be a [token, bias] pair, got {_short_text(pair)}",
                               param="logit_bias")
            pairs.append((pair[0], pair[1]))
    else:
        raise ApiError("'logit_bias' must be an object mapping tokens to biases or a list of [token, bias] pairs",
                       param="logit_bias")
    by_id: dict[int, float] = {}
    by_text: list[tuple[str, float]] = []
    for key, value in pairs:
        if value is False:
            amount = -math.inf  # llama-server's ban
        elif isinstance(value, bool) or not isinstance(value, int | float) or not -100 <= value <= 100:
            raise ApiError(f"'logit_bias' values must be numbers in [-100, 100] or false, got {value!r} for "
                           f"token {_short_text(key)}", param="logit_bias")
        else:
            amount = float(value)
        token = _token_key(key)
        if token is not None:
            by_id[token] = amount
        elif isinstance(key, str) and key:
            by_text.append((key, amount))
        else:
            raise ApiError(f"'logit_bias' keys must be token ids or text, got {_short_text(key)}", param="logit_bias")
    return by_id, by_text


def _token_key(key: Any) -> int | None:
    """A token id given as an integer or as a string of digits; None for text. A negative or huge id is a 400."""
    if isinstance(key, bool):
        return None
    if isinstance(key, int):
        token = key
    elif isinstance(key, str) and key.strip().lstrip("+-").isdigit():
        token = int(key)
    else:
        return None
    if not 0 <= token < INT64 // 2:
        raise ApiError(f"'logit_bias' keys must be token ids, got {_short_text(key)}", param="logit_bias")
    return token


def _short_text(key: Any) -> str:
    text = repr(key)
    return text if len(text) <= 40 else text[:37] + "..."


def _response_format(fmt: Any) -> Any:
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping) or "type" not in fmt:
        raise ApiError("'response_format' must be an object with a 'type'", param="response_format")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        # llama.cpp's server also takes {"type": "json_object", "schema": {...}}
        schema = fmt.get("schema")
        if schema is None:
            return True
        _check_schema(schema, "response_format.schema")
        return dict(schema) or True
    if kind == "json_schema" and fmt.get("json_schema") is None and fmt.get("schema") is not None:
        # the schema directly under response_format (llama-server's clients send it so)
        _check_schema(fmt["schema"], "response_format.schema")
        return dict(fmt["schema"]) or True
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("schema", {}), Mapping):
            raise ApiError("'response_format.json_schema' must be an object with a 'schema' object",
                           param="response_format.json_schema")
        schema = spec.get("schema") or {}
        _check_schema(schema, "response_format.json_schema.schema")
        return dict(schema) or True
    raise ApiError(f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                   param="response_format.type")


def _check_schema(schema: Any, param: str) -> None:
    try:
        check_json_schema(schema, f"'{param}'")
    except BadRequestError as e:
        raise ApiError(str(e), param=param) from None


def parse_chat(body: Any) -> ChatRequest:
    r = _Reader(_check_body(body))
    messages = r.get("messages")
    if messages is None:
        raise ApiError("'messages' is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' must be a non-empty list of messages", param="messages")
    try:
        messages, images = extract_images(messages, allow_paths=False)  # (never a file of the server's)
        out = check_messages(messages)
    except BadRequestError as e:
        raise ApiError(str(e), param=_field_of(str(e))) from None
    if r.body.get("functions"):
        raise ApiError("'functions' is not supported by this server (use 'tools')", param="functions")
    out, prefill = _continuation(r, out)
    return ChatRequest(out, _generation_params(r, None, chat=True), chat_options(r.body), images, prefill)


def _continuation(r: _Reader, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """``continue_final_message`` / ``add_generation_prompt`` (vLLM's and llama-server's fields): the reply
    continues the last assistant message, which then needs ``add_generation_prompt`` false (both true is
    llama-server's 400). The messages before it are rendered with the assistant turn opened, its text after."""
    cont, gen = r.boolean("continue_final_message"), r.boolean("add_generation_prompt", True)
    if cont and gen:
        raise ApiError("Cannot set both add_generation_prompt and continue_final_message to true.",
                       param="continue_final_message")
    if not cont and not gen:
        raise ApiError("'add_generation_prompt': false is supported only with 'continue_final_message': true "
                       "(this server always opens the assistant's turn)", param="add_generation_prompt")
    if not cont:
        return messages, ""
    last = messages[-1]
    if last["role"] != "assistant" or not isinstance(last.get("content"), str) or last.get("tool_calls"):
        raise ApiError("'continue_final_message' needs a last message from the assistant with text content "
                       "(and no tool calls) to continue", param="continue_final_message")
    return messages[:-1], last["content"]


def chat_options(body: Mapping[str, Any]) -> ChatOptions:
    """``tools``, ``tool_choice``, ``parallel_tool_calls``, ``chat_template_kwargs`` and
    ``reasoning_format`` of a request body (absent: the server's default reasoning format)."""
    try:
        tools = parse_tools(body.get("tools"))
    except BadRequestError as e:
        raise ApiError(str(e), param="tools") from None
    try:
        choice = parse_tool_choice(body.get("tool_choice"), tools)
    except BadRequestError as e:
        raise ApiError(str(e), param="tool_choice") from None
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise ApiError(f"'parallel_tool_calls' must be true or false, got {parallel!r}", param="parallel_tool_calls")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise ApiError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    reasoning = body.get("reasoning_format")
    if reasoning is not None and reasoning not in REASONING_FORMATS:
        raise ApiError(f"'reasoning_format' must be one of {', '.join(REASONING_FORMATS)}, got {reasoning!r}",
                       param="reasoning_format")
    return ChatOptions(tools, choice, parallel, dict(kwargs), reasoning)


def _field_of(message: str) -> str | None:
    """The field a runtime message starts with ("messages[2].content must be ..." -> "messages[2].content")."""
    head = message.split(" ", 1)[0].rstrip(":")
    return head if head.startswith("messages") else "messages"


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
