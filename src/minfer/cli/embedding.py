"""``minfer embed`` and ``minfer rerank``: an encoder model's embeddings and a cross-encoder's ranking.

``embed`` takes texts as arguments or one per line of ``-f FILE`` (``-`` reads stdin) and writes JSON (a list of
vectors, or ``{"model", "data": [...]}`` with ``--json-meta``) or a ``.npy`` file (``-o out.npy``, written
atomically). ``rerank`` prints each document's index, score and text, best first.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from minfer.errors import BadRequestError


def add_parsers(add_parser: Callable[..., argparse.ArgumentParser]) -> None:
    """Register ``embed`` and ``rerank`` (``add_parser``: the ``add_parser`` of the subcommands action)."""
    emb = add_parser("embed", help="embeddings of texts with an encoder model (all-minilm, a BERT folder)",
                     description="Embeddings of texts, pooled and normalized as the model's sentence-transformers "
                                 "configuration says.")
    emb.add_argument("model", help="an encoder's HF folder, or a known name such as all-minilm")
    emb.add_argument("texts", nargs="*", metavar="TEXT", help="texts to embed (or -f FILE)")
    emb.add_argument("-f", "--file", default=None, help="read the texts from FILE, one per line ('-': stdin)")
    emb.add_argument("-o", "--output", default=None,
                     help="write to this file: .npy (float32 [n, n_embd]) or .json (default: JSON on stdout)")
    emb.add_argument("--pooling", default=None,
                     choices=["mean", "cls", "last", "max", "mean_sqrt_len", "weighted_mean"],
                     help="override the model's pooling")
    emb.add_argument("--no-normalize", action="store_true", help="do not L2-normalize the vectors")
    emb.add_argument("--truncate", action="store_true",
                     help="cut texts longer than the model's max_seq_length (else they are an error)")
    emb.add_argument("-t", "--threads", type=int, default=None, help="threads (default: the cores available)")
    emb.set_defaults(handler=cmd_embed)
    rr = add_parser("rerank", help="rank documents against a query with a cross-encoder reranker")
    rr.add_argument("model", help="a cross-encoder's HF folder (a *ForSequenceClassification checkpoint)")
    rr.add_argument("query")
    rr.add_argument("documents", nargs="*", metavar="DOCUMENT", help="documents (or -f FILE, one per line)")
    rr.add_argument("-f", "--file", default=None, help="read the documents from FILE, one per line ('-': stdin)")
    rr.add_argument("--top-n", type=int, default=None, help="show the best N only")
    rr.add_argument("--json", action="store_true", help="print the results as JSON")
    rr.add_argument("-t", "--threads", type=int, default=None, help="threads (default: the cores available)")
    rr.set_defaults(handler=cmd_rerank)


def refuse_encoder(model: str | None, command: str) -> None:
    """A one-line error when ``model`` is an encoder, for the subcommands that generate or trace a decoder."""
    from minfer.models.bert import is_encoder_checkpoint
    from minfer.pull import resolve_model

    path = resolve_model(model)
    if is_encoder_checkpoint(path):
        raise BadRequestError(f"{path} is an encoder model: `minfer {command}` needs a generating model (for an "
                              "encoder: `minfer embed`, `minfer rerank`, `minfer serve`, `minfer inspect`; its "
                              "throughput: bench/encoder_throughput.py)")


def _lines(args: argparse.Namespace, given: list[str], what: str) -> list[str]:
    if args.file is not None and given:
        raise BadRequestError(f"give the {what} as arguments or with -f, not both")
    if args.file is None:
        if not given:
            raise BadRequestError(f"no {what}: give them as arguments or with -f FILE")
        return given
    try:
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BadRequestError(f"{args.file}: cannot read ({e.__class__.__name__}: {e})") from None
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise BadRequestError(f"{args.file}: no {what} in it (one per line)")
    return lines


def _encoder(args: argparse.Namespace):
    from minfer.api import load
    from minfer.api_encoder import Encoder

    model = load(args.model, threads=args.threads)
    if not isinstance(model, Encoder):
        raise BadRequestError(f"{model.path} is a generating model; `minfer embed` and `minfer rerank` take an encoder "
                              "(for a decoder's embeddings use the server's /v1/embeddings or Model.embed)")
    return model


def cmd_embed(args: argparse.Namespace) -> int:
    import numpy as np

    from minfer.formats.atomic import write_atomically

    texts = _lines(args, args.texts, "texts")
    model = _encoder(args)
    vectors = model.embed(texts, pooling=args.pooling, normalize=False if args.no_normalize else None,
                          truncate=args.truncate)
    if args.output is not None and args.output.endswith(".npy"):
        import io

        buf = io.BytesIO()
        np.save(buf, np.asarray(vectors, np.float32))
        write_atomically(args.output, buf.getvalue(), "embeddings")
        print(f"minfer: {len(texts)} embeddings of {model.n_embd} values -> {args.output}", file=sys.stderr)
        return 0
    text = json.dumps([[float(x) for x in v] for v in vectors])
    if args.output is not None:
        write_atomically(args.output, text.encode(), "embeddings")
    else:
        print(text)
    return 0


def cmd_rerank(args: argparse.Namespace) -> int:
    documents = _lines(args, args.documents, "documents")
    model = _encoder(args)
    results = model.rerank(args.query, documents, top_n=args.top_n)
    if args.json:
        print(json.dumps([{**r, "document": documents[r["index"]]} for r in results]))
    else:
        for r in results:
            print(f"{r['index']}\t{r['relevance_score']:.6f}\t{documents[r['index']]}")
    return 0
