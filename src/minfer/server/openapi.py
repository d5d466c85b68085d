"""The OpenAPI document FastAPI serves at ``/openapi.json``, completed with what the routes' code says
but their signatures do not: the bodies of the OpenAI endpoints (the routes read raw JSON, checked by
:mod:`minfer.server.protocols.openai`) and the error answers every route can give, each an OpenAI error body.

``tests/test_schemathesis.py`` runs schemathesis against this document: every answer must be one it
lists, with the content it lists.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERROR_STATUSES = {
    "400": "a bad request (the message and 'param' name the field)",
    "401": "a missing or wrong API key",
    "404": "no such route or model",
    "405": "the route does not take this method (see 'Allow')",
    "413": "the body is larger than --max-body-size",
    "429": "the queue is full (see 'Retry-After')",
    "503": "the server is shutting down",
}

ERROR_BODY = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
    }},
}

# ollama's routes (/api/...) answer errors in ollama's shape
OLLAMA_ERROR_BODY = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}
# ollama's routes that stream NDJSON unless the body says "stream": false
OLLAMA_STREAMS = ("/api/chat", "/api/generate", "/api/pull")

_SAMPLING = {
    "model": {"type": "string"},
    "max_tokens": {"type": "integer", "minimum": 0},
    "n": {"type": "integer", "minimum": 1, "maximum": 16},
    "stream": {"type": "boolean"},
    "stop": {"oneOf": [{"type": "string", "minLength": 1},
                       {"type": "array", "maxItems": 16, "items": {"type": "string", "minLength": 1}}]},
    "seed": {"type": "integer"},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": 0},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
}

def _nullable(props: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's optional fields take null for "not given", and so does this server."""
    return {name: {"anyOf": [schema, {"type": "null"}]} for name, schema in props.items()}


# a message's content: its text, or typed parts (OpenAI's): text, and for a vision model images as data: URLs
# (a remote http(s) URL only where the server was started with --allow-image-urls; otherwise, and for a model
# without a vision model, an image part is a 400 naming it)
_CONTENT_PART = {"oneOf": [
    {"type": "object", "required": ["type", "text"],
     "properties": {"type": {"const": "text"}, "text": {"type": "string"}}},
    {"type": "object", "required": ["type", "image_url"],
     "properties": {"type": {"const": "image_url"},
                    "image_url": {"type": "object", "required": ["url"],
                                  "properties": {"url": {"type": "string"},
                                                 "detail": {"enum": ["auto", "low", "high"]}}}}},
]}

_MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {"role": {"enum": ["system", "developer", "user", "assistant"]},
                   "content": {"oneOf": [{"type": "string"},
                                         {"type": "array", "minItems": 1, "items": _CONTENT_PART}]}},
}

REQUEST_BODIES: dict[str, dict[str, Any]] = {
    # action=save|restore: the file, a plain name under --slot-save-path (erase reads no body)
    "/slots/{id_slot}": {"type": "object", "properties": {"filename": {"type": "string", "minLength": 1}}},
    "/v1/chat/completions": {
        "type": "object", "required": ["messages"],
        "properties": {"messages": {"type": "array", "minItems": 1, "items": _MESSAGE}, **_nullable(_SAMPLING)},
    },
    "/v1/completions": {
        "type": "object", "required": ["prompt"],
        "properties": {"prompt": {"anyOf": [
            {"type": "string"},
            {"type": "array", "minItems": 1, "items": {"type": "string"}},
            {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},  # token ids
            {"type": "array", "minItems": 1, "items": {"type": "array", "minItems": 1,
                                                       "items": {"type": "integer", "minimum": 0}}},
        ]},
                       **_nullable({"echo": {"type": "boolean"}, **_SAMPLING})},
    },
}


# answers only some routes give, beyond ERROR_STATUSES
EXTRA_STATUSES: dict[str, dict[str, str]] = {"/slots": {"501": "the server was started without --slots"},
                                             "/slots/{id_slot}": {
                                                 "501": "the server was started without --slot-save-path",
                                                 "500": "the slot file could not be written or read (the disk)"},
                                             **{f"/api/{what}": {"501": "minfer keeps no model store"}
                                                for what in ("delete", "copy", "create", "push")}}

# routes whose 200 is not JSON (FastAPI documents application/json for a route returning a Response)
OK_MEDIA_TYPES: dict[str, str] = {"/metrics": "text/plain"}


def document_errors(app: FastAPI) -> None:
    """Have ``app.openapi()`` list the request bodies above and the error answers on every operation."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        schemas["Error"], schemas["OllamaError"] = ERROR_BODY, OLLAMA_ERROR_BODY
        for path, operations in schema.get("paths", {}).items():
            kind = "OllamaError" if path.startswith("/api/") else "Error"
            error = {"application/json": {"schema": {"$ref": f"#/components/schemas/{kind}"}}}
            for method, op in operations.items():
                responses = op.setdefault("responses", {})
                responses.pop("422", None)  # FastAPI's validation errors are answered as 400s
                for status, description in ERROR_STATUSES.items():
                    responses.setdefault(status, {"description": description, "content": error})
                for status, description in EXTRA_STATUSES.get(path, {}).items():
                    responses.setdefault(status, {"description": description, "content": error})
                media = OK_MEDIA_TYPES.get(path)
                if media is not None:
                    responses["200"] = {"description": "the answer", "content": {media: {"schema": {"type": "string"}}}}
                if path in OLLAMA_STREAMS:
                    responses["200"] = {"description": "the answer, or its NDJSON stream", "content": {
                        "application/json": {"schema": {"type": "object"}},
                        "application/x-ndjson": {"schema": {"type": "object"}}}}
                body = REQUEST_BODIES.get(path)
                if method == "post" and body is not None and "requestBody" not in op:
                    op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
                    ok = responses.setdefault("200", {"description": "the answer"})
                    ok["content"] = {"application/json": {"schema": {"type": "object"}},
                                     # each event a chunk object, an error object, or the closing [DONE]
                                     "text/event-stream": {"schema": {"anyOf": [{"type": "object"},
                                                                                {"type": "string"}]}}}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
