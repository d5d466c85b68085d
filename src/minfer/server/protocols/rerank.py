"""The reranking request bodies of ``/v1/rerank``, ``/rerank``, ``/reranking`` and ``/v1/reranking``: llama-server's
and Jina's (``query``, ``documents``, ``top_n``), Cohere's (the same, with ``return_documents`` and documents that
may be ``{"text": ...}`` objects) and Hugging Face TEI's (``query``, ``texts``, ``return_text``: answered as a bare
list with ``score``), checked field by field (an :class:`~minfer.server.errors.ApiError` naming the field)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from minfer.server.errors import ApiError


@dataclass
class RerankRequest:
    query: str
    documents: list[str]
    top_n: int
    return_documents: bool
    tei: bool  # TEI's shape (``texts`` in, a list of {index, score[, text]} out)
    model: str | None
    truncate: bool


def _flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(f"'{name}' must be true or false, got {value!r:.60}", param=name)
    return value


def parse_rerank(body: Any) -> RerankRequest:
    if not isinstance(body, Mapping):
        raise ApiError(f"the request body must be a JSON object, got {type(body).__name__}")
    query = body.get("query")
    if not isinstance(query, str):
        raise ApiError("'query' must be provided as a string" if query is None else
                       f"'query' must be a string, got {type(query).__name__}", param="query")
    tei = "texts" in body and "documents" not in body
    field = "texts" if tei else "documents"
    docs = body.get(field)
    if not isinstance(docs, list) or not docs:
        raise ApiError(f"'{field}' must be a non-empty array of strings", param=field)
    documents: list[str] = []
    for k, d in enumerate(docs):
        if isinstance(d, Mapping) and not tei:  # Cohere's and Jina's {"text": ...}
            d = d.get("text")
        if not isinstance(d, str):
            raise ApiError(f"'{field}[{k}]' must be a string" + ("" if tei else " or an object with a string 'text'")
                           + f", got {type(d).__name__}", param=field)
        documents.append(d)
    top_n = body.get("top_n")
    if top_n is None:
        top_n = len(documents)
    elif isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1:
        raise ApiError(f"'top_n' must be a positive integer, got {top_n!r:.60}", param="top_n")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(f"'model' must be a string, got {model!r:.60}", param="model")
    return RerankRequest(query, documents, min(top_n, len(documents)),
                         _flag(body, "return_text" if tei else "return_documents", False), tei, model,
                         _flag(body, "truncate", False))
