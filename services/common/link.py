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

Bounds, each checked before what it bounds is stored (docs/limits.md, "Stage links"):
- a message: at most LINK_MESSAGE_BYTES (gRPC's receive limit: refused before it is read into
  Python) and LINK_ENTRIES entries (counted on its bytes before they are parsed: `checked_parser`);
  every entry's stream id 1..128 printable ASCII, checked for the whole message before any entry
  is routed. A message over a bound ends the link (RESOURCE_EXHAUSTED link_message_too_large,
  INVALID_ARGUMENT bad_stream_id) and with it every session on it: its entries cannot be told
  apart unparsed, and dropping some would leave their sessions silently out of step. Routing
  yields to the event loop every ROUTE_BATCH entries, so no message holds the loop for long;
- the first message is due within the stage's first-message deadline, as on every stage RPC;
- a port holds at most `inbox_frames` unread requests, and the ports of a link at most
  `inbox_bytes` in all: the session whose entry does not fit ends with RESOURCE_EXHAUSTED
  (backlog_full), and only it;
- the link's unsent entries at most `outbox_bytes` (its Outbox, common/outbox.py, which also cuts
  them into messages of MESSAGE_BYTES and MESSAGE_ENTRIES at most, the same bounds as the gateway's
  end): a writer then waits, as on a full HTTP/2 window, and the link reads no further message
  until there is room (so the statuses it answers cannot pile up either). A write the caller does
  not take within LINK_WRITE_TIMEOUT_S ends the link (DEADLINE_EXCEEDED link_not_read): a caller
  that stops reading holds no session for good;
- at most `max_sessions` sessions at once; ended stream ids remembered: RECENT_ENDS ids and
  RECENT_END_BYTES characters at most.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError

from duplex.v1 import common_pb2
from services.common.errors import ERROR_KIND_KEY, IdleTimeout, InvalidArgument, ResourceExhausted, StageError
from services.common.outbox import OUTBOX_BYTES, Outbox
from services.common.recent_ids import RecentIds
from services.common.stream_id import MAX_STREAM_ID, validate_stream_id

log = logging.getLogger("duplex.link")

# A message's bounds. A tick of 160 sessions is 160-480 entries and about 1.2 MB (the encoder's
# frames); the largest single entry is a talker open with 60 s of voice audio (5.8 MB).
LINK_MESSAGE_BYTES = 16 * 2**20
LINK_ENTRIES = 8192
ROUTE_BATCH = 256  # entries routed per event-loop turn
INBOX_FRAMES = 64  # 5 s of frames queued for one session before it is refused
INBOX_BYTES = 2 * LINK_MESSAGE_BYTES  # requests queued unread on all ports of one link
LINK_WRITE_TIMEOUT_S = 20.0  # a message the caller does not take this long: it does not read its link
RECENT_ENDS = 4096  # ended stream ids remembered, so entries already in flight for them are dropped quietly
RECENT_END_BYTES = 256 * 1024

_OK = (grpc.StatusCode.OK, "", "")


# ---- a message, before it is parsed ------------------------------------------------------------

def count_fields(raw: bytes, limit: int) -> int:
    """The top-level fields of a serialized message (a link message's are its entries), counted
    on its bytes without parsing them, up to limit + 1. Malformed bytes stop the count: the parse
    then refuses them."""
    if len(raw) < 2 * (limit + 1):
        return 0  # every field takes at least 2 bytes: there cannot be more than limit
    n = i = 0
    end = len(raw)
    try:
        while i < end and n <= limit:
            if raw[i] == 0x0A and raw[i + 1] < 0x80:  # the common field: an entry of less than 128 bytes
                i += 2 + raw[i + 1]
                n += 1
                continue
            key, i = _varint(raw, i)
            wire = key & 7
            if wire == 2:
                length, i = _varint(raw, i)
                i += length
            elif wire == 0:
                _, i = _varint(raw, i)
            elif wire in (1, 5):
                i += 8 if wire == 1 else 4
            else:
                break
            n += 1
    except (IndexError, ValueError):
        pass
    return n


