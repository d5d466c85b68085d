"""The Python API: ``minfer.load(path)`` returns a :class:`Model`.

    model = minfer.load("smollm2")                # a GGUF path or a known model name
    model.generate("The capital of France is", max_tokens=16, temperature=0)
    for piece in model.chat([{"role": "user", "content": "Hi!"}], stream=True): print(piece, end="")

Around the Model: :mod:`minfer.api_setup` (its threads, draft model and speculative default, the frozen
garbage collector) and :mod:`minfer.api_inputs` (embedding and infill inputs made token ids).
"""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from minfer.api_encoder import Encoder
from minfer.api_inputs import embedding_inputs, infill_layout
from minfer.api_setup import LoraSpec, default_threads, load_draft, lora_scales, lora_specs, speculative_settings
from minfer.api_setup import keep_for_process as keep_for_process  # re-exported: the CLI and server import it here
from minfer.backends.cpu.backend import CPUBackend
from minfer.errors import BadRequestError, ContextOverflowError
from minfer.formats.chat_template import ChatTemplate
from minfer.formats.fim import FimTokens, find_fim_tokens
from minfer.formats.tokenizer import Tokenizer
from minfer.models.bert import is_encoder_checkpoint
from minfer.models.hparams import HParams
from minfer.models.mmproj import vision_from_mmproj
from minfer.models.model import TransformerModel
from minfer.pull import resolve_model
from minfer.runtime.chat import (
    ChatDelta,
    ChatOptions,
    ChatPlan,
    MessageBuilder,
    parse_tool_choice,
    parse_tools,
    plan_chat,
)
from minfer.runtime.constraints import Constraint
from minfer.runtime.conversation import Conversation
from minfer.runtime.engine import EngineConfig, build_engine
from minfer.runtime.forward import ForwardRunner
from minfer.runtime.kv_cache import KVCache
from minfer.runtime.perplexity import PerplexityResult, perplexity
from minfer.runtime.pooling import Pooling, check_pooling, model_pooling
from minfer.runtime.requests import EmbeddingRequest, GenerationRequest
from minfer.runtime.sampling import Sampler, SamplingParams, TokenLogprob
from minfer.runtime.sequence import GenerationStats, TokenStep
from minfer.runtime.speculative import SpeculativeSettings
from minfer.runtime.speculative import resolve as resolve_speculative
from minfer.runtime.vision import ImageInput, ImagePrompter, PassImage, VisionRunner, drain, extract_images
from minfer.trace.capture import TraceCapture
from minfer.trace.dump import Dumper
from minfer.trace.explorer import ForwardTrace
from minfer.trace.head_attention import label_image_rows
from minfer.trace.tracer import Tracer
from minfer.trace.vision_pass import VisionCapture, VisionTrace

DEFAULT_N_CTX = 4096


@dataclass
class Completion:
    text: str
    tokens: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprob]
    stats: GenerationStats


