"""llama-server's command-line flags (llama.cpp ``common/arg.cpp``, the server's and the shared ones) and what
``minfer serve`` does with each, as data: so a llama-server command line works unchanged, or stops at once with
one line saying which flag minfer cannot honour and why. Nothing in llama-server's list is silently ignored.

Each :class:`LlamaFlag` names its spellings, whether it takes a value, and one action:

- ``same``: minfer's own flag of that spelling does what llama-server's does;
- ``alias``: another spelling of minfer's flag ``target`` (added onto it, so ``--help`` lists it there);
- ``const``: sets minfer's option ``target`` to ``value`` (``--log-disable``: ``--log-format off``);
- ``ignored``: accepted and without effect, because it cannot change what the server answers (``why`` says
  so in ``--help``): flags for GPUs and thread pinning on a CPU engine, and settings that are minfer's only
  behaviour already;
- ``refused``: a one-line error naming the flag and ``why``.

:func:`install` applies the table to ``minfer serve``'s parser. A spelling minfer's parser defines already is
left to it: minfer's own definition wins, whatever the table says (a flag added later needs no table edit to
work, only to be described right).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

Action = Literal["same", "alias", "const", "ignored", "refused"]


@dataclass(frozen=True)
class LlamaFlag:
    spellings: tuple[str, ...]
    takes_value: bool  # False: a switch; True: one value follows (two for --control-vector-layer-range)
    action: Action
    why: str = ""  # refused / ignored: the reason; alias / const: what it maps to, for --help
    target: str = ""  # alias: minfer's flag; const: the dest it sets
    value: Any = None  # const: the value
    nargs: int = 1  # values a value-taking flag consumes


def _f(spellings: str, takes_value: bool, action: Action, why: str = "", target: str = "", value: Any = None,
       nargs: int = 1) -> LlamaFlag:
    return LlamaFlag(tuple(spellings.split()), takes_value, action, why, target, value, nargs)


_NO_GPU = "minfer runs on the CPU: there is no device to offload to"
_NO_PIN = "minfer does not pin its threads to CPUs or change their priority"
_NO_DOWNLOAD = "minfer serve downloads no models (give a file or folder, or a known name: see minfer pull)"
_ROPE = "minfer reads RoPE scaling from the model file; it cannot be overridden"
_DRAFT_OWN = "minfer's draft model shares the target's threads and cache settings"

FLAGS: tuple[LlamaFlag, ...] = (
    # -- general -------------------------------------------------------------------------------------
    _f("-h --help", False, "same"),
    _f("--usage", False, "alias", target="--help"),
    _f("--version", False, "refused", "minfer prints its version with 'minfer --version'"),
    _f("-cl --cache-list", False, "refused", "minfer serve lists no cache ('minfer pull --help' lists the models)"),
    _f("--completion-bash", False, "refused", "minfer prints no bash completion script"),
    _f("-t --threads", True, "same"),
    _f("-tb --threads-batch", True, "refused", "minfer uses --threads for prompts and generation alike"),
    _f("-C --cpu-mask -Cr --cpu-range --cpu-strict --prio --poll -Cb --cpu-mask-batch -Crb --cpu-range-batch "
       "--cpu-strict-batch --prio-batch --poll-batch", True, "refused", _NO_PIN),
    _f("--numa", True, "refused", _NO_PIN),
    _f("-lcs --lookup-cache-static -lcd --lookup-cache-dynamic", True, "refused",
       "minfer's prompt lookup (--lookup) drafts from the prompt and output only, not from cache files"),
    # -- context and cache -----------------------------------------------------------------------------
    _f("-c --ctx-size", True, "same"),
    _f("-n --predict --n-predict", True, "same"),
    _f("-b --batch-size", True, "same"),
    _f("-ub --ubatch-size", True, "alias", "minfer has one batch size, the tokens of one forward pass",
       target="--batch-size"),
    _f("--keep", True, "refused", "it applies to --context-shift, which minfer serve does not do"),
    _f("--context-shift", False, "refused", "minfer serve ends a sequence at the end of its context (no shift)"),
    _f("--no-context-shift", False, "ignored", "minfer serve never shifts the context"),
    _f("--swa-full", False, "refused", "minfer sizes the sliding-window layers' cache itself"),
    _f("-ctxcp --ctx-checkpoints --swa-checkpoints -cms --checkpoint-min-step", True, "refused",
       "minfer keeps no context checkpoints"),
    _f("--cache-ram", True, "same"),
    _f("-cram", True, "alias", target="--cache-ram"),
    _f("-kvu --kv-unified", False, "ignored", "minfer's KV cache is unified already: all sequences share --ctx-size"),
    _f("-no-kvu --no-kv-unified --kv-unified-per-slot", False, "refused",
       "minfer's sequences share one KV cache (each gets its own context only with --draft)"),
    _f("--cache-idle-slots --no-cache-idle-slots", False, "same"),
    _f("-fa --flash-attn", True, "ignored", "minfer's attention is its own kernel; the choice does not apply"),
    _f("--perf --no-perf", False, "ignored", "minfer always reports timings"),
    _f("-e --escape --no-escape -sp --special", False, "refused", "these shape a prompt given on the command line; "
       "minfer serve takes prompts by HTTP"),
    _f("-r --reverse-prompt", True, "refused", "a stop string is given per request ('stop')"),
    _f("--warmup --no-warmup", False, "ignored", "minfer always warms up at load (it compiles its kernels there)"),
    _f("--spm-infill", False, "refused", "minfer lays out /infill as prefix, suffix, middle"),
    # -- sampling: the server's defaults for requests that do not set them -------------------------------------
    _f("--samplers -s --seed --temp --temperature --top-k --top-p --min-p --top-nsigma --top-n-sigma "
       "--xtc-probability --xtc-threshold --typical --repeat-last-n --repeat-penalty --presence-penalty "
       "--frequency-penalty --dry-multiplier --dry-base --dry-allowed-length --dry-penalty-last-n "
       "--dry-sequence-breaker --mirostat --mirostat-lr --mirostat-ent -l --logit-bias", True, "same"),
    _f("--typical-p", True, "alias", target="--typical"),
    _f("--sampler-seq --sampling-seq", True, "refused", "give the sampler order by name with --samplers"),
    _f("--ignore-eos", False, "refused", "ignore_eos is set per request"),
    _f("--adaptive-target --adaptive-decay --dynatemp-range --dynatemp-exp", True, "refused",
       "minfer has no adaptive-p or dynamic-temperature sampler"),
    _f("--grammar --grammar-file -j --json-schema -jf --json-schema-file", True, "refused",
       "minfer serve constrains output per request ('grammar', 'json_schema', 'response_format')"),
    _f("-bs --backend-sampling", False, "refused", _NO_GPU),
    # -- model -------------------------------------------------------------------------------------
    _f("--pooling", True, "same"),
    _f("--rope-scaling --rope-scale --rope-freq-base --rope-freq-scale --yarn-orig-ctx --yarn-ext-factor "
       "--yarn-attn-factor --yarn-beta-slow --yarn-beta-fast", True, "refused", _ROPE),
    _f("-kvo --kv-offload -nkvo --no-kv-offload --no-host --op-offload --no-op-offload --mmproj-offload "
       "--no-mmproj-offload -cmoe --cpu-moe", False, "ignored", _NO_GPU),
    _f("-ngl --gpu-layers --n-gpu-layers -sm --split-mode -ts --tensor-split -mg --main-gpu", True, "ignored",
       _NO_GPU),
    _f("-dev --device -mmdev --mmproj-device -ncmoe --n-cpu-moe -ncffn --n-cpu-ffn -ot --override-tensor --rpc "
       "-fit --fit -fitt --fit-target -fitc --fit-ctx", True, "refused", _NO_GPU),
    _f("--list-devices", False, "refused", _NO_GPU),
    _f("--repack -nr --no-repack", False, "ignored", "minfer lays out its weights for its own kernels"),
    _f("-ctk --cache-type-k -ctv --cache-type-v", True, "alias",
       "minfer's --cache-type sets K and V alike (the last one given wins)", target="--cache-type"),
    _f("-dt --defrag-thold", True, "ignored", "minfer's paged KV cache needs no defragmentation"),
    _f("-np --parallel", True, "same"),
    _f("-cb --cont-batching", False, "ignored", "minfer always batches continuously"),
    _f("-nocb --no-cont-batching", False, "refused", "minfer always batches continuously"),
    _f("--mmproj", True, "same"),
    _f("-mm", True, "alias", target="--mmproj"),
    _f("-mmu --mmproj-url", True, "refused", _NO_DOWNLOAD),
    _f("--mmproj-auto", False, "refused", "minfer loads a projector only from --mmproj FILE"),
    _f("--no-mmproj --no-mmproj-auto", False, "ignored", "minfer loads a projector only from --mmproj FILE"),
    _f("--image-min-tokens --image-max-tokens --mtmd-batch-max-tokens --video-fps --video-timestamp-interval "
       "--video-ffmpeg-dir", True, "refused", "minfer takes an image's token count from its vision model"),
    _f("-lm --load-mode -lzm --lazy-mode", True, "refused", "minfer loads the weights its own way"),
    _f("--check-tensors", False, "refused", "minfer checks tensors' shapes at load, not their values"),
    _f("--override-kv", True, "refused", "minfer reads the model's metadata as it is"),
    _f("--lora --lora-scaled", True, "same"),
    _f("--lora-init-without-apply", False, "same"),
    _f("--control-vector --control-vector-scaled", True, "refused", "minfer has no control vectors"),
    _f("--control-vector-layer-range", True, "refused", "minfer has no control vectors", nargs=2),
    _f("--alias --tags", True, "same"),
    _f("-a", True, "alias", target="--alias"),
    _f("-m --model", True, "same"),
    _f("-mu --model-url -dr --docker-repo -hf -hfr --hf-repo -hff --hf-file -hft --hf-token", True, "refused",
       _NO_DOWNLOAD),
    _f("--offline", False, "refused", "minfer serve may fetch a known model by name; give a file to stay offline"),
    _f("--embd-normalize", True, "refused", "minfer L2-normalises pooled embeddings, or not with --no-normalize"),
    # -- the HTTP server ------------------------------------------------------------------------------
    _f("--host --port", True, "same"),
    _f("--reuse-port", False, "refused", "minfer listens on its socket alone"),
    _f("--path", True, "refused", "minfer's chat page is built in (--no-ui turns it off)"),
    _f("--cors-origins --cors-methods --cors-headers --api-key-file", True, "same"),
    _f("--cors-credentials --no-cors-credentials", False, "same"),
    _f("--metrics", False, "same"),
    _f("--api-prefix", True, "refused", "minfer serves its paths at the root (and under /v1)"),
    _f("--ui-config --webui-config --ui-config-file --webui-config-file --tools --tools-runtime --mcp-servers-config "
       "--mcp-servers-json", True, "refused", "minfer's chat page has no tools, MCP servers or settings file"),
    _f("--ui-mcp-proxy --webui-mcp-proxy --no-ui-mcp-proxy --no-webui-mcp-proxy -ag --agent -no-ag --no-agent",
       False, "refused", "minfer's chat page has no tools or MCP servers"),
    _f("--ui --no-ui", False, "same"),
    _f("--webui", False, "alias", target="--ui"),
    _f("--no-webui", False, "alias", target="--no-ui"),
    _f("--embedding --embeddings", False, "ignored", "minfer always serves embeddings beside generation"),
    _f("--rerank --reranking", False, "const", "--pooling rank", target="pooling", value="rank"),
    _f("--api-key", True, "same"),
    _f("--ssl-key-file --ssl-cert-file", True, "refused", "minfer serves plain HTTP: put a TLS proxy in front"),
    _f("--chat-template-kwargs", True, "same"),
    _f("-to --timeout --sse-ping-interval", True, "refused", "minfer keeps connections open as long as the client"),
    _f("--threads-http", True, "ignored", "minfer answers HTTP on one event loop, whatever the count"),
    _f("--cache-prompt", False, "ignored", "minfer always reuses cached prompt prefixes"),
    _f("--no-cache-prompt", False, "refused", "minfer always reuses cached prompt prefixes ('cache_prompt': false "
       "per request)"),
    _f("--cache-reuse", True, "refused", "minfer reuses prefixes only, not chunks shifted in the cache"),
    _f("--props", False, "refused", "minfer's /props is read-only"),
    _f("--slots --no-slots", False, "same"),
    _f("--slot-save-path", True, "same"),
    _f("--media-path", True, "same"),
    _f("--models-preset", True, "refused", "minfer's several models take their flags from the command line (no "
       "preset file)"),
    _f("--models-dir --models-max --sleep-idle-seconds", True, "same"),
    _f("--models-autoload", False, "ignored", "minfer always loads a model on its first request"),
    _f("--no-models-autoload", False, "refused", "minfer always loads a model on its first request"),
    _f("--jinja", False, "ignored", "minfer always renders the model's Jinja chat template"),
    _f("--no-jinja", False, "refused", "minfer always renders the model's Jinja chat template"),
    _f("--reasoning-format", True, "same"),
    _f("-rea --reasoning --reasoning-effort --reasoning-budget", True, "same"),
    _f("--reasoning-budget-message", True, "refused", "minfer has no thinking budget (--reasoning-budget -1 only)"),
    _f("--reasoning-preserve --no-reasoning-preserve", False, "same"),
    _f("--skip-chat-parsing --no-skip-chat-parsing", False, "refused",
       "minfer always parses a chat reply's reasoning and tool calls (reasoning_format none per request)"),
    _f("--chat-template", True, "refused", "minfer takes a template from a file (--chat-template-file), not by name"),
    _f("--chat-template-file", True, "same"),
    _f("--prefill-assistant", False, "ignored", "minfer continues a final assistant message already"),
    _f("--no-prefill-assistant", False, "refused", "minfer continues a final assistant message"),
    _f("-sps --slot-prompt-similarity", True, "refused", "minfer picks slots by their cached prefix"),
    # -- logging ---------------------------------------------------------------------------------------
    _f("--log-disable", False, "const", "--log-format off", target="log_format", value="off"),
    _f("--log-jsonl", False, "const", "--log-format json", target="log_format", value="json"),
    _f("--no-log-jsonl", False, "const", "--log-format text", target="log_format", value="text"),
    _f("--log-file --log-prompts-dir", True, "refused", "minfer logs to stderr: redirect it"),
    _f("--log-colors", True, "ignored", "minfer's log has no colours"),
    _f("--log-prefix --no-log-prefix --log-timestamps --no-log-timestamps", False, "ignored",
       "minfer's access log has its own fixed format"),
    _f("-v --verbose", False, "same"),
    _f("--log-verbose", False, "alias", target="--verbose"),
    _f("-lv --verbosity --log-verbosity", True, "refused", "use --log-level (critical ... debug)"),
    # -- speculative decoding --------------------------------------------------------------------------------
    _f("--spec-draft-model -md --model-draft", True, "alias", target="--draft"),
    _f("--draft-max --draft-min --draft-p-min", True, "same"),
    _f("--draft-n --spec-draft-n-max", True, "alias", target="--draft-max"),
    _f("--draft-n-min --spec-draft-n-min", True, "alias", target="--draft-min"),
    _f("--spec-draft-p-min", True, "alias", target="--draft-p-min"),
    _f("--spec-ngram-size-n", True, "alias", target="--lookup-ngram"),
    # llama-server's --draft N is the draft's length (--draft-max); minfer's --draft names the draft model
    _f("--draft", True, "same", "minfer's --draft names the draft model (llama-server's --draft N: use --draft-max)"),
    _f("--spec-draft-hf -hfd -hfrd --hf-repo-draft", True, "refused", _NO_DOWNLOAD),
    _f("--spec-draft-threads -td --threads-draft --spec-draft-threads-batch -tbd --threads-batch-draft "
       "--spec-draft-cpu-mask -Cd --cpu-mask-draft --spec-draft-cpu-range -Crd --cpu-range-draft "
       "--spec-draft-cpu-strict --cpu-strict-draft --spec-draft-prio --prio-draft --spec-draft-poll --poll-draft "
       "--spec-draft-cpu-mask-batch -Cbd --cpu-mask-batch-draft --spec-draft-cpu-strict-batch "
       "--cpu-strict-batch-draft --spec-draft-prio-batch --prio-batch-draft --spec-draft-poll-batch "
       "--poll-batch-draft --spec-draft-type-k -ctkd --cache-type-k-draft --spec-draft-type-v -ctvd "
       "--cache-type-v-draft --spec-draft-override-tensor -otd --override-tensor-draft --spec-draft-n-cpu-moe "
       "--spec-draft-ncmoe -ncmoed --n-cpu-moe-draft --spec-draft-device -devd --device-draft", True, "refused",
       _DRAFT_OWN),
    _f("--spec-draft-cpu-moe -cmoed --cpu-moe-draft --spec-draft-backend-sampling --no-spec-draft-backend-sampling",
       False, "ignored", _NO_GPU),
    _f("--spec-draft-ngl -ngld --gpu-layers-draft --n-gpu-layers-draft", True, "ignored", _NO_GPU),
    _f("--spec-synth-len --spec-synth-rates --spec-draft-p-split --draft-p-split --spec-type --spec-ngram-mod-n-min "
       "--spec-ngram-mod-n-max --spec-ngram-mod-n-match --spec-ngram-simple-size-n --spec-ngram-simple-size-m "
       "--spec-ngram-simple-min-hits --spec-ngram-map-k-size-n --spec-ngram-map-k-size-m --spec-ngram-map-k-min-hits "
       "--spec-ngram-map-k4v-size-n --spec-ngram-map-k4v-size-m --spec-ngram-map-k4v-min-hits --spec-ngram-size-m "
       "--spec-ngram-min-hits", True, "refused",
       "minfer speculates with a draft model (--draft) or prompt lookup (--lookup, --lookup-ngram) only"),
    # -- presets that download a model ---------------------------------------------------------------------
    _f("--embd-gemma-default --fim-qwen-1.5b-default --fim-qwen-3b-default --fim-qwen-7b-default "
       "--fim-qwen-7b-spec --fim-qwen-14b-spec --fim-qwen-30b-default --gpt-oss-20b-default --gpt-oss-120b-default "
       "--vision-gemma-4b-default --vision-gemma-12b-default --spec-default", False, "refused", _NO_DOWNLOAD),
)


def by_spelling() -> dict[str, LlamaFlag]:
    """Each spelling of the table to its entry."""
    return {s: flag for flag in FLAGS for s in flag.spellings}


class _Refuse(argparse.Action):
    """A flag minfer cannot honour: one line naming it and why, exit status 2 (argparse's for a bad flag)."""

    def __init__(self, option_strings: Sequence[str], dest: str, why: str = "", **kwargs: Any) -> None:
        self.why = why
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        parser.exit(2, f"minfer serve: error: {option_string}: {self.why}\n")


class _Ignore(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        pass  # accepted by design: the table's reason is in --help


def install(parser: argparse.ArgumentParser) -> None:
    """Apply :data:`FLAGS` to ``minfer serve``'s parser (after minfer's own flags are added): aliases join their
    target's option (and its ``--help`` line), ``const`` and ``ignored`` flags get a line in a group of their
    own, refused ones are hidden from ``--help`` and stop the parse with their reason."""
    known = parser._option_string_actions  # argparse keeps no public map of spellings to actions
    llama = parser.add_argument_group(
        "llama-server's flags", "minfer serve takes llama-server's command line: the flags above are llama-server's "
        "spellings where they share its name, the ones below are accepted for it, and the rest of llama-server's "
        "flags stop with the reason minfer cannot honour them")
    for flag in FLAGS:
        new = tuple(s for s in flag.spellings if s not in known)
        if not new:
            continue
        nargs = flag.nargs if flag.takes_value else 0
        if flag.action == "same":
            raise ValueError(f"the llama-server flags table says minfer defines {' '.join(new)}, but it does not")
        if flag.action == "alias":
            target = known[flag.target]
            for s in new:
                known[s] = target
            target.option_strings = [*target.option_strings, *new]
            if flag.why:
                target.help = f"{target.help}; {' '.join(new)}: {flag.why}"
        elif flag.action == "const":
            llama.add_argument(*new, dest=flag.target, action="store_const", const=flag.value,
                               default=argparse.SUPPRESS, help=f"llama-server's spelling of {flag.why}")
        elif flag.action == "ignored":
            metavar = {"metavar": "X"} if nargs else {}
            llama.add_argument(*new, action=_Ignore, nargs=nargs, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                               help=f"accepted, no effect: {flag.why}", **metavar)
        else:
            parser.add_argument(*new, action=_Refuse, nargs=nargs, why=flag.why, dest=argparse.SUPPRESS,
                                default=argparse.SUPPRESS, help=argparse.SUPPRESS)