def _varint(raw: bytes, i: int) -> tuple[int, int]:
    """The varint at raw[i] and the index after it; at most 10 bytes (ValueError beyond)."""
    value = 0
    for shift in range(0, 70, 7):
        b = raw[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
    raise ValueError("a varint of more than 10 bytes")


def checked_parser(parse: Callable[[bytes], object], max_entries: int = LINK_ENTRIES) -> Callable[[bytes], object]:
    """A link request's deserializer that refuses a message of more than max_entries entries before
    parsing it (its error surfaces at the handler's read: the link ends with it)."""

    def parse_link_message(raw: bytes):
        # A refusal leaves this frame without `raw`: the error's traceback keeps its frames alive (in
        # asyncio's reference cycles, until a full collection), and with them 16 MiB a message.
        size = len(raw)
        if count_fields(raw, max_entries) > max_entries:
            del raw
            raise ResourceExhausted(f"a link message holds more than {max_entries} entries (it has {size} bytes); "
                                    f"send at most {max_entries} per message", kind="link_message_too_large")
        try:
            return parse(raw)
        except DecodeError:
            del raw
            raise InvalidArgument(f"a link message of {size} bytes does not parse", kind="bad_link_message") from None

    return parse_link_message


# ---- one session's stream ----------------------------------------------------------------------

class LinkPort:
    """One session's stream on a link, seen by its handler as a grpc.aio ServicerContext."""

    def __init__(self, link: "Link", stream_id: str, inbox_frames: int):
        self.stream_id = stream_id
        self._link = link
        self._inbox: collections.deque = collections.deque()  # (request, bytes)
        self.queued_bytes = 0
        self._inbox_frames = inbox_frames
        self._arrived = asyncio.Event()
        self._input_ended = False
        self._refused: StageError | None = None
        self._trailing: tuple = ()
        self.status: tuple[grpc.StatusCode, str, str] | None = None

    # -- the link's side --

    def deliver(self, request, size: int) -> None:
        if self._input_ended or self._refused is not None:
            return
        if len(self._inbox) >= self._inbox_frames:
            self.refuse(f"input backlog over its bound: {len(self._inbox)} requests queued on the link for this "
                        f"{self._link.runtime.stage} (max {self._inbox_frames}); send one frame per frame period")
        elif not self._link.take_inbox_bytes(size):
            self.refuse(f"input backlog over its bound: the link's sessions have {self._link.in_bytes} bytes "
                        f"queued unread on this {self._link.runtime.stage} (max {self._link.inbox_bytes})")
        else:
            self._inbox.append((request, size))
            self.queued_bytes += size
        self._arrived.set()

    def refuse(self, message: str) -> None:
        self._refused = ResourceExhausted(message, kind="backlog_full")
        self.drop_inbox()

    def drop_inbox(self) -> None:
        self._inbox.clear()
        self._link.give_inbox_bytes(self.queued_bytes)
        self.queued_bytes = 0

    def end_input(self) -> None:
        self._input_ended = True
        self._arrived.set()

    # -- the handler's side (grpc.aio.ServicerContext's calls) --

    def read_nowait(self):
        """The next request if one is queued (EOF at the end of input), else None."""
        if self._refused is not None:
            raise self._refused
        if self._inbox:
            request, size = self._inbox.popleft()
            self.queued_bytes -= size
            self._link.give_inbox_bytes(size)
            return request
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


# ---- the link ----------------------------------------------------------------------------------

class Link:
    def __init__(self, runtime, context, response_cls, handler: Callable[[LinkPort], Awaitable[None]], *,
                 inbox_frames: int = INBOX_FRAMES, inbox_bytes: int = INBOX_BYTES, outbox_bytes: int = OUTBOX_BYTES,
                 max_sessions: int | None = None, write_timeout_s: float = LINK_WRITE_TIMEOUT_S):
        self.runtime = runtime
        self.context = context
        self.response_cls = response_cls
        self.handler = handler
        self.inbox_frames = inbox_frames
        self.inbox_bytes = inbox_bytes
        self.in_bytes = 0  # requests queued unread on all ports
        self.write_timeout_s = write_timeout_s
        self.max_sessions = max_sessions if max_sessions is not None else runtime.pool.total + 64
        self.ports: dict[str, LinkPort] = {}
        self.tasks: dict[str, asyncio.Task] = {}
        self._recent = RecentIds(RECENT_ENDS, RECENT_END_BYTES, MAX_STREAM_ID)
        self._outbox = Outbox(outbox_bytes)
        self._closed = False
        self._finishing = False  # half-closed and every session over: the writer's last flush

    # -- in --

    async def serve(self) -> None:
        """Until the caller half-closes the link (its sessions then finish) or the link fails: a
        refused message or a caller that does not read ends it with that error."""
        writer = asyncio.create_task(self._write_loop(), name=f"{self.runtime.stage}-link-writer")
        reader = asyncio.create_task(self._read_loop(), name=f"{self.runtime.stage}-link-reader")
        try:
            await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
            _raise_if_failed(writer)  # a caller that does not read
            _raise_if_failed(reader)  # a refused message
            # The caller half-closed the link: its sessions' input ends, their queued work finishes.
            for port in list(self.ports.values()):
                port.end_input()
            sessions = asyncio.ensure_future(asyncio.gather(*self.tasks.values(), return_exceptions=True))
            await asyncio.wait({sessions, writer}, return_when=asyncio.FIRST_COMPLETED)
            _raise_if_failed(writer)
            self._finishing = True  # the writer sends what is queued (the sessions' last statuses), then ends
            self._outbox.ready.set()
            await writer
        finally:
            self._closed = True
            self._outbox.close()
            for task in (reader, writer, *self.tasks.values()):
                task.cancel()
            await asyncio.gather(reader, writer, *self.tasks.values(), return_exceptions=True)

    async def _read_loop(self) -> None:
        metrics = self.runtime.metrics
        msg = await self.runtime.first_message(self.context)
        while msg is not grpc.aio.EOF:
            metrics.link_messages_in.inc()
            metrics.link_entries_in.inc(len(msg.entries))
            if (refused := bad_stream_id(msg)) is not None:  # before any entry is routed: it ends the link
                del msg  # not kept alive by the error's traceback (see checked_parser)
                raise refused
            for i, entry in enumerate(msg.entries):
                if i and i % ROUTE_BATCH == 0:
                    await asyncio.sleep(0)
                self._route(entry)
            await self._outbox.room()
            msg = await self.context.read()

    def _route(self, entry) -> None:
        sid = entry.stream_id
        kind = entry.WhichOneof("kind")
        port = self.ports.get(sid)
        if port is None:
            opening = kind == "request" and entry.request.WhichOneof("kind") == "open"
            if kind != "request" or (sid in self._recent and not opening):
                return  # in flight when its session ended, or an end for a session already over
            self._recent.discard(sid)  # an ended stream id may open again, as on its own RPC
            if len(self.ports) >= self.max_sessions:
                self._send_status(sid, (grpc.StatusCode.RESOURCE_EXHAUSTED, "link_full",
                                        f"the link carries {len(self.ports)} sessions, at most {self.max_sessions}"))
                return
            port = self.ports[sid] = LinkPort(self, sid, self.inbox_frames)
            self.tasks[sid] = asyncio.create_task(self._run_session(port), name=f"{self.runtime.stage}-link-{sid[:40]}")
        if kind == "request":
            port.deliver(entry.request, entry.request.ByteSize())
        elif entry.end.cancel:
            self.tasks[sid].cancel()
        else:
            port.end_input()

    def take_inbox_bytes(self, size: int) -> bool:
        """Count `size` more bytes queued unread, if they fit the link's bound."""
        if self.in_bytes + size > self.inbox_bytes:
            return False
        self.in_bytes += size
        return True

    def give_inbox_bytes(self, size: int) -> None:
        self.in_bytes -= size

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
            port.drop_inbox()
            self.ports.pop(port.stream_id, None)
            self.tasks.pop(port.stream_id, None)
            self._recent.add(port.stream_id)
        self._send_status(port.stream_id, status)

    # -- out --

    async def send(self, stream_id: str, response) -> None:
        await self._outbox.room()
        if self._closed:
            raise asyncio.CancelledError()  # the link is gone: the session ends as a cancelled stream
        self._outbox.put(self.response_cls.Entry(stream_id=stream_id, response=response))

    def _send_status(self, stream_id: str, status: tuple) -> None:
        if self._closed:
            return
        code, kind, details = status
        self._outbox.put(self.response_cls.Entry(stream_id=stream_id, status=common_pb2.LinkStatus(
            code=code.value[0], kind=kind, details=details)))

    async def _write_loop(self) -> None:
        while not self._finishing or self._outbox:
            await self._outbox.ready.wait()
            await asyncio.sleep(0)  # one more loop turn: the other sessions of a batched step write too
            await self._flush_all()

    async def _flush_all(self) -> None:
        metrics = self.runtime.metrics
        for chunk in self._outbox.take():
            try:
                await asyncio.wait_for(self.context.write(self.response_cls(entries=chunk)), self.write_timeout_s)
            except TimeoutError:
                raise IdleTimeout(f"the caller took no link message for {self.write_timeout_s:g}s: it does not "
                                  f"read its link", kind="link_not_read") from None
            metrics.link_messages_out.inc()
            metrics.link_entries_out.inc(len(chunk))


def bad_stream_id(msg) -> StageError | None:
    """The error of the first entry whose stream id is not one (stream_id.py), else None."""
    for entry in msg.entries:
        try:
            validate_stream_id(entry.stream_id)
        except StageError as e:
            return e.with_traceback(None)
    return None


def _raise_if_failed(task: asyncio.Task) -> None:
    if not task.done() or task.cancelled() or (error := task.exception()) is None:
        return
    raise error


async def serve_link(runtime, context, response_cls, handler: Callable[[LinkPort], Awaitable[None]], **bounds) -> None:
    """The body of a stage's Link RPC: a refused link ends with its typed status."""
    peer = context.peer() if hasattr(context, "peer") else "-"
    async with runtime.guard(context):
        with runtime.link_slot():
            runtime.metrics.links_opened.inc()
            runtime.log.info("link open (%s)", peer)
            try:
                await Link(runtime, context, response_cls, handler, **bounds).serve()
            finally:
                runtime.log.info("link closed (%s)", peer)
