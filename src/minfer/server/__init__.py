"""``minfer serve``: an OpenAI-compatible HTTP server with continuous batching (see :mod:`.app`)."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from minfer.errors import BadRequestError
from minfer.server.api_keys import resolve_api_keys
from minfer.server.cors import ANY_ORIGIN, DEFAULT_HEADERS, DEFAULT_METHODS, CorsPolicy, with_cors

DEFAULT_PARALLEL = 4
MAX_PLANS = 48  # batch shapes whose prepared plans the server keeps


@dataclass(frozen=True)
class ServeOptions:
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    parallel: int = DEFAULT_PARALLEL
    ctx_size: int | None = None  # shared by all sequences (any one may use it all); default min(train, 4096)
    cache_ram: int = 0  # MiB of host memory for KV blocks that left the cache (--cache-ram; 0: off)
    cache_disk: str | None = None  # a folder for the blocks that leave host memory (--cache-disk)
    cache_disk_size: int = 4096  # MiB of blocks the folder holds for this model
    batch_size: int = 512
    queue_size: int = 64
    api_keys: tuple[str, ...] = ()  # --api-key / --api-key-file; empty: $MINFER_API_KEY's, else none
    alias: str | None = None
    threads: int | None = None
    kernels: str | None = None
    cache_type: str | None = None
    shutdown_timeout: float = 30.0
    log_level: str = "warning"
    quantize: str | None = None  # q8_0 / q4_k: quantize float weight matrices at load
    reasoning_format: str = "deepseek"  # "none": <think> blocks stay in the content
    draft: str | None = None  # speculative decoding: a draft model (requests use it by default)
    lookup: bool = False  # speculative decoding: prompt lookup by default
    speculative: dict | None = None  # SpeculativeSettings fields (draft_max, ...)
    pooling: str | None = None  # embeddings: mean / cls / last / none; None: the model's (GGUF pooling_type, else mean)
    normalize: bool = True  # L2-normalise pooled embeddings (--no-normalize: off)
    strict_model: bool = False  # refuse requests naming another model
    # CORS as llama-server (minfer.server.cors): "*" echoes any page's origin; "localhost": loopback pages; or
    # a list. Empty (--no-cors): no CORS headers, and an OPTIONS is routed like any request
    cors_origins: tuple[str, ...] = (ANY_ORIGIN,)
    cors_methods: str = DEFAULT_METHODS
    cors_headers: str = DEFAULT_HEADERS
    cors_credentials: bool = True
    slots: bool = True  # GET /slots (llama-server's default; --no-slots: a 501)
    max_body_size: int = 8 * 1024 * 1024  # bytes; a larger request body is answered 413
    log_format: str = "text"  # the access log: text, json or off
    lora: list | None = None  # LoRA adapters: (path, scale) pairs
    lora_merge: bool = False  # added into the weights at load
    lora_init_without_apply: bool = False  # loaded with scale 0
    allow_image_urls: bool = False  # fetch http(s) image URLs (SECURITY.md)
    ollama_blobs: str | None = None  # where ollama clients' uploaded blobs are kept (None: a temporary folder)
    mmproj: str | None = None  # a text GGUF's vision tower and projector (llama.cpp's mmproj file): images
    metrics: bool = True  # GET /metrics (--no-metrics: answered 501, as llama-server without --metrics)
    # llama-server's server-wide settings (cli/llama_server_flags.py)
    sampling_defaults: dict | None = None  # SamplingParams fields for requests that do not set them (--temp, ...)
    n_predict: int | None = None  # tokens at most for requests that set no max_tokens (-n; None or -1: no limit)
    tags: str | None = None  # --tags: comma-separated, shown in /props and /v1/models
    ui: bool = True  # the chat page at / (--no-ui: off)
    verbose: bool = False  # answers carry __verbose (-v)
    chat_template_file: str | None = None  # a Jinja chat template in place of the model's
    chat_template_kwargs: dict | None = None  # the chat template's variables requests do not set (--reasoning, ...)
    media_path: str | None = None  # file:// image URLs are read from this folder (--media-path)
    slot_save_path: str | None = None  # --slot-save-path: the folder slots are saved to and restored from
    cache_idle_slots: bool = True  # --no-cache-idle-slots: free slots' blocks that give way are not kept in --cache-ram

# uvicorn waits this much longer than --shutdown-timeout: the app cancels what is still open at the
# timeout, and the cancelled answers need a moment to reach their clients (an error event, [DONE])
SHUTDOWN_GRACE_SECONDS = 2.0


def cors_policy(opts: ServeOptions) -> CorsPolicy | None:
    """The server's CORS (None: --no-cors, no CORS headers at all)."""
    if not opts.cors_origins:
        return None
    return CorsPolicy(opts.cors_origins, opts.cors_methods, opts.cors_headers, opts.cors_credentials)


