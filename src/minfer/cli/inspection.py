"""``minfer inspect``: a model's metadata, hyperparameters and tensors, its compute graph, or its KV cache sizes."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Callable

from minfer.cli.options import add_model_argument, add_quantize_flag
from minfer.errors import MinferError


def add_parsers(add_parser: Callable[..., argparse.ArgumentParser]) -> None:
    """Register ``inspect`` (``add_parser``: the ``add_parser`` of the subcommands action)."""
    insp = add_parser("inspect", help="show a model's metadata, tensors and compute graph")
    add_model_argument(insp)
    insp.add_argument("--tensors", action="store_true", help="list every tensor")
    insp.add_argument("--graph", action="store_true", help="print the compute graph of one forward pass")
    insp.add_argument("--format", choices=["text", "dot", "json"], default="text",
                      help="output format: text or json for the summary; text, dot or json for --graph")
    add_quantize_flag(insp)
    insp.add_argument("--tokens", type=int, default=1, help="tokens in the graph's batch (default: 1)")
    insp.add_argument("--layer", type=int, action="append", default=None,
                      help="only show this layer's nodes (repeatable; text and dot)")
    insp.add_argument("--no-fuse", action="store_true", help="show the graph before the fusion pass")
    insp.add_argument("--lora", action="append", default=None, metavar="FILE",
                      help="with --graph: a LoRA adapter whose nodes the graph shows (repeatable)")
    insp.add_argument("--kv", action="store_true", help="KV cache bytes per position and per context, per cell type")
    insp.add_argument("-c", "--ctx-size", dest="n_ctx", type=int, default=None,
                      help="context size for --kv (default: the model's, at most 4096)")
    insp.set_defaults(handler=cmd_inspect)


# over 80 lines on purpose: one report, printed section by section in the order a user reads it
def cmd_inspect(args: argparse.Namespace) -> int:
    from minfer.graph import printing
    from minfer.graph.fusion import fuse
    from minfer.models.model import TransformerModel
    from minfer.pull import resolve_model
    from minfer.tools.model_summary import format_bytes, format_summary, summarize

    path = resolve_model(args.model)
    from minfer.models.bert import is_encoder_checkpoint

    if is_encoder_checkpoint(path):
        return _inspect_encoder(path, args)
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
        for adapter in args.lora or ():
            model.add_lora(adapter)
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
    print(f"\n{model.source.metadata_title}:")
    for k, v in model.source.shown_metadata().items():
        print(f"  {k} = {v}")
    if args.tensors:
        print("\ntensors:")
        for name, t in model.tensors.items():
            stored = model.source.stored_name(name)
            shown_name = name if stored == name else f"{name} ({stored})"
            print(f"  {shown_name:40s} {t.ggml_type.name:6s} {str(list(t.shape)):>16s} {format_bytes(t.nbytes):>12s}")
    return 0


def _inspect_encoder(path, args: argparse.Namespace) -> int:
    """An encoder's summary (hyperparameters, sentence-transformers configuration, metadata, tensors) or graph."""
    from minfer.graph import printing
    from minfer.graph.fusion import fuse
    from minfer.models.bert import BertModel
    from minfer.tools.model_summary import format_bytes

    if args.kv or args.lora or args.quantize:
        raise MinferError(f"{path} is an encoder model: it has no KV cache, adapters or load-time quantization here")
    model = BertModel.open(path)
    if args.graph:
        if args.tokens < 1:
            raise MinferError(f"--tokens must be >= 1, got {args.tokens}")
        graph = model.build_graph(args.tokens)
        graph = graph if args.no_fuse else fuse(graph)
        layers = set(args.layer) if args.layer else None
        text = printing.to_dot(graph, layers) if args.format == "dot" else printing.to_json(graph) \
            if args.format == "json" else printing.to_text(graph, layers)
        print(text)
        return 0
    if args.format == "dot":
        raise MinferError("--format dot is for --graph; the summary prints as text or json")
    config = model.sentence_config()
    summary = {"file": str(model.path), "format": "GGUF" if model.gguf is not None else "HF safetensors folder",
               "kind": "encoder", "architecture": model.hparams.arch, "rerank": model.has_head,
               "pooling": config.pooling, "normalize": config.normalize, "max_seq_length": config.max_seq_length,
               "weights": model.weight_bytes, "hparams": vars(model.hparams)}
    if args.format == "json":
        if args.tensors:
            summary["tensors"] = [{"name": n, "type": t.ggml_type.name, "shape": list(t.shape), "bytes": t.nbytes}
                                  for n, t in model.tensors.items()]
        print(json.dumps(summary, indent=1, default=str))
        return 0
    print(f"file: {summary['file']}\nformat: {summary['format']}, {len(model.tensors)} tensors, "
          f"{format_bytes(model.weight_bytes)}\nkind: encoder ({model.hparams.arch}; embeddings"
          f"{', reranking' if model.has_head else ''})\nembeddings: {config.pooling} pooling"
          f"{', L2-normalized' if config.normalize else ''}, up to {config.max_seq_length} tokens per input"
          f" ({'the sentence-transformers modules' if config.declared else 'defaults: no modules.json'})")
    print("\nhyperparameters:")
    for k, v in vars(model.hparams).items():
        print(f"  {k} = {v}")
    if args.tensors:
        print("\ntensors:")
        for name, t in model.tensors.items():
            print(f"  {name:40s} {t.ggml_type.name:6s} {str(list(t.shape)):>16s} {format_bytes(t.nbytes):>12s}")
    return 0
