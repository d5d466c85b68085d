"""ollama's API (``/api/chat``, ``/api/generate``, ``/api/embed``, ...) translated to and from what the engine runs.

The request side checks every ollama field, then writes the OpenAI chat-completions body that
:func:`~minfer.server.protocols.openai.parse_chat` checks again (so a chat turn runs exactly as OpenAI's does);
an error found there is renamed to the field the caller sent (``options.temperature``, ``messages[1].tool_calls``).

- ``options`` maps onto the sampler: ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``typical_p``,
  ``repeat_penalty``, ``repeat_last_n``, ``presence_penalty``, ``frequency_penalty``, ``seed``, ``stop``,
  ``mirostat``, ``mirostat_tau``, ``mirostat_eta``; ``num_predict`` is the token limit (-1 and -2: none, the
  context bounds it); ``num_ctx`` must fit the server's context per sequence (one model, loaded once, serves
  every request). The options that place or shape the model in ollama's runner (``num_gpu``, ``num_thread``,
  ``use_mmap``, ...) are accepted and do nothing here; any other name, or a value of the wrong type, is a 400
  naming it.
- ``format``: ``"json"`` (any JSON object) or a JSON schema, as ``response_format``.
- ``think``: true / false, or ``"low"`` / ``"medium"`` / ``"high"``: the reply's reasoning goes to ``thinking``
  and the template's ``enable_thinking`` (and ``reasoning_effort``) variables are set.
- ``tool_choice`` and ``parallel_tool_calls`` (OpenAI's values) are minfer's own additions: ollama has no way to
  ask for a call.
- ``images``: base64 images, put before their message's text (``/api/chat``) or the prompt (``/api/generate``,
  not with ``raw``), as ollama renders them; a model without vision answers a 400 naming the field.
- ``keep_alive``: a number of seconds or a duration such as ``"5m"`` (negative: for ever). A server that can
  unload its models (several models, or one with ``--keep-alive`` or ``--sleep-idle-seconds``) unloads a model
  once idle that long, and at once for an empty prompt or empty messages with ``keep_alive`` 0 (ollama's unload
  request, ``done_reason`` ``"unload"``). A one-model server started without either keeps its model loaded for
  its life: there the unload request is a 400 saying how to start it, and other requests' ``keep_alive`` change
  nothing.

The answer side writes ollama's objects: ``created_at`` in RFC 3339, the durations in nanoseconds, and
``done_reason``.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from minfer.runtime.chat import ChatMessage
from minfer.runtime.vision import ImageInput
from minfer.server.errors import ApiError
from minfer.server.protocols.images import MEDIA_MARKER, image_from_base64
from minfer.server.protocols.openai import ChatRequest, CompletionRequest, parse_completion
from minfer.server.translated_chat import parse_translated_chat

# ollama option -> the OpenAI / llama-server body field it becomes
SAMPLING_OPTIONS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                    "typical_p": "typical_p", "repeat_penalty": "repeat_penalty", "repeat_last_n": "repeat_last_n",
                    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty", "seed": "seed",
                    "stop": "stop", "mirostat": "mirostat", "mirostat_tau": "mirostat_tau",
                    "mirostat_eta": "mirostat_eta", "num_predict": "max_tokens"}
# ollama's options that place or shape the model in its runner (or that it has retired): accepted, no effect here
RUNNER_OPTIONS = {"numa": bool, "num_batch": int, "num_gpu": int, "main_gpu": int, "low_vram": bool, "f16_kv": bool,
                  "logits_all": bool, "vocab_only": bool, "use_mmap": bool, "use_mlock": bool, "embedding_only": bool,
                  "num_thread": int, "num_keep": int, "tfs_z": float, "penalize_newline": bool}
_INT_OPTIONS = {"top_k", "repeat_last_n", "seed", "mirostat", "num_predict", "num_ctx"}
_DURATION = re.compile(r"(-?\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+")
_DURATION_PART = re.compile(r"(-?\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def _err(message: str, param: str) -> ApiError:
    return ApiError(f"{param}: {message}", param=param)


def now_rfc3339() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def nanoseconds(seconds: float) -> int:
    return int(round(seconds * 1e9))


@dataclass
class OllamaRequest:
    """A checked ``/api/chat`` or ``/api/generate`` body: what the engine runs, and what the answer echoes."""

    model: str
    stream: bool
    received: float  # time.perf_counter() when it arrived: total_duration counts from here
    chat: ChatRequest | None = None  # /api/chat, and /api/generate without raw (the prompt as one user turn)
    completion: CompletionRequest | None = None  # /api/generate with raw: the prompt as it is
    want_context: bool = False  # /api/generate answers with "context": the prompt's and the reply's token ids


def _model(body: Mapping[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _err("is required (a model name)", "model")
    return model


def _served(model: str) -> str:
    """The name the OpenAI side checks: ollama's ``NAME:latest`` is ``NAME``."""
    return model.removesuffix(":latest")


