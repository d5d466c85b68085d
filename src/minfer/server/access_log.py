"""The server's access log: one line per request (method, path, status, tokens, milliseconds).

``--log-format text`` (the default) writes ``POST /v1/chat/completions 200 prompt=12 completion=30 512.3ms``,
``json`` one JSON object a line, ``off`` nothing. The tokens come from the jobs the request submitted:
:meth:`~minfer.server.context.ServerContext.submit` notes each one in the request's :class:`RequestRecord`
(held by a context variable the middleware sets for the request's task and the tasks it starts).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

LOG_FORMATS = ("text", "json", "off")

log = logging.getLogger("minfer.access")


@dataclass
class RequestRecord:
    method: str
    path: str
    client: str
    started: float = field(default_factory=time.perf_counter)
    status: int = 0
    jobs: list[Any] = field(default_factory=list)  # server.jobs.Job (not imported: it would be a cycle)
    prompt_tokens: int = 0

    def tokens(self) -> tuple[int, int]:
        completion = 0
        for job in self.jobs:
            for c in job.choices:
                completion += c.stats.generated_tokens if c.stats is not None else len(c.text)
        return self.prompt_tokens, completion

    def fields(self) -> dict[str, Any]:
        prompt, completion = self.tokens()
        return {"method": self.method, "path": self.path, "status": self.status, "prompt_tokens": prompt,
                "completion_tokens": completion, "ms": round((time.perf_counter() - self.started) * 1000, 1),
                "client": self.client}


current_request: ContextVar[RequestRecord | None] = ContextVar("minfer_request", default=None)


def note_job(job: Any, prompt_tokens: int) -> None:
    """Count a submitted job's tokens in the current request's log line (a no-op outside a request)."""
    record = current_request.get()
    if record is not None:
        record.jobs.append(job)
        record.prompt_tokens += prompt_tokens


def format_line(record: RequestRecord, fmt: str) -> str:
    f = record.fields()
    if fmt == "json":
        return json.dumps(f, ensure_ascii=False)
    return (f"{f['client']} {f['method']} {f['path']} {f['status']} prompt={f['prompt_tokens']} "
            f"completion={f['completion_tokens']} {f['ms']}ms")


def configure(fmt: str) -> None:
    """Send the access log to stderr in ``fmt`` (``off``: nowhere)."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    log.handlers.clear()
    log.propagate = False
    if fmt == "off":
        log.disabled = True
        return
    log.disabled = False
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
