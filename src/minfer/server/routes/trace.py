"""The trace explorer's JSON endpoints (``/trace/api/...``): forward passes held on the server, their tensors
fetched on demand.

A run is one prompt (or a chat exchange) traced by :meth:`minfer.api.Model.trace_forward` on a plan and
cache of its own. Each run keeps its tensors within ``MINFER_TRACE_MEMORY`` bytes (default 768 MiB, see
:mod:`minfer.trace.explorer`), and the server keeps at most :data:`MAX_RUNS` runs whose memory (tensors,
plan and cache) adds up to no more than that budget: older runs let their held layers go first (captured
again when asked), then whole runs go, oldest first; the newest is always kept. So the trace memory of a
server is bounded by one budget plus the newest run's plan and cache
(``GET /trace/api/runs`` says what each run holds). Everything that touches a run
(a forward pass, a re-capture, the logit lens) runs on the engine's thread between two decode steps, one
at a time, so it never races a generation for the backend.

``POST /trace/api/runs`` ``{"prompt": str}``, ``{"messages": [...]}`` (a chat exchange, rendered with
the chat template, the answer included; a vision model's messages may hold images as the chat routes take
them, ``data:`` URLs), ``{"tokens": [ids]}`` or ``{"run": id}`` (that run's prompt and images again), optional
``"cache_type"``: the run's summary with its ``id``.
``GET /trace/api/runs/{id}``, ``.../layers/{L}/graph``, ``.../nodes/{node}?rows=a:b&cols=c:d``,
``.../layers/{L}/attention/{head}?rows=a:b``, ``.../lens?positions=a:b``; a run with images also
``.../vision`` (the vision tower's nodes) and ``.../vision/nodes/{node}?rows=a:b&cols=c:d``;
``GET /trace/api/compare?a=&b=``.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request

from minfer.api import Model
from minfer.errors import BadRequestError
from minfer.runtime.vision import ImageInput, PassImage, extract_images
from minfer.server.context import ServerContext
from minfer.server.errors import ApiError
from minfer.trace.compare import DumpRun, compare
from minfer.trace.explorer import ForwardTrace
from minfer.trace.vision_pass import VisionTrace

MAX_RUNS = 4
MAX_LENS_POSITIONS = 64
T = TypeVar("T")


@dataclass
class TraceService:
    """The runs a server holds, and where their work runs (``on_engine``: a callable's result, awaited)."""

    model: Model | None
    on_engine: Callable[[Callable[[], Any]], Awaitable[Any]]
    runs: OrderedDict[str, ForwardTrace] = field(default_factory=OrderedDict)
    dumps: dict[str, DumpRun] = field(default_factory=dict)  # dump folders named on the command line
    counter: itertools.count = field(default_factory=lambda: itertools.count(1))

    @classmethod
    def on_thread(cls, model: Model | None) -> TraceService:
        """A service whose work runs on one worker thread (``minfer trace --serve``: no engine running)."""
        pool = ThreadPoolExecutor(1, thread_name_prefix="minfer-trace")
        return cls(model, lambda fn: asyncio.wrap_future(pool.submit(fn)))

    def add(self, trace: ForwardTrace) -> str:
        rid = f"r{next(self.counter)}"
        self.runs[rid] = trace
        while len(self.runs) > MAX_RUNS:
            self.runs.popitem(last=False)
        self.trim()
        return rid

    def trim(self) -> None:
        """Keep the runs within one budget: the older runs let their held layers go first (they capture
        them again when asked), then whole runs go, oldest first; the newest run always stays."""
        if not self.runs:
            return
        budget = next(reversed(self.runs.values())).budget
        for trace in list(self.runs.values())[:-1]:
            while self.bytes() > budget and trace.layers:
                trace.drop_oldest_layer()
        while len(self.runs) > 1 and self.bytes() > budget:
            self.runs.popitem(last=False)

    def bytes(self) -> int:
        """What the runs hold: their tensors, plans and caches."""
        return sum(t.held_bytes() + t.arena_bytes for t in self.runs.values())

    def get(self, rid: str) -> ForwardTrace:
        trace = self.runs.get(rid)
        if trace is None:
            raise ApiError(f"no trace run {rid!r} (this server keeps the last {MAX_RUNS})", status=404,
                           type="not_found_error", param="id")
        return trace

    async def do(self, fn: Callable[[], T]) -> T:
        return await self.on_engine(lambda: (fn(), self.trim())[0])


def _span(raw: str | None, what: str) -> tuple[int, int] | None:
    if raw is None or raw == "":
        return None
    a, sep, b = raw.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(a), int(b)
    except ValueError:
        raise ApiError(f"{what} must look like START:STOP (integers), got {raw!r}", param=what) from None


def _int(raw: str | None, what: str, default: int) -> int:
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ApiError(f"{what} must be an integer, got {raw!r}", param=what) from None


def _window(request: Request) -> tuple[tuple[int, int] | None, tuple[int, int] | None, int, int]:
    """A tensor view's query: ``rows=a:b``, ``cols=c:d``, ``max_rows``, ``max_cols`` (256 each by default)."""
    q = request.query_params
    return (_span(q.get("rows"), "rows"), _span(q.get("cols"), "cols"), _int(q.get("max_rows"), "max_rows", 256),
            _int(q.get("max_cols"), "max_cols", 256))


@dataclass
class RunInputs:
    """What a new run traces: the prompt's ids, where its images' tokens go, and the images as sent."""

    ids: list[int]
    cache_type: str | None
    what: str
    images: list[PassImage] = field(default_factory=list)
    image_inputs: list[ImageInput] = field(default_factory=list)


def _message_images(model: Model, messages: list[Any]) -> tuple[list[dict[str, Any]], list[ImageInput]]:
    """``messages`` with their image parts as media markers, and the images; a 400 naming the field where a
    message is not ``{role, content}`` with string or typed content, or an image is remote or not for this model."""
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str | list)
        for m in messages)
    if not ok:
        raise ApiError("'messages' must be a list of {role, content} objects (content a string or a list of parts)",
                       param="messages")
    try:
        plain, inputs = extract_images(messages)
    except BadRequestError as e:
        raise ApiError(str(e), param="messages") from None
    remote = next((img for img in inputs if img.url is not None and not img.data), None)
    if remote is not None:
        raise ApiError(f"{remote.where}: the trace explorer takes images as data: URLs, not remote ones",
                       param="messages")
    if inputs and model.images is None:
        raise ApiError(f"{model.path.name} takes no images (it has no vision model)", param="messages")
    return plain, inputs


