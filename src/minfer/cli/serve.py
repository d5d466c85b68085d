"""``minfer serve`` (the OpenAI-compatible HTTP server) and ``minfer pull`` (a known model into the cache)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from minfer.cli import llama_server_flags
from minfer.cli.options import (
    add_cache_type_flag,
    add_lora_flags,
    add_mmproj_flag,
    add_quantize_flag,
    add_speculative_flags,
    add_threads_flag,
    lora_kwargs,
    sampling_kwargs,
    speculative_kwargs,
)
from minfer.errors import MinferError
from minfer.pull import DEFAULT_MODEL, KNOWN_MODELS
from minfer.runtime.sampling.params import PARAMS, flag_help

if TYPE_CHECKING:
    from minfer.server import ServeOptions

DEFAULT_MODELS_MAX = 4  # several models without --ray: most loaded at once


def add_parsers(add_parser: Callable[..., argparse.ArgumentParser]) -> None:
    """Register ``serve`` and ``pull`` (``add_parser``: the ``add_parser`` of the subcommands action)."""
    srv = add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching",
                     description="Serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/embeddings, "
                     "/v1/models, also without /v1), llama-server's native endpoints (/completion, /infill, "
                     "/tokenize, /detokenize, /apply-template, /props, /embedding, /slots), /health and /metrics; "
                     "the chat page at / and the trace explorer at /trace, ollama's /api/*. With several models (or "
                     "--models-dir): each loaded on its first request, at most --models-max at once. With --ray: "
                     "replicas on Ray Serve behind one endpoint (with several models, --replicas of each, all "
                     "loaded at start).")
    srv.add_argument("model", nargs="?", default=None,
                     help=f"GGUF file, HF model folder or known model name (default: {DEFAULT_MODEL})")
    srv.add_argument("more_models", nargs="*", metavar="MODEL",
                     help="more models: several are served behind one address, each loaded on its first request")
    srv.add_argument("--models-dir", default=None, metavar="DIR",
                     help="serve every GGUF file and model folder in DIR (named by file stem or folder name), each "
                     "loaded on its first request; a folder holding a GGUF and an mmproj*.gguf is a vision model "
                     "(served with --mmproj that file)")
    srv.add_argument("--models-max", type=int, default=None, metavar="N",
                     help="with several models: most loaded at once; the least recently used idle one is unloaded "
                     f"when another is needed (default: {DEFAULT_MODELS_MAX}; not with --ray, which loads them all)")
    srv.add_argument("--sleep-idle-seconds", type=float, default=None, metavar="S",
                     help="unload a model idle for S seconds, as llama-server: one model sleeps (its process and "
                     "memory released; /health, /props, /v1/models and /metrics answer without waking it) and the "
                     "next request reloads it; with several models, each unloads alone (negative: never; "
                     "default: never for one model, only to make room for several)")
    srv.add_argument("--keep-alive", default=None, metavar="DURATION",
                     help="ollama's default keep-alive (its OLLAMA_KEEP_ALIVE): a model idle this long unloads, in "
                     "seconds or a duration such as 5m (negative: never by itself). Requests' keep_alive set it per "
                     "model, and ollama's unload request (no prompt, keep_alive 0) unloads at once. A one-model "
                     "server given this (or --sleep-idle-seconds) runs its model in a process of its own, which "
                     "it can unload; without either it keeps its model loaded for its life")
    srv.add_argument("--metrics", dest="metrics", action="store_true", default=True,
                     help="accepted for llama-server's command lines; a no-op: minfer always serves /metrics")
    srv.add_argument("--no-metrics", dest="metrics", action="store_false",
                     help="answer /metrics with 501, as llama-server started without --metrics")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8080, help="port, 0 = any free one (default: 8080)")
    srv.add_argument("-np", "--parallel", type=int, default=4,
                     help="sequences generated at once, sharing the context (default: 4)")
    srv.add_argument("-c", "--ctx-size", dest="n_ctx", type=int, default=None,
                     help="KV cache positions shared by all sequences, any one of which may use them all (with "
                     "--draft: each gets ctx-size / parallel) (default: the model's, at most 4096)")
    srv.add_argument("--cache-ram", type=int, default=0, metavar="MiB",
                     help="host memory for KV blocks that leave the cache (a slot's cached prompt overwritten or "
                     "dropped under load), found again by a prompt that starts with them (default: 0, off)")
    srv.add_argument("--cache-disk", default=None, metavar="DIR",
                     help="a folder for the KV blocks that leave --cache-ram (or all of them, without it): "
                     "written atomically, read back only when their checksum and model match")
    srv.add_argument("--cache-disk-size", type=int, default=4096, metavar="MiB",
                     help="most bytes of blocks --cache-disk holds for this model (default: 4096)")
    srv.add_argument("--cache-idle-slots", dest="cache_idle_slots", action=argparse.BooleanOptionalAction,
                     default=True,
                     help="a free slot whose cached prompt gives way to running requests keeps its blocks in "
                     "--cache-ram (or --cache-disk), where its conversation finds them when it returns; "
                     "--no-cache-idle-slots drops them (a slot's prompt overwritten by a new one is kept either "
                     "way) (default: on, as llama-server; without --cache-ram/--cache-disk nothing is kept)")
    srv.add_argument("--slot-save-path", default=None, metavar="DIR",
                     help="a folder for POST /slots/{id}?action=save|restore: a slot's cached tokens and KV cells "
                     "saved to a file there and read back (checksummed, refused when from another model) "
                     "(default: none, those actions answer 501)")
    srv.add_argument("-b", "--batch-size", type=int, default=512,
                     help="most tokens one forward pass evaluates (default: 512)")
    srv.add_argument("--queue-size", type=int, default=64,
                     help="requests that may wait for a free sequence; beyond it: 429 (default: 64)")
    srv.add_argument("--api-key", default=None, metavar="KEY[,KEY...]",
                     help="require one of these keys, as 'Authorization: Bearer KEY' or 'x-api-key: KEY' (a "
                     "comma-separated list; default: $MINFER_API_KEY, else none)")
    srv.add_argument("--api-key-file", default=None, metavar="FILE",
                     help="keys to require, one a line ('#' lines are comments); with --api-key: either's keys")
    srv.add_argument("--alias", default=None,
                     help="model id reported by /v1/models and /props, or several, comma-separated: the first is the "
                     "id, all are names requests may give (default: the file name)")
    srv.add_argument("--reasoning-format", choices=["none", "deepseek"], default="deepseek",
                     help="deepseek: a chat reply's <think>...</think> goes to message.reasoning_content; "
                     "none: it stays in the content (default: deepseek)")
    srv.add_argument("--strict-model", action="store_true",
                     help="refuse requests whose 'model' is not this model's name (default: any name is served)")
    srv.add_argument("--pooling", default=None,
                     choices=["mean", "cls", "last", "none", "max", "mean_sqrt_len", "weighted_mean", "rank"],
                     help="embeddings pooling (default: the GGUF's pooling_type or an encoder's sentence-transformers "
                     "Pooling module, else mean; max, mean_sqrt_len and weighted_mean: encoders only); none: one "
                     "vector per token, on /embedding only; rank: a reranker (/v1/rerank), refused for a model "
                     "without a classification head")
    srv.add_argument("--no-normalize", dest="normalize", action="store_false",
                     help="do not L2-normalise pooled embeddings")
    add_cors_flags(srv)
    srv.add_argument("--slots", action="store_true", default=True,
                     help="serve GET /slots, each slot's state (default: on, as llama-server)")
    add_threads_flag(srv)
    add_cache_type_flag(srv)
    add_quantize_flag(srv)
    add_speculative_flags(srv)
    add_lora_flags(srv)
    add_mmproj_flag(srv)
    srv.add_argument("--allow-image-urls", action="store_true",
                     help="fetch http(s) image URLs that requests name (20 MiB and 10 s at most each); the server "
                     "then makes requests to any address a client names: only where that is safe (SECURITY.md)")
    srv.add_argument("--ollama-blobs", default=None, metavar="DIR",
                     help="keep the blobs that ollama clients upload (POST /api/blobs, for /api/create's adapters) "
                     "in DIR; default: a temporary folder of the server's life")
    srv.add_argument("--media-path", default=None, metavar="DIR",
                     help="read file:// image URLs that requests name from DIR (paths relative to it, never out of "
                     "it); default: file:// URLs are refused")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds open requests get to finish on SIGINT/SIGTERM before they are cancelled (30)")
    srv.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                     help="uvicorn log level (default: warning)")
    srv.add_argument("--log-format", default="text", choices=["text", "json", "off"],
                     help="access log on stderr, one line a request: method, path, status, tokens, ms "
                     "(default: text)")
    srv.add_argument("--max-body-size", default="8M", metavar="SIZE",
                     help="largest request body, in bytes or with K/M/G; larger ones get 413 (default: 8M)")
    _add_server_default_flags(srv)
    ray = srv.add_argument_group("replicas on Ray Serve (pip install 'minfer[ray]')")
    ray.add_argument("--ray", action="store_true",
                     help="serve replicas of this server on Ray Serve behind one endpoint, routed by prompt prefix")
    ray.add_argument("--replicas", type=int, default=2,
                     help="with --ray: replicas, of each model when there are several (default: 2)")
    ray.add_argument("--autoscale", default=None, metavar="MIN:MAX",
                     help="with --ray: let Ray Serve scale the replicas between MIN and MAX by load (each model's "
                     "on its own)")
    ray.add_argument("--ray-address", default=None, metavar="ADDRESS",
                     help="with --ray: join this Ray cluster ('auto', host:6379); default: start a local one")
    ray.add_argument("--route-policy", choices=["prefix", "least-loaded", "random"], default="prefix",
                     help="with --ray: prefix (the replica that last served the prompt's leading blocks), "
                     "least-loaded, or random (default: prefix)")
    ray.add_argument("--route-queue-threshold", type=int, default=2, metavar="N",
                     help="with --ray: a prefix's replica with more than N requests waiting for a slot is "
                     "passed over for the least-loaded one (default: 2)")
    llama_server_flags.install(srv)  # last: llama-server's other spellings, and the flags minfer refuses
    srv.set_defaults(handler=cmd_serve)

    pull = add_parser("pull", help="download a known model into the cache",
                      formatter_class=argparse.RawDescriptionHelpFormatter,
                      description="Download a known model into the cache (verified by sha256) and print its path: "
                      "a GGUF file, or an HF model folder.\n\nknown models:\n"
                      + "\n".join(f"  {name:<13} {m.description}" for name, m in sorted(KNOWN_MODELS.items())))
    pull.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=sorted(KNOWN_MODELS),
                      help=f"the model (default {DEFAULT_MODEL})")
    pull.add_argument("--force", action="store_true", help="download again even if cached")
    pull.set_defaults(handler=cmd_pull)


def add_cors_flags(srv: argparse.ArgumentParser) -> None:
    """llama-server's CORS flags (see minfer.server.cors; SECURITY.md says what the default allows)."""
    srv.add_argument("--cors-origins", "--cors-origin", dest="cors_origins", action="append", default=None,
                     metavar="ORIGINS",
                     help="browser pages that may call the API: '*' (any, the default, as llama-server), "
                     "'localhost' (loopback pages only), or origins such as https://app.example (comma-separated, "
                     "repeatable)")
    srv.add_argument("--no-cors", action="store_true",
                     help="no CORS headers at all, and an OPTIONS request is routed like any other (browser pages "
                     "from other origins cannot call the API)")
    srv.add_argument("--cors-methods", default=None, metavar="METHODS",
                     help="a preflight's Access-Control-Allow-Methods (default: 'GET, POST, DELETE, OPTIONS')")
    srv.add_argument("--cors-headers", default=None, metavar="HEADERS",
                     help="a preflight's Access-Control-Allow-Headers (default: '*', and the headers it asks for)")
    srv.add_argument("--cors-credentials", action=argparse.BooleanOptionalAction, default=True,
                     help="a preflight's Access-Control-Allow-Credentials; with '*' origins and credentials on, "
                     "the request's Origin is echoed, off: '*' is sent (default: on)")


