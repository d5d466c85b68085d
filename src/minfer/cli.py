"""The ``minfer`` command: run, chat, serve, inspect, perplexity, bench, trace, pull.

User mistakes print one line ``minfer: error: ...`` on stderr and exit with status 1 (2 for bad
command-line usage, as argparse does); no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Sequence

from minfer.errors import MinferError
from minfer.pull import DEFAULT_MODEL, KNOWN_MODELS
from minfer.runtime.sampling.params import PARAMS, flag_help


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--max-tokens", "--n-predict", dest="max_tokens", type=int, default=256,
                   help="maximum number of tokens to generate (default: 256)")
    g = p.add_argument_group("sampling")
    for field, param in PARAMS.items():  # defaults (None: not given) are SamplingParams' own
        how = {"action": "append"} if param.repeatable else {"type": param.check.cli_type}
        g.add_argument(*param.flags, dest=field, default=None, metavar=param.metavar, help=flag_help(field), **how)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable); not printed")
    c = p.add_argument_group("constrained output")
    c.add_argument("--grammar", default=None, help="GBNF grammar the output must follow")
    c.add_argument("--grammar-file", default=None, help="file with a GBNF grammar")
    c.add_argument("-j", "--json-schema", default=None, metavar="FILE_OR_JSON",
                   help="JSON Schema the output must validate against (a file or inline JSON)")
    c.add_argument("--json", action="store_true", help="output any JSON object")
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="print each token's log-probability and the N best alternatives on stderr")


def _constraint_kwargs(args: argparse.Namespace) -> dict:
    from pathlib import Path

    given = [f for f in ("grammar", "grammar_file", "json_schema", "json") if getattr(args, f)]
    if len(given) > 1:
        raise MinferError(f"use one of --grammar, --grammar-file, --json-schema, --json (got {', '.join(given)})")
    if args.grammar_file:
        try:
            return {"grammar": Path(args.grammar_file).read_text(encoding="utf-8")}
        except (OSError, UnicodeDecodeError) as e:
            raise MinferError(f"--grammar-file {args.grammar_file}: cannot read: {e}") from None
    if args.grammar:
        return {"grammar": args.grammar}
    if args.json_schema:
        text = args.json_schema
        if not text.lstrip().startswith("{"):
            try:
                text = Path(text).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise MinferError(f"--json-schema {args.json_schema}: not inline JSON and cannot read as a file: {e}") \
                    from None
        return {"json_schema": text}
    return {"json_schema": True} if args.json else {}


def _sampling_kwargs(args: argparse.Namespace) -> dict:
    kw = {}
    for field, param in PARAMS.items():
        value = getattr(args, field)
        if value is not None:
            kw[field] = param.from_cli(value) if param.from_cli is not None else value
    return kw


def _add_quantize_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantize", default=None, choices=["q8_0", "q4_k"],
                   help="quantize the float weight matrices at load (HF folders: f32/f16/bf16 safetensors)")


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    _add_quantize_flag(p)
    p.add_argument("-t", "--threads", type=int, default=None, help="threads (default: the cores available)")
    p.add_argument("-c", "--ctx-size", dest="n_ctx", type=int, default=None,
                   help="context size in tokens (default: the model's, at most 4096)")
    p.add_argument("--cache-type", default=None, choices=["f32", "f16", "q8_0"],
                   help="KV cache cells (default: $MINFER_CACHE_TYPE or f32)")
    p.add_argument("--context-shift", action="store_true",
                   help="when the context is full, drop the oldest half (after --keep tokens) instead of failing")
    p.add_argument("--keep", type=int, default=0, help="tokens kept at the start by --context-shift (default: 0)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minfer",
                                     description="Run GGUF and Hugging Face language models on the CPU.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    run = sub.add_parser("run", help="generate text from a prompt",
                         description="Generate text. MODEL is a GGUF file, an HF model folder (config.json, "
                         "safetensors, tokenizer.json) or a known model name "
                         f"({', '.join(KNOWN_MODELS)}; default {DEFAULT_MODEL}, pulled on first use).")
    run.add_argument("args", nargs="+", metavar="[MODEL] PROMPT", help="the model (optional) and the prompt")
    _add_sampling_flags(run)
    _add_model_flags(run)
    run.add_argument("--chat", action="store_true", help="treat PROMPT as a user message in the model's chat template")
    run.add_argument("--system", default=None, help="system message (with --chat)")
    run.add_argument("--echo", action="store_true", help="print the prompt before the generated text")
    run.add_argument("-q", "--quiet", action="store_true", help="do not print timings on stderr")
    run.add_argument("--trace", default=None, metavar="FILE",
                     help="write every node's time and output statistics as JSON lines (also $MINFER_TRACE)")
    run.add_argument("--dump-dir", default=None, metavar="DIR",
                     help="save node outputs as .npy with a manifest (also $MINFER_DUMP_DIR)")
    run.add_argument("--dump-filter", default=None, metavar="PATTERNS",
                     help="node names to dump, comma-separated shell patterns, e.g. 'blk.*.attn,output' "
                     "(also $MINFER_DUMP_FILTER; default: every node)")

    chat = sub.add_parser("chat", help="interactive multi-turn chat (type /help inside)")
    chat.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="GGUF file, HF model folder or known model name")
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--load", default=None, metavar="FILE", help="resume a saved session")
    _add_sampling_flags(chat)
    _add_model_flags(chat)

    insp = sub.add_parser("inspect", help="show a model's metadata, tensors and compute graph")
    insp.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="GGUF file, HF model folder or known model name")
    insp.add_argument("--tensors", action="store_true", help="list every tensor")
    insp.add_argument("--graph", action="store_true", help="print the compute graph of one forward pass")
    insp.add_argument("--format", choices=["text", "dot", "json"], default="text",
                      help="output format: text or json for the summary; text, dot or json for --graph")
    _add_quantize_flag(insp)
    insp.add_argument("--tokens", type=int, default=1, help="tokens in the graph's batch (default: 1)")
    insp.add_argument("--layer", type=int, action="append", default=None,
                      help="only show this layer's nodes (repeatable; text and dot)")
    insp.add_argument("--no-fuse", action="store_true", help="show the graph before the fusion pass")
    insp.add_argument("--kv", action="store_true", help="KV cache bytes per position and per context, per cell type")
    insp.add_argument("-c", "--ctx-size", dest="n_ctx", type=int, default=None,
                      help="context size for --kv (default: the model's, at most 4096)")

    ppl = sub.add_parser("perplexity", help="perplexity of a text file (the llama-perplexity method)")
    ppl.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="GGUF file, HF model folder or known model name")
    ppl.add_argument("-f", "--file", required=True, help="text file to score")
    ppl.add_argument("-c", "--ctx-size", dest="ctx", type=int, default=512, help="chunk size in tokens (default: 512)")
    ppl.add_argument("-b", "--batch-size", dest="batch", type=int, default=None,
                     help="tokens per forward pass (default: the chunk size)")
    ppl.add_argument("-t", "--threads", type=int, default=None, help="threads (default: the cores available)")
    _add_quantize_flag(ppl)

    bench = sub.add_parser("bench", help="throughput of prompt processing and generation (llama-bench style)")
    bench.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="GGUF file, HF model folder or known model name")
    bench.add_argument("-p", "--n-prompt", default="128,512", help="prompt sizes, comma-separated (default: 128,512)")
    bench.add_argument("-n", "--n-gen", default="128", help="generation lengths, comma-separated (default: 128)")
    bench.add_argument("-r", "--repetitions", type=int, default=3, help="runs per test after a warm-up (default: 3)")
    bench.add_argument("-t", "--threads", default=None, help="thread counts, comma-separated (default: the cores)")
    bench.add_argument("--json", action="store_true", help="print a JSON list of records instead of a table")
    _add_quantize_flag(bench)
    bench.add_argument("--compare", action="store_true",
                       help="also run llama.cpp (llama-cpp-python) and HF transformers on the same file")
    bench.add_argument("--peer-python", action="append", default=[], metavar="ENGINE=PYTHON",
                       help="interpreter that has a peer installed, e.g. transformers=/opt/refenv/bin/python")

    tr = sub.add_parser("trace", help="one forward pass of a prompt as a self-contained HTML page")
    tr.add_argument("args", nargs="+", metavar="[MODEL] PROMPT", help="the model (optional) and the prompt")
    tr.add_argument("--html", required=True, metavar="FILE", help="where to write the page")
    tr.add_argument("-c", "--ctx-size", dest="n_ctx", type=int, default=None, help="context size")
    _add_quantize_flag(tr)

    cmp = sub.add_parser("compare-dumps", help="compare two dump folders node by node")
    cmp.add_argument("a", help="dump folder (minfer run --dump-dir)")
    cmp.add_argument("b", help="dump folder to compare with")
    cmp.add_argument("--tol", type=float, default=1e-4, help="relative difference that counts as parting (1e-4)")
    cmp.add_argument("--all", action="store_true", help="print every node, not only up to the first divergence")

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching",
                         description="Serve /v1/chat/completions, /v1/completions, /v1/models, /health and /metrics.")
    srv.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="GGUF file, HF model folder or known model name")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8080, help="port, 0 = any free one (default: 8080)")
    srv.add_argument("-np", "--parallel", type=int, default=4,
                     help="sequences generated at once, sharing the context (default: 4)")
    srv.add_argument("-c", "--ctx-size", dest="n_ctx", type=int, default=None,
                     help="KV cache positions shared by all sequences; each gets ctx-size / parallel "
                     "(default: the model's, at most 4096)")
    srv.add_argument("-b", "--batch-size", type=int, default=512,
                     help="most tokens one forward pass evaluates (default: 512)")
    srv.add_argument("--queue-size", type=int, default=64,
                     help="requests that may wait for a free sequence; beyond it: 429 (default: 64)")
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (also $MINFER_API_KEY)")
    srv.add_argument("--alias", default=None, help="model id reported by /v1/models (default: the file name)")
    srv.add_argument("-t", "--threads", type=int, default=None, help="threads (default: the cores available)")
    srv.add_argument("--cache-type", default=None, choices=["f32", "f16", "q8_0"],
                     help="KV cache cells (default: $MINFER_CACHE_TYPE or f32)")
    _add_quantize_flag(srv)
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds open requests get to finish on SIGINT/SIGTERM before they are cancelled (30)")
    srv.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                     help="uvicorn log level (default: warning)")

    pull = sub.add_parser("pull", help="download a known model into the cache")
    pull.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=sorted(KNOWN_MODELS))
    pull.add_argument("--force", action="store_true", help="download again even if cached")
    return parser


def cmd_run(args: argparse.Namespace) -> int:
    import minfer

    if len(args.args) > 2:
        raise MinferError(f"run takes [MODEL] PROMPT, got {len(args.args)} arguments (quote the prompt)")
    model_ref, prompt = (None, args.args[0]) if len(args.args) == 1 else args.args
    model = minfer.load(model_ref, n_ctx=args.n_ctx, threads=args.threads, cache_type=args.cache_type,
                        trace=args.trace, dump_dir=args.dump_dir, dump_filter=args.dump_filter, quantize=args.quantize)
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": prompt})
        text, add_special = model.render_chat(messages), False
    else:
        if args.system:
            raise MinferError("--system needs --chat")
        text, add_special = prompt, True
    steps = model.stream(text, args.max_tokens, stop=args.stop, logprobs=args.logprobs, add_special=add_special,
                         context_shift=args.context_shift, n_keep=args.keep,
                         **_constraint_kwargs(args), **_sampling_kwargs(args))
    if args.echo:
        sys.stdout.write(prompt)
    t0 = time.perf_counter()
    for step in steps:
        sys.stdout.write(step.text)
        sys.stdout.flush()
        if step.logprob is not None:
            lp = step.logprob
            alts = " ".join(f"{model.tokenizer.decode([t])!r}:{v:.3f}" for t, v in lp.top_logprobs)
            print(f"[logprob] {model.tokenizer.decode([lp.token])!r} {lp.logprob:.4f} | {alts}", file=sys.stderr)
    sys.stdout.write("\n")
    stats = model.last_stats
    if stats is not None and not args.quiet:
        print(
            f"minfer: prompt {stats.prompt_tokens} tokens ({stats.prefill_tokens_per_s:.1f} t/s), "
            f"generated {stats.generated_tokens} tokens ({stats.decode_tokens_per_s:.1f} t/s), "
            f"{time.perf_counter() - t0:.2f} s, finish: {stats.finish_reason}",
            file=sys.stderr,
        )
    return 0


CHAT_HELP = """commands:
  /clear        forget the conversation (the system prompt stays)
  /regen        generate the last reply again
  /save FILE    save the conversation (transcript and KV cache) to FILE
  /load FILE    resume a conversation saved with /save
  /help         this help
  /exit         leave (also Ctrl-D)"""


def cmd_chat(args: argparse.Namespace) -> int:
    import minfer
    from minfer.runtime.conversation import Conversation

    if args.logprobs is not None:
        raise MinferError("--logprobs is printed by `minfer run`, not in the chat")
    model = minfer.load(args.model, n_ctx=args.n_ctx, threads=args.threads, cache_type=args.cache_type,
                        quantize=args.quantize)
    sampling = _sampling_kwargs(args)
    conv = Conversation.load(model, args.load) if args.load else model.conversation(system=args.system, **sampling)
    turn = dict(stop=args.stop, context_shift=args.context_shift, n_keep=args.keep, **_constraint_kwargs(args))
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"minfer chat with {model.path.name} ({model.cache_type} cache, n_ctx {model.n_ctx}); /help for "
              "commands", file=sys.stderr)

    def show(pieces) -> None:
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()

    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            return 0
        text = line.strip()
        if not text:
            continue
        command, _, arg = text.partition(" ")
        try:
            if command in ("/exit", "/quit"):
                return 0
            if command == "/help":
                print(CHAT_HELP)
            elif command == "/clear":
                conv.clear()
                print("(conversation cleared)", file=sys.stderr)
            elif command == "/regen":
                show(conv.regenerate(args.max_tokens, stream=True, **turn))
            elif command == "/save":
                if not arg:
                    raise MinferError("/save needs a file name")
                conv.save(arg.strip())
                print(f"(saved to {arg.strip()})", file=sys.stderr)
            elif command == "/load":
                if not arg:
                    raise MinferError("/load needs a file name")
                conv = Conversation.load(model, arg.strip())
                print(f"(loaded {len(conv.messages)} messages)", file=sys.stderr)
            elif command.startswith("/"):
                raise MinferError(f"unknown command {command} (/help lists them)")
            else:
                show(conv.send(line, args.max_tokens, stream=True, **turn))
        except MinferError as e:  # a bad command or a failed turn does not end the chat
            print(f"minfer: error: {e}", file=sys.stderr)
            if not interactive:
                return 1


def cmd_inspect(args: argparse.Namespace) -> int:
    from minfer.graph import printing
    from minfer.graph.fusion import fuse
    from minfer.models.model import TransformerModel
    from minfer.pull import resolve_model
    from minfer.tools.model_summary import format_bytes, format_summary, summarize

    path = resolve_model(args.model)
    if args.kv:
        from minfer.runtime.kv_cache import CACHE_TYPES, cell_bytes

        model = TransformerModel.from_path(path)
        hp = model.hparams
        n_ctx = args.n_ctx or min(hp.n_ctx_train, 4096)
        print(f"KV cache of {path.name}: {hp.n_layer} layers, K width {hp.k_width}, V width {hp.v_width}")
        for ct in CACHE_TYPES:
            per_pos = hp.n_layer * (cell_bytes(ct, hp.k_width) + cell_bytes(ct, hp.v_width))
            print(f"  {ct:5s} {per_pos:8d} bytes per position, {format_bytes(per_pos * n_ctx):>11s} for n_ctx {n_ctx}"
                  f"  ({hp.kv_f32_bytes_per_position / per_pos:.2f}x smaller than f32)")
        return 0
    if args.graph:
        model = TransformerModel.from_path(path, quantize=args.quantize)
        if args.tokens < 1:
            raise MinferError(f"--tokens must be >= 1, got {args.tokens}")
        graph = model.build_graph(args.tokens, args.tokens, min(model.hparams.n_ctx_train, 4096))
        if not args.no_fuse:
            graph = fuse(graph)
        layers = set(args.layer) if args.layer else None
        if args.format == "dot":
            print(printing.to_dot(graph, layers))
        elif args.format == "json":
            print(printing.to_json(graph))
        else:
            print(printing.to_text(graph, layers))
        return 0
    if args.format == "dot":
        raise MinferError("--format dot is for --graph; the summary prints as text or json")

    if path.is_dir():
        model = TransformerModel.from_path(path, quantize=args.quantize)  # an HF folder: errors are the answer
    else:
        from minfer.formats.gguf_file import GGUFFile

        f = GGUFFile(path)  # a file that is GGUF but not runnable still shows its metadata and tensors
        try:
            model = TransformerModel.from_path(path, quantize=args.quantize)
        except MinferError as e:
            if args.format == "json":
                raise
            print(f"file: {f.path}\nformat: GGUF v{f.version}, {len(f.tensors)} tensors\n"
                  f"architecture: {f.get('general.architecture', '?')}\n\nnot runnable: {e}\n\nmetadata:")
            for k, v in f.summary_metadata().items():
                print(f"  {k} = {v}")
            types = Counter(t.ggml_type.name for t in f)
            print("\ntensor types: " + ", ".join(f"{k}: {v}" for k, v in types.most_common()))
            return 0
    summary = summarize(model)
    if args.format == "json":
        hp = vars(model.hparams)
        summary["hparams"] = {k: (v.describe() if hasattr(v, "describe") else v) for k, v in hp.items()}
        if args.tensors:
            summary["tensors"] = [{"name": n, "type": t.ggml_type.name, "shape": list(t.shape), "bytes": t.nbytes}
                                  for n, t in model.tensors.items()]
        print(json.dumps(summary, indent=1, default=str))
        return 0
    print(format_summary(summary))
    print("\nhyperparameters:")
    for k, v in vars(model.hparams).items():
        print(f"  {k} = {v.describe() if hasattr(v, 'describe') else v}")
    print(f"  kv cache (f32) = {format_bytes(model.hparams.kv_f32_bytes_per_position)} per position")
    source = "metadata" if model.gguf is not None else "config.json"
    print(f"\n{source}:")
    shown = model.gguf.summary_metadata() if model.gguf is not None else model.metadata
    for k, v in shown.items():
        print(f"  {k} = {v}")
    if args.tensors:
        print("\ntensors:")
        for name, t in model.tensors.items():
            shown_name = name
            if model.hf is not None:
                from minfer.models.hf_checkpoint import hf_tensor_name

                shown_name = f"{name} ({hf_tensor_name(model.hf.spec, name)})"
            print(f"  {shown_name:40s} {t.ggml_type.name:6s} {str(list(t.shape)):>16s} {format_bytes(t.nbytes):>12s}")
    return 0


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
    report = bench(resolve_model(args.model), _int_list(args.n_prompt, "-p"), _int_list(args.n_gen, "-n"),
                   threads, args.repetitions, compare=args.compare, peer_python=peers, quantize=args.quantize)
    print(json.dumps(report.to_json(), indent=1) if args.json else markdown(report))
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    from pathlib import Path

    import minfer
    from minfer.trace.html import render, trace_page_data

    if len(args.args) > 2:
        raise MinferError(f"trace takes [MODEL] PROMPT, got {len(args.args)} arguments (quote the prompt)")
    model_ref, prompt = (None, args.args[0]) if len(args.args) == 1 else args.args
    model = minfer.load(model_ref, n_ctx=args.n_ctx, quantize=args.quantize)
    out = Path(args.html)
    out.write_text(render(trace_page_data(model, prompt)), encoding="utf-8")
    print(out)
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
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from minfer.server import ServeOptions, serve

    serve(ServeOptions(model=args.model, host=args.host, port=args.port, parallel=args.parallel, ctx_size=args.n_ctx,
                       batch_size=args.batch_size, queue_size=args.queue_size, api_key=args.api_key, alias=args.alias,
                       threads=args.threads, cache_type=args.cache_type, shutdown_timeout=args.shutdown_timeout,
                       log_level=args.log_level, quantize=args.quantize))
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from minfer.pull import pull

    path = pull(args.name, force=args.force)
    print(path)
    return 0


COMMANDS = {"run": cmd_run, "chat": cmd_chat, "inspect": cmd_inspect, "perplexity": cmd_perplexity, "bench": cmd_bench,
            "trace": cmd_trace, "compare-dumps": cmd_compare_dumps, "serve": cmd_serve, "pull": cmd_pull}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args, _ = parser.parse_known_args(argv)
    if args.command != "run":
        args = parser.parse_args(argv)
    else:
        # options may sit between MODEL and PROMPT (`minfer run model.gguf --chat "hi"`): parse intermixed
        run_parser = parser._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr]
        args = run_parser.parse_intermixed_args(argv[argv.index("run") + 1 :], argparse.Namespace(command="run"))
    try:
        return COMMANDS[args.command](args)
    except MinferError as e:
        print(f"minfer: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
