"""One client connection's session, whatever its wire: the part the Realtime and /api/chat protocols share.

A `ClientSession` owns the session's relay to a cell (relay.py), its input frames, its bounded output
queue and the one task that writes it to the socket, its idle clock, its error counting and its
cleanup. A protocol subclasses it and only reads its wire and renders its events. What it must
implement (abstract):

    for_connection(ws, ctx, query)   the session of an upgraded connection (a classmethod)
    start()                  before the first client message: open or take the relay, greet
    on_message(message)      one client message (RelayError from push_audio is the base's to swallow)
    render_output(frame)     queue one output frame's messages; False when there is nowhere to show it
    send_error(type, code, message)   queue one error (a stage failure, an idle timeout)
    on_idle(limit)           the client sent nothing for too long: the wire's last words (close 1008)

and what it may (no-ops here):

    at_upgrade(ctx, conn, query)   before the 101: an HTTP answer refuses the upgrade (a classmethod)
    on_relay_failure(err)    after a stage failure's error and the release: the wire's last words; the
                             close is 1011 with the error code unless this ends the session itself
    on_prompt_live()         the relay's latest prompt went live
    on_prime_refused(n, err) the talker refused a re-prime's settings
    on_say_answer(answer)    the talker's answer to a say (say.py)
    on_resumed(dropped)      a resume's connection took over (resume.py): the wire's greeting, first

A session whose class sets `resumable` is PAUSED when its connection goes away without a close frame
from the client (resume.py says how a client comes back): the relay stays open in its slot, nothing
reaches the stages, output frames the relay delivers meanwhile are dropped and counted, and what was
queued for the client stays queued (bounded as ever) for the resumed connection; the message being
written at the drop is lost. The idle clock runs on and the slot counts as any other. A resume's
connection is handed to `run`, which serves it as it served the first; the grace's end ends the
session as a drop did before. The first connection's handler runs the session to its end.

The session is the relay's listener (relay.RelayListener): it is given to the open, and events of a
relay it does not hold yet are dropped; `adopt` reads a failure that came before.

Status (`SessionStatus`; the legal moves are `_NEXT`, in one place):

    WAITING <-> OPENING -> LIVE -> CLOSING -> ENDED | CUT_OFF
    LIVE -> PAUSED -> RESUMING -> LIVE    (PAUSED <- RESUMING: the claimed connection never came)
    WAITING -> LIVE (opened at the upgrade), and ENDED or CUT_OFF from any status before them
    (CLOSING not from OPENING: nothing can close a session while its open is in flight)

Threading: everything runs on the event loop; the relay calls the `relay_*` methods from its link
tasks, so they only queue and never wait.
"""

from __future__ import annotations

import abc
import asyncio
import enum
import logging
import secrets
import time
from typing import Awaitable

import numpy as np
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Response

from duplex.v1 import talker_pb2
from services.common.status import transition
from services.gateway import audio
from services.gateway.admission import admit, release
from services.gateway.bounded import OutputQueue
from services.gateway.context import GatewayContext
from services.gateway.relay import PRELIVE_FRAMES, OpenParams, OutputFrame, Relay, RelayError, RelayListener

# Client errors logged per session (at INFO); past that they are only counted (a flood is one line).
LOGGED_CLIENT_ERRORS = 20
# At the end, what is still queued for a client that reads gets this long to leave.
FINAL_FLUSH_S = 2.0


async def open_relay(ctx: GatewayContext, listener: RelayListener, session_id: str, voice: str, persona: str,
                     sampling: talker_pb2.Sampling, prefer=None, wait: bool = True, hold_prompt_ms: int = 0) -> Relay:
    """Admit a session on a cell (admission.admit). An enrolled voice's samples are read off the
    event loop and travel with the open. `hold_prompt_ms`: open on hold (relay.py). Raises RelayError."""
    voice, voice_audio = await asyncio.to_thread(ctx.voices.for_open, voice)
    params = lambda: OpenParams(f"{session_id}.{secrets.token_hex(4)}", voice, persona,  # noqa: E731
                                sampling, voice_audio, ctx.config.early_outputs, hold_prompt_ms)
    return await admit(ctx, params, listener, prefer, wait=wait)


