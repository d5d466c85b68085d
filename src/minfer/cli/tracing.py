"""``minfer trace`` (one forward pass: the explorer served, or one HTML page) and ``minfer compare-dumps`` (two
dump folders, node by node)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from minfer.cli.options import add_cache_type_flag, add_mmproj_flag, add_quantize_flag, add_threads_flag
from minfer.errors import MinferError

EXAMPLES = ("attention-2x2",)


def add_parsers(add_parser: Callable[..., argparse.ArgumentParser]) -> None:
    """Register ``trace`` and ``compare-dumps`` (``add_parser``: the ``add_parser`` of the subcommands action)."""
    tr = add_parser("trace", help="one forward pass of a prompt: the explorer (--serve) or one HTML page (--html)",
                    description="Trace one forward pass. --serve opens the trace explorer (tensors fetched as the "
                    "page needs them); --html writes one self-contained page, its inline data capped.")
    tr.add_argument("args", nargs="*", metavar="[MODEL] PROMPT", help="the model (optional) and the prompt")
    out = tr.add_mutually_exclusive_group(required=True)
    out.add_argument("--html", metavar="FILE", help="write one self-contained page to FILE")
    out.add_argument("--serve", action="store_true", help="serve the trace explorer (no chat) and print its address")
    tr.add_argument("--example", choices=EXAMPLES, default=None,
                    help="--serve a hand-made example instead of a model (attention-2x2: the learning page's one)")
    tr.add_argument("--host", default="127.0.0.1", help="--serve: address to listen on (default: 127.0.0.1)")
    tr.add_argument("--port", type=int, default=8081, help="--serve: port, 0 = any free one (default: 8081)")
    tr.add_argument("--compare-cache-type", choices=["f32", "f16", "q8_0"], default=None,
                    help="--serve: also trace the prompt with this KV cache type, to compare")
    tr.add_argument("--compare-dump", action="append", default=[], metavar="DIR",
                    help="--serve: a dump folder (minfer run --dump-dir) to compare with (repeatable)")
    tr.add_argument("--layers", default=None, help="--html: layers whose attention the page inlines (e.g. 0,3,5-7)")
    tr.add_argument("--heads", default=None, help="--html: query heads inlined (default: all)")
    tr.add_argument("--positions", type=int, default=64,
                    help="--html: the first N positions of the attention matrices (default: 64)")
    tr.add_argument("-c", "--ctx-size", dest="n_ctx", type=int, default=None, help="context size")
    tr.add_argument("--image", action="append", default=None, metavar="FILE",
                    help="an image in the prompt (a vision model; repeatable): at each <__media__> in PROMPT, or "
                    "before it where PROMPT has none")
    add_cache_type_flag(tr)
    add_threads_flag(tr)
    add_quantize_flag(tr)
    add_mmproj_flag(tr)
    tr.set_defaults(handler=cmd_trace)

    cmp = add_parser("compare-dumps", help="compare two dump folders node by node")
    cmp.add_argument("a", help="dump folder (minfer run --dump-dir)")
    cmp.add_argument("b", help="dump folder to compare with")
    cmp.add_argument("--tol", type=float, default=1e-4, help="relative difference that counts as parting (1e-4)")
    cmp.add_argument("--all", action="store_true", help="print every node, not only up to the first divergence")
    cmp.set_defaults(handler=cmd_compare_dumps)


def _int_list(text: str | None, flag: str) -> list[int] | None:
    """``0,3,5-7`` -> [0, 3, 5, 6, 7]."""
    if text is None:
        return None
    out: list[int] = []
    try:
        for part in text.split(","):
            a, sep, b = part.strip().partition("-")
            out.extend(range(int(a), int(b) + 1) if sep else [int(a)])
    except ValueError:
        raise MinferError(f"{flag} takes numbers and ranges like 0,3,5-7, got {text!r}") from None
    return out


def _model_and_prompt(args: argparse.Namespace) -> tuple[str | None, str]:
    if not args.args:
        raise MinferError("trace needs a PROMPT ([MODEL] PROMPT), or --serve --example NAME")
    if len(args.args) > 2:
        raise MinferError(f"trace takes [MODEL] PROMPT, got {len(args.args)} arguments (quote the prompt)")
    return (None, args.args[0]) if len(args.args) == 1 else (args.args[0], args.args[1])


def cmd_trace(args: argparse.Namespace) -> int:

    import minfer

    if args.example is not None:
        if not args.serve or args.args:
            raise MinferError("--example is served alone: minfer trace --serve --example NAME (no model, no prompt)")
        return _serve_example(args)
    model_ref, prompt = _model_and_prompt(args)
    if _is_encoder(model_ref):
        return _trace_encoder(args, model_ref, prompt)
    model = minfer.load(model_ref, n_ctx=args.n_ctx, quantize=args.quantize, cache_type=args.cache_type,
                        threads=args.threads, mmproj=args.mmproj)
    ids, images, inputs = _prompt_ids(model, prompt, args.image or [])
    if args.serve:
        return _serve_model(args, model, ids, images, inputs)
    from minfer.trace.html import trace_page_data

    if args.positions < 1:
        raise MinferError(f"--positions must be >= 1, got {args.positions}")
    data = trace_page_data(model, ids, layers=_int_list(args.layers, "--layers"),
                           heads=_int_list(args.heads, "--heads"), max_positions=args.positions, images=images,
                           image_inputs=inputs)
    return _write_page(args.html, data)


def _prompt_ids(model: object, prompt: str, image_files: list[str]) -> tuple[list[int], list, list]:
    """The prompt's ids (BOS first where the model wants one), where its images' tokens go, and the images: an
    image at each media marker of the prompt, or, where it has none, all of them before it (as ``minfer run
    --image``)."""
    from minfer.runtime.vision import MEDIA_MARKER, extract_images

    if not image_files:
        return model.tokenize(prompt), [], []  # type: ignore[attr-defined]
    if MEDIA_MARKER not in prompt:
        prompt = MEDIA_MARKER * len(image_files) + prompt
    content = [{"type": "image", "path": f} for f in image_files]
    _, inputs = extract_images([{"role": "user", "content": content}], allow_paths=True)
    ids, placed = model.image_prompt(prompt, inputs, add_special=True)  # type: ignore[attr-defined]
    return ids, placed, inputs


def _write_page(path: str, data: dict) -> int:
    """The page of ``data`` written to ``path`` (atomically: a full disk or a kill leaves the user's old page
    as it was, never half a page), then what it left out."""
    from pathlib import Path

    from minfer.formats.atomic import write_atomically
    from minfer.trace.html import render

    write_atomically(Path(path), render(data).encode("utf-8"), what="trace page")
    print(path)
    for what in data["omitted"]:
        print(f"left out: {what}")
    return 0


def _is_encoder(model_ref: str | None) -> bool:
    from minfer.models.bert import is_encoder_checkpoint
    from minfer.pull import resolve_model

    return is_encoder_checkpoint(resolve_model(model_ref))


def _trace_encoder(args: argparse.Namespace, model_ref: str | None, text: str) -> int:
    """``minfer trace ENCODER TEXT --html FILE``: the page of one encoder pass (--serve is refused)."""

    import minfer
    from minfer.trace.encoder_page import encoder_trace_page_data

    if args.serve:
        raise MinferError(f"{model_ref} is an encoder model: trace --serve (the explorer) runs generating models "
                          "only; use --html FILE for an encoder's trace page")
    if args.positions < 1:
        raise MinferError(f"--positions must be >= 1, got {args.positions}")
    # the generating flags given (-c, --cache-type, --quantize) are refused by load, naming them
    encoder = minfer.load(model_ref, n_ctx=args.n_ctx, quantize=args.quantize, cache_type=args.cache_type,
                          threads=args.threads)
    data = encoder_trace_page_data(encoder, text, layers=_int_list(args.layers, "--layers"),
                                   heads=_int_list(args.heads, "--heads"), max_positions=args.positions)
    return _write_page(args.html, data)


def _serve_model(args: argparse.Namespace, model: object, ids: list[int], images: list, inputs: list) -> int:
    from minfer.server.explorer_app import ExplorerOptions, serve_explorer
    from minfer.server.routes.trace import TraceService
    from minfer.trace.compare import DumpRun

    name = model.path.name  # type: ignore[attr-defined]
    what = f"prompt with {len(images)} image{'s' if len(images) != 1 else ''}" if images else "prompt"
    first = model.trace_forward(ids, images=images, image_inputs=inputs,  # type: ignore[attr-defined]
                                description=f"{name}, {model.cache_type} cache, {what} ({len(ids)} tokens)")  # type: ignore[attr-defined]
    service = TraceService.on_thread(model)  # type: ignore[arg-type]
    rid = service.add(first)
    if args.compare_cache_type:
        other = model.trace_forward(ids, cache_type=args.compare_cache_type, images=images,  # type: ignore[attr-defined]
                                    image_inputs=inputs,
                                    description=f"{name}, {args.compare_cache_type} cache, {what} ({len(ids)} tokens)")
        service.add(other)
    dumps = {f"dump:{d}": DumpRun(d) for d in args.compare_dump}
    serve_explorer(service, rid, ExplorerOptions(host=args.host, port=args.port), dumps)
    return 0


def _serve_example(args: argparse.Namespace) -> int:
    import numpy as np

    from minfer.backends.cpu.backend import CPUBackend
    from minfer.server.explorer_app import ExplorerOptions, serve_explorer
    from minfer.server.routes.trace import TraceService
    from minfer.trace.example import LEARNING_2X2, example_trace

    e = LEARNING_2X2
    trace = example_trace(np.array(e["q"]), np.array(e["k"]), np.array(e["v"]), list(e["labels"]), CPUBackend())
    service = TraceService.on_thread(None)
    serve_explorer(service, service.add(trace), ExplorerOptions(host=args.host, port=args.port))
    return 0


def cmd_compare_dumps(args: argparse.Namespace) -> int:
    from minfer.trace.dump import compare_dumps, first_divergence

    rows = sorted(compare_dumps(args.a, args.b), key=lambda r: (r["call"], r["node"]))
    if not rows:
        raise MinferError(f"{args.a} and {args.b} have no node in common")
    first = first_divergence(rows, args.tol)
    print(f"{'call':>4s} {'node':>5s} {'name':34s} {'op':14s} {'max abs':>10s} {'max rel':>10s} {'cosine':>10s}")
    for r in rows:
        if "shape_mismatch" in r:
            print(f"{r['call']:4d} {r['node']:5d} {r['name']:34s} {r['op']:14s} shapes {r['shape_mismatch']}")
        else:
            print(f"{r['call']:4d} {r['node']:5d} {r['name']:34s} {r['op']:14s} {r['max_abs']:10.3g} "
                  f"{r['max_rel']:10.3g} {r['cosine']:10.6f}")
        if r is first and not args.all:
            break
    if first is None:
        print(f"all {len(rows)} nodes agree within {args.tol:g}")
    else:
        print(f"first divergence: call {first['call']}, node {first['node']} {first['name']} ({first['op']})")
    return 0 if first is None else 1  # scripts and CI can tell that two runs part