def _stream(body: Mapping[str, Any]) -> bool:
    stream = body.get("stream", True)  # ollama streams unless told not to
    if stream is None:
        return True
    if not isinstance(stream, bool):
        raise _err(f"must be true or false, got {stream!r}", "stream")
    return stream


def keep_alive_seconds(value: Any) -> float | None:
    """ollama's ``keep_alive`` in seconds: a number of seconds or a Go duration (``"5m"``, ``"1h30m"``); a negative
    one is for ever (``math.inf``); None when not given. A 400 naming the field for anything else."""
    if value is None:
        return None
    seconds: float | None = None
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        seconds = float(value)
    elif isinstance(value, str) and re.fullmatch(r"-?\d+", value.strip()):
        seconds = float(value.strip())
    elif isinstance(value, str) and _DURATION.fullmatch(value.strip()):
        seconds = sum(float(n) * _UNIT_SECONDS[u] for n, u in _DURATION_PART.findall(value.strip()))
    if seconds is None:
        raise _err(f"must be a number of seconds or a duration such as \"5m\", got {value!r}", "keep_alive")
    return math.inf if seconds < 0 else seconds


def check_keep_alive(value: Any) -> None:
    keep_alive_seconds(value)


def load_request(path: str, body: Any) -> str | None:
    """ollama's requests that only load or unload a model, as ollama tells them: ``/api/generate`` without a
    prompt and ``/api/chat`` without messages are ``"unload"`` when their ``keep_alive`` is 0, else ``"load"``;
    None for any other request. A bad ``keep_alive`` is a 400 naming it."""
    if not isinstance(body, Mapping):
        return None
    if path == "/api/generate":
        if body.get("prompt"):
            return None
        if keep_alive_seconds(body.get("keep_alive")) == 0:
            return "unload"
        return None if body.get("raw") else "load"
    if path == "/api/chat" and not body.get("messages"):
        return "unload" if keep_alive_seconds(body.get("keep_alive")) == 0 else "load"
    return None


def load_answer(path: str, model: str, reason: str) -> dict[str, Any]:
    """The answer to a :func:`load_request`: done at once, with ``done_reason`` ``reason``."""
    done = {"model": model, "created_at": now_rfc3339()}
    if path == "/api/chat":
        return {**done, "message": {"role": "assistant", "content": ""}, "done": True, "done_reason": reason}
    return {**done, "response": "", "done": True, "done_reason": reason}


def _options(body: Mapping[str, Any], slot_context: int) -> dict[str, Any]:
    """The OpenAI body fields ``options`` sets (each checked for its type here, for its range by parse_chat)."""
    options = body.get("options")
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise _err("must be an object of model options", "options")
    out: dict[str, Any] = {}
    for name, value in options.items():
        where = f"options.{name}"
        if value is None:
            continue
        if name in RUNNER_OPTIONS:
            kind = RUNNER_OPTIONS[name]
            ok = isinstance(value, bool) if kind is bool else (
                not isinstance(value, bool) and isinstance(value, int if kind is int else int | float))
            if not ok:
                raise _err(f"must be {'true or false' if kind is bool else 'a number'}, got {value!r}", where)
            continue
        if name == "stop":
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
                raise _err(f"must be a list of strings, got {value!r}", where)
            out["stop"] = [s for s in value if s] or None
            continue
        if name != "num_ctx" and name not in SAMPLING_OPTIONS:
            raise _err(f"is not an option minfer knows (ollama's options: "
                       f"{', '.join(sorted({*SAMPLING_OPTIONS, 'num_ctx', *RUNNER_OPTIONS}))})", where)
        if isinstance(value, bool) or not isinstance(value, int | float) or (
                name in _INT_OPTIONS and not float(value).is_integer()):
            raise _err(f"must be {'an integer' if name in _INT_OPTIONS else 'a number'}, got {value!r}", where)
        if name == "num_ctx":
            if value > slot_context:
                raise _err(f"{int(value)} is more than the {slot_context} tokens per sequence this server was "
                           "started with (minfer serve --ctx-size, --parallel)", where)
            continue
        if name == "num_predict" and value < 0:
            continue  # -1 (no limit) and -2 (fill the context): the context bounds the reply
        out[SAMPLING_OPTIONS[name]] = int(value) if name in _INT_OPTIONS else value
    return out


