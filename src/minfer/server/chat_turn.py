"""One chat request on the engine, for every endpoint that answers with a chat turn.

:class:`ChatTurn` is the layer between an endpoint's request shape and the engine. Given a parsed
:class:`~minfer.server.protocols.openai.ChatRequest` (messages, including assistant ``tool_calls`` and ``tool``
results; its :class:`~minfer.runtime.chat.ChatOptions`: tools, tool choice, parallel calls, template
variables, reasoning format; its sampling parameters) :meth:`ChatTurn.start` renders the prompt
(:func:`~minfer.runtime.chat.plan_chat`), builds each sequence's constraint (a forced call's grammar,
or the request's own grammar / response format) and submits ``n`` sequences. Then either:

* ``await turn.result(request)``: each choice's whole :class:`TurnChoice` (its
  :class:`~minfer.runtime.chat.ChatMessage`: content, reasoning_content, tool_calls; finish_reason;
  logprobs), cancelling the sequences if the client goes away; or
* ``async for batch in turn.batches()``: lists of :data:`TurnEvent` as they come (one list per wake-up
  of the event loop, so a formatter writes them in one go): :class:`TurnStarted`, :class:`TurnDelta`
  (a content / reasoning / tool-call-start / tool-call-arguments delta, with the log-probabilities of
  the tokens that produced it), :class:`TurnFinished` (finish_reason and the whole message). An
  engine error or a shutdown raises :class:`~minfer.server.errors.ApiError` from the iterator (a
  formatter turns it into its own error event); leaving the loop early cancels the sequences.

``finish_reason`` is the engine's ("stop", "length"), or "tool_calls" when a reply that stopped made
calls. Both forms read the text through the same parser, so a streamed reply assembles to exactly the
whole one. Endpoint modules (``routes/chat_completions.py`` and the others) only format these objects.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial

from fastapi import Request

from minfer.errors import MinferError
from minfer.runtime.chat import ChatDelta, ChatMessage, ChatOutputParser, ChatPlan, MessageBuilder, plan_chat
from minfer.runtime.requests import Failed, Finished, Started, Token
from minfer.runtime.sampling import TokenLogprob
from minfer.runtime.vision import PassImage
from minfer.server.context import ServerContext
from minfer.server.errors import ApiError, api_error, cancelled_error
from minfer.server.jobs import Job
from minfer.server.protocols.openai import ChatRequest

__all__ = ["bias_tokens", "ChatTurn", "TurnChoice", "TurnStarted", "TurnDelta", "TurnFinished", "TurnEvent"]


@dataclass(frozen=True)
class TurnStarted:
    """Choice ``index`` got its slot."""

    index: int


@dataclass(frozen=True)
class TurnDelta:
    """A piece of choice ``index``'s reply; ``delta`` None: only log-probabilities (of tokens whose text
    went nowhere, such as the last of a call)."""

    index: int
    delta: ChatDelta | None
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class TurnFinished:
    index: int
    finish_reason: str
    message: ChatMessage


TurnEvent = TurnStarted | TurnDelta | TurnFinished


@dataclass
class TurnChoice:
    index: int
    message: ChatMessage
    finish_reason: str
    logprobs: list[TokenLogprob] = field(default_factory=list)


def bias_tokens(ctx: ServerContext, text: str) -> list[int]:
    """The tokens a ``logit_bias`` text key biases: its tokens with no BOS and no special tokens read from it,
    as llama-server tokenizes it."""
    return ctx.model.tokenizer.encode(text, False, False)


class ChatTurn:
    """A submitted chat request (see the module docstring)."""

    def __init__(self, ctx: ServerContext, req: ChatRequest, plan: ChatPlan, prompt_ids: list[int], job: Job) -> None:
        self.ctx = ctx
        self.request = req
        self.plan = plan
        self.prompt_ids = prompt_ids
        self.job = job

    @staticmethod
    def plan(ctx: ServerContext, req: ChatRequest) -> ChatPlan:
        """The rendered prompt and what it asks of decoding (ApiError 400 when it cannot be rendered)."""
        model = ctx.model
        options = req.options
        if options.reasoning_format is None:
            options = dataclasses.replace(options, reasoning_format=ctx.config.reasoning_format)
        if ctx.config.chat_template_kwargs:  # the server's defaults, under what the request sets
            options = dataclasses.replace(options, template_kwargs={**ctx.config.chat_template_kwargs,
                                                                    **options.template_kwargs})
        if model.chat_template is None:
            raise ApiError(f"{model.path} has no chat template, so it cannot answer chat requests")
        try:
            return plan_chat(model.chat_template, model.tokenizer, req.messages, options)
        except MinferError as e:  # ApiError, as start() promises its callers
            raise api_error(e) from None

    @classmethod
    async def count_prompt(cls, ctx: ServerContext, req: ChatRequest, prefill: str = "") -> int:
        """The tokens ``req``'s rendered prompt takes, images included, nothing submitted (the token-count
        endpoints: llama-server's ``/chat/completions/input_tokens``, Anthropic's ``count_tokens``)."""
        chars = ctx.check_text_fits(m.get("content") for m in req.messages if isinstance(m, dict))
        prompt = (await ctx.off_loop(cls.plan, ctx, req, size=chars)).prompt + (prefill or req.prefill)
        if req.images:  # each image counts its tokens (so they are made, once: the image cache keeps them)
            ids, _ = await ctx.image_prompt(prompt, req.images)
        else:
            ids = await ctx.off_loop(ctx.model.tokenize, prompt, False, size=len(prompt))
        return len(ids)

    @classmethod
    async def start(cls, ctx: ServerContext, req: ChatRequest, prefill: str = "") -> ChatTurn:
        """Render, tokenize and submit ``req``; ApiError (400, 429) when that fails. ``prefill``: text
        the reply starts with (Anthropic's last assistant message), put after the rendered prompt; the
        reply continues it and does not repeat it."""
        model = ctx.model
        params = req.params
        ctx.check_model(params.model)
        # a prompt that cannot fit is refused before the template renders it and the tokenizer reads it
        chars = ctx.check_text_fits(m.get("content") for m in req.messages if isinstance(m, dict))
        plan = await ctx.off_loop(cls.plan, ctx, req, size=chars)
        params.resolve_text_bias(partial(bias_tokens, ctx))
        constraint = None
        if plan.grammar is not None:
            if params.grammar is not None or params.json_schema is not None:
                raise ApiError(f"tool_choice {req.options.choice.mode!r} cannot be combined with 'grammar' or "
                               "'response_format'", param="tool_choice")

            def constraint():  # type: ignore[no-untyped-def]
                return plan.constraint(model.tokenizer)

        prompt = plan.prompt + (prefill or req.prefill)
        placed: list[PassImage] = []
        if req.images:  # each image's marker in the rendered prompt becomes its tokens (n choices: all see them)
            ids, placed = await ctx.image_prompt(prompt, req.images)
        else:
            ids = await ctx.off_loop(model.tokenize, prompt, False, size=len(prompt))  # the template writes BOS
        job = ctx.submit([ids], params, constraint=constraint, images=placed)
        return cls(ctx, req, plan, ids, job)

    def usage(self) -> dict[str, object]:
        return self.ctx.usage(self.job, [self.prompt_ids])

    def _reason(self, engine_reason: str, parser: ChatOutputParser) -> str:
        return "tool_calls" if engine_reason == "stop" and parser.made_calls else engine_reason

    async def result(self, request: Request) -> list[TurnChoice]:
        """Every choice's whole reply, once all are done."""
        await self.ctx.collect(self.job, request)
        out = []
        for c in self.job.choices:
            assert c.stats is not None
            parser = self.plan.parser()
            message = parser.parse("".join(c.text))
            out.append(TurnChoice(c.index, message, self._reason(c.stats.finish_reason, parser), list(c.logprobs)))
        return out

    async def batches(self) -> AsyncIterator[list[TurnEvent]]:
        """The turn's events as they arrive (see the module docstring)."""
        job = self.job
        parsers = [self.plan.parser() for _ in job.choices]
        builders = [MessageBuilder() for _ in job.choices]
        pending: list[list[TokenLogprob]] = [[] for _ in job.choices]

        def deltas(index: int, found: list[ChatDelta], out: list[TurnEvent]) -> None:
            builders[index].add(found)
            for d in found:
                lp, pending[index] = tuple(pending[index]), []
                out.append(TurnDelta(index, d, lp))

        try:
            while not job.done:
                out: list[TurnEvent] = []
                item = await job.events.get()
                while True:
                    index, event = item
                    c = job.apply(index, event)
                    if isinstance(event, Failed):
                        raise api_error(event.error)
                    if c.cancelled:
                        raise cancelled_error()
                    if isinstance(event, Started):
                        out.append(TurnStarted(index))
                    elif isinstance(event, Token):
                        if event.step.logprob is not None:
                            pending[index].append(event.step.logprob)
                        deltas(index, parsers[index].feed(event.step.text), out)
                    elif isinstance(event, Finished):
                        deltas(index, parsers[index].finish(), out)
                        if pending[index]:
                            out.append(TurnDelta(index, None, tuple(pending[index])))
                            pending[index] = []
                        reason = self._reason(event.stats.finish_reason, parsers[index])
                        out.append(TurnFinished(index, reason, builders[index].message()))
                    if job.done or job.events.empty():
                        break
                    item = job.events.get_nowait()
                if out:
                    yield out
        finally:
            job.cancel()  # a no-op when every sequence finished; frees the slots when the client left

    async def events(self) -> AsyncIterator[TurnEvent]:
        """:meth:`batches`, one event at a time."""
        async for batch in self.batches():
            for event in batch:
                yield event
