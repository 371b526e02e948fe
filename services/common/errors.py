"""Typed stage errors, each bound to the gRPC status it becomes.

A handler raises one of these; the stream runner (`stage_server.StageRuntime`)
counts it under its `kind` in the errors metric and ends only that stream with
`code` and the message. Nothing else is touched: one stream's bad input never
reaches another stream or the shared codec/model state.

    raise InvalidArgument("pcm frame has 100 bytes, expected 7680", kind="bad_frame")
"""

from __future__ import annotations

import re

import grpc


ERROR_KIND_KEY = "error-kind"


def error_kind(e: BaseException) -> str | None:
    """The `error-kind` a stage attached to a failed RPC (None if absent or not an RPC error)."""
    if not isinstance(e, grpc.aio.AioRpcError):
        return None
    for key, value in e.trailing_metadata() or ():
        if key == ERROR_KIND_KEY:
            return value
    return None


class StageError(Exception):
    """Base: a failure that ends one stream with a specific gRPC status."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    kind: str = "internal"

    def __init__(self, message: str, *, kind: str | None = None):
        super().__init__(message)
        self.message = message
        if kind is not None:
            self.kind = kind

    async def abort(self, context: grpc.aio.ServicerContext) -> None:
        """End the RPC with this error's status (raises, as grpc.aio's abort does). The error's kind
        travels as trailing metadata `error-kind` (ERROR_KIND_KEY), so a client can tell, say, a bad
        voice from a bad persona without parsing the message."""
        context.set_trailing_metadata(((ERROR_KIND_KEY, self.kind),))
        await context.abort(self.code, self.message)


class InvalidArgument(StageError):
    """A malformed message: bad frame size, NaN, codes out of range, first message not `open`."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    kind = "invalid_argument"


class SeqRepeated(InvalidArgument):
    """A frame's seq was already consumed (a retried send); it is never processed twice."""

    kind = "seq_repeated"


class SeqGap(StageError):
    """A frame's seq skips ahead: a frame was lost between the caller and this stage."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    kind = "seq_gap"


class AlreadyExists(StageError):
    """A live stream already has this stream id."""

    code = grpc.StatusCode.ALREADY_EXISTS
    kind = "already_exists"


class ResourceExhausted(StageError):
    """No free slot (or, for the talker, a backlog over its bound)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    kind = "resource_exhausted"


class Unavailable(StageError):
    """The service is draining: no new streams, or a live stream past the drain deadline."""

    code = grpc.StatusCode.UNAVAILABLE
    kind = "unavailable"


class FailedPrecondition(StageError):
    """The request cannot be served in the service's current state (e.g. un-drain while shutting down)."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    kind = "failed_precondition"


class IdleTimeout(StageError):
    """A live stream sent nothing (no frame, no half-close) for the stage's idle bound."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    kind = "idle"


class Unauthenticated(StageError):
    """An admin RPC (Drain) without the stage's admin token, or on a stage that has none."""

    code = grpc.StatusCode.UNAUTHENTICATED
    kind = "unauthenticated"


class Internal(StageError):
    """A bug or a failed codec/model step; the stream ends, the service keeps serving."""

    code = grpc.StatusCode.INTERNAL
    kind = "internal"


# A refusal that a retry can fix ends its message with this hint, the one format every stage writes
# and the gateway reads (its Retry-After): "... retry in 1.5 s".
_RETRY_HINT = re.compile(r"retry in (\d+(?:\.\d+)?) s$")


def retry_hint(seconds: float) -> str:
    return f"retry in {max(0.1, seconds):.1f} s"


def parse_retry_hint(message: str) -> float | None:
    """The seconds a message's retry hint names (None without one)."""
    m = _RETRY_HINT.search(message or "")
    return float(m.group(1)) if m else None
