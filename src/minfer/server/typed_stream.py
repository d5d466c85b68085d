"""Server-sent events for the APIs whose stream is typed events (OpenAI Responses, Anthropic Messages):
``event: <type>`` and ``data: <json>`` per event, no ``[DONE]``; a failure mid-stream ends it with the
API's own error event."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from minfer.server.jobs import Job
from minfer.server.protocol import ApiError


def sse_event(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: ".encode() + json.dumps(event, ensure_ascii=False).encode() + b"\n\n"


def typed_stream(job: Job, events: AsyncIterator[list[dict[str, Any]]],
                 on_error: Callable[[ApiError], dict[str, Any]]) -> StreamingResponse:
    """Send each batch of events ``events`` yields in one write; an :class:`ApiError` it raises becomes
    ``on_error``'s event and ends the stream. The job is cancelled when the client leaves early."""

    async def body() -> AsyncIterator[bytes]:
        try:
            async for batch in events:
                if batch:
                    yield b"".join(sse_event(e) for e in batch)
        except ApiError as e:
            job.cancel()
            yield sse_event(on_error(e))
        finally:
            job.cancel()  # a no-op once every sequence finished; frees the slot when the client left

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