def with_keys(api_keys: tuple[str, ...]) -> str:
    """The startup line's note of the keys."""
    return "" if not api_keys else " with an API key" if len(api_keys) == 1 else f" with {len(api_keys)} API keys"


def errors_to_stderr() -> None:
    """The server's own log (the 500s, with their tracebacks) goes to stderr, whatever uvicorn's config."""
    import logging

    log = logging.getLogger("minfer.server")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("minfer: %(levelname)s %(message)s"))
        log.addHandler(handler)
        log.propagate = False
        log.setLevel(logging.INFO)


def listening_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A socket bound to ``host:port`` (port 0: a free one) and listening: connections wait in the backlog
    until uvicorn accepts them. A port in use is a one-line BadRequestError."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise BadRequestError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(backlog)
    return sock


def listening_sockets(hosts: str, port: int) -> list[socket.socket]:
    """``--host A,B``: a listening socket on each address, all on one port (with port 0: the free one the first
    address got)."""
    names = split_names(hosts)
    if not names:
        raise BadRequestError(f"--host must name at least one address, got {hosts!r}")
    socks = [listening_socket(names[0], port)]
    try:
        for name in names[1:]:
            socks.append(listening_socket(name, socks[0].getsockname()[1]))
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def split_names(text: str | None) -> list[str]:
    """A comma-separated flag's values (--host), blanks dropped, in the order given."""
    if text is None:
        return []
    return [part.strip() for part in text.split(",") if part.strip()]


def name_set(text: str | None) -> tuple[str, ...]:
    """--alias's and --tags' values as llama-server keeps them: a sorted set (its first alias is the model's id)."""
    return tuple(sorted(set(split_names(text))))


def server_defaults(opts: ServeOptions) -> dict:
    """``ServerConfig``'s request defaults from the flags: the sampling fields (checked now, so a bad --temp
    stops the server at start), the seed apart (each request's sequences count up from it), -n."""
    from minfer.errors import MinferError
    from minfer.runtime.sampling.params import SamplingParams

    sampling = dict(opts.sampling_defaults or {})
    try:
        SamplingParams(**sampling)
    except (MinferError, ValueError, TypeError) as e:
        raise BadRequestError(f"server sampling defaults: {e}") from None
    seed = sampling.pop("seed", None)
    if seed is not None and seed < 0:
        seed = None  # llama-server's -1: a fresh seed for each request
    n_predict = opts.n_predict
    if n_predict is not None and n_predict < -1:
        raise BadRequestError(f"-n/--n-predict must be -1 (no limit) or >= 0, got {n_predict}")
    return {"sampling_defaults": sampling, "default_seed": seed,
            "default_n_predict": None if n_predict is None or n_predict < 0 else n_predict}


def read_chat_template(path: str, tokenizer: object) -> object:
    """``--chat-template-file``: the Jinja template in ``path``, with the tokenizer's BOS/EOS texts."""
    from minfer.errors import FormatError
    from minfer.formats.chat_template import ChatTemplate

    try:
        source = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise BadRequestError(f"--chat-template-file {path}: {e.strerror}") from None
    tok: Any = tokenizer
    bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
    eos = tok.token_text(tok.eos_id) if tok.eos_id is not None else ""
    try:
        return ChatTemplate(source, bos, eos)
    except FormatError as e:
        raise BadRequestError(f"--chat-template-file {path}: {e}") from None


