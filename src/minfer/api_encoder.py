"""Encoder models in the Python API: what :func:`minfer.load` returns for an embedding model or a cross-encoder
reranker (BERT folders, see :mod:`minfer.models.bert`), in place of a generating :class:`~minfer.api.Model`.

``Encoder.embed`` follows the folder's sentence-transformers modules (pooling, ``Normalize``, ``max_seq_length``:
:mod:`minfer.formats.sentence_config`); ``Encoder.rerank`` scores (query, document) pairs with the
classification head, as llama-server's ``/rerank`` does (the raw score, best first).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from minfer.api_setup import default_threads
from minfer.backends.cpu.backend import CPUBackend
from minfer.errors import BadRequestError
from minfer.graph.plan import Plan, Step
from minfer.models.bert import BertModel, EncoderHParams
from minfer.runtime.encoder import EncoderRunner
from minfer.runtime.pooling import ENCODER_POOLINGS

# a generating Model's API, which an Encoder refuses by name
GENERATING = frozenset({"generate", "stream", "complete", "chat", "conversation", "perplexity", "logits",
                        "trace_forward", "plan_chat", "render_chat", "infill_prompt", "sampler", "engine", "kv",
                        "chat_template", "transformer", "n_ctx"})
Texts = str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]]


class Encoder:
    """A loaded encoder: its tokenizer, sentence-transformers configuration, backend and runner."""

    def __init__(self, path: str | os.PathLike[str], threads: int | None = None, kernels: str | None = None,
                 max_tokens: int = 2048) -> None:
        if threads is None:
            threads = default_threads()
        if not isinstance(threads, int) or threads < 1:
            raise BadRequestError(f"threads must be a positive integer, got {threads!r}")
        self.model = BertModel.open(path)
        self.path: Path = self.model.path
        self.threads = threads
        self.config = self.model.sentence_config()
        self.tokenizer = self.model.load_tokenizer(self.config.max_seq_length)
        self.backend = CPUBackend(threads=threads, kernels=kernels)
        self.runner = EncoderRunner(self.model, self.backend, max_tokens=max_tokens)
        self.runner.warm_up()

    @property
    def hparams(self) -> EncoderHParams:
        return self.model.hparams

    @property
    def n_embd(self) -> int:
        return self.model.hparams.n_embd

    @property
    def pooling(self) -> str:
        """The pooling embeddings get by default: the folder's ``1_Pooling`` module, else ``mean``."""
        return self.config.pooling

    @property
    def max_length(self) -> int:
        """The longest input in tokens, the special ones included (``max_seq_length``)."""
        return self.config.max_seq_length

    @property
    def can_rerank(self) -> bool:
        return self.model.has_head

    def __getattr__(self, name: str) -> Any:
        # what a generating Model has (generate, chat, stream, ...) is one clear error here, not an AttributeError
        if not name.startswith("_") and name in GENERATING:
            raise BadRequestError(f"{self.path} is an encoder model: it embeds and reranks, it cannot {name} "
                                  "(`minfer embed`, Encoder.embed, /v1/embeddings, /v1/rerank)")
        raise AttributeError(name)

    def tokenize(self, text: str, pair: str | None = None) -> list[int]:
        return self.tokenizer.encode(text, pair, truncate=True).ids

    def embed_inputs(self, texts: Texts, truncate: bool = False) -> tuple[list[list[int]], int]:
        """Token ids of each input (a string, a list of strings, a list of token ids or a list of such lists),
        and how many inputs were cut at :attr:`max_length` (only with ``truncate``; else a longer input is a
        :class:`BadRequestError` naming it)."""
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, Sequence) or len(texts) == 0:
            raise BadRequestError("input must be a non-empty string, list of strings or list of token ids")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in texts):
            texts = [list(texts)]  # type: ignore[arg-type]
        out: list[list[int]] = []
        cut = 0
        for k, t in enumerate(texts):
            if isinstance(t, str):
                enc = self.tokenizer.encode(t, truncate=truncate, what=f"input[{k}]")
                out.append(enc.ids)
                cut += enc.truncated > 0
            elif isinstance(t, Sequence) and t and all(isinstance(i, int) and not isinstance(i, bool) for i in t):
                ids = list(t)
                if len(ids) > self.max_length:
                    if not truncate:
                        raise BadRequestError(f"input[{k}] is {len(ids)} tokens, longer than the model's "
                                              f"{self.max_length}; shorten it or ask for truncate: true")
                    ids, cut = ids[:self.max_length], cut + 1
                out.append(ids)
            else:
                raise BadRequestError(f"input[{k}] must be a non-empty string or a non-empty list of token ids")
        return out, cut

    def embed(self, texts: Texts, pooling: str | None = None, normalize: bool | None = None,
              truncate: bool = False) -> np.ndarray | list[np.ndarray]:
        """Embeddings ``[n_inputs, n_embd]`` float32, as sentence-transformers' ``encode`` gives them (the
        folder's pooling and ``Normalize``, unless ``pooling`` / ``normalize`` say otherwise).
        ``pooling="none"``: a list of ``[n_tokens, n_embd]`` arrays, one vector per token."""
        pooling = self.pooling if pooling is None else pooling
        if pooling not in ENCODER_POOLINGS:
            raise BadRequestError(f"pooling must be one of {', '.join(ENCODER_POOLINGS)}, got {pooling!r}")
        normalize = self.config.normalize if normalize is None else bool(normalize)
        ids, _ = self.embed_inputs(texts, truncate)
        vectors = self.runner.embed(ids, pooling, normalize)
        return vectors if pooling == "none" else np.stack(vectors)

    def rerank(self, query: str, documents: Sequence[str], top_n: int | None = None,
               truncate: bool = False) -> list[dict[str, Any]]:
        """``[{"index", "relevance_score"}, ...]``: each document's score against ``query`` from the
        classification head (its raw output, as llama-server's), best first, the ``top_n`` best."""
        if not self.can_rerank:
            raise BadRequestError(f"{self.path} has no classification head: it cannot rerank (load a "
                                  "cross-encoder, e.g. a *ForSequenceClassification checkpoint)")
        if not isinstance(query, str):
            raise BadRequestError(f"query must be a string, got {type(query).__name__}")
        if isinstance(documents, str) or not isinstance(documents, Sequence) or len(documents) == 0:
            raise BadRequestError("documents must be a non-empty list of strings")
        for k, d in enumerate(documents):
            if not isinstance(d, str):
                raise BadRequestError(f"documents[{k}] must be a string, got {type(d).__name__}")
        if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
            raise BadRequestError(f"top_n must be a positive integer, got {top_n!r}")
        pairs = [self.tokenizer.encode(query, d, truncate=truncate, what=f"documents[{k}] with the query")
                 for k, d in enumerate(documents)]
        scores = self.runner.classify([p.ids for p in pairs], [p.token_types for p in pairs])[:, 0]
        order = sorted(range(len(documents)), key=lambda k: -float(scores[k]))
        return [{"index": k, "relevance_score": float(scores[k])} for k in order[:top_n]]

    def run_observed(self, ids: Sequence[int], on_step: Callable[[Step, float], None],
                     token_types: Sequence[int] | None = None) -> tuple[Plan, np.ndarray]:
        """One sequence's forward pass alone in its pass, ``on_step(step, seconds)`` seeing every node as it ran
        (the trace): the plan it ran in and the sequence's last hidden states (:meth:`EncoderRunner.observe`)."""
        return self.runner.observe(list(ids), on_step, token_types)