def cors_kwargs(args: argparse.Namespace) -> dict:
    """The ServeOptions fields of the CORS flags; a bad value or a contradiction is a one-line error."""
    from minfer.server.cors import ANY_ORIGIN, DEFAULT_HEADERS, DEFAULT_METHODS, parse_origins, parse_token_list

    if args.no_cors:
        given = [flag for flag, value in (("--cors-origins", args.cors_origins), ("--cors-methods", args.cors_methods),
                                          ("--cors-headers", args.cors_headers)) if value is not None]
        if given or not args.cors_credentials:
            raise MinferError(f"--no-cors turns CORS off: {', '.join(given) or '--no-cors-credentials'} cannot apply")
        return {"cors_origins": ()}
    methods, headers = args.cors_methods, args.cors_headers
    return {"cors_origins": parse_origins(args.cors_origins) if args.cors_origins is not None else (ANY_ORIGIN,),
            "cors_methods": parse_token_list("--cors-methods", methods, "method") if methods is not None
            else DEFAULT_METHODS,
            "cors_headers": parse_token_list("--cors-headers", headers, "header") if headers is not None
            else DEFAULT_HEADERS,
            "cors_credentials": args.cors_credentials}


def _add_server_default_flags(srv: argparse.ArgumentParser) -> None:
    """llama-server's server-wide settings: the model as -m, the defaults of requests that do not set them, what
    /props and /v1/models show, the chat page, the chat template."""
    srv.add_argument("-m", "--model", dest="model_option", default=None, metavar="FILE",
                     help="the model, as llama-server takes it (the same as the MODEL argument)")
    srv.add_argument("--tags", default=None, metavar="TAGS",
                     help="comma-separated tags of the model, shown in /props and /v1/models")
    srv.add_argument("--chat-template-file", default=None, metavar="FILE",
                     help="a Jinja chat template read from FILE, in place of the model's own")
    srv.add_argument("--ui", dest="ui", action=argparse.BooleanOptionalAction, default=True,
                     help="serve the chat page at / (default: on)")
    srv.add_argument("--no-slots", dest="slots", action="store_false", help="no GET /slots: it answers 501")
    srv.add_argument("-v", "--verbose", action="store_true",
                     help="answers of /completion and /v1/chat/completions carry __verbose (the rendered prompt and "
                     "the whole answer), as llama-server's do")
    t = srv.add_argument_group("the chat template's variables, for requests that do not set them in "
                               "chat_template_kwargs (llama-server's flags)")
    t.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                   help="a JSON object of variables, e.g. '{\"enable_thinking\": false}'")
    t.add_argument("-rea", "--reasoning", default=None, metavar="on|off|auto",
                   help="on / off: enable_thinking true / false; auto: the template's own default (default: auto)")
    t.add_argument("--reasoning-effort", default=None, metavar="LEVEL",
                   help="reasoning_effort for templates that read it (minimal, low, medium, high, ...); default: "
                   "the template's own")
    t.add_argument("--reasoning-preserve", dest="reasoning_preserve", action=argparse.BooleanOptionalAction,
                   default=None, help="preserve_reasoning: keep earlier turns' reasoning in the prompt, for templates "
                   "that read it (default: the template's own)")
    t.add_argument("--reasoning-budget", type=int, default=-1, metavar="N",
                   help="thinking tokens at most: minfer has no thinking budget, so only -1 (unrestricted) is taken")
    d = srv.add_argument_group("defaults of requests that do not set them (llama-server's flags)")
    d.add_argument("-n", "--n-predict", "--predict", dest="n_predict", type=int, default=None, metavar="N",
                   help="tokens generated at most when a request sets no max_tokens/n_predict (default: -1, until "
                   "the end of generation or of the context)")
    for field, param in PARAMS.items():  # None: not given, the model's own default (generation_config) then
        how = {"action": "append"} if param.repeatable else {"type": param.check.cli_type}
        d.add_argument(*param.flags, dest=field, default=None, metavar=param.metavar, help=flag_help(field), **how)