def _run_body(model: Model, body: Any, runs: OrderedDict[str, ForwardTrace]) -> RunInputs:
    if not isinstance(body, dict):
        raise ApiError("the body must be a JSON object with 'prompt' or 'messages'")
    cache_type = body.get("cache_type")
    if cache_type is not None and not isinstance(cache_type, str):
        raise ApiError("'cache_type' must be a string (f32, f16, q8_0)", param="cache_type")
    prompt, messages, tokens, run = body.get("prompt"), body.get("messages"), body.get("tokens"), body.get("run")
    if sum(x is not None for x in (prompt, messages, tokens, run)) != 1:
        raise ApiError("give exactly one of 'prompt' (a string), 'messages' (a chat exchange), 'tokens' (ids) "
                       "or 'run' (a run's id: its prompt again)")
    if run is not None:
        old = runs.get(run) if isinstance(run, str) else None
        if old is None:
            raise ApiError(f"no trace run {run!r} (this server keeps the last {MAX_RUNS})", status=404,
                           type="not_found_error", param="run")
        return RunInputs(list(old.tokens), cache_type, f"run {run} again", list(old.images),
                         list(old.image_inputs))
    if tokens is not None:
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, int) for t in tokens):
            raise ApiError("'tokens' must be a non-empty list of token ids", param="tokens")
        bad = next((t for t in tokens if not 0 <= t < model.hparams.n_vocab), None)
        if bad is not None:
            raise ApiError(f"token id {bad} is outside the vocabulary (0..{model.hparams.n_vocab - 1})",
                           param="tokens")
        return RunInputs(list(tokens), cache_type, "token ids")
    if messages is not None:
        plain, inputs = _message_images(model, messages)
        text = model.render_chat(plain, add_generation_prompt=plain[-1]["role"] != "assistant")
        what = f"chat exchange of {len(messages)} messages" + (f" with {len(inputs)} images" if inputs else "")
        if not inputs:
            return RunInputs(model.tokenize(text, add_special=False), cache_type, what)
        ids, placed = model.image_prompt(text, inputs)
        return RunInputs(ids, cache_type, what, placed, inputs)
    if not isinstance(prompt, str) or not prompt:
        raise ApiError("'prompt' must be a non-empty string", param="prompt")
    return RunInputs(model.tokenize(prompt), cache_type, "prompt")


