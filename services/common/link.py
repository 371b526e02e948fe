"""A stage's multiplexed link: the streams of many sessions on one bidirectional RPC (common.proto).

    async def EncodeLink(self, request_iterator, context):
        await serve_link(self.runtime, context, encoder_pb2.EncodeLinkResponse, self.stream.serve)

Each session on a link gets a LinkPort: the three calls a session handler makes on its own RPC's
context (read, write, abort with trailing metadata). The link runs the very handler the session's
own stream runs, as its own task, so a session is admitted, validated, stepped and ended exactly as
on its own stream. Only the transport differs:
- in: each entry goes to the port of the stream id it names; a new stream id opens a session;
- out: the sessions' writes are queued and leave as one message per loop turn, so the answers of
  one batched step cost one message, not one per session;
- end: a session's last entry is its LinkStatus. When the caller half-closes the link, its sessions
  get end-of-input; when the link breaks, its sessions are cancelled, as their own RPCs would be.

Bounds: a port holds at most `inbox_frames` unread requests (over that its session ends with
RESOURCE_EXHAUSTED, and only it); the link's unsent entries at most `outbox_bytes` (a writer then
waits, as on a full HTTP/2 window); a link carries at most `max_sessions` sessions at once.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Awaitable, Callable

import grpc

from duplex.v1 import common_pb2
from services.common.errors import ERROR_KIND_KEY, ResourceExhausted, StageError

log = logging.getLogger("duplex.link")

INBOX_FRAMES = 64  # 5 s of frames queued for one session before it is refused
OUTBOX_BYTES = 32 * 2**20
MESSAGE_BYTES = 2 * 2**20  # one outgoing message at most this big (the peer's receive limit is larger)
RECENT_ENDS = 4096  # ended stream ids remembered, so entries already in flight for them are dropped quietly

_OK = (grpc.StatusCode.OK, "", "")


class LinkPort:
    """One session's stream on a link, seen by its handler as a grpc.aio ServicerContext."""

    def __init__(self, link: "Link", stream_id: str, inbox_frames: int):
        self.stream_id = stream_id
        self._link = link
        self._inbox: collections.deque = collections.deque()
        self._inbox_frames = inbox_frames
        self._arrived = asyncio.Event()
        self._input_ended = False
        self._refused: StageError | None = None
        self._trailing: tuple = ()
        self.status: tuple[grpc.StatusCode, str, str] | None = None

    # -- the link's side --

    def deliver(self, request) -> None:
        if self._input_ended or self._refused is not None:
            return
        if len(self._inbox) >= self._inbox_frames:
            self._refused = ResourceExhausted(
                f"input backlog over its bound: {len(self._inbox)} requests queued on the link for this "
                f"{self._link.runtime.stage} (max {self._inbox_frames}); send one frame per frame period",
                kind="backlog_full")
            self._inbox.clear()
        else:
            self._inbox.append(request)
        self._arrived.set()

    def end_input(self) -> None:
        self._input_ended = True
        self._arrived.set()

    # -- the handler's side (grpc.aio.ServicerContext's calls) --

    def read_nowait(self):
        """The next request if one is queued (EOF at the end of input), else None."""
        if self._refused is not None:
            raise self._refused
        if self._inbox:
            return self._inbox.popleft()
        return grpc.aio.EOF if self._input_ended else None

    async def read(self):
        while (req := self.read_nowait()) is None:
            self._arrived.clear()
            await self._arrived.wait()
        return req

    async def write(self, response) -> None:
        await self._link.send(self.stream_id, response)

    def set_trailing_metadata(self, metadata) -> None:
        self._trailing = tuple(metadata)

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        kind = dict(tuple(trailing_metadata) or self._trailing).get(ERROR_KIND_KEY, "")
        self.status = (code, kind, details)
        raise grpc.aio.AbortError(details)