class Model:
    """A loaded model with its tokenizer, chat template, KV cache and backend."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        n_ctx: int | None = None,
        threads: int | None = None,
        kernels: str | None = None,
        cache_type: str | None = None,
        trace: str | os.PathLike[str] | None = None,
        dump_dir: str | os.PathLike[str] | None = None,
        dump_filter: str | None = None,
        quantize: str | None = None,
        engine_config: EngineConfig | None = None,
        draft: str | os.PathLike[str] | None = None,
        lookup: bool = False,
        speculative: SpeculativeSettings | Mapping[str, Any] | None = None,
        lora: LoraSpec | Sequence[LoraSpec] | None = None,
        lora_merge: bool = False,
        lora_init_without_apply: bool = False,
        mmproj: str | os.PathLike[str] | None = None,
    ) -> None:
        if n_ctx is not None and (not isinstance(n_ctx, int) or n_ctx < 1):
            raise BadRequestError(f"n_ctx must be a positive integer, got {n_ctx!r}")
        if threads is None:
            threads = default_threads()
        if not isinstance(threads, int) or threads < 1:
            raise BadRequestError(f"threads must be a positive integer, got {threads!r}")
        adapters = lora_specs(lora)
        self.transformer = TransformerModel.from_path(path, quantize=quantize, threads=threads,
                                                      merge_loras=adapters if lora_merge else ())
        for adapter, _ in adapters if not lora_merge else ():
            self.transformer.add_lora(adapter)
        self.path = self.transformer.path
        hp = self.transformer.hparams
        if n_ctx is None:
            n_ctx = min(hp.n_ctx_train, DEFAULT_N_CTX)
        self.n_ctx = n_ctx
        self.threads = threads
        self.tokenizer: Tokenizer = self.transformer.load_tokenizer()
        if mmproj is not None:  # a text GGUF's vision tower and projector, in a file of their own (llama.cpp's)
            self.transformer.vision = vision_from_mmproj(mmproj, hp.n_embd, self.tokenizer.backend.token_to_id)
        self.chat_template: ChatTemplate | None = self.transformer.load_chat_template(self.tokenizer)
        # sampling defaults the checkpoint ships (HF generation_config.json); explicit arguments win
        self.generation_defaults: dict[str, Any] = self.transformer.generation_defaults()
        self.backend = CPUBackend(threads=threads, kernels=kernels)
        trace = trace or os.environ.get("MINFER_TRACE") or None
        dump_dir = dump_dir or os.environ.get("MINFER_DUMP_DIR") or None
        self.tracer = Tracer(trace, self.tokenizer) if trace else None
        dump_filter = dump_filter or os.environ.get("MINFER_DUMP_FILTER")
        self.dumper = Dumper(dump_dir, dump_filter) if dump_dir else None
        observers = [o for o in (self.tracer, self.dumper) if o is not None]
        settings = speculative_settings(draft, lookup, speculative)
        self.draft = load_draft(draft, self.tokenizer, threads) if draft is not None else None
        self.engine = build_engine(self.transformer, self.backend, self.tokenizer, n_ctx, cache_type,
                                   engine_config or EngineConfig(), observers, settings, self.draft)
        self.runner = self.engine.runner
        if self.transformer.loras:
            self.runner.set_lora([0.0 if lora_init_without_apply else s for _, s in adapters])
        # a cold cache compiles here, announced, not inside the first answer; the plans of the passes after
        # a prompt are built now, not between its tokens
        self.engine.warm_up()
        self.kv = self.engine.kv
        self.last_stats: GenerationStats | None = None
        # a vision-language model's images: decoded, encoded (each one once) and placed in prompts
        vision = self.transformer.vision
        self.images = None if vision is None else ImagePrompter(VisionRunner(vision, self.backend), vision.processor,
                                                                self.tokenizer)

    @property
    def hparams(self) -> HParams:
        return self.transformer.hparams

    # -- LoRA adapters ---------------------------------------------------------------------------

    @property
    def lora_adapters(self) -> list[dict[str, Any]]:
        """The loaded (unmerged) adapters as llama-server lists them: ``{"id", "path", "scale", "task_name",
        "prompt_prefix"}``, the scale being what a request that names none runs with."""
        scales = self.runner.lora_scales
        return [{"id": k, "path": str(a.path), "scale": float(scales[k]), "task_name": a.task_name,
                 "prompt_prefix": a.prompt_prefix} for k, a in enumerate(self.transformer.loras)]

    def request_lora(self, lora: Mapping[int, float] | Sequence[Mapping[str, Any]] | None) -> list[float] | None:
        """A request's ``lora`` (``[{"id": 0, "scale": 0.5}]``; adapters not named are off) as each adapter's scale;
        None (no ``lora``): the defaults. A bad id or scale is a one-line error."""
        return None if lora is None else lora_scales(lora, len(self.transformer.loras))

    def set_lora(self, scales: Mapping[int, float] | Sequence[Mapping[str, Any]]) -> None:
        """The default adapter scales, as llama-server's ``POST /lora-adapters``: ``[{"id": 0, "scale": 0.5}]``
        or ``{0: 0.5}``; an adapter not named gets 0 (off). Cached prefixes computed under other scales are
        not reused."""
        self.runner.set_lora(lora_scales(scales, len(self.transformer.loras)))

    def add_lora_adapter(self, path: str | os.PathLike[str]) -> int:
        """Load one more LoRA adapter (a GGUF adapter file or a PEFT folder) while the model serves: its id. It
        starts off (scale 0) for every sequence, so nothing that runs changes; a request turns it on with its
        ``lora``. Call it on the thread that runs the engine, between two steps (a server's
        ``EngineLoop.call``): the prepared plans were built for the old adapter set and are dropped here (the
        next pass of each shape builds its plan again), and the running sequences' scales grow by a 0.
        Cached prefixes computed before keep their old scales, so they are not reused under the new ones."""
        k = self.transformer.add_lora(path)
        self.runner.adapter_added()
        return k

    @property
    def cache_type(self) -> str:
        return self.kv.cache_type

    @property
    def kv_bytes_per_position(self) -> int:
        """KV cache bytes per position (all layers, K and V), measured from the allocated regions."""
        return self.kv.bytes_per_position

    @property
    def kv_bytes(self) -> int:
        """KV cache bytes for the whole context."""
        return self.kv.nbytes

    # -- tokens ----------------------------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    # -- forward ---------------------------------------------------------------------------------

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Logits ``[len(token_ids), n_vocab]`` of a fresh sequence at positions 0..n-1."""
        ids = list(token_ids)
        if len(ids) > self.n_ctx:
            raise ContextOverflowError(f"{len(ids)} tokens do not fit in the context of {self.n_ctx}")
        return self.runner.forward(ids, range(len(ids)))

    def trace_forward(
        self, token_ids: Sequence[int], cache_type: str | None = None, budget: int | None = None,
        description: str = "", images: Sequence[PassImage] = (), image_inputs: Sequence[ImageInput] = (),
    ) -> ForwardTrace:
        """One forward pass of a fresh sequence, held for the trace explorer (:mod:`minfer.trace.explorer`).

        It runs on a plan and KV cache of its own (``cache_type``: this model's by default; another one
        to compare), sharing the weights and backend, so it never touches a generation's cache; call it
        from the thread that runs the engine. ``budget``: bytes of full tensors kept (``MINFER_TRACE_MEMORY``).
        ``images``: where images' tokens go in the prompt (:meth:`image_prompt` makes both); their rows are
        labelled ``<image k>`` and the trace marks them (``ForwardTrace.images``). ``image_inputs``: those images
        as sent, whose pass through the vision tower the trace holds too (``ForwardTrace.vision``)."""
        ids = list(token_ids)
        if not ids:
            raise BadRequestError("no tokens to trace")
        if len(ids) > self.n_ctx:
            raise ContextOverflowError(f"{len(ids)} tokens do not fit in the context of {self.n_ctx}")
        kv = KVCache(self.hparams, len(ids), cache_type or self.cache_type)
        runner = ForwardRunner(self.transformer, self.backend, kv, max_plans=1)
        runner.lora_scales = self.runner.lora_scales
        plan = runner.plan(len(ids), len(ids))
        placed = list(images)

        def execute(capture: TraceCapture) -> None:
            runner.observers = [capture]
            try:
                runner.forward(ids, range(len(ids)), images=placed)
            finally:
                runner.observers = []

        labels = label_image_rows([self.tokenizer.decode([t]) if t >= 0 else "" for t in ids], placed)
        arena = sum(a.nbytes for a in plan.pool) + kv.nbytes
        trace = ForwardTrace.run(plan.graph, self.hparams, ids, labels, kv.cache_type, self.path.name, execute,
                                 lambda t: self.tokenizer.decode([t]), self.backend, budget, arena, images=placed,
                                 images_bidirectional=bool(getattr(self.transformer.vision, "bidirectional", False)))
        trace.description = description or f"{self.path.name}, {kv.cache_type} cache"
        trace.image_inputs = list(image_inputs)
        if image_inputs:
            trace.vision = self._trace_vision(image_inputs, trace.budget // 4)  # (a share of the trace's budget)
        return trace

    def _trace_vision(self, images: Sequence[ImageInput], budget: int) -> VisionTrace:
        """The vision tower's pass over ``images``' tiles, held for the trace explorer within ``budget`` bytes."""
        if self.images is None:
            raise BadRequestError(f"{self.path} takes no images (it has no vision model)")
        runner = self.images.runner
        pixels = self.images.pixels(images)
        plan = runner.plan(len(pixels))

        def execute(capture: VisionCapture) -> None:
            runner.encode(pixels, capture.step)

        return VisionTrace.run(plan.graph, execute, len(pixels), runner.model.hparams.tokens_per_image, budget)

    # -- embeddings ------------------------------------------------------------------------------

    @property
    def pooling(self) -> Pooling:
        """The pooling embeddings get by default: the GGUF's ``<arch>.pooling_type``, else ``mean``."""
        return model_pooling(self.transformer.source.pooling_type(), self.hparams.arch)

    def embed_inputs(self, texts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]]) -> list[list[int]]:
        """The token ids of each input: a string, a list of strings, a list of token ids or a list of such
        lists (strings are tokenized with the model's special tokens, BOS included where it wants one)."""
        return embedding_inputs(texts, lambda text: self.tokenize(text, add_special=True))

    def embed(
        self,
        texts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        pooling: Pooling | None = None,
        normalize: bool = True,
    ) -> np.ndarray | list[np.ndarray]:
        """Embeddings of ``texts`` (see :meth:`embed_inputs`): ``[n_inputs, n_embd]`` float32, pooled from
        the final-normed hidden states (``pooling``: ``mean`` over every position, BOS included, ``cls``
        the first, ``last`` the last; default :attr:`pooling`), L2-normalised unless ``normalize=False``.
        ``pooling="none"``: a list of ``[n_tokens, n_embd]`` arrays, one vector per token, not normalised."""
        pooling = check_pooling(pooling) if pooling is not None else self.pooling
        requests = [EmbeddingRequest(ids, pooling, normalize) for ids in self.embed_inputs(texts)]
        self.engine.cancel_all()  # one caller at a time, as for generation
        vectors = self.engine.embed(requests)
        return vectors if pooling == "none" else np.stack(vectors)

    # -- fill in the middle ------------------------------------------------------------------------

    @property
    def fim_tokens(self) -> FimTokens | None:
        """The fill-in-the-middle tokens (GGUF ``tokenizer.ggml.fim_*_token_id``, else by their texts), or None."""
        if not hasattr(self, "_fim"):
            self._fim = find_fim_tokens(self.transformer.metadata, self.tokenizer.backend.token_to_id,
                                        self.hparams.n_vocab)
        return self._fim

    def infill_prompt(self, prefix: str, suffix: str, prompt: str = "",
                      extra: Sequence[tuple[str, str]] = ()) -> list[int]:
        """The token ids of a fill-in-the-middle prompt, laid out as llama-server's ``/infill`` does: the
        ``extra`` (filename, text) chunks first (repo-level, with the repository and file-separator tokens
        when the model has them, else their text as is), then ``<PRE>prefix<SUF>suffix<MID>prompt``."""
        fim = self.fim_tokens
        if fim is None:
            raise BadRequestError(f"{self.path} has no fill-in-the-middle tokens (prefix, suffix, middle), so it "
                                  "cannot infill")
        bos = [self.tokenizer.bos_id] if self.tokenizer.add_bos and self.tokenizer.bos_id is not None else []
        return infill_layout(fim, lambda text: self.tokenize(text, add_special=False), bos, prefix, suffix, prompt,
                             extra)

    # -- generation ------------------------------------------------------------------------------

    def sampler(self, **sampling: Any) -> Sampler:
        """A sampler for one sequence from sampling keywords (``SamplingParams`` fields)."""
        fields = SamplingParams.__dataclass_fields__
        unknown = sorted(set(sampling) - set(fields))
        if unknown:
            raise BadRequestError(f"unknown sampling parameter {unknown[0]!r} (known: {', '.join(fields)})")
        params = SamplingParams(**{**self.generation_defaults, **sampling})
        return Sampler(params, token_text=self.tokenizer.token_bytes)

    def stream(
        self,
        prompt: str | Sequence[int],
        max_tokens: int = 256,
        *,
        stop: str | Sequence[str] = (),
        logprobs: int | None = None,
        grammar: str | None = None,
        json_schema: str | Mapping[str, Any] | bool | None = None,
        add_special: bool = True,
        context_shift: bool = False,
        n_keep: int = 0,
        speculative: str | Mapping[str, Any] | SpeculativeSettings | None = None,
        lora: Mapping[int, float] | Sequence[Mapping[str, Any]] | None = None,
        images: Sequence[PassImage] = (),
        **sampling: Any,
    ) -> Iterator[TokenStep]:
        """Generate step by step: each :class:`TokenStep` has the token, the text it releases and, with
        ``logprobs=N``, its log-probability and the N best alternatives. Stats land in ``last_stats``.

        ``grammar``: a GBNF grammar the output must follow; ``json_schema``: a JSON Schema (dict or JSON
        text) the output must validate against, or ``True`` for any JSON object. ``context_shift``: when
        the context fills up, drop the oldest half after the first ``n_keep`` tokens instead of failing.
        ``speculative``: this call's speculative decoding, ``"off"``, ``"lookup"``, ``"draft"`` (a model
        loaded with ``draft=``) or a mapping of :class:`SpeculativeSettings` fields; default: the model's.
        Stats (``last_stats``) count the drafted and accepted tokens. ``lora``: this call's adapter scales
        (``[{"id": 0, "scale": 0.5}]``, adapters not named are off); default: the model's (:meth:`set_lora`).
        ``images``: where images' tokens go in the prompt ids (:meth:`image_prompt` makes both).
        """
        ids = self.tokenize(prompt, add_special=add_special) if isinstance(prompt, str) else list(prompt)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
            raise BadRequestError(f"max_tokens must be an integer >= 0, got {max_tokens!r}")
        request = GenerationRequest(ids, self.sampler(**sampling), max_tokens, stop=stop, logprobs=logprobs,
                                    constraint=self.constraint(grammar, json_schema), context_shift=context_shift,
                                    n_keep=n_keep, speculative=resolve_speculative(
                                        speculative, self.engine.speculative) if speculative is not None else None,
                                    lora=self.request_lora(lora), images=images)
        self.last_stats = request.stats
        # one caller at a time: a stream left unfinished ends here. The prompt is placed now (a bad one
        # fails where the call is made), reusing the prefix the cache already holds.
        self.engine.cancel_all()
        return self.engine.run(request)

    def constraint(
        self, grammar: str | None = None, json_schema: str | Mapping[str, Any] | bool | None = None
    ) -> Constraint | None:
        """The output constraint for a grammar or a JSON schema (at most one of them), or None."""
        if grammar is not None and json_schema not in (None, False):
            raise BadRequestError("grammar and json_schema cannot be used together")
        if grammar is not None:
            return Constraint.from_grammar(grammar, self.tokenizer)
        if json_schema is True:
            return Constraint.from_json_schema(None, self.tokenizer)
        if json_schema not in (None, False):
            return Constraint.from_json_schema(json_schema, self.tokenizer)
        return None

    def complete(self, prompt: str | Sequence[int], max_tokens: int = 256, **kwargs: Any) -> Completion:
        """The whole completion with its tokens, finish reason, usage and (with ``logprobs``) log-probabilities."""
        steps = list(self.stream(prompt, max_tokens, **kwargs))
        stats = self.last_stats
        assert stats is not None
        return Completion(
            text="".join(s.text for s in steps),
            tokens=[s.token for s in steps if s.token is not None],
            finish_reason=stats.finish_reason,
            prompt_tokens=stats.prompt_tokens,
            completion_tokens=stats.generated_tokens,
            logprobs=[s.logprob for s in steps if s.logprob is not None],
            stats=stats,
        )

    def generate(
        self,
        prompt: str | Sequence[int],
        max_tokens: int = 256,
        *,
        stream: bool = False,
        stop: str | Sequence[str] = (),
        add_special: bool = True,
        **sampling: Any,
    ) -> str | Iterator[str]:
        """Continue ``prompt`` (text, or token ids): the text, or an iterator of text pieces with ``stream``.

        Sampling keywords are :class:`SamplingParams` fields (temperature, top_k, top_p, min_p, seed,
        repeat_penalty, ...); ``temperature=0`` is greedy.
        """
        steps = self.stream(prompt, max_tokens, stop=stop, add_special=add_special, **sampling)
        pieces = (s.text for s in steps if s.text)
        return pieces if stream else "".join(pieces)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        max_tokens: int = 256,
        *,
        stream: bool = False,
        stop: str | Sequence[str] = (),
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
        reasoning_format: str | None = None,
        **sampling: Any,
    ) -> Any:
        """The assistant's reply to ``messages`` rendered with the model's own chat template.

        Plain chat (no ``tools``, no ``reasoning_format``): the reply's text, or with ``stream`` an
        iterator of text pieces. With ``tools`` (OpenAI's function tools) or ``reasoning_format``
        (``"deepseek"`` splits ``<think>...</think>`` off, ``"none"`` leaves it): a
        :class:`~minfer.runtime.chat.ChatMessage` (``content``, ``reasoning_content``, ``tool_calls``),
        or with ``stream`` an iterator of its deltas (``ContentDelta``, ``ReasoningDelta``,
        ``ToolCallStart``, ``ToolCallDelta``). ``tool_choice``: ``"auto"`` (default with tools),
        ``"none"``, ``"required"`` or ``{"type": "function", "function": {"name": ...}}``; the last two
        constrain decoding so the call's arguments validate against the tool's schema. Messages may hold
        assistant ``tool_calls`` and ``tool`` results. ``template_kwargs`` reach the template
        (``enable_thinking=False``). See :mod:`minfer.runtime.chat.prompt`.
        """
        messages, images = extract_images(messages, allow_paths=True)
        if tools is None and reasoning_format is None and tool_choice is None:
            prompt = self.render_chat(messages, **(template_kwargs or {}))
            if images:
                ids, placed = self.image_prompt(prompt, images)
                steps = self.stream(ids, max_tokens, stop=stop, images=placed, **sampling)
                pieces = (s.text for s in steps if s.text)
                return pieces if stream else "".join(pieces)
            # the template writes BOS itself when the model wants one
            return self.generate(prompt, max_tokens, stream=stream, stop=stop, add_special=False, **sampling)
        plan = self.plan_chat(messages, tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls,
                              template_kwargs=template_kwargs, reasoning_format=reasoning_format)
        json_schema = sampling.pop("json_schema", None)
        grammar = sampling.pop("grammar", None)
        if plan.grammar is not None and (grammar is not None or json_schema is not None):
            raise BadRequestError("a forced tool call (tool_choice) cannot be combined with grammar or json_schema")
        ids, placed = self.image_prompt(plan.prompt, images) if images else (self.tokenize(plan.prompt, False), [])
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
            raise BadRequestError(f"max_tokens must be an integer >= 0, got {max_tokens!r}")
        constraint = plan.constraint(self.tokenizer) if plan.grammar is not None else self.constraint(grammar,
                                                                                                      json_schema)
        lora = self.request_lora(sampling.pop("lora", None))
        request = GenerationRequest(ids, self.sampler(**sampling), max_tokens, stop=stop, constraint=constraint,
                                    lora=lora, images=placed)
        self.last_stats = request.stats
        self.engine.cancel_all()
        steps = self.engine.run(request)
        parser = plan.parser()

        def deltas() -> Iterator[ChatDelta]:
            for step in steps:
                yield from parser.feed(step.text)
            yield from parser.finish()

        if stream:
            return deltas()
        builder = MessageBuilder()
        builder.add(deltas())
        return builder.message()

    def plan_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
        reasoning_format: str | None = None,
    ) -> ChatPlan:
        """The prepared turn (prompt, forced-call grammar, reply parser) :meth:`chat` generates from."""
        if self.chat_template is None:
            self.render_chat(messages)  # raises: no template
        assert self.chat_template is not None
        specs = parse_tools(tools)
        options = ChatOptions(specs, parse_tool_choice(tool_choice, specs), bool(parallel_tool_calls),
                              dict(template_kwargs or {}), reasoning_format)
        return plan_chat(self.chat_template, self.tokenizer, messages, options)

    def conversation(self, system: str | None = None, seed: int | None = None, **sampling: Any) -> Conversation:
        """A multi-turn chat that keeps its KV cache between turns (see :class:`Conversation`)."""
        if self.engine.slots.n_slots != 1:
            raise BadRequestError("a conversation needs a model loaded with one slot (the default engine)")
        return Conversation(self, system, seed=seed, **sampling)

    def image_prompt(self, prompt: str, images: Sequence[ImageInput], add_special: bool = False,
                     ) -> tuple[list[int], list[PassImage]]:
        """The ids of a rendered prompt holding one media marker per image (``add_special``: a plain prompt, the
        tokenizer adding its special tokens as :meth:`tokenize` does), and where each image's tokens go."""
        return drain(self.image_prompt_slices(prompt, images, add_special))

    def image_prompt_slices(self, prompt: str, images: Sequence[ImageInput], add_special: bool = False,
                            ) -> Generator[None, None, tuple[list[int], list[PassImage]]]:
        """:meth:`image_prompt` as a generator that yields between two layers of the vision tower (a server runs
        it a slice at a time between decode steps)."""
        if self.images is None:
            raise BadRequestError(f"{self.path} takes no images (it has no vision model)")
        return (yield from self.images.prompt_slices(prompt, images, add_special))

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    **template_kwargs: Any) -> str:
        if self.chat_template is None:
            raise BadRequestError(f"{self.path} has no chat template ({self.transformer.source.chat_template_field})")
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, **template_kwargs)

    # -- evaluation -------------------------------------------------------------------------------

    def perplexity(
        self, text: str, n_ctx: int = 256, n_batch: int | None = None, progress: bool = False
    ) -> PerplexityResult:
        """Perplexity of ``text`` by the llama-perplexity method (see :mod:`minfer.runtime.perplexity`)."""
        tokens = self.tokenize(text, add_special=True)
        bos = self.tokenizer.bos_id if self.tokenizer.add_bos else None
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=max(len(tokens) // max(n_ctx, 1), 1), unit="chunk", desc="perplexity", leave=False)

        def on_chunk(i: int, n: int, running: float) -> None:
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"PPL {running:.4f}")

        try:
            return perplexity(self.runner, tokens, n_ctx, n_batch, bos_id=bos, on_chunk=on_chunk)
        finally:
            if bar is not None:
                bar.close()