def parse_size(text: str) -> int:
    """``--max-body-size``'s value: bytes, or a number with K, M or G (powers of 1024)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    scale = units.get(t[-1:], 1)
    number = t[:-1] if t[-1:] in units else t
    try:
        size = int(float(number) * scale)
    except ValueError:
        raise BadRequestError(f"--max-body-size must be a size like 8M, 512K or 1048576, got {text!r}") from None
    if size < 1:
        raise BadRequestError(f"--max-body-size must be at least one byte, got {text!r}")
    return size


def serve(opts: ServeOptions) -> None:
    """Load the model, then serve until SIGINT/SIGTERM (graceful: open requests get ``shutdown_timeout``)."""
    import uvicorn

    from minfer.api import keep_for_process, load
    from minfer.runtime.engine import EngineConfig
    from minfer.runtime.engine_loop import EngineLoop
    from minfer.runtime.pooling import check_pooling
    from minfer.server import access_log
    from minfer.server.app import ServerConfig, create_app
    from minfer.server.http_protocols import http_protocol

    if opts.parallel < 1:
        raise BadRequestError(f"--parallel must be >= 1, got {opts.parallel}")
    if opts.batch_size < 1:
        raise BadRequestError(f"--batch-size must be >= 1, got {opts.batch_size}")
    if opts.cache_ram < 0:
        raise BadRequestError(f"--cache-ram must be >= 0 MiB, got {opts.cache_ram}")
    if opts.cache_disk_size < 1:
        raise BadRequestError(f"--cache-disk-size must be >= 1 MiB, got {opts.cache_disk_size}")
    if opts.cache_disk is not None and os.path.exists(opts.cache_disk) and not os.path.isdir(opts.cache_disk):
        raise BadRequestError(f"--cache-disk {opts.cache_disk!r} is not a folder")
    if opts.max_body_size < 1:
        raise BadRequestError(f"--max-body-size must be >= 1 byte, got {opts.max_body_size}")
    if opts.log_format not in access_log.LOG_FORMATS:
        raise BadRequestError(f"--log-format must be one of {', '.join(access_log.LOG_FORMATS)}, "
                              f"got {opts.log_format!r}")
    if not opts.shutdown_timeout >= 0:
        raise BadRequestError(f"--shutdown-timeout must be >= 0 seconds, got {opts.shutdown_timeout}")
    if opts.slot_save_path is not None and not os.path.isdir(opts.slot_save_path):
        raise BadRequestError(f"--slot-save-path {opts.slot_save_path!r} is not a folder")
    defaults = server_defaults(opts)  # bad values stop the server before the model loads
    from minfer.models.bert import is_encoder_checkpoint
    from minfer.pull import resolve_model

    resolved = resolve_model(opts.model)
    if is_encoder_checkpoint(resolved):
        _serve_encoder(opts, resolved)
        return
    engine_config = EngineConfig(n_slots=opts.parallel, batch_size=opts.batch_size, end_of_context="length",
                                 max_plans=MAX_PLANS, cache_ram=opts.cache_ram * 2**20, cache_disk=opts.cache_disk,
                                 cache_disk_bytes=opts.cache_disk_size * 2**20, cache_idle_slots=opts.cache_idle_slots)
    model = load(opts.model, n_ctx=opts.ctx_size, threads=opts.threads, kernels=opts.kernels,
                 cache_type=opts.cache_type, quantize=opts.quantize, engine_config=engine_config,
                 draft=opts.draft, lookup=opts.lookup, speculative=opts.speculative, lora=opts.lora,
                 lora_merge=opts.lora_merge, lora_init_without_apply=opts.lora_init_without_apply,
                 mmproj=opts.mmproj)
    if opts.chat_template_file is not None:
        model.chat_template = read_chat_template(opts.chat_template_file, model.tokenizer)
    engine_loop = EngineLoop(model.engine, max_queue=opts.queue_size)  # load warmed the engine up
    # Everything loaded so far lives as long as the server. Measured at 8 clients: collections took 95 ms of
    # a 10 s run, 1.7 ms each, landing inside decode steps; frozen, 16 ms.
    keep_for_process(collect=True)
    api_keys = resolve_api_keys(opts.api_keys)
    if opts.pooling == "rank":
        raise BadRequestError(f"--pooling rank: {model.path} is a generating model; reranking needs a cross-encoder "
                              "(a *ForSequenceClassification checkpoint)")
    pooling = check_pooling(opts.pooling) if opts.pooling is not None else model.pooling  # a bad one fails now
    aliases = name_set(opts.alias)
    config = ServerConfig(model_id=aliases[0] if aliases else Path(model.path).name, api_keys=api_keys,
                          strict_model=opts.strict_model, pooling=pooling, normalize=opts.normalize,
                          cors=cors_policy(opts), slots_endpoint=opts.slots,
                          reasoning_format=opts.reasoning_format,
                          max_body_size=opts.max_body_size, log_format=opts.log_format,
                          allow_image_urls=opts.allow_image_urls, metrics_endpoint=opts.metrics,
                          aliases=aliases, tags=name_set(opts.tags), ui=opts.ui, verbose=opts.verbose,
                          slot_save_path=opts.slot_save_path, chat_template_kwargs=opts.chat_template_kwargs or {},
                          media_path=opts.media_path, ollama_blobs=opts.ollama_blobs,
                          **defaults)
    access_log.configure(opts.log_format)
    errors_to_stderr()
    app = create_app(model, engine_loop, config, shutdown_timeout=0.0, start_engine_loop=False)

    socks = listening_sockets(opts.host, opts.port)
    host, port = socks[0].getsockname()[:2]
    server = uvicorn.Server(uvicorn.Config(app, log_level=opts.log_level, access_log=False, http=http_protocol(),
                                           timeout_graceful_shutdown=opts.shutdown_timeout + SHUTDOWN_GRACE_SECONDS))

    # The engine loop (the model's kernels) runs on the main thread, uvicorn's event loop on another one.
    # A first SIGTERM/SIGINT starts uvicorn's graceful shutdown: open requests get --shutdown-timeout
    # seconds, then the app cancels what is left (streams end with an error event and [DONE]) and,
    # once they are answered, the app's lifespan stops the engine loop. A second signal forces it.
    def on_signal(_signum: int, _frame: object) -> None:
        if server.should_exit:
            server.force_exit = True
        else:
            app.ctx.begin_shutdown_threadsafe(opts.shutdown_timeout)
        server.should_exit = True

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    def serve_http() -> None:
        try:
            server.run(sockets=socks)
        finally:
            engine_loop.stop(0.0)  # also when uvicorn could not start: the main thread must not wait forever

    http = threading.Thread(target=serve_http, name="minfer-http", daemon=True)
    try:
        http.start()
        layout = (f"sharing {engine_loop.kv.n_ctx} tokens" if engine_loop.kv.unified
                  else f"of {engine_loop.slot_context} tokens")
        also = "".join(f" and http://{_url_host(s.getsockname()[0])}:{s.getsockname()[1]}" for s in socks[1:])
        print(f"minfer: serving {config.model_id} on http://{_url_host(host)}:{port}{also} ({opts.parallel} "
              f"parallel sequences {layout}, {model.threads} threads){with_keys(api_keys)}",
              file=sys.stderr, flush=True)
        engine_loop.run()  # returns once the app's lifespan has stopped the engine loop
        http.join()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


# the options a several-model server passes to each model's own server (ServeOptions field -> flag)
_PER_MODEL_FLAGS = {"parallel": "--parallel", "ctx_size": "--ctx-size", "batch_size": "--batch-size",
                    "queue_size": "--queue-size", "threads": "--threads", "kernels": "--kernels",
                    "cache_type": "--cache-type", "quantize": "--quantize", "reasoning_format": "--reasoning-format",
                    "pooling": "--pooling", "shutdown_timeout": "--shutdown-timeout", "log_level": "--log-level",
                    "log_format": "--log-format", "max_body_size": "--max-body-size", "cache_ram": "--cache-ram"}
# the options that name or shape one model, refused with several
_ONE_MODEL_FLAGS = {"alias": "--alias", "draft": "--model-draft", "lookup": "--lookup", "lora": "--lora",
                    "lora_merge": "--lora-merge", "lora_init_without_apply": "--lora-init-without-apply",
                    "cache_disk": "--cache-disk", "strict_model": "--strict-model",
                    "slots": "--no-slots", "mmproj": "--mmproj",
                    "sampling_defaults": "the sampling defaults (--temp, --seed, ...)", "n_predict": "--n-predict",
                    "tags": "--tags", "ui": "--no-ui", "verbose": "--verbose",
                    "chat_template_file": "--chat-template-file",
                    "chat_template_kwargs": "the chat template's defaults (--chat-template-kwargs, --reasoning, ...)",
                    "media_path": "--media-path",
                    "slot_save_path": "--slot-save-path"}  # (a slot action names no model to route it by)


def refuse_one_model_flags(opts: ServeOptions) -> None:
    """Several models (with or without --ray): the options that name or shape one model are refused."""
    defaults = ServeOptions()
    given = [flag for name, flag in _ONE_MODEL_FLAGS.items() if getattr(opts, name) != getattr(defaults, name)]
    if given:
        # with several models, a vision model's mmproj file goes beside its GGUF (llama-server's router layout)
        where = (" (or put its GGUF and its mmproj*.gguf in a folder of their own in --models-dir)"
                 if opts.mmproj is not None else "")
        raise BadRequestError(f"{', '.join(given)} apply to one model: serve it alone to use them{where}")


def serve_models(opts: ServeOptions, models: list[str], models_dir: str | None, models_max: int,
                 sleep_idle: float | None = None) -> None:
    """Serve several models behind one address (:mod:`minfer.server.model_router`) until SIGINT/SIGTERM."""
    import uvicorn

    from minfer.server.http_protocols import http_protocol
    from minfer.server.model_router import ModelRouter, model_entries

    refuse_one_model_flags(opts)
    defaults = ServeOptions()
    entries = model_entries(models, models_dir)
    if not entries:
        raise BadRequestError("no model to serve: give model files or folders, or --models-dir DIR")
    # each model's server gets the flags given here; an encoder's only those it takes (it refuses the others)
    child_args: list[str] = []
    generating_args: list[str] = []
    for name, flag in _PER_MODEL_FLAGS.items():
        value = getattr(opts, name)
        if value is not None and value != getattr(defaults, name):
            (generating_args if name in _GENERATING_OPTIONS else child_args).extend([flag, str(value)])
    if not opts.normalize:
        child_args.append("--no-normalize")
    if not opts.cache_idle_slots:
        generating_args.append("--no-cache-idle-slots")
    if opts.allow_image_urls:  # every generating model's server fetches image URLs (an encoder takes no images)
        generating_args.append("--allow-image-urls")
    api_keys = resolve_api_keys(opts.api_keys)
    child_args.append("--no-cors")  # the front answers CORS for all of them (else each answer has it twice)
    router = ModelRouter(entries, child_args, models_max, api_keys, opts.max_body_size, sleep_idle,
                         generating_args=generating_args)
    errors_to_stderr()
    socks = listening_sockets(opts.host, opts.port)
    host, port = socks[0].getsockname()[:2]
    app = with_cors(router, cors_policy(opts))  # the preflight answered before the router's key check
    server = uvicorn.Server(uvicorn.Config(app, log_level=opts.log_level, access_log=False, http=http_protocol(),
                                           timeout_graceful_shutdown=opts.shutdown_timeout + SHUTDOWN_GRACE_SECONDS))
    names = ", ".join(e.name for e in entries)
    print(f"minfer: serving {len(entries)} models on http://{host}:{port} (at most {models_max} loaded at once, "
          f"each loaded on its first request: {names}){with_keys(api_keys)}",
          file=sys.stderr, flush=True)
    server.run(sockets=socks)


def for_model(opts: ServeOptions, path: str | os.PathLike[str]) -> ServeOptions:
    """``opts`` for one model among several: an encoder's without the generating options (its server refuses them;
    given for the generating models beside it)."""
    from minfer.models.bert import is_encoder_checkpoint

    if not is_encoder_checkpoint(path):
        return opts
    defaults = ServeOptions()
    return replace(opts, **{name: getattr(defaults, name) for name in _GENERATING_OPTIONS})


# the options of a generating server that mean nothing for an encoder's, refused when given
_GENERATING_OPTIONS = {"ctx_size": "--ctx-size", "cache_ram": "--cache-ram", "cache_disk": "--cache-disk",
                       "cache_type": "--cache-type", "quantize": "--quantize", "draft": "--model-draft",
                       "lookup": "--lookup", "lora": "--lora", "lora_merge": "--lora-merge", "mmproj": "--mmproj",
                       "metrics": "--no-metrics",  # (the encoder's server always serves /metrics)
                       "sampling_defaults": "the sampling defaults (--temp, --seed, ...)", "n_predict": "--n-predict",
                       "ui": "--no-ui", "verbose": "--verbose", "chat_template_file": "--chat-template-file",
                       "slot_save_path": "--slot-save-path", "cache_idle_slots": "--no-cache-idle-slots",
                       "chat_template_kwargs": "--chat-template-kwargs, --reasoning, ...", "media_path": "--media-path"}


def _serve_encoder(opts: ServeOptions, path: str | os.PathLike[str]) -> None:
    """Serve an encoder (:mod:`minfer.server.encoder_app`) until SIGINT/SIGTERM."""
    import uvicorn

    from minfer.api import keep_for_process
    from minfer.api_encoder import Encoder
    from minfer.runtime.encoder_loop import EncoderLoop
    from minfer.server import access_log
    from minfer.server.context import ServerConfig
    from minfer.server.encoder_app import create_encoder_app
    from minfer.server.http_protocols import http_protocol

    defaults = ServeOptions()
    given = [flag for name, flag in _GENERATING_OPTIONS.items() if getattr(opts, name) != getattr(defaults, name)]
    if given:
        raise BadRequestError(f"{path} is an encoder model (embeddings, reranking): {', '.join(given)} do not apply")
    encoder = Encoder(path, threads=opts.threads, kernels=opts.kernels)
    pooling = opts.pooling
    if pooling == "rank":  # llama-server's way of asking for reranking: the model must have the head for it
        if not encoder.can_rerank:
            raise BadRequestError(f"--pooling rank: {path} has no classification head, so it cannot rerank (serve a "
                                  "cross-encoder, a *ForSequenceClassification checkpoint)")
        pooling = None
    loop = EncoderLoop(encoder.runner, max_queue=opts.queue_size)
    keep_for_process(collect=True)
    api_keys = resolve_api_keys(opts.api_keys)
    aliases = name_set(opts.alias)
    config = ServerConfig(model_id=aliases[0] if aliases else Path(encoder.path).name, api_keys=api_keys,
                          strict_model=opts.strict_model, normalize=opts.normalize, cors=cors_policy(opts),
                          max_body_size=opts.max_body_size, log_format=opts.log_format, aliases=aliases,
                          tags=name_set(opts.tags))
    access_log.configure(opts.log_format)
    errors_to_stderr()
    app = create_encoder_app(encoder, loop, config, pooling=pooling)
    socks = listening_sockets(opts.host, opts.port)
    host, port = socks[0].getsockname()[:2]
    server = uvicorn.Server(uvicorn.Config(app, log_level=opts.log_level, access_log=False, http=http_protocol(),
                                           timeout_graceful_shutdown=opts.shutdown_timeout + SHUTDOWN_GRACE_SECONDS))
    what = "embeddings and reranking" if encoder.can_rerank else "embeddings"
    print(f"minfer: serving {config.model_id} on http://{host}:{port} ({what}, {encoder.pooling} pooling, up to "
          f"{encoder.max_length} tokens per input, {encoder.threads} threads){with_keys(api_keys)}",
          file=sys.stderr, flush=True)
    server.run(sockets=socks)
