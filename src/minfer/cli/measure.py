"""``minfer perplexity`` (the llama-perplexity method on a text file) and ``minfer bench`` (llama-bench style)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

from minfer.cli.embedding import refuse_encoder
from minfer.cli.options import add_model_argument, add_quantize_flag, add_threads_flag
from minfer.errors import MinferError


def add_parsers(add_parser: Callable[..., argparse.ArgumentParser]) -> None:
    """Register ``perplexity`` and ``bench`` (``add_parser``: the ``add_parser`` of the subcommands action)."""
    ppl = add_parser("perplexity", help="perplexity of a text file (the llama-perplexity method)")
    add_model_argument(ppl)
    ppl.add_argument("-f", "--file", required=True, help="text file to score")
    ppl.add_argument("-c", "--ctx-size", dest="ctx", type=int, default=512, help="chunk size in tokens (default: 512)")
    ppl.add_argument("-b", "--batch-size", dest="batch", type=int, default=None,
                     help="tokens per forward pass (default: the chunk size)")
    add_threads_flag(ppl)
    add_quantize_flag(ppl)
    ppl.set_defaults(handler=cmd_perplexity)

    bench = add_parser("bench", help="throughput of prompt processing and generation (llama-bench style)")
    add_model_argument(bench)
    bench.add_argument("-p", "--n-prompt", default="128,512", help="prompt sizes, comma-separated (default: 128,512)")
    bench.add_argument("-n", "--n-gen", default="128", help="generation lengths, comma-separated (default: 128)")
    bench.add_argument("-r", "--repetitions", type=int, default=3, help="runs per test after a warm-up (default: 3)")
    bench.add_argument("-t", "--threads", default=None, help="thread counts, comma-separated (default: the cores)")
    bench.add_argument("--json", action="store_true", help="print a JSON list of records instead of a table")
    add_quantize_flag(bench)
    bench.add_argument("--compare", action="store_true",
                       help="also run llama.cpp (llama-cpp-python) and HF transformers on the same file")
    bench.add_argument("--peer-python", action="append", default=[], metavar="ENGINE=PYTHON",
                       help="interpreter that has a peer installed, e.g. transformers=/opt/refenv/bin/python")
    bench.add_argument("--lookup", action="store_true",
                       help="also generate through the engine without and with prompt lookup (gen<N> tests)")
    bench.add_argument("--draft", default=None, metavar="MODEL",
                       help="also generate without and with this draft model (gen<N> tests)")
    bench.set_defaults(handler=cmd_bench)


def cmd_perplexity(args: argparse.Namespace) -> int:
    from pathlib import Path

    import minfer

    path = Path(args.file)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise MinferError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise MinferError(f"{path}: cannot read as UTF-8 text: {e}") from None
    refuse_encoder(args.model, "perplexity")
    model = minfer.load(args.model, n_ctx=max(args.ctx, 4), threads=args.threads, quantize=args.quantize)
    t0 = time.perf_counter()
    result = model.perplexity(text, n_ctx=args.ctx, n_batch=args.batch, progress=True)
    elapsed = time.perf_counter() - t0
    running = " ".join(f"[{i + 1}]{p:.4f}" for i, p in enumerate(result.chunk_ppl))
    print(running)
    print(f"Final estimate: {result}")
    print(f"minfer: {result.n_chunks} chunks of {result.n_ctx} tokens, {result.tokens_scored} tokens scored, "
          f"{result.n_chunks * result.n_ctx / elapsed:.1f} t/s", file=sys.stderr)
    return 0


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise MinferError(f"{flag} takes comma-separated integers, got {text!r}") from None
    return values


def cmd_bench(args: argparse.Namespace) -> int:
    from minfer.api import default_threads
    from minfer.pull import resolve_model
    from minfer.tools.bench import bench, markdown

    peers = {}
    for item in args.peer_python:
        engine, sep, python = item.partition("=")
        if not sep:
            raise MinferError(f"--peer-python takes ENGINE=PYTHON, got {item!r}")
        peers[engine] = python
    threads = _int_list(args.threads, "--threads") if args.threads else [default_threads()]
    refuse_encoder(args.model, "bench")
    report = bench(resolve_model(args.model), _int_list(args.n_prompt, "-p"), _int_list(args.n_gen, "-n"),
                   threads, args.repetitions, compare=args.compare, peer_python=peers, quantize=args.quantize,
                   lookup=args.lookup, draft=args.draft,
                   progress=lambda line: print(f"minfer bench: {line}", file=sys.stderr, flush=True))
    print(json.dumps(report.to_json(), indent=1) if args.json else markdown(report))
    return 0
