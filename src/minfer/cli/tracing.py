"""``minfer trace`` (one forward pass as an HTML page) and ``minfer compare-dumps`` (two dump folders, node by node)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from minfer.cli.options import add_model_and_prompt_arguments, add_quantize_flag, model_and_prompt
from minfer.errors import MinferError


def add_parsers(add_parser: Callable[..., argparse.ArgumentParser]) -> None:
    """Register ``trace`` and ``compare-dumps`` (``add_parser``: the ``add_parser`` of the subcommands action)."""
    tr = add_parser("trace", help="one forward pass of a prompt as a self-contained HTML page")
    add_model_and_prompt_arguments(tr)
    tr.add_argument("--html", required=True, metavar="FILE", help="where to write the page")
    tr.add_argument("-c", "--ctx-size", dest="n_ctx", type=int, default=None, help="context size")
    add_quantize_flag(tr)
    tr.set_defaults(handler=cmd_trace)

    cmp = add_parser("compare-dumps", help="compare two dump folders node by node")
    cmp.add_argument("a", help="dump folder (minfer run --dump-dir)")
    cmp.add_argument("b", help="dump folder to compare with")
    cmp.add_argument("--tol", type=float, default=1e-4, help="relative difference that counts as parting (1e-4)")
    cmp.add_argument("--all", action="store_true", help="print every node, not only up to the first divergence")
    cmp.set_defaults(handler=cmd_compare_dumps)


def cmd_trace(args: argparse.Namespace) -> int:
    from pathlib import Path

    import minfer
    from minfer.trace.html import render, trace_page_data

    model_ref, prompt = model_and_prompt(args)
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
    return 0 if first is None else 1  # scripts and CI can tell that two runs part
