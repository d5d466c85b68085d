"""uvicorn's HTTP protocols, answering a request they cannot parse (protocol garbage, a header too big)
with a JSON OpenAI error body instead of uvicorn's plain text, like every other error of the server."""

from __future__ import annotations

import json

from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools is optional in uvicorn (uvicorn[standard] has it)
    HttpToolsProtocol = None  # type: ignore[assignment,misc]


def garbage_body(msg: str) -> bytes:
    return json.dumps({"error": {"message": f"not an HTTP request this server can parse: {msg}",
                                 "type": "invalid_request_error", "param": None, "code": "bad_http"}}).encode()


def garbage_response(msg: str) -> bytes:
    body = garbage_body(msg)
    return (b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)


class JsonErrorsH11(H11Protocol):
    def send_400_response(self, msg: str) -> None:
        self.transport.write(garbage_response(msg))
        self.transport.close()


def http_protocol() -> type:
    """The protocol class ``uvicorn.Config(http=...)`` gets: httptools' when it is installed."""
    if HttpToolsProtocol is None:
        return JsonErrorsH11

    class JsonErrorsHttpTools(HttpToolsProtocol):  # type: ignore[misc,valid-type]
        def send_400_response(self, msg: str) -> None:
            self.transport.write(garbage_response(msg))
            self.transport.close()

    return JsonErrorsHttpTools
