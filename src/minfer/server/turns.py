"""Text-only stand-in for the chat turn layer (``server/chat_turn.py`` on the tools branch), same names:
replaced by it at the merge."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request

from minfer.errors import MinferError
from minfer.runtime.engine import Failed, Finished, Started, Token
from minfer.server.context import ServerContext
from minfer.server.errors import api_error, cancelled_error
from minfer.server.jobs import Job
from minfer.server.protocol import ChatRequest


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallDelta:
    index: int
    arguments: str


ChatDelta = ContentDelta | ReasoningDelta | ToolCallStart | ToolCallDelta


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str


@dataclass
class ChatMessage:
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class TurnStarted:
    index: int


@dataclass(frozen=True)
class TurnDelta:
    index: int
    delta: ChatDelta | None


@dataclass(frozen=True)
class TurnFinished:
    index: int
    finish_reason: str
    message: ChatMessage


@dataclass
class TurnChoice:
    index: int
    message: ChatMessage
    finish_reason: str


class ChatTurn:
    def __init__(self, ctx: ServerContext, req: ChatRequest, prompt_ids: list[int], job: Job) -> None:
        self.ctx, self.request, self.prompt_ids, self.job = ctx, req, prompt_ids, job

    @classmethod
    def start(cls, ctx: ServerContext, req: ChatRequest, prefill: str = "") -> ChatTurn:
        ctx.check_model(req.params.model)
        try:
            prompt = ctx.model.render_chat(req.messages) + prefill
        except MinferError as e:
            raise api_error(e) from None
        ids = ctx.model.tokenize(prompt, add_special=False)
        return cls(ctx, req, ids, ctx.submit([ids], req.params))

    def usage(self) -> dict[str, object]:
        return self.ctx.usage(self.job, [self.prompt_ids])

    async def result(self, request: Request) -> list[TurnChoice]:
        await self.ctx.collect(self.job, request)
        return [TurnChoice(c.index, ChatMessage("".join(c.text)), c.stats.finish_reason)
                for c in self.job.choices if c.stats is not None]

    async def batches(self) -> AsyncIterator[list[TurnStarted | TurnDelta | TurnFinished]]:
        job = self.job
        try:
            while not job.done:
                index, event = await job.events.get()
                c = job.apply(index, event)
                if isinstance(event, Failed):
                    raise api_error(event.error)
                if c.cancelled:
                    raise cancelled_error()
                if isinstance(event, Started):
                    yield [TurnStarted(index)]
                elif isinstance(event, Token) and event.step.text:
                    yield [TurnDelta(index, ContentDelta(event.step.text))]
                elif isinstance(event, Finished):
                    yield [TurnFinished(index, event.stats.finish_reason, ChatMessage("".join(c.text)))]
        finally:
            job.cancel()
