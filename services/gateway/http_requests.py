"""HTTP requests on the gateway's port, read strictly and bounded before any handler sees them.

websockets reads the request that opens a WebSocket and refuses every body. Each connection of the
gateway reads its request with `parse` instead (client_connection.py installs it):

    request line, head   8 KiB a line (else 414 / 431), 128 header fields, HEAD_BYTES in all (431)
    Content-Length       ASCII digits, at most 18, in one header field: "+5", "5_0", "", "5, 5",
                         or the field twice, are 400 bad_content_length
    Transfer-Encoding    400 unsupported_transfer_encoding, and with a Content-Length as well 400
                         conflicting_length: a body needs a Content-Length
    the body             read only when the route said so: `route(method, path, headers, length)`
                         sees the head alone (method, path, key, length) and returns a refusal
                         (401, 403, 411, 413, ...), answered without reading a byte of the body, or
                         None. Bodies held by all connections together are bounded (`BodyBudget`,
                         else 503 server_busy); `Expect: 100-continue` is answered before reading
    one request          a request that is not a WebSocket upgrade is its connection's only one:
                         bytes already waiting behind it (a pipelined request) make the answer 400
                         pipelining_unsupported; bytes that come later are discarded. Every answer
                         says `Connection: close`
    deadline             client_connection.py: the head and body are due within the request timeout

A refusal here is a JSON error like every other (`error_response`).
"""

from __future__ import annotations

import http
import json
from typing import Callable, Generator
from urllib.parse import urlsplit

from websockets.datastructures import Headers
from websockets.exceptions import InvalidMessage
from websockets.http11 import HeaderLineTooLong, Request, RequestLineTooLong, Response, TooManyHeaders, parse_headers
from websockets.http11 import parse_line
from websockets.protocol import CONNECTING, Protocol
from websockets.server import ServerProtocol

HEAD_BYTES = 64 * 1024
_LENGTH_DIGITS = 18  # below 10**18: int() of it is cheap and no body is that large

# route(method, path, headers, content_length or None) -> a refusal, or None to read the body
Route = Callable[[str, str, Headers, "int | None"], "Response | None"]


def response(status: int, body: bytes, content_type: str, extra: list[tuple[str, str]] = ()) -> Response:
    headers = Headers([("Content-Type", content_type), ("Content-Length", str(len(body))),
                       ("Cache-Control", "no-store"), ("Connection", "close"), *extra])
    return Response(status, http.HTTPStatus(status).phrase, headers, body)


def json_response(status: int, obj: dict, extra: list[tuple[str, str]] = ()) -> Response:
    return response(status, json.dumps(obj).encode(), "application/json", extra)


def error_response(status: int, code: str, message: str, extra: list[tuple[str, str]] = ()) -> Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return json_response(status, {"error": {"type": kind, "code": code, "message": message}}, extra)


class BadRequest(Exception):
    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code = status, code


class BodyBudget:
    """Bytes of request bodies every connection of this process may hold at once. A connection
    holds its reservation until its transport is gone (client_connection.py releases it)."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.held = max_bytes, 0

    def reserve(self, n: int) -> bool:
        if self.held + n > self.max_bytes:
            return False
        self.held += n
        return True

    def release(self, n: int) -> None:
        self.held -= n


def content_length(headers: Headers) -> int | None:
    """The body's length from a strict Content-Length (RFC 9110 8.6: 1*DIGIT), None without one."""
    values = headers.get_all("Content-Length")
    if "Transfer-Encoding" in headers:
        if values:
            raise BadRequest(400, "conflicting_length", "a request may not carry Transfer-Encoding and Content-Length")
        raise BadRequest(400, "unsupported_transfer_encoding", "send the body with a Content-Length, not chunked")
    if not values:
        return None
    if len(values) > 1:
        raise BadRequest(400, "bad_content_length", "Content-Length is given more than once")
    value = values[0]
    if not (value.isascii() and value.isdigit() and len(value) <= _LENGTH_DIGITS):
        raise BadRequest(400, "bad_content_length", "Content-Length must be ASCII digits only (at most 18)")
    return int(value)


