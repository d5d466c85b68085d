"""The routes a deployment probes: ``/health``, ``/metrics`` (Prometheus), ``/v1/models``."""

from __future__ import annotations

import math
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from minfer.formats.file_types import ftype_name, vocab_type
from minfer.server.context import ServerContext
from minfer.server.errors import ApiError


def metrics_disabled() -> JSONResponse:
    """llama-server's answer to ``/metrics`` when it was started without ``--metrics`` (minfer: ``--no-metrics``),
    its body word for word (its error bodies carry the HTTP status as ``code``)."""
    return JSONResponse({"error": {"code": 501, "type": "not_supported_error",
                                   "message": "This server does not support metrics endpoint. Start it with "
                                   "`--metrics`"}}, status_code=501)


def register(app: FastAPI, ctx: ServerContext) -> None:
    @app.get("/health")
    async def health() -> dict[str, Any]:
        running, waiting = ctx.engine_loop.load()
        kv = ctx.engine_loop.kv
        return {"status": "ok", "slots_running": running, "slots_waiting": waiting,
                "kv_blocks_used": kv.blocks_in_use, "kv_blocks_shared": kv.blocks_shared,
                "kv_blocks_total": kv.n_blocks - 1, "preempted": ctx.engine_loop.engine.scheduler.n_preempted}

    @app.get("/metrics")
    async def prometheus() -> Response:
        if not ctx.config.metrics_endpoint:
            return metrics_disabled()
        return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8",
                        headers={"Process-Start-Time-Unix": str(int(ctx.metrics.start_time))})

    transformer = ctx.model.transformer
    n_params = sum(int(math.prod(t.shape)) for t in transformer.tensors.values())
    ftype = model_ftype(ctx)

    def model_card() -> dict[str, Any]:
        hp = ctx.model.hparams
        # llama-server's meta (n_vocab, n_ctx_train, n_embd, n_params, size) and this server's own
        # llama-server's capabilities ("multimodal": the model takes images)
        capabilities = ["completion", *(["multimodal"] if ctx.takes_images else [])]
        return {"id": ctx.config.model_id, "object": "model", "created": ctx.created, "owned_by": "minfer",
                "capabilities": capabilities,
                # llama-server's --alias names and --tags, each a sorted list ([] without the flag)
                "aliases": list(ctx.config.aliases or (ctx.config.model_id,)), "tags": list(ctx.config.tags),
                "meta": {"architecture": hp.arch, "vocab_type": vocab_type(ctx.model.tokenizer.model),
                         "ftype": ftype, "n_vocab": hp.n_vocab, "n_ctx_train": hp.n_ctx_train,
                         "n_embd": hp.n_embd, "n_ctx": ctx.engine_loop.slot_context, "n_params": n_params,
                         "size": transformer.weight_bytes,
                         "n_ctx_per_sequence": ctx.engine_loop.slot_context, "parallel": ctx.engine_loop.n_slots}}

    def listing() -> dict[str, Any]:
        """llama-server's ``models`` list beside OpenAI's ``data`` (ollama's listing shape, whose fields llama-server
        leaves empty where minfer fills them in: the family and the file type)."""
        hp, card = ctx.model.hparams, model_card()
        return {"name": card["id"], "model": card["id"], "modified_at": "", "size": "", "digest": "", "type": "model",
                "description": "", "tags": list(ctx.config.tags) or [""], "capabilities": card["capabilities"],
                "parameters": "", "details": {"parent_model": "",
                                              "format": "gguf" if ctx.model.path.is_file() else "safetensors",
                                              "family": hp.arch, "families": [hp.arch], "parameter_size": "",
                                              "quantization_level": ftype}}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"models": [listing()], "object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str) -> dict[str, Any]:
        if model_id not in ctx.names:
            raise ApiError(f"the model {model_id!r} does not exist (this server has {ctx.config.model_id!r})",
                           status=404, type="not_found_error", param="model", code="model_not_found")
        return model_card()


def model_ftype(ctx: ServerContext) -> str:
    """llama.cpp's name of the served file's type (``Q4_K - Medium``), as ``/props`` and ``/v1/models`` show it."""
    transformer = ctx.model.transformer
    matrices = [(t.ggml_type.name, int(t.nbytes)) for t in transformer.tensors.values()
                if len(t.shape) >= 2 and hasattr(t, "ggml_type")]
    return ftype_name(transformer.metadata, matrices)