def load(
    path: str | os.PathLike[str] | None = None,
    n_ctx: int | None = None,
    threads: int | None = None,
    kernels: str | None = None,
    cache_type: str | None = None,
    trace: str | os.PathLike[str] | None = None,
    dump_dir: str | os.PathLike[str] | None = None,
    dump_filter: str | None = None,
    quantize: str | None = None,
    engine_config: EngineConfig | None = None,
    draft: str | os.PathLike[str] | None = None,
    lookup: bool = False,
    speculative: SpeculativeSettings | Mapping[str, Any] | None = None,
    lora: LoraSpec | Sequence[LoraSpec] | None = None,
    lora_merge: bool = False,
    lora_init_without_apply: bool = False,
    mmproj: str | os.PathLike[str] | None = None,
) -> Model | Encoder:
    """Load a model: a GGUF file, a Hugging Face model folder (config.json, safetensors, tokenizer.json), or
    a known model name such as ``"smollm2"`` (pulled on first use).

    An encoder's folder (BERT: an embedding model such as ``"all-minilm"``, or a cross-encoder reranker) gives
    an :class:`~minfer.api_encoder.Encoder` (``embed``, ``rerank``) instead of a generating :class:`Model`;
    of the options below only ``threads`` and ``kernels`` apply to it.

    ``quantize``: ``"q8_0"`` or ``"q4_k"`` quantizes the float weight matrices at load time (HF folders
    hold f32/f16/bf16 weights; see :mod:`minfer.formats.quantize`).

    ``kernels``: ``"fast"`` (compiled, the default) or ``"reference"`` (plain numpy); the environment
    variable ``MINFER_KERNELS`` sets the default. ``cache_type``: KV cells ``"f32"`` (default), ``"f16"``
    or ``"q8_0"``; ``MINFER_CACHE_TYPE`` sets the default. ``trace``: a JSON-lines file that gets every
    executed node's time and output statistics (``MINFER_TRACE`` sets it too; see :mod:`minfer.trace`).
    ``dump_dir``: a folder that gets the output tensors of the nodes whose names match ``dump_filter``
    (comma-separated shell patterns; ``MINFER_DUMP_DIR`` / ``MINFER_DUMP_FILTER`` set them too; see
    :mod:`minfer.trace.dump`). ``engine_config``: the engine's slots and batches (one sequence by
    default; ``minfer serve`` asks for several, see :class:`~minfer.runtime.engine.EngineConfig`).

    Speculative decoding (see :mod:`minfer.runtime.speculative`): ``lookup=True`` drafts by prompt lookup,
    ``draft=PATH`` with a draft model (a smaller model with the same vocabulary); ``speculative``: the
    limits (``{"draft_max": 8, "draft_min": 0, "draft_p_min": 0.5, "ngram_max": 3, "ngram_min": 1}``).
    Greedy output is the text of plain decoding; sampled output has the same distribution.

    LoRA adapters (llama.cpp GGUF adapter files or PEFT folders, see :mod:`minfer.models.lora`): ``lora``,
    a path, a (path, scale) pair or a list of them. Each runs as graph nodes beside the matmuls it adapts,
    with its scale as data (:meth:`Model.set_lora`; per request: ``lora=`` of :meth:`Model.generate`);
    ``lora_merge=True`` adds them into the (float) weights at load instead, at no cost per token;
    ``lora_init_without_apply=True`` loads them with scale 0.

    Images (a vision-language model, Gemma 3 or SmolVLM: an HF folder, or the text GGUF with ``mmproj``, llama.cpp's
    file of its vision tower and projector): image parts in :meth:`Model.chat`'s messages
    (``{"type": "image", "path": ...}``, OpenAI's ``image_url`` with a ``data:`` URL).
    """
    resolved = resolve_model(path)
    if is_encoder_checkpoint(resolved):
        generating = {"n_ctx": n_ctx, "cache_type": cache_type, "trace": trace, "dump_dir": dump_dir,
                      "quantize": quantize, "engine_config": engine_config, "draft": draft, "lookup": lookup or None,
                      "speculative": speculative, "lora": lora, "lora_merge": lora_merge or None, "mmproj": mmproj}
        given = [name for name, value in generating.items() if value is not None]
        if given:
            raise BadRequestError(f"{resolved} is an encoder model: it embeds and reranks, it does not generate "
                                  f"(`minfer embed`; {', '.join(given)} do not apply to it)")
        return Encoder(resolved, threads=threads, kernels=kernels)
    return Model(resolved, n_ctx=n_ctx, threads=threads, kernels=kernels, cache_type=cache_type,
                 trace=trace, dump_dir=dump_dir, dump_filter=dump_filter, quantize=quantize,
                 engine_config=engine_config, draft=draft, lookup=lookup, speculative=speculative, lora=lora,
                 lora_merge=lora_merge, lora_init_without_apply=lora_init_without_apply, mmproj=mmproj)