def check_parameters(value: Any, slot_context: int) -> dict[str, Any]:
    """``/api/create``'s ``parameters`` (a variant's default ``options``), checked as ``options`` are: a copy,
    without the nulls; a 400 naming ``parameters.NAME`` for a bad one."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _err("must be an object of model options", "parameters")
    try:
        _options({"options": value}, slot_context)
    except ApiError as e:
        param = (e.param or "options").replace("options", "parameters", 1)
        raise ApiError(e.message.replace("options", "parameters", 1), param=param) from None
    return {k: v for k, v in value.items() if v is not None}


def _format(value: Any) -> dict[str, Any] | None:
    if value is None or value == "":
        return None
    if value == "json":
        return {"type": "json_object"}
    if isinstance(value, Mapping):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": dict(value)}}
    raise _err(f"must be \"json\" or a JSON schema object, got {value!r:.60}", "format")


def _think(value: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The body fields and template variables ``think`` sets."""
    if value is None:
        return {}, {}
    if isinstance(value, bool):
        return {"reasoning_format": "auto"}, {"enable_thinking": value}
    if value in ("low", "medium", "high"):
        return {"reasoning_format": "auto"}, {"enable_thinking": True, "reasoning_effort": value}
    raise _err(f"must be true, false, \"low\", \"medium\" or \"high\", got {value!r}", "think")


def _images(value: Any, where: str) -> list[ImageInput]:
    """A message's (or a prompt's) ``images``: base64 strings (a model without vision refuses them when the
    turn starts, naming the first)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise _err("must be a list of base64-encoded images", where)
    return [image_from_base64(v, f"{where}[{k}]") for k, v in enumerate(value)]


def _common(body: Mapping[str, Any], slot_context: int) -> tuple[dict[str, Any], dict[str, str]]:
    """The OpenAI fields shared by chat and generate, and the renames of their errors back to ollama's names."""
    check_keep_alive(body.get("keep_alive"))
    fields = _options(body, slot_context)
    fmt = _format(body.get("format"))
    if fmt is not None:
        fields["response_format"] = fmt
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise _err(f"must be true or false, got {logprobs!r}", "logprobs")
    if logprobs:
        fields["logprobs"] = True
        if body.get("top_logprobs") is not None:
            fields["top_logprobs"] = body["top_logprobs"]
    renames = {field: f"options.{name}" for name, field in SAMPLING_OPTIONS.items()}
    renames["response_format"] = "format"
    return fields, renames


