"""``minfer run`` (one prompt, streamed to stdout) and ``minfer chat`` (a multi-turn REPL with /commands)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from minfer.cli.options import (
    add_model_and_prompt_arguments,
    add_model_argument,
    add_model_flags,
    add_sampling_flags,
    add_speculative_flags,
    constraint_kwargs,
    lora_kwargs,
    model_and_prompt,
    sampling_kwargs,
    speculative_kwargs,
    speculative_summary,
)
from minfer.errors import MinferError
from minfer.pull import DEFAULT_MODEL, KNOWN_MODELS

GENERATING_MODELS = [name for name, m in KNOWN_MODELS.items() if m.generates]  # (all-minilm is an encoder)

CHAT_HELP = """commands:
  /clear        forget the conversation (the system prompt stays)
  /regen        generate the last reply again
  /save FILE    save the conversation (transcript and KV cache) to FILE
  /load FILE    resume a conversation saved with /save
  /image FILE   show an image with the next message (a vision model; repeatable)
  /help         this help
  /exit, /quit  leave (also Ctrl-D or Ctrl-C at the prompt); an unsaved chat is saved to the cache folder
Ctrl-C while an answer is being written stops that answer."""


def add_parsers(add_parser: Callable[..., argparse.ArgumentParser]) -> None:
    """Register ``run`` and ``chat`` (``add_parser``: the ``add_parser`` of the subcommands action)."""
    run = add_parser("run", help="generate text from a prompt",
                     description="Generate text. MODEL is a GGUF file, an HF model folder (config.json, "
                     "safetensors, tokenizer.json) or a known model name "
                     f"({', '.join(GENERATING_MODELS)}; default {DEFAULT_MODEL}, pulled on first use).")
    add_model_and_prompt_arguments(run)
    add_sampling_flags(run)
    add_model_flags(run)
    add_speculative_flags(run)
    run.add_argument("--chat", action="store_true", help="treat PROMPT as a user message in the model's chat template")
    run.add_argument("--image", action="append", default=None, metavar="FILE",
                     help="an image the user message shows, before PROMPT (a vision model; implies --chat; repeatable)")
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
    run.set_defaults(handler=cmd_run)

    chat = add_parser("chat", help="interactive multi-turn chat (type /help inside)")
    add_model_argument(chat)
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--load", default=None, metavar="FILE", help="resume a saved session")
    add_sampling_flags(chat)
    add_model_flags(chat)
    add_speculative_flags(chat)
    chat.set_defaults(handler=cmd_chat)


def cmd_run(args: argparse.Namespace) -> int:
    import minfer
    from minfer.api import keep_for_process
    from minfer.runtime.vision import extract_images

    model_ref, prompt = model_and_prompt(args)
    model = minfer.load(model_ref, n_ctx=args.n_ctx, threads=args.threads, cache_type=args.cache_type,
                        trace=args.trace, dump_dir=args.dump_dir, dump_filter=args.dump_filter, quantize=args.quantize,
                        mmproj=args.mmproj, **speculative_kwargs(args), **lora_kwargs(args))
    keep_for_process()
    images: list = []
    if args.chat or args.image:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        content = [*({"type": "image", "path": f} for f in args.image or ()), {"type": "text", "text": prompt}]
        messages, inputs = extract_images([{"role": "user", "content": content}], allow_paths=True)
        text, add_special = model.render_chat(messages), False  # the template writes BOS
    else:
        if args.system:
            raise MinferError("--system needs --chat")
        text, add_special = prompt, True
    # -n beyond what the context leaves: stop at its end with finish "length" and say how to get more,
    # rather than fail on the token that does not fit
    if args.image:
        ids, images = model.image_prompt(text, inputs)
    else:
        ids = model.tokenize(text, add_special=add_special)
    room = model.n_ctx - len(ids) + 1
    max_tokens, capped = args.max_tokens, False
    if not args.context_shift and len(ids) <= model.n_ctx and max_tokens > room:
        max_tokens, capped = room, True
    steps = model.stream(ids, max_tokens, stop=args.stop, logprobs=args.logprobs, add_special=add_special,
                         context_shift=args.context_shift, n_keep=args.keep, images=images,
                         **constraint_kwargs(args), **sampling_kwargs(args))
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
            f"generated {stats.generated_tokens} tokens ({stats.decode_tokens_per_s:.1f} t/s)"
            f"{speculative_summary(stats)}, "
            f"{time.perf_counter() - t0:.2f} s, finish: {stats.finish_reason}",
            file=sys.stderr,
        )
    if capped and stats is not None and stats.finish_reason == "length":
        print(f"minfer: -n {args.max_tokens} is more than the context leaves ({room} tokens after the prompt's "
              f"{len(ids)} in a context of {model.n_ctx}); for more, raise --ctx-size or pass --context-shift",
              file=sys.stderr)
    return 0


def autosave_path() -> str:
    """Where an unsaved chat is kept on exit: ``<cache folder>/sessions/chat-<time>.session``."""
    from minfer.pull import cache_dir

    folder = cache_dir() / "sessions"
    folder.mkdir(parents=True, exist_ok=True)
    return str(folder / time.strftime("chat-%Y%m%d-%H%M%S.session"))


# over 80 lines on purpose: one interactive session (read, Ctrl-C, commands, save) read top to bottom; its
# parts would share the loop's state
def cmd_chat(args: argparse.Namespace) -> int:
    import minfer
    from minfer.api import keep_for_process
    from minfer.runtime.conversation import Conversation
    from minfer.runtime.vision import extract_images

    if args.logprobs is not None:
        raise MinferError("--logprobs is printed by `minfer run`, not in the chat")
    model = minfer.load(args.model, n_ctx=args.n_ctx, threads=args.threads, cache_type=args.cache_type,
                        quantize=args.quantize, mmproj=args.mmproj, **speculative_kwargs(args), **lora_kwargs(args))
    keep_for_process()
    sampling = sampling_kwargs(args)
    conv = Conversation.load(model, args.load) if args.load else model.conversation(system=args.system, **sampling)
    turn = dict(stop=args.stop, context_shift=args.context_shift, n_keep=args.keep, **constraint_kwargs(args))
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"minfer chat with {model.path.name} ({model.cache_type} cache, n_ctx {model.n_ctx}); /help for "
              "commands", file=sys.stderr)

    unsaved = False  # turns since the last /save or /load: offered to keep on the way out
    pending: list = []  # images (/image) for the next message

    def show(pieces) -> None:
        """Print an answer as it comes; Ctrl-C stops the answer, not the chat (the turn is dropped)."""
        nonlocal unsaved
        try:
            for piece in pieces:
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            pieces.close()
            sys.stdout.write("\n")
            print("(answer stopped; Ctrl-C again or /quit to end the chat)", file=sys.stderr)
            return
        sys.stdout.write("\n")
        sys.stdout.flush()
        unsaved = True

    def leave() -> int:
        """The chat ends: an unsaved conversation is kept in the cache folder, and the user told where."""
        if interactive and unsaved and conv.messages:
            path = autosave_path()
            try:
                conv.save(path)
                print(f"(conversation saved to {path}; resume it with: minfer chat --load {path})", file=sys.stderr)
            except MinferError as e:
                print(f"minfer: could not save the conversation: {e}", file=sys.stderr)
        return 0

    while True:
        try:
            line = input("> " if interactive else "")
        except (EOFError, KeyboardInterrupt):
            if interactive:
                sys.stdout.write("\n")
            return leave()
        text = line.strip()
        if not text:
            continue
        command, _, arg = text.partition(" ")
        try:
            if command in ("/exit", "/quit"):
                return leave()
            if command == "/help":
                print(CHAT_HELP)
            elif command == "/clear":
                conv.clear()
                unsaved = False
                print("(conversation cleared)", file=sys.stderr)
            elif command == "/regen":
                show(conv.regenerate(args.max_tokens, stream=True, **turn))
            elif command == "/save":
                if not arg:
                    raise MinferError("/save needs a file name")
                conv.save(arg.strip())
                unsaved = False
                print(f"(saved to {arg.strip()})", file=sys.stderr)
            elif command == "/load":
                if not arg:
                    raise MinferError("/load needs a file name")
                conv = Conversation.load(model, arg.strip())
                unsaved = False
                print(f"(loaded {len(conv.messages)} messages)", file=sys.stderr)
            elif command == "/image":
                if not arg:
                    raise MinferError("/image needs a file name")
                if model.images is None:
                    raise MinferError(f"{model.path} takes no images (it has no vision model)")
                _, found = extract_images([{"role": "user", "content": [{"type": "image", "path": arg.strip()}]}],
                                          allow_paths=True)
                pending.extend(found)
                print(f"(image {arg.strip()} goes with the next message)", file=sys.stderr)
            elif command.startswith("/"):
                raise MinferError(f"unknown command {command} (/help lists them)")
            else:
                images, pending = pending, []
                show(conv.send(line, args.max_tokens, stream=True, images=images, **turn))
        except MinferError as e:  # a bad command or a failed turn does not end the chat
            print(f"minfer: error: {e}", file=sys.stderr)
            if not interactive:
                return 1
