"""The ``minfer`` command: run, chat, embed, rerank, serve, inspect, perplexity, bench, trace, pull, warmup.

Each module of this package registers its subcommands (``add_parsers``) with their handler (``handler`` default);
the handlers import what they run (the model, the server) when called, so ``minfer --help`` stays quick.

User mistakes print one line ``minfer: error: ...`` on stderr and exit with status 1 (2 for bad
command-line usage, as argparse does); no traceback.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence

from minfer.cli import embedding, generate, inspection, measure, serve, tracing, warmup
from minfer.errors import MinferError

# the subcommands that run kernels (the others never import numba, whose import alone takes ~1 s)
COMPILING_COMMANDS = frozenset({"run", "chat", "perplexity", "bench", "serve", "trace", "warmup", "embed", "rerank"})
# the subcommands whose options may come after (or between) their positional texts
INTERMIXED_COMMANDS = frozenset({"run", "embed", "rerank", "serve"})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minfer",
                                     description="Run GGUF and Hugging Face language models on the CPU.")
    parser.add_argument("--version", action="version", version=f"minfer {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    # the order `minfer --help` lists them in
    for group in (generate, embedding, inspection, measure, tracing, serve, warmup):
        group.add_parsers(sub.add_parser)
    return parser


def _version() -> str:
    """The installed distribution's version (read from its metadata: importing ``minfer`` would load numpy)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("minfer")
    except PackageNotFoundError:  # run from a source tree that was not installed
        return "unknown"


def interrupt_on_ctrl_c() -> None:
    """Ctrl-C (SIGINT) raises KeyboardInterrupt, whatever disposition the parent left: Python installs its own
    handler only when SIGINT was not ignored at start, and a shell starts its background jobs (`cmd &`, a script's
    `nohup`) with SIGINT ignored, as some supervisors do. Without this, Ctrl-C would not stop a chat's answer, nor
    a pull. (`minfer serve` installs its own shutdown handlers over this one.)"""
    if threading.current_thread() is threading.main_thread():  # signal.signal works only there
        signal.signal(signal.SIGINT, signal.default_int_handler)


def main(argv: Sequence[str] | None = None) -> int:
    interrupt_on_ctrl_c()
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args, _ = parser.parse_known_args(argv)
    if args.command not in INTERMIXED_COMMANDS:
        args = parser.parse_args(argv)
    else:
        # options may sit between MODEL and PROMPT (`minfer run model.gguf --chat "hi"`): parse intermixed
        command = args.command
        sub_parser = parser._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
        args = sub_parser.parse_intermixed_args(argv[argv.index(command) + 1 :], argparse.Namespace(command=command))
    try:
        if args.command in COMPILING_COMMANDS:  # these run kernels: say so when one is compiled
            from minfer.cli.compile_notice import compile_notices

            with compile_notices(sys.stderr):
                return args.handler(args)
        return args.handler(args)
    except MinferError as e:
        print(f"minfer: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nminfer: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