_TRUTHY, _FALSEY, _AUTO = ("on", "enabled", "true", "1"), ("off", "disabled", "false", "0"), ("auto", "-1")


def template_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The chat template's server-wide variables from llama-server's flags: --chat-template-kwargs, then what
    --reasoning, --reasoning-effort and --reasoning-preserve set over it (as llama-server applies them)."""
    kwargs: dict[str, Any] = {}
    if args.chat_template_kwargs is not None:
        try:
            kwargs = json.loads(args.chat_template_kwargs)
        except json.JSONDecodeError as e:
            raise MinferError(f"--chat-template-kwargs is not valid JSON: {e.msg} at character {e.pos}") from None
        if not isinstance(kwargs, dict):
            raise MinferError("--chat-template-kwargs must be a JSON object of the template's variables, got "
                              f"{type(kwargs).__name__}")
    if args.reasoning is not None:
        value = args.reasoning.lower()
        if value in _TRUTHY or value in _FALSEY:
            kwargs["enable_thinking"] = value in _TRUTHY
        elif value not in _AUTO:
            raise MinferError(f"--reasoning must be on, off or auto, got {args.reasoning!r}")
    if args.reasoning_effort is not None and args.reasoning_effort != "default":
        kwargs["reasoning_effort"] = args.reasoning_effort
    if args.reasoning_preserve is not None:
        kwargs["preserve_reasoning"] = args.reasoning_preserve
    if args.reasoning_budget != -1:
        raise MinferError(f"--reasoning-budget {args.reasoning_budget}: minfer has no thinking budget; only -1 "
                          "(unrestricted) is taken (end thinking with --reasoning off)")
    return kwargs


def _media_path(folder: str | None) -> str | None:
    if folder is not None and not os.path.isdir(folder):
        raise MinferError(f"--media-path {folder!r} is not a folder")
    return folder


def _blobs_folder(folder: str | None) -> str | None:
    """--ollama-blobs: a folder, made if missing (its parent must exist)."""
    if folder is None:
        return None
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise MinferError(f"--ollama-blobs {folder!r} is not a folder")
    parent = os.path.dirname(os.path.abspath(folder))
    if not os.path.isdir(parent):
        raise MinferError(f"--ollama-blobs {folder!r}: its parent folder {parent!r} does not exist")
    return folder


def cmd_serve(args: argparse.Namespace) -> int:
    from minfer.server import ServeOptions, parse_size, serve
    from minfer.server.api_keys import server_api_keys

    if args.model_option is not None:
        if args.model is not None:
            raise MinferError(f"-m/--model {args.model_option} and MODEL {args.model}: give the model once")
        args.model = args.model_option
    opts = ServeOptions(max_body_size=parse_size(args.max_body_size), log_format=args.log_format,
                       model=args.model, host=args.host, port=args.port, parallel=args.parallel, ctx_size=args.n_ctx,
                       batch_size=args.batch_size, queue_size=args.queue_size, alias=args.alias,
                       api_keys=server_api_keys(args.api_key, args.api_key_file),
                       cache_ram=args.cache_ram, cache_disk=args.cache_disk, cache_disk_size=args.cache_disk_size,
                       threads=args.threads, cache_type=args.cache_type, shutdown_timeout=args.shutdown_timeout,
                       log_level=args.log_level, quantize=args.quantize, pooling=args.pooling,
                       normalize=args.normalize, strict_model=args.strict_model,
                       slots=args.slots, **cors_kwargs(args),
                       reasoning_format=args.reasoning_format, mmproj=args.mmproj,
                       allow_image_urls=args.allow_image_urls, metrics=args.metrics, **speculative_kwargs(args),
                       **lora_kwargs(args), sampling_defaults=sampling_kwargs(args) or None, n_predict=args.n_predict,
                       tags=args.tags, ui=args.ui, verbose=args.verbose, chat_template_file=args.chat_template_file,
                       slot_save_path=args.slot_save_path, cache_idle_slots=args.cache_idle_slots,
                       chat_template_kwargs=template_kwargs(args) or None, media_path=_media_path(args.media_path),
                       ollama_blobs=_blobs_folder(args.ollama_blobs))
    sleep_idle = args.sleep_idle_seconds if args.sleep_idle_seconds is None or args.sleep_idle_seconds >= 0 else None
    if args.keep_alive is not None:
        if args.sleep_idle_seconds is not None:
            raise MinferError("--keep-alive and --sleep-idle-seconds both set how long an idle model stays loaded: "
                              "give one")
        sleep_idle = _keep_alive_flag(args.keep_alive)
    if not args.metrics and (args.more_models or args.models_dir is not None or args.ray):
        raise MinferError("--no-metrics applies to one model's own server: the several-model and --ray fronts "
                          "serve /metrics of their own")
    if args.more_models or args.models_dir is not None:
        from minfer.server import serve_models

        models = ([args.model] if args.model is not None else []) + list(args.more_models)
        if args.ray:
            for flag, value in (("--models-max", args.models_max), ("--sleep-idle-seconds", args.sleep_idle_seconds),
                                ("--keep-alive", args.keep_alive)):
                if value is not None:
                    raise MinferError(f"{flag} with --ray: every model's replicas stay loaded; serve without --ray "
                                      "to load models on demand")
            _serve_ray(args, opts, models)
            return 0
        models_max = DEFAULT_MODELS_MAX if args.models_max is None else args.models_max
        serve_models(opts, models, args.models_dir, models_max, sleep_idle)
        return 0
    if sleep_idle is not None:
        from minfer.server.sleeping import serve_sleeping

        flag = "--keep-alive" if args.keep_alive is not None else "--sleep-idle-seconds"
        if args.ray:
            raise MinferError(f"{flag} with --ray: Ray Serve keeps its replicas loaded; serve without --ray to let "
                              "the model sleep")
        if args.model is None:
            raise MinferError(f"{flag} needs a MODEL to serve")
        serve_sleeping(opts, _serve_arguments(), sleep_idle)
        return 0
    if args.ray:
        _serve_ray(args, opts, [])
    else:
        serve(opts)
    return 0


def _keep_alive_flag(text: str) -> float:
    """``--keep-alive``'s seconds (``math.inf`` for a negative one), read as a request's ``keep_alive`` is."""
    from minfer.server.errors import ApiError
    from minfer.server.protocols.ollama import keep_alive_seconds

    try:
        seconds = keep_alive_seconds(text)
    except ApiError:
        raise MinferError(f"--keep-alive must be a number of seconds or a duration such as 5m, got {text!r}") from None
    assert seconds is not None
    return seconds


def _serve_ray(args: argparse.Namespace, opts: ServeOptions, models: list[str]) -> None:
    """``--ray``: one model's replicas, or (``models``, ``--models-dir``) each model's."""
    from minfer.server.cluster.launch import RayOptions, parse_autoscale, serve_ray

    serve_ray(opts, RayOptions(replicas=args.replicas, address=args.ray_address,
                               autoscale=parse_autoscale(args.autoscale) if args.autoscale else None,
                               route_policy=args.route_policy, queue_threshold=args.route_queue_threshold),
              models, args.models_dir)


def _serve_arguments() -> list[str]:
    """This command line's arguments after ``serve``: a sleeping server's model process gets them as they are
    (every flag, now or added later, means there what it means here), with its own address and key after them."""
    argv = sys.argv[1:]
    return argv[argv.index("serve") + 1:] if "serve" in argv else argv


def cmd_pull(args: argparse.Namespace) -> int:
    from minfer.pull import pull

    path = pull(args.name, force=args.force)
    print(path)
    return 0