def parse_ollama_chat(body: Any, slot_context: int) -> OllamaRequest:
    received = time.perf_counter()
    if not isinstance(body, Mapping):
        raise ApiError(f"the request body must be a JSON object, got {type(body).__name__}")
    model, stream = _model(body), _stream(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _err("must be a non-empty list of messages", "messages")
    out: list[dict[str, Any]] = []
    images: list[ImageInput] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise _err("must be an object with 'role' and 'content'", where)
        mine = _images(m.get("images"), f"{where}.images")
        msg = {k: m[k] for k in ("role", "content") if k in m}
        if m.get("content") is None and not m.get("tool_calls"):
            msg["content"] = ""  # ollama lets a message leave out its content
        if mine:  # before the message's text, as ollama puts them
            if not isinstance(msg.get("content"), str):
                raise _err("must be a string when the message has images", f"{where}.content")
            msg["content"] = MEDIA_MARKER * len(mine) + msg["content"]
            images += mine
        if isinstance(m.get("thinking"), str) and m["thinking"]:
            msg["reasoning_content"] = m["thinking"]
        if m.get("tool_calls") is not None:
            msg["tool_calls"] = m["tool_calls"]
        name = m.get("tool_name", m.get("name"))
        if m.get("role") == "tool" and name is not None:
            if not isinstance(name, str):
                raise _err(f"must be a string, got {name!r}", f"{where}.tool_name")
            msg["name"] = name
        out.append(msg)
    fields, renames = _common(body, slot_context)
    think_fields, variables = _think(body.get("think"))
    chat: dict[str, Any] = {"model": _served(model), "messages": out, "stream": stream, **fields, **think_fields}
    for name in ("tools", "tool_choice", "parallel_tool_calls"):  # the last two: minfer's own (see above)
        if body.get(name) is not None:
            chat[name] = body[name]
    if variables:
        chat["chat_template_kwargs"] = variables
    req = parse_translated_chat(chat, [f"messages[{i}]" for i in range(len(out))], schema_field="parameters",
                                messages_field="messages", renames=renames)
    req.images = images
    return OllamaRequest(model, stream, received, chat=req)


def parse_ollama_generate(body: Any, slot_context: int) -> OllamaRequest:
    received = time.perf_counter()
    if not isinstance(body, Mapping):
        raise ApiError(f"the request body must be a JSON object, got {type(body).__name__}")
    model, stream = _model(body), _stream(body)
    prompt = body.get("prompt", "")
    if prompt is None:
        prompt = ""
    if not isinstance(prompt, str):
        raise _err(f"must be a string, got {prompt!r:.60}", "prompt")
    for name in ("system", "template", "suffix"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise _err(f"must be a string, got {body[name]!r:.60}", name)
    if body.get("template"):
        raise _err("a per-request template is not supported (the model's own chat template is used)", "template")
    if body.get("suffix"):
        raise _err("fill-in-the-middle is not supported on /api/generate (use llama-server's /infill)", "suffix")
    if body.get("context"):
        raise _err("the deprecated token context of an earlier answer is not supported (send the conversation "
                   "to /api/chat)", "context")
    images = _images(body.get("images"), "images")
    raw = body.get("raw", False)
    if not isinstance(raw, bool):
        raise _err(f"must be true or false, got {raw!r}", "raw")
    fields, renames = _common(body, slot_context)
    if raw:
        if images:
            raise _err("images need the chat template, which raw leaves out (send them without raw)", "images")
        if body.get("system"):
            raise _err("a system prompt needs the chat template, which raw leaves out", "system")
        try:
            completion = parse_completion({"model": _served(model), "prompt": prompt, "stream": stream,
                                           "max_tokens": fields.pop("max_tokens", None), **_completion(fields)})
        except ApiError as e:
            raise _renamed(e, renames) from None
        return OllamaRequest(model, stream, received, completion=completion, want_context=True)
    messages = ([{"role": "system", "content": body["system"]}] if body.get("system") else []) + \
        [{"role": "user", "content": MEDIA_MARKER * len(images) + prompt}]  # the images before the text
    think_fields, variables = _think(body.get("think"))
    chat: dict[str, Any] = {"model": _served(model), "messages": messages, "stream": stream, **fields,
                            **think_fields}
    if variables:
        chat["chat_template_kwargs"] = variables
    origins = (["system"] if body.get("system") else []) + ["prompt"]
    req = parse_translated_chat(chat, origins, schema_field="parameters", messages_field="prompt", renames=renames)
    req.images = images
    return OllamaRequest(model, stream, received, chat=req, want_context=True)


def _completion(fields: dict[str, Any]) -> dict[str, Any]:
    """The chat fields as completion ones: a completion's ``logprobs`` is the count of alternatives."""
    out = dict(fields)
    if out.pop("logprobs", False):
        out["logprobs"] = out.pop("top_logprobs", 0) or 0
    return out


def _renamed(e: ApiError, renames: Mapping[str, str]) -> ApiError:
    param = e.param or ""
    for theirs, ours in renames.items():
        if param.startswith(theirs):
            return ApiError(e.message.replace(theirs, ours), status=e.status, param=param.replace(theirs, ours))
    return e


def parse_embed(body: Mapping[str, Any], n_embd: int) -> tuple[list[str], bool]:
    """``/api/embed``'s texts and ``truncate`` (true unless false, as ollama's)."""
    check_keep_alive(body.get("keep_alive"))
    texts = body.get("input")
    texts = [texts] if isinstance(texts, str) else texts
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise _err("must be a string or a non-empty list of strings", "input")
    truncate = body.get("truncate", True)
    if not isinstance(truncate, bool):
        raise _err(f"must be true or false, got {truncate!r}", "truncate")
    dims = body.get("dimensions")
    if dims is not None and dims != n_embd:
        raise _err(f"must be {n_embd} for this model (it cannot shorten vectors), got {dims!r}", "dimensions")
    return texts, truncate


def parse_embeddings_prompt(body: Mapping[str, Any]) -> str:
    """The older ``/api/embeddings``' ``prompt``."""
    check_keep_alive(body.get("keep_alive"))
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise _err("must be a string", "prompt")
    return prompt


# -- answers ----------------------------------------------------------------------------------------


def ollama_message(message: ChatMessage) -> dict[str, Any]:
    """The assistant message in ollama's shape: tool calls' arguments as objects, reasoning as ``thinking``."""
    out: dict[str, Any] = {"role": "assistant", "content": message.content or ""}
    if message.reasoning_content:
        out["thinking"] = message.reasoning_content
    if message.tool_calls:
        out["tool_calls"] = [{"function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                             for c in message.tool_calls]
    return out


def _arguments(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        return {"arguments": text}  # what the model wrote, kept rather than dropped
    return value if isinstance(value, dict) else {"value": value}


def durations(received: float, prompt_tokens: int, prompt_seconds: float, eval_tokens: int,
              eval_seconds: float) -> dict[str, Any]:
    """ollama's counts and durations (nanoseconds) of a finished answer; ``load_duration`` is 0: the model was
    loaded when the server started."""
    return {"total_duration": nanoseconds(time.perf_counter() - received), "load_duration": 0,
            "prompt_eval_count": prompt_tokens, "prompt_eval_duration": nanoseconds(prompt_seconds),
            "eval_count": eval_tokens, "eval_duration": nanoseconds(eval_seconds)}
