"""Flags several subcommands share (model, threads, cache, quantize, sampling, constraints) and their kwargs."""

from __future__ import annotations

import argparse

from minfer.errors import MinferError
from minfer.pull import DEFAULT_MODEL
from minfer.runtime.sampling.params import PARAMS, flag_help


def add_model_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="GGUF file, HF model folder or known model name")


def add_model_and_prompt_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("args", nargs="+", metavar="[MODEL] PROMPT", help="the model (optional) and the prompt")


def model_and_prompt(args: argparse.Namespace) -> tuple[str | None, str]:
    """The ``[MODEL] PROMPT`` positionals of ``add_model_and_prompt_arguments``: (None, PROMPT) without a model."""
    if len(args.args) > 2:
        raise MinferError(f"{args.command} takes [MODEL] PROMPT, got {len(args.args)} arguments (quote the prompt)")
    return (None, args.args[0]) if len(args.args) == 1 else (args.args[0], args.args[1])


def add_threads_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("-t", "--threads", type=int, default=None, help="threads (default: the cores available)")


def add_cache_type_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-type", default=None, choices=["f32", "f16", "q8_0"],
                   help="KV cache cells (default: $MINFER_CACHE_TYPE or f32)")


def add_quantize_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantize", default=None, choices=["q8_0", "q4_k"],
                   help="quantize the float weight matrices at load (HF folders: f32/f16/bf16 safetensors)")


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """How a generating command loads the model and handles a full context."""
    add_quantize_flag(p)
    add_threads_flag(p)
    p.add_argument("-c", "--ctx-size", dest="n_ctx", type=int, default=None,
                   help="context size in tokens (default: the model's, at most 4096)")
    add_cache_type_flag(p)
    p.add_argument("--context-shift", action="store_true",
                   help="when the context is full, drop the oldest half (after --keep tokens) instead of failing")
    p.add_argument("--keep", type=int, default=0, help="tokens kept at the start by --context-shift (default: 0)")
    add_mmproj_flag(p)
    add_lora_flags(p)


def add_mmproj_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mmproj", default=None, metavar="FILE",
                   help="a text GGUF's vision tower and projector (llama.cpp's mmproj file): the model takes images")


def add_lora_flags(p: argparse.ArgumentParser) -> None:
    """LoRA adapters, with llama.cpp's flag names."""
    g = p.add_argument_group("LoRA adapters (llama.cpp GGUF adapter files or PEFT folders)")
    g.add_argument("--lora", dest="lora", action="append", default=None, metavar="FILE[:SCALE]",
                   help="apply this adapter, at SCALE (default 1); repeatable")
    g.add_argument("--lora-scaled", dest="lora_scaled", action="append", nargs=2, default=None,
                   metavar=("FILE", "SCALE"), help="apply this adapter at SCALE (llama.cpp's form); repeatable")
    g.add_argument("--lora-merge", action="store_true",
                   help="add the adapters into the float weights at load (no cost per token; scales fixed)")
    g.add_argument("--lora-init-without-apply", action="store_true",
                   help="load the adapters with scale 0 (a request or POST /lora-adapters turns them on)")


def lora_kwargs(args: argparse.Namespace) -> dict:
    """``minfer.load``'s LoRA arguments from the flags of :func:`add_lora_flags`."""
    adapters: list[tuple[str, float]] = []
    for spec in args.lora or ():
        path, colon, tail = spec.rpartition(":")  # a path may hold ':' itself: only a number after it is a scale
        if colon and _is_number(tail):
            adapters.append((path, _scale(tail, f"--lora {spec}")))
        else:
            adapters.append((spec, 1.0))
    for path, scale in args.lora_scaled or ():
        adapters.append((path, _scale(scale, f"--lora-scaled {path} {scale}")))
    if not adapters:
        if args.lora_merge or args.lora_init_without_apply:
            flag = "--lora-merge" if args.lora_merge else "--lora-init-without-apply"
            raise MinferError(f"{flag} needs an adapter (--lora FILE)")
        return {}
    if args.lora_merge and args.lora_init_without_apply:
        raise MinferError("--lora-merge adds the adapters into the weights: it cannot load them unapplied "
                          "(--lora-init-without-apply)")
    return {"lora": adapters, "lora_merge": args.lora_merge, "lora_init_without_apply": args.lora_init_without_apply}


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _scale(text: str, where: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise MinferError(f"{where}: the scale {text!r} is not a number") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise MinferError(f"{where}: the scale must be finite")
    return value


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    """``-n``, the sampling group (one flag per SamplingParams field, --stop, --logprobs), the constraint group."""
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


def sampling_kwargs(args: argparse.Namespace) -> dict:
    """The SamplingParams fields given on the command line, converted as each one says."""
    kw = {}
    for field, param in PARAMS.items():
        value = getattr(args, field)
        if value is not None:
            kw[field] = param.from_cli(value) if param.from_cli is not None else value
    return kw


def constraint_kwargs(args: argparse.Namespace) -> dict:
    """``grammar=`` or ``json_schema=`` from at most one of --grammar, --grammar-file, --json-schema, --json."""
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


_SPECULATIVE_FLAGS = {"draft_max": "--draft-max", "draft_min": "--draft-min", "draft_p_min": "--draft-p-min",
                      "ngram_max": "--lookup-ngram"}


def add_speculative_flags(p: argparse.ArgumentParser) -> None:
    """Speculative decoding: prompt lookup or a draft model, and the limits of a draft."""
    s = p.add_argument_group("speculative decoding")
    s.add_argument("--lookup", action="store_true",
                   help="prompt lookup: draft the next tokens from earlier text of the prompt and the output")
    s.add_argument("--lookup-ngram", type=int, default=None, metavar="N",
                   help="n-gram lengths prompt lookup tries, N down to 1 (default: 3)")
    s.add_argument("--draft", default=None, metavar="MODEL",
                   help="draft model (GGUF file, HF folder or known name) with the target's vocabulary")
    s.add_argument("--draft-max", type=int, default=None, metavar="K", help="tokens a draft holds at most (default: 8)")
    s.add_argument("--draft-min", type=int, default=None, metavar="N",
                   help="a shorter draft is not verified (default: 0)")
    s.add_argument("--draft-p-min", type=float, default=None, metavar="P",
                   help="the draft model stops when its best token's probability is below P (default: 0.5)")


def speculative_kwargs(args: argparse.Namespace) -> dict:
    """``load``'s ``draft``, ``lookup`` and ``speculative`` from the flags, each value checked (the error names
    the flag)."""
    from minfer.errors import BadRequestError
    from minfer.runtime.speculative import SpeculativeSettings

    fields = {f: getattr(args, f if f != "ngram_max" else "lookup_ngram") for f in _SPECULATIVE_FLAGS}
    fields = {f: v for f, v in fields.items() if v is not None}
    if args.lookup and args.draft:
        raise MinferError("use one of --lookup and --draft")
    try:
        SpeculativeSettings(**fields)
    except BadRequestError as e:
        message = str(e)
        for field, flag in _SPECULATIVE_FLAGS.items():
            message = message.replace(field, flag)
        raise MinferError(message) from None
    return {"draft": args.draft, "lookup": args.lookup, "speculative": fields}


def speculative_summary(stats) -> str:
    """``, lookup: 52/60 drafted tokens accepted (87%), 3.41 tokens per target pass`` (empty without drafting)."""
    if stats.speculative == "off":
        return ""
    return (f", {stats.speculative}: {stats.accepted_tokens}/{stats.drafted_tokens} drafted tokens accepted "
            f"({stats.acceptance_rate:.0%}), {stats.tokens_per_pass:.2f} tokens per target pass")
