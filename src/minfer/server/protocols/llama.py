"""llama-server's native ``/completion`` and ``/infill`` bodies.

Their sampling fields already have llama-server's names here (``temperature``, ``top_k``, ``min_p``,
``repeat_penalty``, ``mirostat``, ``samplers``...), so a native body is translated into the OpenAI
completion body (``n_predict`` -> ``max_tokens``, ``n_probs`` -> ``logprobs``, ``json_schema`` ->
``response_format``, ``n_cmpl`` -> ``n``) and checked by the same parser; an error names the native field.
The native fields this server cannot honour are refused by name rather than ignored.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from minfer.runtime.vision import PassImage
from minfer.server.errors import ApiError
from minfer.server.protocols.openai import GenerationParams, parse_completion

# OpenAI field the translated body has -> the native field the user wrote
_NATIVE_NAMES = {"max_tokens": "n_predict", "logprobs": "n_probs", "response_format": "json_schema",
                 "response_format.json_schema": "json_schema", "n": "n_cmpl", "prompt": "prompt"}
# native fields with no counterpart here: refused unless they hold their default
_UNSUPPORTED_DEFAULTS: dict[str, Any] = {
    "dynatemp_range": 0.0, "n_indent": 0, "t_max_predict_ms": 0,
    "n_discard": 0, "n_cache_reuse": 0, "response_fields": [],
}


@dataclass
class NativeRequest:
    prompts: list[list[int]]
    params: GenerationParams
    ignore_eos: bool
    cache_prompt: bool
    return_tokens: bool
    timings_per_token: bool
    id_slot: int
    images: list[PassImage] = field(default_factory=list)  # where multimodal_data's images go in prompts[0]


@dataclass
class InfillRequest:
    prefix: str
    suffix: str
    prompt: str
    extra: list[tuple[str, str]]


def _is_token(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def native_prompts(prompt: Any, tokenize: Callable[[str, bool], list[int]]) -> list[list[int]]:
    """``prompt`` as llama-server takes it: a string, token ids, tokens and strings mixed, an object
    ``{"prompt_string": ...}``, or a list of those (several prompts). ``tokenize(text, add_special)``: BOS
    goes before a prompt that starts with text."""

    def one(p: Any, i: int | None) -> list[int] | None:
        where = "'prompt'" if i is None else f"'prompt[{i}]'"
        if isinstance(p, Mapping) and "prompt_string" in p:
            # llama-server's {"prompt_string": ..., "multimodal_data": [...]}; its images are placed by the
            # route (llama_native.multimodal_prompt) before this sees it, so here it is text only
            if p.get("multimodal_data"):
                raise ApiError(f"{where}: images in a prompt object go with one prompt, not several",
                               param="prompt")
            text = p["prompt_string"]
            if not isinstance(text, str) and not (isinstance(text, list) and text):
                raise ApiError(f"{where}.prompt_string must be a string or a list of token ids and strings, got "
                               f"{text!r:.60}", param="prompt")
            return one(text, 0 if i is None else i)
        if isinstance(p, str):
            return tokenize(p, True)
        if isinstance(p, list) and p and all(_is_token(x) or isinstance(x, str) for x in p) and (
                i is not None or any(_is_token(x) for x in p)):  # a list of strings only: several prompts
            ids: list[int] = []
            for k, x in enumerate(p):
                ids += tokenize(x, k == 0) if isinstance(x, str) else [x]
            return ids
        if i is not None:
            raise ApiError(f"{where} must be a string or a list of token ids and strings, got {p!r:.60}",
                           param="prompt")
        return None

    if prompt is None:
        raise ApiError("'prompt' is required", param="prompt")
    single = one(prompt, None)
    if single is not None:
        prompts = [single]
    elif isinstance(prompt, list) and prompt:
        prompts = [one(p, i) or [] for i, p in enumerate(prompt)]
    else:
        raise ApiError("'prompt' must be a string, a list of token ids and strings, or a list of such prompts",
                       param="prompt")
    for i, ids in enumerate(prompts):
        if not ids:
            raise ApiError(f"prompt {i} is empty (no tokens to start from)", param="prompt")
    return prompts


def _logit_bias(bias: Any, tokenize: Callable[[str, bool], list[int]]) -> tuple[dict[str, float], set[int]]:
    """llama-server's ``[[token or text, bias or false], ...]`` (or an OpenAI-style object): the finite
    biases, and the tokens ``false`` bans."""
    if isinstance(bias, Mapping):  # {"15043": 1.0} or {"hello": -100}: a key of digits is a token id
        pairs: list[Any] = [[int(k) if isinstance(k, str) and k.isdigit() else k, v] for k, v in bias.items()]
    elif isinstance(bias, list):
        pairs = bias
    else:
        raise ApiError("'logit_bias' must be a list of [token, bias] pairs or an object", param="logit_bias")
    out: dict[str, float] = {}
    banned: set[int] = set()
    for pair in pairs:
        if not isinstance(pair, list) or len(pair) != 2:
            raise ApiError(f"'logit_bias' entries must be [token, bias] pairs, got {pair!r:.60}", param="logit_bias")
        key, value = pair
        ids = tokenize(key, False) if isinstance(key, str) and key else [key] if _is_token(key) else None
        if ids is None:
            raise ApiError(f"'logit_bias' tokens must be ids or text, got {key!r:.60}", param="logit_bias")
        for t in ids:
            if value is False:
                banned.add(t)
            else:
                out[str(t)] = value
    return out, banned


def parse_native_completion(body: Any, tokenize: Callable[[str, bool], list[int]],
                            prompts: list[list[int]] | None = None) -> NativeRequest:
    """``prompts``: already made (``/infill``); else from the body's ``prompt``."""
    if not isinstance(body, Mapping):
        raise ApiError(f"the request body must be a JSON object, got {type(body).__name__}")
    for name, default in _UNSUPPORTED_DEFAULTS.items():
        if body.get(name) not in (None, default):
            raise ApiError(f"'{name}' is not supported by this server", param=name)
    if prompts is None:
        prompts = native_prompts(body.get("prompt"), tokenize)
    oai: dict[str, Any] = {k: v for k, v in body.items() if k not in ("prompt", "n_predict", "n_probs", "json_schema",
                                                                    "logit_bias", "seed", "n_cmpl", "max_tokens")}
    oai["prompt"] = prompts
    n_predict = body.get("n_predict", body.get("max_tokens"))
    if n_predict is not None and n_predict != -1:
        oai["max_tokens"] = n_predict
    if body.get("n_probs"):
        oai["logprobs"] = body["n_probs"]
    if body.get("n_cmpl") is not None:
        oai["n"] = body["n_cmpl"]
    schema = body.get("json_schema")
    if schema is not None:
        if not isinstance(schema, Mapping):
            raise ApiError("'json_schema' must be a JSON Schema object", param="json_schema")
        oai["response_format"] = ({"type": "json_schema", "json_schema": {"schema": dict(schema)}} if schema
                                  else {"type": "json_object"})
    seed = body.get("seed")
    if seed is not None and seed not in (-1, 0xFFFFFFFF):  # llama-server: -1 (or its u32 form) is a random seed
        oai["seed"] = seed
    banned: set[int] = set()
    if body.get("logit_bias") is not None:
        oai["logit_bias"], banned = _logit_bias(body["logit_bias"], tokenize)
    try:
        req = parse_completion(oai)
    except ApiError as e:
        if e.param in _NATIVE_NAMES:
            native = _NATIVE_NAMES[e.param]
            e.message = e.message.replace(f"'{e.param}'", f"'{native}'")
            e.args = (e.message,)
            e.param = native
        raise
    params = req.params
    if n_predict is None or n_predict == -1:
        params.max_tokens = None  # llama-server's default: until the end of generation or of the slot
    if banned:
        params.sampling["logit_bias"] = {**params.sampling.get("logit_bias", {}), **dict.fromkeys(banned, -math.inf)}

    def flag(name: str, default: bool) -> bool:
        v = body.get(name, default)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise ApiError(f"'{name}' must be true or false, got {v!r}", param=name)
        return v

    id_slot = body.get("id_slot", -1)
    if not _is_token(id_slot) or id_slot != -1:
        raise ApiError(f"'id_slot' {id_slot!r}: this server picks the slot (the one sharing the longest cached "
                       "prefix); send -1 or leave it out", param="id_slot")
    return NativeRequest(prompts, params, flag("ignore_eos", False), flag("cache_prompt", True),
                         flag("return_tokens", False), flag("timings_per_token", False), id_slot)


def parse_infill(body: Any) -> InfillRequest:
    if not isinstance(body, Mapping):
        raise ApiError(f"the request body must be a JSON object, got {type(body).__name__}")

    def text(name: str) -> str:
        v = body.get(name, "")
        if v is None:
            return ""
        if not isinstance(v, str):
            raise ApiError(f"'{name}' must be a string, got {v!r:.60}", param=name)
        return v

    extra_raw = body.get("input_extra") or []
    if not isinstance(extra_raw, list):
        raise ApiError("'input_extra' must be a list of {filename, text} objects", param="input_extra")
    extra = []
    for i, chunk in enumerate(extra_raw):
        if not isinstance(chunk, Mapping) or not isinstance(chunk.get("text"), str) or not isinstance(
                chunk.get("filename", ""), str):
            raise ApiError(f"'input_extra[{i}]' must be an object with a string 'text' (and 'filename')",
                           param="input_extra")
        extra.append((chunk.get("filename", ""), chunk["text"]))
    return InfillRequest(text("input_prefix"), text("input_suffix"), text("prompt"), extra)
