"""One assistant turn of a chat request on the engine, as the events the Responses and Messages routes
translate: text deltas, a tool call's start and argument fragments, the finish.

(A thin adapter: text only until the chat turn layer with tool calls is merged.)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

from fastapi import Request

from minfer.errors import MinferError
from minfer.runtime.engine import Failed, Finished, Token
from minfer.server.context import ServerContext
from minfer.server.errors import api_error, cancelled_error
from minfer.server.jobs import Job
from minfer.server.protocol import ChatRequest


@dataclass
class TextDelta:
    text: str


@dataclass
class ToolCallStart:
    id: str
    name: str


@dataclass
class ToolArguments:
    delta: str


@dataclass
class TurnFinished:
    finish_reason: str  # as chat says it: "stop", "length", "tool_calls"
    stop: str | None  # the stop string that ended the turn, if one did
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


TurnEvent = TextDelta | ToolCallStart | ToolArguments | TurnFinished


@dataclass
class Turn:
    ctx: ServerContext
    chat: ChatRequest
    job: Job
    prompt_ids: list[int]

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    async def events(self, request: Request) -> AsyncIterator[TurnEvent]:
        """The turn's events as they come (streaming) or once it is done (otherwise, watching for the
        client going away); an engine failure raises the :class:`ApiError` it is answered with."""
        if self.chat.params.stream:
            async for ev in self._live():
                yield ev
            return
        await self.ctx.collect(self.job, request)
        c = self.job.choices[0]
        for ev in self._texts(c.text):
            yield ev
        yield self._finished()

    async def _live(self) -> AsyncIterator[TurnEvent]:
        job = self.job
        while not job.done:
            index, event = await job.events.get()
            c = job.apply(index, event)
            if isinstance(event, Failed):
                raise api_error(event.error)
            if c.cancelled:
                raise cancelled_error()
            if isinstance(event, Token):
                for ev in self._texts([event.step.text]):
                    yield ev
            elif isinstance(event, Finished):
                yield self._finished()

    def _texts(self, pieces: Iterable[str]) -> Iterable[TurnEvent]:
        return [TextDelta(t) for t in pieces if t]

    def _finished(self) -> TurnFinished:
        c = self.job.choices[0]
        assert c.stats is not None
        return TurnFinished(c.stats.finish_reason, c.stats.stop, len(self.prompt_ids), c.stats.generated_tokens,
                            c.cached_tokens)


def start_turn(ctx: ServerContext, chat: ChatRequest, prefill: str = "") -> Turn:
    """Render the chat (continuing an assistant ``prefill``), tokenize, and submit one sequence."""
    try:
        prompt = ctx.model.render_chat(chat.messages) + prefill
    except MinferError as e:
        raise api_error(e) from None
    ids = ctx.model.tokenize(prompt, add_special=False)
    return Turn(ctx, chat, ctx.submit([ids], chat.params), ids)