def register_explorer(app: FastAPI, service: TraceService, read_json: Callable[[Request], Awaitable[Any]]) -> None:
    """The ``/trace/api`` routes over ``service`` (``read_json``: the body of a request, or a 400)."""

    @app.post("/trace/api/runs")
    async def new_run(request: Request) -> dict[str, Any]:
        model = service.model
        if model is None:
            raise ApiError("this explorer serves a hand-made example only (no model loaded)", status=400)
        body = await read_json(request)
        # (images are decoded and encoded on the engine's thread, as a chat request's are)
        run = await service.do(lambda: _run_body(model, body, service.runs))
        cache = run.cache_type or model.cache_type
        description = f"{model.path.name}, {cache} cache, {run.what} ({len(run.ids)} tokens)"
        trace = await service.do(lambda: model.trace_forward(
            run.ids, cache_type=run.cache_type, description=description, images=run.images,
            image_inputs=run.image_inputs))
        rid = service.add(trace)
        return {"id": rid, **await service.do(trace.summary)}

    @app.get("/trace/api/runs")
    async def list_runs() -> dict[str, Any]:
        return {"runs": [{"id": rid, "description": t.description, "n_tokens": len(t.tokens),
                          "cache_type": t.cache_type, "memory": t.memory()} for rid, t in service.runs.items()],
                "max_runs": MAX_RUNS, "held_bytes": service.bytes(), "dumps": sorted(service.dumps)}

    @app.get("/trace/api/runs/{rid}")
    async def one_run(rid: str) -> dict[str, Any]:
        trace = service.get(rid)
        return {"id": rid, **await service.do(trace.summary)}

    @app.get("/trace/api/runs/{rid}/layers/{layer}/graph")
    async def layer_graph(rid: str, layer: int) -> dict[str, Any]:
        trace = service.get(rid)
        return await service.do(lambda: trace.layer_graph(layer))

    @app.get("/trace/api/runs/{rid}/nodes/{node}")
    async def node_tensor(rid: str, node: int, request: Request) -> dict[str, Any]:
        trace = service.get(rid)
        window = _window(request)
        return await service.do(lambda: trace.tensor_view(node, *window))

    @app.get("/trace/api/runs/{rid}/layers/{layer}/attention/{head}")
    async def attention(rid: str, layer: int, head: int, request: Request) -> dict[str, Any]:
        trace = service.get(rid)
        rows = _span(request.query_params.get("rows"), "rows")
        return await service.do(lambda: trace.attention(layer, head, rows))

    def vision_of(rid: str) -> VisionTrace:
        vision = service.get(rid).vision
        if vision is None:
            raise ApiError(f"trace run {rid!r} holds no image (no vision pass to show)", status=404,
                           type="not_found_error", param="id")
        return vision

    @app.get("/trace/api/runs/{rid}/vision")
    async def vision_pass(rid: str) -> dict[str, Any]:
        vision = vision_of(rid)
        return await service.do(vision.summary)

    @app.get("/trace/api/runs/{rid}/vision/nodes/{node}")
    async def vision_tensor(rid: str, node: int, request: Request) -> dict[str, Any]:
        vision = vision_of(rid)
        window = _window(request)
        return await service.do(lambda: vision.tensor_view(node, *window))

    @app.get("/trace/api/runs/{rid}/lens")
    async def lens(rid: str, request: Request) -> dict[str, Any]:
        trace = service.get(rid)
        n = len(trace.tokens)
        span = _span(request.query_params.get("positions"), "positions") or (max(0, n - 16), n)
        if span[1] - span[0] > MAX_LENS_POSITIONS:
            raise ApiError(f"at most {MAX_LENS_POSITIONS} positions at once, asked for {span[1] - span[0]}",
                           param="positions")
        return await service.do(lambda: trace.lens(range(*span)))

    @app.get("/trace/api/compare")
    async def compare_runs(request: Request) -> dict[str, Any]:
        q = request.query_params
        a = service.get(q.get("a", ""))
        b_name = q.get("b", "")
        b: ForwardTrace | DumpRun = service.dumps[b_name] if b_name in service.dumps else service.get(b_name)
        try:
            tol = float(q.get("tol", "1e-4"))
        except ValueError:
            raise ApiError(f"tol must be a number, got {q.get('tol')!r}", param="tol") from None
        all_nodes = q.get("all") in ("1", "true")
        return await service.do(lambda: compare(a, b, tol, all_nodes))


def register(app: FastAPI, ctx: ServerContext) -> None:
    """On ``minfer serve``: traces run on the engine's thread between decode steps."""
    service = TraceService(ctx.model, lambda fn: asyncio.wrap_future(ctx.engine_loop.call(fn)))
    register_explorer(app, service, ctx.read_json)