class SessionStatus(enum.Enum):
    WAITING = "waiting"  # connected, no relay held: the idle-connection clock runs
    OPENING = "opening"  # an open is in flight: never idle meanwhile (a prefill may take a while)
    LIVE = "live"  # holds a relay: the no-audio clock runs
    PAUSED = "paused"  # its connection dropped: the relay stays open, waiting for a resume or the grace's end
    RESUMING = "resuming"  # a resume's handshake claimed it (resume.Resumes.claim): its connection is on the way
    CLOSING = "closing"  # ending (client close, idle, a stage failure): no new input or settings
    ENDED = "ended"  # end() was called: the socket closes with its code once `run` has cleaned up
    CUT_OFF = "cut_off"  # ended because the client does not read: what is queued is not flushed


S = SessionStatus
_NEXT: dict[SessionStatus, frozenset[SessionStatus]] = {
    S.WAITING: frozenset({S.OPENING, S.LIVE, S.CLOSING, S.ENDED, S.CUT_OFF}),  # LIVE: opened at the upgrade
    S.OPENING: frozenset({S.WAITING, S.LIVE, S.ENDED, S.CUT_OFF}),  # WAITING: refused
    S.LIVE: frozenset({S.PAUSED, S.CLOSING, S.ENDED, S.CUT_OFF}),
    S.PAUSED: frozenset({S.RESUMING, S.CLOSING, S.ENDED, S.CUT_OFF}),
    S.RESUMING: frozenset({S.LIVE, S.PAUSED, S.CLOSING, S.ENDED, S.CUT_OFF}),
    S.CLOSING: frozenset({S.ENDED, S.CUT_OFF}),
    S.ENDED: frozenset(),  # the first end's code stands
    S.CUT_OFF: frozenset(),
}
_OVER = frozenset({S.ENDED, S.CUT_OFF})
_AWAY = frozenset({S.PAUSED, S.RESUMING})  # no connection serves the session
# A claimed resume's connection arrives within this long of its handshake's checks, or the claim lapses.
HANDOFF_TIMEOUT_S = 10.0


def advance(status: SessionStatus, to: SessionStatus) -> SessionStatus:
    """`to`, if a session in `status` may move there; else IllegalTransition."""
    return transition(_NEXT, status, to)


