"""What every stage service (encoder, talker, decoder) shares around its model.

StageRuntime: admission and the life of a stream.
    handle = runtime.open_stream(stream_id)   # validates id; UNAVAILABLE when draining,
                                              # ALREADY_EXISTS, RESOURCE_EXHAUSTED (no slot)
    req = await handle.read(context)          # next request, None at end of stream; raises
                                              # Unavailable if the drain deadline ended the stream
    handle.seq.check(seq); ...; handle.seq.advance()
    runtime.close_stream(handle, reason)      # frees the slot (confirmed: see slots.SlotPool)

A stream that sends nothing for `stream_idle_timeout_s` (however it arrives: its own RPC or a
link) ends with DEADLINE_EXCEEDED (kind "idle") at that read: an idle or forgotten client never
holds a slot for good. It must exceed the gateway's own no-audio bound.

Before that, every stage RPC's first message (a stream's open, a link's first message) is read
with `runtime.first_message(context)`: due within `first_message_timeout_s` (DEADLINE_EXCEEDED,
kind "first_message_timeout"), and at most `max_unopened` RPCs wait for theirs at once (more are
refused at once: RESOURCE_EXHAUSTED, "too_many_unopened"). A caller that opens RPCs and sends
nothing holds neither a handler nor a socket's stream for long. A stage carries at most
`max_links` Link RPCs at once (`runtime.link_slot()`; more: RESOURCE_EXHAUSTED, "too_many_links").

    async with runtime.guard(context):        # StageError -> errors metric + gRPC status
        ...

StageRpcs: the GetCapacity and Drain RPCs, identical for every stage (a mixin
for the generated servicer classes). Drain is an admin RPC: it needs the metadata
`authorization: Bearer <token>` with the token in the stage's DUPLEX_ADMIN_TOKEN
environment variable; with none set, Drain is refused (UNAUTHENTICATED) and SIGTERM is the
only way to drain. `Drain(cancel=true)` un-drains: admission and health come back.

StageServer: the process around them: a grpc.aio server behind the stage gate (stage_gate.py: the
link token, link messages counted before they are parsed), standard grpc.health.v1 health (SERVING;
NOT_SERVING once draining, except the name "liveness", which stays SERVING until exit) and server
reflection, the Prometheus /metrics endpoint, and SIGTERM/SIGINT = drain (stop admitting, let
streams run until the deadline, end the rest with UNAVAILABLE, exit). It deliberately sets no
`maximum_concurrent_rpcs`: a full service must still answer health checks and GetCapacity; admission
is the slot pool's job.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import time
from typing import Awaitable, Callable, Iterable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from duplex.v1 import common_pb2
from services.common.errors import (AlreadyExists, FailedPrecondition, IdleTimeout, InvalidArgument,
                                    ResourceExhausted, StageError, Unauthenticated, Unavailable)
from services.common.frame import FRAME_MS
from services.common.link import LINK_MESSAGE_BYTES
from services.common.metrics import StageMetrics
from services.common.sequence import SequenceChecker
from services.common.slots import SlotPool
from services.common.stage_gate import LINK_TOKEN_ENV, StageGate, has_token
from services.common.stream_id import MAX_STREAM_ID, validate_stream_id  # noqa: F401 (services import it here)

# A health service name that stays SERVING while draining (for a liveness probe: a draining
# process is alive and must not be restarted; "" and the stage's own name go NOT_SERVING).
LIVENESS = "liveness"
STREAM_IDLE_TIMEOUT_S = 60.0
# A caller opens an RPC and sends its first message at once (the gateway's opens, a link's first
# message): 10 s is slack for a loaded machine, and short enough that RPCs opened and left silent
# come and go long before MAX_UNOPENED of them add up.
FIRST_MESSAGE_TIMEOUT_S = 10.0
MAX_UNOPENED = 256  # RPCs waiting for their first message at once (a full cell's worth of opens, and more)
MAX_LINKS = 32  # Link RPCs at once: one per gateway worker per cell, with room for restarts
ADMIN_TOKEN_ENV = "DUPLEX_ADMIN_TOKEN"


def freeze_startup_heap() -> None:
    """For a service process once it is ready: what is alive now (models, buffers, the server)
    lives as long as the process, so take it out of the cyclic collector's sight. A full
    collection mid-conversation then walks only what the conversations allocate: shorter pauses
    of the thread that runs the clock."""
    gc.collect()
    gc.freeze()


class StreamHandle:
    """One live stream: its id, its slot, its sequence checker, and a way to be ended from outside."""

    def __init__(self, stream_id: str, slot: int, idle_timeout_s: float = 0.0):
        self.stream_id = stream_id
        self.slot = slot
        self.idle_timeout_s = idle_timeout_s  # 0: no bound
        self.seq = SequenceChecker()
        self.opened_at = time.monotonic()
        self.frames = 0  # frames answered, for the close log line
        self._killed: StageError | None = None
        self._kill_event = asyncio.Event()

    def kill(self, error: StageError) -> None:
        """End the stream at its next read (used by the drain deadline)."""
        if self._killed is None:
            self._killed = error
            self._kill_event.set()

    def raise_if_killed(self) -> None:
        if self._killed is not None:
            raise self._killed

    async def read(self, context: grpc.aio.ServicerContext):
        """The next request, or None at the end of the client's stream."""
        self.raise_if_killed()
        poll = getattr(context, "read_nowait", None)  # a link's port: most frames are already queued
        if poll is not None and (req := poll()) is not None:
            return None if req is grpc.aio.EOF else req
        read = asyncio.ensure_future(context.read())
        killed = asyncio.ensure_future(self._kill_event.wait())
        try:
            await asyncio.wait({read, killed}, timeout=self.idle_timeout_s or None, return_when=asyncio.FIRST_COMPLETED)
        finally:
            killed.cancel()
            if not read.done():
                read.cancel()
        if read.done() and not read.cancelled():
            req = read.result()
            return None if req is grpc.aio.EOF else req
        self.raise_if_killed()
        raise IdleTimeout(f"stream {self.stream_id} sent nothing for {self.idle_timeout_s:g}s (the stage's idle bound)")