def is_upgrade(request: Request) -> bool:
    tokens = request.headers.get("Upgrade", "").lower().replace(",", " ").split()
    return request.method == "GET" and "websocket" in tokens


def parse(p: ServerProtocol, route: Route, budget: BodyBudget) -> Generator[None, None, None]:
    """ServerProtocol.parse, with the request read as the module doc says. Sets `p.body_reserved`
    to the bytes reserved in `budget` for this connection's body."""
    p.body_reserved = 0
    if p.state is CONNECTING:
        try:
            request = yield from _read_head(p)
            length = content_length(request.headers)
        except RequestLineTooLong as e:
            yield from _refuse(p, error_response(414, "request_line_too_long", str(e)), e)
        except (HeaderLineTooLong, TooManyHeaders) as e:
            yield from _refuse(p, error_response(431, "headers_too_large", str(e)), e)
        except BadRequest as e:
            yield from _refuse(p, error_response(e.status, e.code, str(e)), e)
        except EOFError as e:  # the client went away mid-request: nobody to answer
            p.handshake_exc = InvalidMessage("did not receive a valid HTTP request")
            p.handshake_exc.__cause__ = e
            p.send_eof()
            p.parser = p.discard()
            next(p.parser)
            yield
        except ValueError as e:  # a request line or header field websockets cannot parse
            yield from _refuse(p, error_response(400, "bad_request", f"not an HTTP/1.1 request: {str(e)[:80]}"), e)
        refusal = route(request.method, request.path, request.headers, length)
        if refusal is None and length and not budget.reserve(length):
            refusal = error_response(503, "server_busy", "too many request bodies are being received; retry shortly",
                                     [("Retry-After", "1")])
        if refusal is not None:
            yield from _refuse(p, refusal, None)
        if length is not None:
            p.body_reserved = length
            if length and request.headers.get("Expect", "").lower() == "100-continue":
                p.writes.append(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.body = bytes((yield from p.reader.read_exact(length)))
        upgrade = is_upgrade(request)
        if not upgrade and p.reader.buffer.strip(b"\r\n"):
            yield from _refuse(p, error_response(400, "pipelining_unsupported", "one request per connection: wait for "
                                                 "each answer (every answer closes its connection)"), None)
        p.events.append(request)
        if not upgrade:  # what follows the only request is not read
            while not (yield from p.reader.at_eof()):
                p.reader.discard()
            while True:
                yield
    yield from Protocol.parse(p)


def _read_head(p: ServerProtocol) -> Generator[None, None, Request]:
    """websockets' Request.parse, with the head bounded to HEAD_BYTES in all."""
    left = HEAD_BYTES

    def read_line(limit: int, too_long: type[Exception] = RuntimeError):
        nonlocal left
        line = yield from p.reader.read_line(min(limit, left), HeaderLineTooLong if limit > left else too_long)
        left -= len(line)
        return line

    request_line = yield from parse_line(read_line, RequestLineTooLong)
    try:
        raw_method, raw_path, raw_protocol = request_line.split(b" ", 2)
    except ValueError:
        raise BadRequest(400, "bad_request", "the request line is not 'METHOD PATH HTTP/1.1'") from None
    if raw_protocol not in (b"HTTP/1.1", b"HTTP/1.0"):
        raise BadRequest(400, "bad_request", "only HTTP/1.1 (or 1.0) is served")
    if not (raw_method.isalpha() and raw_method.isascii() and raw_path.isascii()):
        raise BadRequest(400, "bad_request", "the method and path must be ASCII")
    try:
        urlsplit(raw_path.decode("ascii"))
    except ValueError:  # e.g. '//[': the routes split every path
        raise BadRequest(400, "bad_request", "the path is not a URL path") from None
    headers = yield from parse_headers(read_line)
    return Request(raw_path.decode("ascii"), headers, raw_method.decode("ascii"), raw_protocol.decode("ascii"))


def _refuse(p: ServerProtocol, answer: Response, exc: Exception | None) -> Generator[None, None, None]:
    """Answer now, read nothing more: send_response replaces this parser with websockets' discard."""
    p.handshake_exc = exc or InvalidMessage(f"refused with HTTP {answer.status_code}")
    p.send_response(answer)
    yield
    raise AssertionError("a refused request's parser is never resumed")