class Link:
    def __init__(self, runtime, context, response_cls, handler: Callable[[LinkPort], Awaitable[None]], *,
                 inbox_frames: int = INBOX_FRAMES, outbox_bytes: int = OUTBOX_BYTES, max_sessions: int | None = None):
        self.runtime = runtime
        self.context = context
        self.response_cls = response_cls
        self.handler = handler
        self.inbox_frames = inbox_frames
        self.outbox_bytes = outbox_bytes
        self.max_sessions = max_sessions if max_sessions is not None else runtime.pool.total + 64
        self.ports: dict[str, LinkPort] = {}
        self.tasks: dict[str, asyncio.Task] = {}
        self._recent: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._out: list = []
        self._out_bytes = 0
        self._out_ready = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._closed = False

    # -- in --

    async def serve(self) -> None:
        metrics = self.runtime.metrics
        writer = asyncio.create_task(self._write_loop(), name=f"{self.runtime.stage}-link-writer")
        try:
            while (msg := await self.context.read()) is not grpc.aio.EOF:
                metrics.link_messages_in.inc()
                metrics.link_entries_in.inc(len(msg.entries))
                for entry in msg.entries:
                    self._route(entry)
            # The caller half-closed the link: its sessions' input ends, their queued work finishes.
            for port in list(self.ports.values()):
                port.end_input()
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)
            await self._flush_all()
        finally:
            self._closed = True
            self._room.set()
            for task in self.tasks.values():
                task.cancel()
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)

    def _route(self, entry) -> None:
        sid = entry.stream_id
        kind = entry.WhichOneof("kind")
        port = self.ports.get(sid)
        if port is None:
            opening = kind == "request" and entry.request.WhichOneof("kind") == "open"
            if kind != "request" or (sid in self._recent and not opening):
                return  # in flight when its session ended, or an end for a session already over
            self._recent.pop(sid, None)  # an ended stream id may open again, as on its own RPC
            if len(self.ports) >= self.max_sessions:
                self._send_status(sid, (grpc.StatusCode.RESOURCE_EXHAUSTED, "link_full",
                                        f"the link carries {len(self.ports)} sessions, at most {self.max_sessions}"))
                return
            port = self.ports[sid] = LinkPort(self, sid, self.inbox_frames)
            self.tasks[sid] = asyncio.create_task(self._run_session(port), name=f"{self.runtime.stage}-link-{sid[:40]}")
        if kind == "request":
            port.deliver(entry.request)
        elif entry.end.cancel:
            self.tasks[sid].cancel()
        else:
            port.end_input()

    async def _run_session(self, port: LinkPort) -> None:
        try:
            await self.handler(port)
            status = port.status or _OK
        except grpc.aio.AbortError:
            status = port.status or (grpc.StatusCode.INTERNAL, "internal", "aborted")
        except asyncio.CancelledError:
            status = (grpc.StatusCode.CANCELLED, "cancelled", "the session was cancelled")
        except Exception as e:  # a bug in the handler: this session ends, the link goes on
            self.runtime.log.exception("link session %s failed", port.stream_id)
            status = (grpc.StatusCode.INTERNAL, "internal", f"{type(e).__name__}: {e}"[:500])
        finally:
            self.ports.pop(port.stream_id, None)
            self.tasks.pop(port.stream_id, None)
            self._recent[port.stream_id] = None
            if len(self._recent) > RECENT_ENDS:
                self._recent.popitem(last=False)
        self._send_status(port.stream_id, status)

    # -- out --

    async def send(self, stream_id: str, response) -> None:
        while self._out_bytes > self.outbox_bytes and not self._closed:
            self._room.clear()
            await self._room.wait()
        if self._closed:
            raise asyncio.CancelledError()  # the link is gone: the session ends as a cancelled stream
        self._queue(self.response_cls.Entry(stream_id=stream_id, response=response))

    def _send_status(self, stream_id: str, status: tuple) -> None:
        if self._closed:
            return
        code, kind, details = status
        self._queue(self.response_cls.Entry(stream_id=stream_id, status=common_pb2.LinkStatus(
            code=code.value[0], kind=kind, details=details)))

    def _queue(self, entry) -> None:
        size = entry.ByteSize()
        self._out.append((entry, size))
        self._out_bytes += size
        self._out_ready.set()

    async def _write_loop(self) -> None:
        while True:
            await self._out_ready.wait()
            await asyncio.sleep(0)  # one more loop turn: the other sessions of a batched step write too
            await self._flush_all()

    async def _flush_all(self) -> None:
        self._out_ready.clear()
        entries, self._out, self._out_bytes = self._out, [], 0
        self._room.set()
        metrics = self.runtime.metrics
        for chunk in _chunks(entries, MESSAGE_BYTES):
            await self.context.write(self.response_cls(entries=chunk))
            metrics.link_messages_out.inc()
            metrics.link_entries_out.inc(len(chunk))


def _chunks(entries: list, max_bytes: int):
    """(entry, bytes) pairs -> consecutive runs of entries of at most max_bytes each (one alone may be larger)."""
    chunk, size = [], 0
    for e, n in entries:
        if chunk and size + n > max_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append(e)
        size += n
    if chunk:
        yield chunk


async def serve_link(runtime, context, response_cls, handler: Callable[[LinkPort], Awaitable[None]], **bounds) -> None:
    """The body of a stage's Link RPC."""
    runtime.metrics.links_opened.inc()
    runtime.log.info("link open (%s)", context.peer() if hasattr(context, "peer") else "-")
    try:
        await Link(runtime, context, response_cls, handler, **bounds).serve()
    finally:
        runtime.log.info("link closed")