class StageRuntime:
    """Slots, live streams and the draining flag of one stage service (event loop thread only)."""

    def __init__(self, stage: str, slots: int, metrics: StageMetrics | None = None, frame_ms: int = FRAME_MS,
                 stream_idle_timeout_s: float = STREAM_IDLE_TIMEOUT_S, admin_token: str | None = None,
                 first_message_timeout_s: float = FIRST_MESSAGE_TIMEOUT_S, link_token: str | None = None,
                 max_unopened: int = MAX_UNOPENED, max_links: int = MAX_LINKS):
        self.stage = stage
        self.frame_ms = frame_ms
        self.stream_idle_timeout_s = stream_idle_timeout_s
        self.first_message_timeout_s = first_message_timeout_s  # 0: no bound
        self.max_unopened, self.max_links = max_unopened, max_links
        self.unopened = 0  # RPCs waiting for their first message
        self.links = 0  # Link RPCs being served
        # The Drain RPC's bearer token (None: Drain is refused); by default from the environment.
        self.admin_token = admin_token if admin_token is not None else os.environ.get(ADMIN_TOKEN_ENV) or None
        # The session RPCs' bearer token (stage_gate.py; None: no check); by default from the environment.
        self.link_token = link_token if link_token is not None else os.environ.get(LINK_TOKEN_ENV) or None
        self.stopping = False  # a SIGTERM shutdown is under way: it cannot be un-drained
        self.pool = SlotPool(slots)
        self.metrics = metrics or StageMetrics(stage)
        self.metrics.track(active=lambda: len(self.streams), free=lambda: self.pool.free_count)
        self.streams: dict[str, StreamHandle] = {}
        self.draining = False
        self.log = logging.getLogger(f"duplex.{stage}")
        self._drain_listeners: list[Callable[[bool], Awaitable[None]]] = []
        self._idle = asyncio.Event()
        self._idle.set()
        self._drain_timers: set[asyncio.Task] = set()

    # -- streams -----------------------------------------------------------------------------

    async def first_message(self, context: grpc.aio.ServicerContext):
        """An RPC's first request (grpc.aio.EOF if the caller ended its side first), due within
        first_message_timeout_s. A link's port has its first entry queued already."""
        poll = getattr(context, "read_nowait", None)
        if poll is not None and (req := poll()) is not None:
            return req
        if self.unopened >= self.max_unopened:
            raise ResourceExhausted(f"{self.unopened} RPCs on this {self.stage} wait for their first message "
                                    f"(at most {self.max_unopened}); send the open with the call",
                                    kind="too_many_unopened")
        self.unopened += 1
        try:
            return await asyncio.wait_for(context.read(), self.first_message_timeout_s or None)
        except TimeoutError:
            raise IdleTimeout(f"no first message within {self.first_message_timeout_s:g}s of the call (the "
                              f"{self.stage}'s bound): send the open with the call",
                              kind="first_message_timeout") from None
        finally:
            self.unopened -= 1

    @contextlib.contextmanager
    def link_slot(self):
        """Held while a Link RPC is served: at most max_links at once (ResourceExhausted beyond)."""
        if self.links >= self.max_links:
            raise ResourceExhausted(f"this {self.stage} serves {self.links} links, at most {self.max_links}",
                                    kind="too_many_links")
        self.links += 1
        try:
            yield
        finally:
            self.links -= 1

    def open_stream(self, stream_id: str) -> StreamHandle:
        validate_stream_id(stream_id)
        if self.draining:
            raise Unavailable(f"{self.stage} is draining and admits no new stream", kind="draining")
        if stream_id in self.streams:
            raise AlreadyExists(f"stream id {stream_id!r} is already live on this {self.stage}")
        slot = self.pool.acquire()
        handle = StreamHandle(stream_id, slot, self.stream_idle_timeout_s)
        self.streams[stream_id] = handle
        self._idle.clear()
        self.metrics.streams_opened.inc()
        self.log.info("open  stream=%s slot=%d active=%d free=%d", stream_id, slot, len(self.streams),
                      self.pool.free_count)
        return handle

    def close_stream(self, handle: StreamHandle, reason: str) -> None:
        """The stream is over (reason: ok | cancelled | error | drained). Idempotent."""
        if self.streams.get(handle.stream_id) is not handle:
            return
        del self.streams[handle.stream_id]
        self.pool.release(handle.slot)
        if not self.streams:
            self._idle.set()
        self.metrics.stream_closed(reason)
        self.log.info(
            "close stream=%s slot=%d reason=%s frames=%d secs=%.1f active=%d",
            handle.stream_id, handle.slot, reason, handle.frames, time.monotonic() - handle.opened_at,
            len(self.streams),
        )

    @contextlib.asynccontextmanager
    async def guard(self, context: grpc.aio.ServicerContext, stream_id: str = "-"):
        """Turn a StageError raised inside into the errors metric, a log line and the stream's gRPC status."""
        try:
            yield
        except StageError as e:
            await self.fail(context, e, stream_id)

    async def fail(self, context: grpc.aio.ServicerContext, error: StageError, stream_id: str = "-") -> None:
        """Count, log and send `error` as the RPC's status (raises, as grpc.aio's abort does)."""
        self.metrics.error(error.kind)
        self.log.warning("error stream=%s kind=%s code=%s: %s", stream_id[:MAX_STREAM_ID], error.kind, error.code.name,
                         error.message[:500])
        await error.abort(context)

    # -- admission state -----------------------------------------------------------------------

    def capacity(self) -> common_pb2.Capacity:
        return common_pb2.Capacity(
            total_slots=self.pool.total,
            free_slots=0 if self.draining else self.pool.free_count,
            active_streams=len(self.streams),
            draining=self.draining,
            stage=self.stage,
            frame_ms=self.frame_ms,
        )

    def on_drain(self, listener: Callable[[bool], Awaitable[None]]) -> None:
        """`await listener(draining)` whenever draining starts (True) or is cancelled (False)."""
        self._drain_listeners.append(listener)

    def check_admin(self, context: grpc.aio.ServicerContext) -> None:
        """Raise Unauthenticated unless the call carries `authorization: Bearer <admin token>`."""
        if not self.admin_token:
            raise Unauthenticated(f"{self.stage}: Drain is disabled (no {ADMIN_TOKEN_ENV} is set); SIGTERM drains",
                                  kind="admin_disabled")
        if not has_token(context.invocation_metadata(), self.admin_token):
            raise Unauthenticated(f"{self.stage}: Drain needs 'authorization: Bearer <{ADMIN_TOKEN_ENV}>'",
                                  kind="bad_admin_token")

    async def undrain(self) -> common_pb2.DrainResponse:
        """Cancel a drain: admit again, and no pending deadline ends a stream (ended ones stay ended)."""
        if self.stopping:
            raise FailedPrecondition(f"{self.stage} is shutting down (SIGTERM): it cannot be un-drained",
                                     kind="stopping")
        for task in list(self._drain_timers):
            task.cancel()
        if self.draining:
            self.draining = False
            self.log.info("drain cancelled: admitting again; %d live", len(self.streams))
            for listener in self._drain_listeners:
                await listener(False)
        return common_pb2.DrainResponse(active_streams=len(self.streams))

    async def drain(self, deadline_s: float) -> common_pb2.DrainResponse:
        """Stop admitting. With deadline_s > 0, streams still live after it end with UNAVAILABLE."""
        if deadline_s < 0 or deadline_s != deadline_s:
            raise InvalidArgument(f"drain deadline_s must be >= 0, got {deadline_s}", kind="bad_drain")
        if not self.draining:
            self.draining = True
            self.log.info("draining: admitting no new stream; %d live, deadline %.1fs", len(self.streams), deadline_s)
            for listener in self._drain_listeners:
                await listener(True)
        if deadline_s > 0:
            task = asyncio.ensure_future(self._end_streams_after(deadline_s))
            self._drain_timers.add(task)
            task.add_done_callback(self._drain_timers.discard)
        return common_pb2.DrainResponse(active_streams=len(self.streams))

    async def _end_streams_after(self, deadline_s: float) -> None:
        await asyncio.sleep(deadline_s)
        for handle in list(self.streams.values()):
            handle.kill(Unavailable(f"{self.stage} drained: the stream outlived the {deadline_s:g}s drain deadline",
                                    kind="drained"))

    async def wait_idle(self, timeout: float | None = None) -> bool:
        """True once no stream is live (False on timeout)."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False


class StageRpcs:
    """GetCapacity and Drain, the same for every stage. Mix in before the generated servicer base."""

    runtime: StageRuntime

    async def GetCapacity(self, request, context):
        return self.runtime.capacity()

    async def Drain(self, request, context):
        async with self.runtime.guard(context):
            self.runtime.check_admin(context)
            if request.cancel:
                return await self.runtime.undrain()
            return await self.runtime.drain(request.deadline_s)


class StageServer:
    """grpc.aio server + health + reflection + /metrics + SIGTERM drain for one stage."""

    def __init__(
        self,
        runtime: StageRuntime,
        *,
        register: Callable[[grpc.aio.Server], None],
        service_names: Iterable[str],
        host: str = "127.0.0.1",
        port: int = 0,
        metrics_port: int | None = 0,
        drain_deadline_s: float = 30.0,
    ):
        self.runtime = runtime
        self.register = register
        self.service_names = list(service_names)
        self.host, self.port, self.metrics_port = host, port, metrics_port
        self.drain_deadline_s = drain_deadline_s
        self.health = HealthServicer()
        self.server: grpc.aio.Server | None = None
        self._metrics_http = None
        self._stopped = asyncio.Event()

    async def start(self) -> None:
        # Never set maximum_concurrent_rpcs: health and GetCapacity must answer when the slots are full.
        self.server = grpc.aio.server(interceptors=[StageGate(self.runtime)], options=[
            ("grpc.so_reuseport", 0),  # a second service on the same port must fail, not share it
            # Find clients that vanished without closing (a dead peer holds its slot until then).
            ("grpc.keepalive_time_ms", 20_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            # Refused by gRPC before it is read into Python: a link message's byte bound (link.py),
            # and a Talk open's with its voice audio (60 s of float32 is 5.8 MB).
            ("grpc.max_receive_message_length", LINK_MESSAGE_BYTES),
        ])
        self.register(self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            self.service_names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self.server,
        )
        bound = self.server.add_insecure_port(f"[{self.host}]:{self.port}" if ":" in self.host
                                              else f"{self.host}:{self.port}")
        if bound == 0:
            raise OSError(f"{self.runtime.stage}: cannot bind gRPC port {self.host}:{self.port}")
        self.port = bound
        if self.metrics_port is not None and self.metrics_port >= 0:
            self._metrics_http = self.runtime.metrics.serve_http(self.metrics_port, self.host)
            self.metrics_port = self._metrics_http.server_port
        await self.server.start()
        for name in ["", *self.service_names, LIVENESS]:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.runtime.on_drain(self._set_serving)
        self.runtime.log.info(
            "%s serving on %s:%d (metrics :%s, %d slots)",
            self.runtime.stage, self.host, self.port, self.metrics_port, self.runtime.pool.total,
        )

    async def _set_serving(self, draining: bool) -> None:
        status = health_pb2.HealthCheckResponse.NOT_SERVING if draining else health_pb2.HealthCheckResponse.SERVING
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def stop(self, grace: float = 1.0) -> None:
        if self.server is not None:
            await self.server.stop(grace)
        if self._metrics_http is not None:
            # shutdown() waits out the server thread's poll (0.5 s): off the loop, which other stops share
            await asyncio.to_thread(self._metrics_http.shutdown)
            self._metrics_http.server_close()
            self._metrics_http = None
        self._stopped.set()

    async def drain_and_stop(self, deadline_s: float | None = None) -> None:
        """SIGTERM path: drain, let streams finish (up to the deadline, then they get UNAVAILABLE), stop."""
        deadline_s = self.drain_deadline_s if deadline_s is None else deadline_s
        self.runtime.stopping = True
        await self.runtime.drain(deadline_s)
        # The deadline kills streams at their next read; give them a moment to say so to their clients.
        idle = await self.runtime.wait_idle(deadline_s + 2.0 if deadline_s > 0 else None)
        self.runtime.log.info("drained (%s); stopping",
                              "all streams ended" if idle else f"{len(self.runtime.streams)} still live")
        await self.stop(grace=1.0)

    async def serve_until_signal(self) -> None:
        """Run until SIGTERM/SIGINT (then drain and exit) or until stop()."""
        loop = asyncio.get_running_loop()
        draining: list[asyncio.Task] = []

        def on_signal(signum: int) -> None:
            if draining:  # a second signal: stop now
                self.runtime.log.info("second signal %s: stopping now", signal.Signals(signum).name)
                asyncio.ensure_future(self.stop(grace=0))
                return
            self.runtime.log.info("%s: draining", signal.Signals(signum).name)
            draining.append(asyncio.ensure_future(self.drain_and_stop()))

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        await self._stopped.wait()
