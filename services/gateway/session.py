"""One client connection's session, whatever its wire: the part the Realtime and /api/chat protocols share.

A `ClientSession` owns the session's relay to a cell (relay.py), its input frames, its bounded output
queue and the one task that writes it to the socket, its idle clock, its error counting and its
cleanup. A protocol subclasses it and only reads its wire and renders its events:

    on_message(message)      one client message (RelayError from push_audio is the base's to swallow)
    render_output(frame)     queue one output frame's messages; False when there is nowhere to show it
    send_error(type, code, message)   queue one error (a stage failure, an idle timeout)
    on_relay_failure(err)    after a stage failure's error and the release: the wire's last words; the
                             close is 1011 with the error code unless this ends the session itself
    on_idle(limit)           the client sent nothing for too long: the wire's last words (close 1008)
    start()                  before the first client message: open or take the relay, greet

Threading: everything runs on the event loop; the relay calls `_on_output` and `_on_relay_error` from
its link tasks, so they only queue and never wait.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Awaitable

import numpy as np
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from duplex.v1 import talker_pb2
from services.gateway import audio
from services.gateway.admission import admit, release
from services.gateway.bounded import OutputQueue
from services.gateway.relay import PRELIVE_FRAMES, OpenParams, OutputFrame, Relay, RelayError

# Client errors logged per session (at INFO); past that they are only counted (a flood is one line).
LOGGED_CLIENT_ERRORS = 20
# At the end, what is still queued for a client that reads gets this long to leave.
FINAL_FLUSH_S = 2.0


async def open_relay(ctx, session_id: str, voice: str, persona: str, sampling: talker_pb2.Sampling,
                     prefer=None, wait: bool = True, hold_prompt_ms: int = 0) -> Relay:
    """Admit a session on a cell (admission.admit). An enrolled voice's samples are read off the
    event loop and travel with the open. `hold_prompt_ms`: open on hold (relay.py). Raises RelayError."""
    voice, voice_audio = await asyncio.to_thread(ctx.voices.for_open, voice)
    params = lambda: OpenParams(f"{session_id}.{secrets.token_hex(4)}", voice, persona,  # noqa: E731
                                sampling, voice_audio, ctx.config.early_outputs, hold_prompt_ms)
    return await admit(ctx, params, prefer, wait=wait)


class ClientSession:
    protocol = ""  # the metrics' protocol label; also names the logger (gateway.<protocol>)
    log_tag = "session"  # how log lines name one of these sessions

    def __init__(self, ws: ServerConnection, ctx, session_id: str):
        self.ws, self.ctx, self.cfg = ws, ctx, ctx.config  # ctx: server.Gateway (config, pool, metrics)
        self.session_id = session_id
        self.log = logging.getLogger(f"gateway.{self.protocol}")
        self.relay: Relay | None = None
        self.closing = False  # the session is ending: no new input or settings
        self.frames_out = 0  # output frames rendered to the client
        self.cleanup_confirmed: bool | None = None
        self._out = OutputQueue(self.cfg.output_queue_events, self.cfg.output_queue_bytes)
        self._ended = asyncio.Event()
        self._close_code, self._close_reason = 1000, "session closed"
        self._slow_client = False
        self._assembler = audio.FrameAssembler()
        self._audio_at = time.monotonic()  # connect, open, or the last audio message: the idle clock
        self._opening = 0  # opens in flight (never idle meanwhile: a prefill may take a while)
        self._client_errors = 0
        self._release_task: asyncio.Future | None = None
        self._bg: set[asyncio.Task] = set()

    # ---- the wire's part -----------------------------------------------------------------------

    async def start(self) -> None:
        pass

    async def on_message(self, message: str | bytes) -> None:
        raise NotImplementedError

    def render_output(self, frame: OutputFrame) -> bool:
        raise NotImplementedError

    def send_error(self, type_: str, code: str, message: str) -> None:
        raise NotImplementedError

    async def on_relay_failure(self, err: RelayError) -> None:
        pass

    async def on_idle(self, limit: float) -> None:
        pass

    def on_prompt_live(self) -> None:
        """The relay's latest prompt went live (a held open's or a re-prime's): frames flow now."""

    def on_prime_refused(self, prime: int, err: RelayError) -> None:
        """The talker refused a re-prime's settings; the session goes on with the prompt it had."""

    # ---- run -----------------------------------------------------------------------------------

    async def run(self) -> None:
        writer = asyncio.create_task(self._write_loop())
        reader: asyncio.Task | None = None
        try:
            await self.start()
            if not self._ended.is_set():
                reader = asyncio.create_task(self._read_loop())
                ended = asyncio.create_task(self._ended.wait())
                idle = asyncio.create_task(self._idle_watch())
                await asyncio.wait({reader, ended, writer}, return_when=asyncio.FIRST_COMPLETED)
                ended.cancel()
                idle.cancel()
                await asyncio.gather(idle, return_exceptions=True)
        finally:
            if reader is not None:
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)
            await self.release(graceful=False)
            await asyncio.gather(*self._bg, return_exceptions=True)
            await self._finish_writer(writer)

    def end(self, code: int, reason: str) -> None:
        """End the session; the socket closes with this code once `run` has cleaned up. The first
        end's code stands (a client cut off while its close is handled stays cut off)."""
        if not self._ended.is_set():
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
                pass  # already reported through the relay's on_error
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
            if self._opening:
                continue
            limit = self.cfg.idle_connection_timeout_s if self.relay is None else self.cfg.idle_session_timeout_s
            if limit > 0 and time.monotonic() - self._audio_at > limit and not self.closing:
                self.closing = True
                await self.on_idle(limit)
                self.end(1008, "idle timeout")
                return

    # ---- output --------------------------------------------------------------------------------

    def send(self, message: str | bytes, tag: str | None = None) -> None:
        """Queue one message for the client; `tag` lets `drop_queued` take it back unsent."""
        try:
            self._out.put_nowait(message, tag=tag)
        except asyncio.QueueFull:
            self._cut_off()

    def drop_queued(self, tag: str) -> int:
        return self._out.drop(tag)

    def wire_message(self, message: str | bytes) -> str | bytes:
        """A queued message as it leaves (Realtime adds its envelope here)."""
        return message

    def _cut_off(self) -> None:
        if self._ended.is_set():
            return
        self.log.warning("%s %s cut off: client is not reading (%d messages, %d bytes queued)", self.log_tag,
                         self.session_id, self._out.qsize(), self._out.bytes)
        self.ctx.metrics.slow_client_cutoffs.inc()
        self.ctx.metrics.errors.labels("server_error", "slow_client").inc()
        self._slow_client = True
        self.end(1008, "client not reading output")

    async def _write_loop(self) -> None:
        while (msg := await self._out.get()) is not None:
            await self.ws.send(self.wire_message(msg))

    async def _finish_writer(self, writer: asyncio.Task) -> None:
        # Whatever is queued (an error, the last events) reaches the client, unless the client is
        # the reason the queue is full.
        if not self._slow_client and not writer.done():
            try:
                self._out.finish()
                await asyncio.wait_for(asyncio.shield(writer), FINAL_FLUSH_S)
            except (asyncio.TimeoutError, ConnectionClosed):
                pass
        writer.cancel()
        await asyncio.gather(writer, return_exceptions=True)
        await self.ws.close(self._close_code, self._close_reason)

    def _on_output(self, f: OutputFrame) -> None:
        if self._ended.is_set() or not self.render_output(f):
            return
        self.frames_out += 1
        self.ctx.metrics.frames_out.inc()
        self.ctx.metrics.frame_latency.observe(f.latency_s)

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
        self._opening += 1
        try:
            return await open_relay(self.ctx, self.session_id, voice, persona, sampling, prefer, wait,
                                    hold_prompt_ms)
        finally:
            self._opening -= 1

    def adopt(self, relay: Relay) -> None:
        """The session holds `relay` now: it counts in the active gauge until `release`."""
        relay.on_output = self._on_output
        relay.on_error = self._on_relay_error
        relay.on_ready = lambda ready: self.on_prompt_live()
        relay.on_prime_refused = self.on_prime_refused
        self.relay = relay
        self._audio_at = time.monotonic()  # the no-audio clock starts at open
        self.ctx.metrics.sessions_active.labels(self.protocol).inc()

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

    def _on_relay_error(self, err: RelayError) -> None:
        # Called from a link task: report now (within the second), end in the background.
        if self._ended.is_set() or self.closing:
            return
        self.closing = True
        self.send_error(err.error_type, err.code, err.message)
        self.in_background(self._end_after_failure(err))

    async def _end_after_failure(self, err: RelayError) -> None:
        await self.release(graceful=False)
        await self.on_relay_failure(err)
        if not self._ended.is_set():
            self.end(1011, err.code)
