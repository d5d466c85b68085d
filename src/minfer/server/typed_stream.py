"""What the APIs with typed stream events (OpenAI Responses, Anthropic Messages) share: feeding a chat
turn's deltas or its whole message to the API's builder, and the server-sent events themselves
(``event: <type>`` and ``data: <json>`` per event, no ``[DONE]``; a failure mid-stream ends the stream
with the API's own error event)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from fastapi.responses import StreamingResponse

from minfer.runtime.chat import ChatDelta, ChatMessage, ContentDelta, ReasoningDelta, ToolCallDelta, ToolCallStart
from minfer.server.chat_turn import ChatTurn, TurnDelta, TurnFinished
from minfer.server.errors import ApiError
from minfer.server.jobs import Job

Events = list[dict[str, Any]]


class Builder(Protocol):
    """The answer being built (:class:`~minfer.server.protocols.responses.ResponseBuilder`,
    :class:`~minfer.server.protocols.anthropic.MessageBuilder`): each call returns the events it causes."""

    def start(self) -> Events: ...

    def text(self, delta: str) -> Events: ...

    def reasoning(self, delta: str) -> Events: ...

    def tool_call(self, call_id: str, name: str) -> Events: ...

    def arguments(self, delta: str) -> Events: ...


def feed_delta(builder: Builder, d: ChatDelta) -> Events:
    if isinstance(d, ContentDelta):
        return builder.text(d.text)
    if isinstance(d, ReasoningDelta):
        return builder.reasoning(d.text)
    if isinstance(d, ToolCallStart):
        return builder.tool_call(d.id, d.name)
    if isinstance(d, ToolCallDelta):
        return builder.arguments(d.arguments)
    return []


def feed_message(builder: Builder, message: ChatMessage) -> None:
    """A whole reply, in the order a stream would have given it: reasoning, content, calls."""
    builder.reasoning(message.reasoning_content or "")
    builder.text(message.content or "")
    for call in message.tool_calls:
        builder.tool_call(call.id, call.name)
        builder.arguments(call.arguments)


async def turn_events(turn: ChatTurn, builder: Builder, finish: Callable[[str], Events]) -> AsyncIterator[Events]:
    """A streamed turn as the builder's events: its start, each delta, then what ``finish`` (given the
    finish reason) adds; one batch per batch of the turn's events. The start goes with the first batch (the
    sequence has its slot then, so the start's usage can say how much of the prompt the cache served, as
    llama-server's does)."""
    started = False
    async for batch in turn.batches():
        out: Events = [] if started else builder.start()
        started = True
        for ev in batch:
            if isinstance(ev, TurnDelta) and ev.delta is not None:
                out += feed_delta(builder, ev.delta)
            elif isinstance(ev, TurnFinished):
                out += finish(ev.finish_reason)
        yield out


def sse_event(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: ".encode() + json.dumps(event, ensure_ascii=False).encode() + b"\n\n"


def typed_stream(job: Job, events: AsyncIterator[Events], on_error: Callable[[ApiError], dict[str, Any]]
                 ) -> StreamingResponse:
    """Send each batch of events ``events`` yields in one write; an :class:`ApiError` it raises becomes
    ``on_error``'s event and ends the stream. The job is cancelled when the client leaves early."""

    async def body() -> AsyncIterator[bytes]:
        try:
            async for batch in events:
                if batch:
                    yield b"".join(sse_event(e) for e in batch)
        except ApiError as e:
            yield sse_event(on_error(e))
        finally:
            job.cancel()  # a no-op once every sequence finished; frees the slot when the client left

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