class ClientSession(abc.ABC):
    protocol = ""  # the metrics' protocol label; also names the logger (gateway.<protocol>)
    log_tag = "session"  # how log lines name one of these sessions
    resumable = False  # a lost connection pauses the session (resume.py) instead of ending it

    def __init__(self, ws: ServerConnection, ctx: GatewayContext, session_id: str):
        self.ws, self.ctx, self.cfg = ws, ctx, ctx.config
        self.session_id = session_id
        self.log = logging.getLogger(f"gateway.{self.protocol}")
        self.relay: Relay | None = None
        self.status = SessionStatus.WAITING
        self.frames_out = 0  # output frames rendered to the client
        self.cleanup_confirmed: bool | None = None
        self._out = OutputQueue(self.cfg.output_queue_events, self.cfg.output_queue_bytes)
        self._ended = asyncio.Event()  # set with ENDED or CUT_OFF: `run` stops waiting
        self._close_code, self._close_reason = 1000, "session closed"
        self._assembler = audio.FrameAssembler()
        self._audio_at = time.monotonic()  # connect, open, or the last audio message: the idle clock
        self._client_errors = 0
        self._release_task: asyncio.Future | None = None
        self._bg: set[asyncio.Task] = set()
        self.resume_token: str | None = None  # set by `offer_resume` (the wire's greeting carries it)
        self.frames_undelivered = 0  # output frames produced while paused, dropped
        self._handoff: asyncio.Future | None = None  # while paused: a resume's connection
        self._claimed_by: object = None  # while RESUMING: the connection that claimed it
        self._claimed_at = 0.0  # loop time of the claim
        self._first_counted = False  # the first connection counts in websockets_open (run)
        self._connection_done = asyncio.Event()  # the session is done with its current connection

    # ---- the route (server.WS_ROUTES: path -> one of these classes) -----------------------------

    @classmethod
    async def at_upgrade(cls, ctx: GatewayContext, conn: ServerConnection, query: dict[str, str]) -> Response | None:
        """Before the 101, after the shared checks (key, connection cap): an HTTP answer refuses the
        upgrade; None goes on with the handshake."""
        return None

    @classmethod
    @abc.abstractmethod
    def for_connection(cls, ws: ServerConnection, ctx: GatewayContext, query: dict[str, str]) -> ClientSession:
        """The session of an upgraded connection (`run` serves it)."""

    # ---- the wire's part -----------------------------------------------------------------------

    @abc.abstractmethod
    async def start(self) -> None:
        """Before the first client message: open or take the relay, greet."""

    @abc.abstractmethod
    async def on_message(self, message: str | bytes) -> None:
        """One client message."""

    @abc.abstractmethod
    def render_output(self, frame: OutputFrame) -> bool:
        """Queue one output frame's messages; False when there is nowhere to show it."""

    @abc.abstractmethod
    def send_error(self, type_: str, code: str, message: str) -> None:
        """Queue one error event."""

    @abc.abstractmethod
    async def on_idle(self, limit: float) -> None:
        """The client sent nothing for `limit` seconds: the wire's last words before close 1008."""

    async def on_relay_failure(self, err: RelayError) -> None:
        """After a stage failure's error and the release: the wire's last words (close 1011 follows)."""

    def on_prompt_live(self) -> None:
        """The relay's latest prompt went live (a held open's or a re-prime's): frames flow now."""

    def on_prime_refused(self, prime: int, err: RelayError) -> None:
        """The talker refused a re-prime's settings; the session goes on with the prompt it had."""

    def on_say_answer(self, answer: talker_pb2.TalkResponse) -> None:
        """The talker's say_done or say_refused (services/gateway/say.py)."""

    def on_resumed(self, dropped: int) -> None:
        """A resume's connection serves the session now (`dropped` output frames were not delivered):
        queue the wire's greeting (`send(..., first=True)`: before what was queued at the drop)."""

    # ---- status --------------------------------------------------------------------------------

    def _to(self, status: SessionStatus) -> None:
        self.status = advance(self.status, status)

    @property
    def closing(self) -> bool:
        """The session is ending: no new input or settings."""
        return self.status in (SessionStatus.CLOSING, *_OVER)

    def start_closing(self) -> bool:
        """Move to CLOSING (a close, an idle timeout, a stage failure). False: it is ending already."""
        if self.closing:
            return False
        self._to(SessionStatus.CLOSING)
        return True

    # ---- run -----------------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve the session to its end: its first connection, and each resume's after a drop."""
        metrics = self.ctx.metrics
        metrics.websockets_open.inc()  # the first connection, until it goes; a resume's handler counts its own
        self._first_counted = True
        writer = asyncio.create_task(self._write_loop())
        reader: asyncio.Task | None = None
        idle: asyncio.Task | None = None
        try:
            await self.start()
            if not self._ended.is_set():
                idle = asyncio.create_task(self._idle_watch())
                while True:
                    reader = asyncio.create_task(self._read_loop())
                    ended = asyncio.create_task(self._ended.wait())
                    await asyncio.wait({reader, ended, writer}, return_when=asyncio.FIRST_COMPLETED)
                    ended.cancel()
                    if not self._connection_lost(reader):
                        break
                    await self._stop_serving(reader, writer)
                    reader = None
                    if await self._pause():  # a resume's connection serves it now
                        writer = asyncio.create_task(self._write_loop())
                    if self.status is not SessionStatus.LIVE:
                        break
        finally:
            if idle is not None:
                idle.cancel()
                await asyncio.gather(idle, return_exceptions=True)
            if reader is not None:
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)
            self.ctx.resumes.forget(self)
            await self.release(graceful=False)
            await asyncio.gather(*self._bg, return_exceptions=True)
            await self._finish_writer(writer)
            self._connection_done.set()
            self._uncount_first_connection()

    # ---- pause and resume (resume.py) ------------------------------------------------------------

    def offer_resume(self) -> str | None:
        """Make the session resumable (a token for the wire's greeting); None where it is not."""
        if self.resumable and self.ctx.resumes.enabled and self.resume_token is None:
            self.resume_token = self.ctx.resumes.register(self)
        return self.resume_token

    def _connection_lost(self, reader: asyncio.Task) -> bool:
        """The connection went away without the client's close frame, from a session that may pause."""
        if (self._ended.is_set() or self.resume_token is None or self.status is not SessionStatus.LIVE
                or self.ctx.resumes.shutting_down):
            return False
        if self.relay is None or self.relay.frames_in == 0:
            # The model has heard nothing: no conversation to resume, and a new session is the same.
            # Pausing it would let a client that connects, sends updates and drops, again and again,
            # hold a slot per drop for the whole grace (issue 31's first attack).
            return False
        if reader.done() and not reader.cancelled() and reader.exception() is not None \
                and not isinstance(reader.exception(), ConnectionClosed):
            return False  # an unexpected error: the session ends (the handler logs it)
        return self.ws.protocol.close_rcvd is None

    async def _stop_serving(self, reader: asyncio.Task, writer: asyncio.Task) -> None:
        """The lost connection's tasks end: the reader finishes the message it is handling (it sees
        the loss at its next read; bounded), the writer stops (the message it was writing is lost)."""
        await asyncio.wait({reader}, timeout=self.cfg.cleanup_timeout_s)
        for task in (reader, writer):
            task.cancel()
        await asyncio.gather(reader, writer, return_exceptions=True)
        self._connection_done.set()

    def _uncount_first_connection(self) -> None:
        if self._first_counted:
            self._first_counted = False
            self.ctx.metrics.websockets_open.dec()

    async def _pause(self) -> bool:
        """PAUSED until a resume hands over its connection (True: `self.ws` is it, and the session is
        LIVE again unless it was ending meanwhile) or the grace period ends (False; the session ends,
        if nothing else ended it meanwhile: idle, a stage failure, the gateway's shutdown)."""
        loop = asyncio.get_running_loop()
        metrics = self.ctx.metrics
        self._to(SessionStatus.PAUSED)
        self._uncount_first_connection()
        metrics.sessions_paused.inc()
        self.log.info("%s %s paused: its connection dropped (resumable for %g s)", self.log_tag, self.session_id,
                      self.cfg.resume_grace_s)
        deadline = loop.time() + self.cfg.resume_grace_s
        ended = asyncio.create_task(self._ended.wait())
        try:
            self._handoff = loop.create_future()
            while not self._ended.is_set():
                resuming = self.status is SessionStatus.RESUMING
                wait = (self._claimed_at + HANDOFF_TIMEOUT_S if resuming else deadline) - loop.time()
                if wait > 0:
                    await asyncio.wait({self._handoff, ended}, timeout=wait)
                if self._handoff.done():
                    self.ws, self._connection_done = self._handoff.result()
                    if self.status is not SessionStatus.RESUMING:
                        return True  # it was ending meanwhile: its last words go to the new connection
                    self._to(SessionStatus.LIVE)
                    metrics.resumes.labels("resumed").inc()
                    self.log.info("%s %s resumed (%d output frames dropped while paused)", self.log_tag,
                                  self.session_id, self.frames_undelivered)
                    self.on_resumed(self.frames_undelivered)
                    return True
                if self._ended.is_set():
                    return False
                if resuming:
                    if loop.time() < self._claimed_at + HANDOFF_TIMEOUT_S:
                        continue  # claimed while the grace's wait ran: wait for its connection now
                    self._to(SessionStatus.PAUSED)  # the claimed connection never came
                    self._claimed_by = None
                    self.ctx.resumes.unclaim(self)
                    continue
                if loop.time() < deadline:
                    continue
                metrics.resume_grace_expired.inc()
                self.log.info("%s %s: no resume within %g s: ended", self.log_tag, self.session_id,
                              self.cfg.resume_grace_s)
                self.end(1001, "resume grace period over")
            return False
        finally:
            ended.cancel()
            self._handoff = None
            metrics.sessions_paused.dec()

    def claim_resume(self, conn: object) -> bool:
        """A resume's handshake passed its checks (resume.Resumes.claim): PAUSED -> RESUMING for `conn`.
        False: not paused (its connection is still there, or another resume holds it)."""
        if self.status is not SessionStatus.PAUSED:
            return False
        self._to(SessionStatus.RESUMING)
        self._claimed_by, self._claimed_at = conn, asyncio.get_running_loop().time()
        return True

    async def serve_resumed(self, ws: ServerConnection) -> bool:
        """A resume's handler: hand `ws` to `run` and wait until the session is done with it. False:
        the claim had lapsed (nothing was handed over; the caller answers)."""
        handoff = self._handoff
        if self.status is not SessionStatus.RESUMING or self._claimed_by is not ws or handoff is None \
                or handoff.done():
            return False
        self._claimed_by = None
        done = asyncio.Event()
        self.ctx.metrics.websockets_open.inc()
        try:
            handoff.set_result((ws, done))
            await done.wait()
        finally:
            self.ctx.metrics.websockets_open.dec()
        return True

    def end_if_paused(self) -> None:
        """At the gateway's shutdown: a paused session ends now."""
        if self.status in _AWAY:
            self.end(1001, "gateway shutting down")

    def end(self, code: int, reason: str) -> None:
        """End the session; the socket closes with this code once `run` has cleaned up. The first
        end's code stands (a client cut off while its close is handled stays cut off)."""
        self._finish(SessionStatus.ENDED, code, reason)

    def _finish(self, status: SessionStatus, code: int, reason: str) -> None:
        if self.status not in _OVER:
            self._to(status)
            self._close_code, self._close_reason = code, reason
            self._ended.set()

    def in_background(self, coro: Awaitable) -> None:
        """Run `coro` beside the session; `run` waits for it before the socket closes."""
        task = asyncio.ensure_future(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    async def _read_loop(self) -> None:
        async for message in self.ws:
            try:
                await self.on_message(message)
            except RelayError:
                pass  # already reported through relay_failed
            if self._ended.is_set():
                return

    async def _idle_watch(self) -> None:
        """End a connection that opens no session, or a session that sends no audio, for too long
        (operator-set; 0 = never): either holds resources a live client would be using."""
        limits = [t for t in (self.cfg.idle_connection_timeout_s, self.cfg.idle_session_timeout_s) if t > 0]
        if not limits:
            return
        while not self.closing:
            await asyncio.sleep(min(1.0, min(limits) / 4))
            if self.status is SessionStatus.OPENING:
                continue
            limit = self.cfg.idle_connection_timeout_s if self.relay is None else self.cfg.idle_session_timeout_s
            if limit > 0 and time.monotonic() - self._audio_at > limit and self.start_closing():
                await self.on_idle(limit)
                self.end(1008, "idle timeout")
                return

    # ---- output --------------------------------------------------------------------------------

    def send(self, message: str | bytes, tag: str | None = None, first: bool = False) -> None:
        """Queue one message for the client; `tag` lets `drop_queued` take it back unsent; `first`
        puts it before what is queued (a resume's greeting)."""
        try:
            self._out.put_nowait(message, tag=tag, first=first)
        except asyncio.QueueFull:
            self._cut_off()

    def drop_queued(self, tag: str) -> int:
        return self._out.drop(tag)

    def wire_message(self, message: str | bytes) -> str | bytes:
        """A queued message as it leaves (Realtime adds its envelope here)."""
        return message

    def _cut_off(self) -> None:
        if self.status in _OVER:
            return
        self.log.warning("%s %s cut off: client is not reading (%d messages, %d bytes queued)", self.log_tag,
                         self.session_id, self._out.qsize(), self._out.bytes)
        self.ctx.metrics.slow_client_cutoffs.inc()
        self.ctx.metrics.errors.labels("server_error", "slow_client").inc()
        self._finish(SessionStatus.CUT_OFF, 1008, "client not reading output")

    async def _write_loop(self) -> None:
        while (msg := await self._out.get()) is not None:
            await self.ws.send(self.wire_message(msg))

    async def _finish_writer(self, writer: asyncio.Task) -> None:
        # Whatever is queued (an error, the last events) reaches the client, unless the client is
        # the reason the queue is full.
        if self.status is not SessionStatus.CUT_OFF and not writer.done():
            try:
                self._out.finish()
                await asyncio.wait_for(asyncio.shield(writer), FINAL_FLUSH_S)
            except (asyncio.TimeoutError, ConnectionClosed):
                pass
        writer.cancel()
        await asyncio.gather(writer, return_exceptions=True)
        await self.ws.close(self._close_code, self._close_reason)

    def count_error(self, type_: str, code: str, message: str) -> None:
        """Count and log one error the wire is about to send (logged up to LOGGED_CLIENT_ERRORS)."""
        self.ctx.metrics.errors.labels(type_, code).inc()
        self._client_errors += 1
        if self._client_errors <= LOGGED_CLIENT_ERRORS:
            self.log.info("%s %s: %s/%s: %s", self.log_tag, self.session_id, type_, code, message)
        elif self._client_errors == LOGGED_CLIENT_ERRORS + 1:
            self.log.info("%s %s: more errors are counted, not logged (gateway_errors_total)", self.log_tag,
                          self.session_id)

    # ---- input ---------------------------------------------------------------------------------

    def heard_from_client(self) -> None:
        """Audio arrived (accepted or not): the client is alive."""
        self._audio_at = time.monotonic()

    async def push_audio(self, samples: np.ndarray) -> None:
        """Validated samples into 1920-sample frames, each handed to the relay (waits while the
        encoder link is full). Raises RelayError when the relay has failed."""
        for frame in self._assembler.push(samples):
            dropped = self.relay.prelive_dropped
            await self.relay.send_frame(frame)
            if self.relay.prelive_dropped > dropped:
                self.ctx.metrics.prelive_dropped.inc()
                if self.relay.prelive_dropped == 1:
                    self.log.info("%s %s: audio before the prompt is live: the newest %d frames are kept, older ones "
                                  "dropped (counted in session.closed)", self.log_tag, self.session_id, PRELIVE_FRAMES)
            else:
                self.ctx.metrics.frames_in.inc()

    async def flush_audio(self) -> None:
        """At a graceful close: the zero-padded residual goes out as the last frame."""
        if self.relay is None or self.relay.failed is not None:
            return
        last = self._assembler.flush()
        if last is not None:
            try:
                await self.relay.send_frame(last)
                self.ctx.metrics.frames_in.inc()
            except RelayError:
                pass

    def clear_audio(self) -> int:
        """Drop the samples not yet in a frame; returns how many."""
        return self._assembler.clear()

    # ---- the relay -----------------------------------------------------------------------------

    async def open_relay(self, voice: str, persona: str, sampling: talker_pb2.Sampling, prefer=None,
                         wait: bool = True, hold_prompt_ms: int = 0) -> Relay:
        """Open a relay that tells this session; the caller adopts it. Raises RelayError."""
        self._to(SessionStatus.OPENING)
        try:
            return await open_relay(self.ctx, self, self.session_id, voice, persona, sampling, prefer, wait,
                                    hold_prompt_ms)
        except BaseException:
            if self.status is SessionStatus.OPENING:
                self._to(SessionStatus.WAITING)
            raise

    def adopt(self, relay: Relay) -> None:
        """The session holds `relay` (opened with this session as its listener) now: it counts in the
        active gauge until `release`. A relay that failed before it was taken (a stage that errored
        right after accepting the open: the failure found no holder) is reported now as a link task
        would have, one loop turn later, so the wire's greeting goes first."""
        self.relay = relay
        if self.status in (SessionStatus.WAITING, SessionStatus.OPENING):
            self._to(SessionStatus.LIVE)
        self._audio_at = time.monotonic()  # the no-audio clock starts at open
        self.ctx.metrics.sessions_active.labels(self.protocol).inc()
        if relay.failed is not None:
            asyncio.get_running_loop().call_soon(self._on_relay_error, relay.failed)

    def count_opened(self) -> None:
        relay = self.relay
        self.ctx.metrics.sessions_opened.labels(self.protocol).inc()
        if relay.ready is None:
            self.log.info("%s %s open on cell %s (its prompt on hold)", self.log_tag, self.session_id, relay.cell.name)
        else:
            self.log.info("%s %s open on cell %s (prefill %d frames in %.0f ms)", self.log_tag, self.session_id,
                          relay.cell.name, relay.ready.prefill_frames, relay.ready.prefill_ms)

    async def release(self, graceful: bool) -> None:
        """End the relay's streams, once, however many paths (close, drop, failure) ask."""
        if self.relay is None:
            return
        if self._release_task is None:
            self._release_task = asyncio.ensure_future(self._release_once(self.relay, graceful))
        await asyncio.shield(self._release_task)

    async def _release_once(self, relay: Relay, graceful: bool) -> None:
        self.cleanup_confirmed = await release(self.ctx, relay, graceful)
        self.ctx.metrics.sessions_active.labels(self.protocol).dec()
        self.log.info("%s %s released (frames in %d, out %d, latency %s, cleanup %s)", self.log_tag,
                      self.session_id, relay.frames_in, relay.frames_out, relay.latency_summary(),
                      "confirmed" if self.cleanup_confirmed else "NOT confirmed")

    # ---- the relay's listener (relay.RelayListener): called from link tasks, they only queue -------

    def relay_output(self, f: OutputFrame) -> None:
        if self.status in _AWAY:  # paused: nowhere to send it (dropped and counted, module doc)
            self.frames_undelivered += 1
            self.ctx.metrics.resume_dropped_frames.inc()
            return
        if self.relay is None or self.status in _OVER or not self.render_output(f):
            return
        self.frames_out += 1
        self.ctx.metrics.frames_out.inc()
        self.ctx.metrics.frame_latency.observe(f.latency_s)

    def relay_failed(self, err: RelayError) -> None:
        if self.relay is not None:  # else not taken yet: adopt reads relay.failed
            self._on_relay_error(err)

    def relay_live(self, ready: talker_pb2.TalkReady) -> None:
        if self.relay is not None:
            self.on_prompt_live()

    def relay_prime_refused(self, prime: int, err: RelayError) -> None:
        if self.relay is not None:
            self.on_prime_refused(prime, err)

    def relay_say(self, answer: talker_pb2.TalkResponse) -> None:
        if self.relay is not None:
            self.on_say_answer(answer)

    def _on_relay_error(self, err: RelayError) -> None:
        # Report now (within the second), end in the background.
        if not self.start_closing():
            return
        self.send_error(err.error_type, err.code, err.message)
        self.in_background(self._end_after_failure(err))

    async def _end_after_failure(self, err: RelayError) -> None:
        await self.release(graceful=False)
        await self.on_relay_failure(err)
        if not self._ended.is_set():
            self.end(1011, err.code)
