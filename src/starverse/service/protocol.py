"""The HTTP protocol ``starverse serve`` runs uvicorn with: uvicorn's own (httptools when installed, else h11,
as uvicorn's ``auto`` picks), except for its answer to a request it cannot parse.

A control byte in a header value, a raw byte beyond ASCII in the request target or a malformed header line
never reaches the app: the parser refuses it and uvicorn answers a plain-text ``Invalid HTTP request
received.``. Every other error of the service is one JSON line (``{"detail": ..., "error": ...}``), so this
one is too: the same 400 and ``connection: close``, with a JSON body that says what to fix.
"""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

MALFORMED_REQUEST = {
    "detail": "malformed HTTP request: the request line or a header holds a control byte, a raw byte beyond "
              "ASCII or a malformed header line, which the HTTP parser refuses before the service reads it. To "
              "fix: percent-encode the URL and send header values as printable ASCII",
    "error": "MalformedHTTPRequest",
}
"""The body of the 400 for a request the HTTP parser refused."""


class JsonBadRequest:
    """Mixin of a uvicorn HTTP protocol: its 400 for an unparsable request is :data:`MALFORMED_REQUEST`."""

    transport: asyncio.Transport
    server_state: Any

    def send_400_response(self, msg: str) -> None:
        """Answer 400 with the JSON line and close the connection (``msg``: uvicorn's text, which it logs)."""
        body = json.dumps(MALFORMED_REQUEST).encode()
        head = [b"HTTP/1.1 400 Bad Request\r\n"]
        head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
        head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
                 b"connection: close\r\n\r\n"]
        self.transport.write(b"".join(head) + body)
        self.transport.close()


class JsonErrorH11Protocol(JsonBadRequest, H11Protocol):
    """uvicorn's h11 protocol with the JSON 400."""


@functools.cache
def http_protocol() -> type[asyncio.Protocol]:
    """The protocol class to give ``uvicorn.run(http=...)``: httptools' when it is installed, else h11's."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return JsonErrorH11Protocol

    class JsonErrorHttpToolsProtocol(JsonBadRequest, HttpToolsProtocol):
        """uvicorn's httptools protocol with the JSON 400."""

    return JsonErrorHttpToolsProtocol
