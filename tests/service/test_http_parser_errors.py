"""A request uvicorn's HTTP parser refuses (a control byte in a header, a raw byte beyond ASCII in the target)
is answered with the service's one JSON line, not uvicorn's plain text, by either parser (httptools, h11)."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator

import pytest
from service_fixtures import serve_in_thread
from starlette.types import Receive, Scope, Send

from starverse.service.protocol import MALFORMED_REQUEST, JsonErrorH11Protocol, http_protocol


async def _app(scope: Scope, receive: Receive, send: Send) -> None:
    """What the parser lets through (h11 takes a control byte in a header value; the app's token check refuses
    it): 200."""
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(scope="module", params=["h11", "auto"])
def port(request: pytest.FixtureRequest) -> Iterator[tuple[int, str]]:
    """A uvicorn server on 127.0.0.1 with the protocol; yields its port and its parser's name."""
    protocol: type[asyncio.Protocol] = JsonErrorH11Protocol if request.param == "h11" else http_protocol()
    with serve_in_thread(_app, protocol) as p:
        yield p, "h11" if issubclass(protocol, JsonErrorH11Protocol) else "httptools"


@pytest.mark.parametrize("request_bytes", [
    b"GET /api/whoami HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sv_\x01\r\n\r\n",
    b"GET /api/jobs?state=\xc3\xa9 HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /api/whoami HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n",
], ids=["control-byte-in-a-header", "raw-utf8-in-the-target", "header-line-without-colon"])
def test_an_unparsable_request_is_the_services_json_400(port: tuple[int, str], request_bytes: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port[0]), timeout=10) as sock:
        sock.sendall(request_bytes)
        raw = b""
        while chunk := sock.recv(65536):  # the server closes the connection after it
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("ascii").lower().split("\r\n")
    if port[1] == "h11" and b"\x01" in request_bytes:  # h11 lets it through: the service's token check has it
        assert lines[0] == "http/1.1 200 ok" and body == b"ok", raw
        return
    assert lines[0] == "http/1.1 400 bad request", raw
    assert "content-type: application/json" in lines and "connection: close" in lines
    assert f"content-length: {len(body)}" in lines
    assert json.loads(body) == MALFORMED_REQUEST
