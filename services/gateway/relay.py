"""The gateway's relay to a cell: one session's frames through the encoder -> talker -> decoder.

    client frame --send_frame--> encoder --codes--> talker --output--> decoder --pcm--> on_output

A gateway process talks to each cell over one CellLink: one long-lived Link stream per stage
(common.proto) that carries every session this process holds on the cell. A link message holds the
entries of many sessions (a tick's outputs, an encoder batch's codes), so the stages' event loops and
this one pay per message, not per frame: at 160 sessions the per-session streams cost each stage
about 4000 gRPC messages a second. The relay between stages stays here: each hop is one entry in a
message that arrives anyway, and the stages stay independent processes that know only their
neighbours' contract (direct stage-to-stage feeding would save one loop turn per hop, and couple the
stages' failure handling).

Lifecycle of a session (a Relay):
- `open_on_cells` sends the session's three opens on the cell's links; if any stage refuses, the
  stages that did open get an end and are waited for (nothing is half-opened), then the next cell is
  tried. All full -> RelayError("resource_exhausted").
- A session may open on hold (`OpenParams.hold_prompt_ms`, the Realtime wire's autostart): the
  talker takes the slot and answers `held`, and the prompt runs at the first `prime()` (new
  settings, re-primed in place as often as the client changes them before its audio), at the first
  frame (the open's settings), or when the hold ends. The session is live at the talker's `ready`
  for the latest prime (`on_ready`); earlier readies are stale and ignored.
- Audio before go-live is held here, at most PRELIVE_FRAMES (the newest; older ones are dropped and
  counted in `prelive_dropped`), and leaves for the encoder at go-live: the session lives however
  long its prompt waited, and it starts at most that many frames behind.
- Frames: the talker is opened with early_outputs (the gateway's --early-outputs), so a tick's
  outputs leave its step together and the decoder steps once per tick. Output k can then be decoded
  before the client sent frame k (the model computes it from frames up to k-1); the relay delivers
  it once frame k is in, so the client still gets N outputs for N frames, in order. At most one
  output waits so: the talker computes output k+1 only after frame k reached it.
- `close()` (client close): the encoder gets an end; each stage's OK status ends the next stage's
  input, so every queued frame still comes out; all three must end OK within `cleanup_timeout_s`.
  An output still waiting for its frame then is the last input's surplus step: dropped.
- `abort()` (socket drop, stage failure, slow client): every stage still open gets an end now and is
  waited for (bounded); one that does not confirm in time is cancelled, logged and counted.
- A stage's error status, a broken link, or no progress for `stall_timeout_s` while output is due
  fails the session once through `on_error` with a typed RelayError. A link that breaks fails
  only the sessions on it; the next open builds a new one.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass
from typing import Callable

import grpc
import numpy as np

from duplex.v1 import common_pb2, decoder_pb2, encoder_pb2, talker_pb2
from services.common.errors import parse_retry_hint
from services.common.pairing import OutputPairing, PairingError
from services.common.stage_gate import link_metadata
from services.gateway.audio import FRAME_SAMPLES, f32_frame_bytes, f32_from_frame_bytes
from services.gateway.cells import STAGES, Cell

log = logging.getLogger("gateway.relay")

_REQUESTS = {"encoder": encoder_pb2.EncodeRequest, "talker": talker_pb2.TalkRequest,
             "decoder": decoder_pb2.DecodeRequest}
_LINK_REQUESTS = {"encoder": encoder_pb2.EncodeLinkRequest, "talker": talker_pb2.TalkLinkRequest,
                  "decoder": decoder_pb2.DecodeLinkRequest}
_LINK_METHODS = {"encoder": "EncodeLink", "talker": "TalkLink", "decoder": "DecodeLink"}
_OPEN_ANSWERS = {"encoder": ("opened",), "talker": ("ready", "held"), "decoder": ("opened",)}
_STATUS = {c.value[0]: c for c in grpc.StatusCode}
MESSAGE_BYTES = 1 * 2**20  # one outgoing link message at most this big
MESSAGE_ENTRIES = 4096  # and with at most this many entries (a stage refuses more than 8192: common.proto)
# How long a link waits after its first unsent entry before it writes, per stage. Client frames reach
# the gateway spread over the period, one at a time: without a wait each would be its own message to
# the encoder (2000 a second at 160 sessions). 5 ms makes that 200 and delays a frame 2.5 ms on
# average; a session's open or end leaves at once. The talker's and decoder's entries come in bursts
# (one encoder batch, one tick's outputs) and leave on the next loop turn.
FLUSH_S = {"encoder": 0.005, "talker": 0.0, "decoder": 0.0}
OUTBOX_BYTES = 32 * 2**20  # unsent entries on one stage link before send_frame waits
# Unsent entries past which a stage that does not read its link is given up (its sessions fail
# typed): the relays into the talker and decoder links cannot wait for room, so this bounds them.
OUTBOX_LIMIT_BYTES = 2 * OUTBOX_BYTES
WATCH_PERIOD_S = 0.25
# Client frames held while the prompt is not live (the newest are kept): 1 s of audio. The talker
# catches a session up a frame per catch-up step, so a short hold costs a few ticks, not the call.
PRELIVE_FRAMES = 12


class RelayError(Exception):
    """A typed failure. `code` is the wire error code; `client_fault` picks invalid_request_error."""

    def __init__(self, code: str, message: str, stage: str | None = None, client_fault: bool = False,
                 retry_after_s: float | None = None):
        super().__init__(message)
        self.code = code
        self.stage = stage
        self.client_fault = client_fault
        self.message = message
        self.retry_after_s = retry_after_s  # a refusal's hint: try again after this long

    @property
    def error_type(self) -> str:
        if self.code in ("resource_exhausted", "server_busy"):
            return "rate_limit_error"
        return "invalid_request_error" if self.client_fault else "server_error"


@dataclass(frozen=True)
class StageEnd:
    """How a stage ended one session's stream (its LinkStatus)."""

    code: grpc.StatusCode
    kind: str
    details: str

    @property
    def ok(self) -> bool:
        return self.code == grpc.StatusCode.OK

    def describe(self) -> str:
        return f"{self.code.name} {self.details}".strip()


@dataclass(frozen=True)
class OpenParams:
    stream_id: str
    voice: str
    persona: str
    sampling: talker_pb2.Sampling
    voice_audio: bytes = b""  # an enrolled voice's samples (services/gateway/voices.py); b"": bundled
    early_outputs: bool = True  # the talker sends output k at its step's end; the relay pairs it (module doc)
    hold_prompt_ms: int = 0  # open on hold: the prompt waits for a prime, a frame or this long (module doc)


@dataclass
class OutputFrame:
    seq: int  # output frame number: 0, 1, 2, ...
    input_seq: int  # the input frame whose model step produced it
    pcm: np.ndarray  # 1920 float32 samples
    text: str  # text piece ('' for no text)
    latency_s: float  # from handing the input frame to the encoder to delivering its output (about 0 for an
    # output decoded before the frame came: early_outputs)


# ---- the links --------------------------------------------------------------------------------

class StageLink:
    """One Link stream to one stage of a cell. Entries out are queued and leave as one message per
    loop turn; entries in go to `on_entry`; the stream's end or failure goes to `on_lost` once."""

    def __init__(self, cell: Cell, stage: str, on_entry: Callable, on_lost: Callable[[str, str], None]):
        self.cell, self.stage = cell, stage
        self._on_entry, self._on_lost = on_entry, on_lost
        self._request_cls = _LINK_REQUESTS[stage]
        self._call = getattr(cell.stubs[stage], _LINK_METHODS[stage])(metadata=link_metadata())  # stage_gate.py
        self._out: list = []
        self._out_bytes = 0
        self._out_ready = asyncio.Event()
        self._urgent = asyncio.Event()  # an open or an end waits: no gathering (FLUSH_S) for it
        self._room = asyncio.Event()
        self._room.set()
        self.lost: str | None = None
        self._tasks = [asyncio.create_task(self._read_loop(), name=f"link-{cell.name}-{stage}-read"),
                       asyncio.create_task(self._write_loop(), name=f"link-{cell.name}-{stage}-write")]

    def send(self, stream_id: str, **kind) -> None:
        """Queue one entry (request=... or end=...) for this stage. Never blocks; see `room`."""
        if self.lost is not None:
            return
        entry = self._request_cls.Entry(stream_id=stream_id, **kind)
        size = entry.ByteSize()
        self._out.append((entry, size))
        self._out_bytes += size
        if self._out_bytes > OUTBOX_LIMIT_BYTES:
            self._lose(f"the {self.stage} does not read its link: {self._out_bytes} bytes unsent")
            self._call.cancel()
        elif self._out_bytes > OUTBOX_BYTES:
            self._room.clear()
        if "end" in kind or kind["request"].WhichOneof("kind") != "frame":
            self._urgent.set()
        self._out_ready.set()

    async def room(self) -> None:
        """Wait while this link's unsent entries are over their bound (the stage reads too slowly)."""
        if not self._room.is_set():
            await self._room.wait()

    async def _write_loop(self) -> None:
        try:
            await self._write([])  # at once: a stage ends a link whose first message is late (stage_server.py)
            while True:
                await self._out_ready.wait()
                await self._gather()
                self._out_ready.clear()
                self._urgent.clear()
                entries, self._out, self._out_bytes = self._out, [], 0
                self._room.set()
                chunk, size = [], 0
                for entry, n in entries:
                    if chunk and (size + n > MESSAGE_BYTES or len(chunk) == MESSAGE_ENTRIES):
                        await self._write(chunk)
                        chunk, size = [], 0
                    chunk.append(entry)
                    size += n
                if chunk:
                    await self._write(chunk)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._lose(f"writing failed: {_describe(e)}")

    async def _gather(self) -> None:
        """Let the other entries of this loop turn join, and on a link with a FLUSH_S those of that long,
        unless an open or an end is waiting (a session's start and close are not held back)."""
        wait = FLUSH_S[self.stage]
        if wait <= 0 or self._urgent.is_set():
            await asyncio.sleep(0)
            return
        try:
            await asyncio.wait_for(self._urgent.wait(), wait)
        except asyncio.TimeoutError:
            pass

    async def _write(self, entries: list) -> None:
        await self._call.write(self._request_cls(entries=entries))

    async def _read_loop(self) -> None:
        try:
            while (msg := await self._call.read()) is not grpc.aio.EOF:
                for entry in msg.entries:
                    self._on_entry(self.stage, entry)
            self._lose(f"ended the link: {(await self._call.code()).name} {await self._call.details()}".strip())
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._lose(_describe(e))

    def _lose(self, why: str) -> None:
        if self.lost is None:
            self.lost = why
            self._out, self._out_bytes = [], 0
            self._room.set()
            self._on_lost(self.stage, why)

    async def close(self) -> None:
        self._lose("link closed")
        self._call.cancel()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class CellLink:
    """This process's three stage links to one cell and the sessions on them."""

    def __init__(self, cell: Cell):
        self.cell = cell
        self.sessions: dict[str, Relay] = {}
        self.links = {s: StageLink(cell, s, self._on_entry, self._on_lost) for s in STAGES}
        self.broken: str | None = None
        self._watch = asyncio.create_task(self._watchdog(), name=f"link-{cell.name}-watch")

    @classmethod
    def of(cls, cell: Cell) -> "CellLink":
        """The cell's working link, made on first use and again after one broke."""
        link = cell.link
        if link is None or link.broken is not None:
            link = cell.link = cls(cell)
        return link

    def _on_entry(self, stage: str, entry) -> None:
        p = self.sessions.get(entry.stream_id)
        if p is not None:  # else: a session already over here (late answers are dropped)
            p._on_entry(stage, entry)

    def _on_lost(self, stage: str, why: str) -> None:
        if self.broken is None:
            self.broken = f"{stage} link: {why}"
            log.warning("cell %s: %s link lost (%s); its %d session(s) fail", self.cell.name, stage, why,
                        len(self.sessions))
        for p in list(self.sessions.values()):
            p._stage_lost(stage, why)
        if not self.sessions:
            asyncio.ensure_future(self.close())

    def _forget(self, p: "Relay") -> None:
        if self.sessions.get(p.params.stream_id) is p:
            del self.sessions[p.params.stream_id]
        if self.broken is not None and not self.sessions:
            asyncio.ensure_future(self.close())

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(WATCH_PERIOD_S)
            now = time.monotonic()
            for p in list(self.sessions.values()):
                p._check_stall(now)

    async def close(self) -> None:
        self._watch.cancel()
        await asyncio.gather(*(link.close() for link in self.links.values()), return_exceptions=True)
        if self.cell.link is self:
            self.cell.link = None


# ---- one session --------------------------------------------------------------------------------

class Relay:
    def __init__(self, cell: Cell, link: CellLink, params: OpenParams, stall_timeout_s: float,
                 cleanup_timeout_s: float):
        self.cell = cell
        self.params = params
        self.ready: talker_pb2.TalkReady | None = None
        self._link = link
        self._stall_timeout_s = stall_timeout_s
        self._cleanup_timeout_s = cleanup_timeout_s
        self.on_output: Callable[[OutputFrame], None] = lambda f: None
        self.on_error: Callable[[RelayError], None] = lambda e: None
        self.on_ready: Callable[[talker_pb2.TalkReady], None] = lambda r: None  # the latest prompt is live
        # A prime the talker refused (its number, the refusal): the session goes on with its last prompt.
        self.on_prime_refused: Callable[[int, RelayError], None] = lambda n, e: None
        self.on_say: Callable[[talker_pb2.TalkResponse], None] = lambda r: None  # say_done / say_refused (say.py)
        self.primes = 0  # primes sent (numbered 1, 2, ...)
        self._accepted = [0]  # the open's prompt and each prime not refused: the last one's ready makes it live
        self._last_ready: talker_pb2.TalkReady | None = None
        self._prelive: collections.deque[np.ndarray] = collections.deque(maxlen=PRELIVE_FRAMES)
        self.prelive_dropped = 0  # client frames dropped while the prompt was not live
        self.frames_in = 0
        self.frames_out = 0
        self.latencies: list[float] = []  # per output frame, seconds (for the session's summary)
        self._sent_at: dict[int, float] = {}
        self._text: dict[int, tuple[int, str]] = {}
        self._pairing: OutputPairing[OutputFrame] = OutputPairing()  # a frame decoded before its input came
        loop = asyncio.get_running_loop()
        self._opened = {s: loop.create_future() for s in STAGES}  # the stage's open answer, or StageEnd
        self._ended = {s: loop.create_future() for s in STAGES}  # the stage's StageEnd
        self._failed: RelayError | None = None
        self._closing = False
        self._aborting = False  # abort() runs: nothing is forwarded any more
        self._settled = asyncio.Event()  # the decoder ended, or the session failed: close() waits no more
        self._last_output_at = 0.0
        self.cleanup_confirmed: bool | None = None
        self._abort_task: asyncio.Future | None = None
        self._counted = False  # in cell.live_sessions

    @property
    def output_delay_frames(self) -> int:
        return int(self.ready.output_delay_frames) if self.ready is not None else 0

    def latency_summary(self) -> dict:
        if not self.latencies:
            return {"frames": 0}
        ms = np.asarray(self.latencies) * 1000.0
        return {"frames": int(ms.size), "p50_ms": round(float(np.median(ms)), 1),
                "p99_ms": round(float(np.percentile(ms, 99)), 1), "max_ms": round(float(ms.max()), 1)}

    @property
    def failed(self) -> RelayError | None:
        return self._failed

    # ---- open -------------------------------------------------------------

    @classmethod
    async def open_on(cls, cell: Cell, params: OpenParams, *, open_timeout_s: float, stall_timeout_s: float,
                      cleanup_timeout_s: float) -> "Relay":
        link = CellLink.of(cell)
        if params.stream_id in link.sessions:
            raise RelayError("runtime_open_failed",
                             f"stream id {params.stream_id!r} is already live on cell {cell.name}")
        p = cls(cell, link, params, stall_timeout_s, cleanup_timeout_s)
        link.sessions[params.stream_id] = p
        try:
            await p._open(open_timeout_s, cleanup_timeout_s)
        except asyncio.CancelledError:
            # The caller went away mid-open (a dropped client): whatever the stages opened is ended in
            # the background, bounded by cleanup_timeout_s, so no slot outlives the caller.
            p._aborting = p._closing = True
            asyncio.ensure_future(p._end_then_forget(cleanup_timeout_s))
            raise
        return p

    async def _open(self, open_timeout_s: float, cleanup_timeout_s: float) -> None:
        params, cell = self.params, self.cell
        opens = {
            "encoder": encoder_pb2.EncodeRequest(open=common_pb2.StreamOpen(stream_id=params.stream_id)),
            "talker": talker_pb2.TalkRequest(open=talker_pb2.TalkOpen(
                stream=common_pb2.StreamOpen(stream_id=params.stream_id), voice=params.voice, persona=params.persona,
                sampling=params.sampling, voice_audio=params.voice_audio,
                early_outputs=params.early_outputs, hold_prompt_ms=params.hold_prompt_ms)),
            "decoder": decoder_pb2.DecodeRequest(open=common_pb2.StreamOpen(stream_id=params.stream_id)),
        }
        # The talker first, the codecs once it accepts: the talker's slot refusal alone decides
        # admission. Opened all at once, concurrent opens (two gateway workers) could get each
        # stage's last slots in a different order, and as a caller refused anywhere is refused
        # whole, a full cell would admit fewer callers than it has slots.
        deadline = time.monotonic() + open_timeout_s
        self._send("talker", request=opens["talker"])
        await asyncio.wait([self._opened["talker"]], timeout=open_timeout_s)
        if _open_outcome(self._opened["talker"]) is None:
            for stage in ("encoder", "decoder"):
                self._send(stage, request=opens[stage])
            await asyncio.wait([self._opened["encoder"], self._opened["decoder"]],
                               timeout=max(0.0, deadline - time.monotonic()))
        else:
            for stage in ("encoder", "decoder"):  # never opened there: nothing to end
                self._stage_ended(stage, StageEnd(grpc.StatusCode.CANCELLED, "not_opened", "the talker refused first"))
        outcomes = {s: _open_outcome(f) for s, f in self._opened.items()}
        failures = {s: why for s, why in outcomes.items() if why is not None and not _never_opened(why)}
        if failures:
            # Nothing half-opened: end what did open and wait until each stage acknowledges.
            self._aborting = self._closing = True
            await self._end_then_forget(cleanup_timeout_s)
            raise _open_failure(cell, failures)
        answer = self._opened["talker"].result()
        if answer.WhichOneof("kind") == "ready":
            self.ready = self._last_ready = answer.ready
        cell.live_sessions += 1
        self._counted = True

    async def _end_then_forget(self, timeout: float) -> None:
        await self._end_stages(timeout)
        self._link._forget(self)

    # ---- the prompt --------------------------------------------------------

    @property
    def live(self) -> bool:
        """The latest prompt is in the talker's slot: frames flow."""
        return self.ready is not None

    def prime(self, voice: str, persona: str, sampling: talker_pb2.Sampling, voice_audio: bytes = b"") -> int:
        """(Re)start the prompt with these settings, in the same slot (allowed until the first frame
        left for the encoder). Returns the prime's number; the session is live again at the talker's
        ready for it, or goes on with its last prompt if the talker refuses it (on_prime_refused)."""
        if self._failed:
            raise self._failed
        if self.frames_in:
            raise RelayError("session_locked", "the prompt cannot change once audio has reached the model",
                             client_fault=True)
        self.primes += 1
        self._accepted.append(self.primes)
        self.ready = None
        self._send("talker", request=talker_pb2.TalkRequest(prime=talker_pb2.TalkPrime(
            voice=voice, persona=persona, sampling=sampling, voice_audio=voice_audio, prime=self.primes)))
        return self.primes

    def talk(self, request: talker_pb2.TalkRequest) -> None:
        """One more request on the session's talker stream (a say or say_cancel: services/gateway/say.py)."""
        if self._failed:
            raise self._failed
        self._send("talker", request=request)

    def _on_ready(self, ready: talker_pb2.TalkReady) -> None:
        self._last_ready = ready
        if ready.prime != self._accepted[-1]:
            return  # an earlier prompt's: replaced since
        self.ready = ready
        self._accepted = [ready.prime]  # the primes before it can no longer go live
        self.on_ready(ready)
        while self._prelive and self._failed is None:
            self._forward(self._prelive.popleft())

    def _on_prime_refused(self, refused: talker_pb2.TalkPrimeRefused) -> None:
        if refused.prime in self._accepted:
            self._accepted.remove(refused.prime)
        code = _TALKER_REFUSALS.get(refused.kind, "invalid_instructions")
        self.on_prime_refused(refused.prime, RelayError(code, refused.details, "talker", client_fault=True))
        last = self._last_ready
        if self.ready is None and last is not None and last.prime == self._accepted[-1]:
            self._on_ready(last)  # the prompt it goes on with was live already

    # ---- frames in ---------------------------------------------------------

    async def send_frame(self, frame: np.ndarray) -> None:
        """Hand one 1920-sample frame to the encoder, or hold it until the prompt is live (a held
        open's first frame starts its prompt with the open's settings)."""
        if self._failed:
            raise self._failed
        assert frame.shape == (FRAME_SAMPLES,)
        if not self.live:
            if self.primes == 0 and self.params.hold_prompt_ms:
                p = self.params
                self.prime(p.voice, p.persona, p.sampling, p.voice_audio)
            if len(self._prelive) == PRELIVE_FRAMES:
                self.prelive_dropped += 1
            self._prelive.append(frame)
            return
        self._forward(frame)
        await self._link.links["encoder"].room()

    def _forward(self, frame: np.ndarray) -> None:
        seq = self.frames_in
        self._sent_at[seq] = time.monotonic()
        pcm = common_pb2.PcmFrame(seq=seq, pcm_f32le=f32_frame_bytes(frame))
        self._send("encoder", request=encoder_pb2.EncodeRequest(frame=pcm))
        self.frames_in += 1
        if (early := self._pairing.release(self.frames_in)) is not None:
            self._deliver(early, self._sent_at.get(early.input_seq, time.monotonic()))

    def _send(self, stage: str, **kind) -> None:
        link = self._link.links[stage]
        if link.lost is not None:
            self._stage_lost(stage, link.lost)
        else:
            link.send(self.params.stream_id, **kind)

    # ---- entries from the stages --------------------------------------------

    def _on_entry(self, stage: str, entry) -> None:
        if entry.WhichOneof("kind") == "status":
            st = entry.status
            self._stage_ended(stage, StageEnd(_STATUS.get(st.code, grpc.StatusCode.UNKNOWN), st.kind, st.details))
            return
        resp = entry.response
        kind = resp.WhichOneof("kind")
        if kind in _OPEN_ANSWERS[stage]:
            if not self._opened[stage].done():
                self._opened[stage].set_result(resp)
            elif kind == "ready" and not self._aborting:
                self._on_ready(resp.ready)
            return
        if kind == "prime_refused":
            self._on_prime_refused(resp.prime_refused)
            return
        if kind in ("say_done", "say_refused"):
            self.on_say(resp)
            return
        if self._aborting:
            return
        try:
            if stage == "encoder":
                codes = resp.codes
                frame = common_pb2.CodesFrame(seq=codes.seq, codes=codes.codes)
                self._send("talker", request=talker_pb2.TalkRequest(frame=frame))
            elif stage == "talker":
                out = resp.output
                self._text[out.seq] = (out.input_seq, out.text_piece)
                frame = common_pb2.CodesFrame(seq=out.seq, codes=out.agent_codes)
                self._send("decoder", request=decoder_pb2.DecodeRequest(frame=frame))
            else:
                self._on_pcm(resp.pcm)
        except RelayError as e:
            self._fail(e)

    def _on_pcm(self, pcm) -> None:
        input_seq, text = self._text.pop(pcm.seq, (None, ""))
        if input_seq is None:
            raise RelayError("runtime_stream_failed", f"decoder returned frame {pcm.seq} the talker never produced",
                             "decoder")
        self._last_output_at = time.monotonic()
        frame = OutputFrame(pcm.seq, input_seq, f32_from_frame_bytes(pcm.pcm_f32le), text, 0.0)
        try:
            paired = self._pairing.pair(input_seq, frame, self.frames_in)  # None: until frame input_seq is sent
        except PairingError as e:
            raise RelayError("runtime_stream_failed", f"the talker sent output {pcm.seq} too early: {e}",
                             "talker") from None
        if paired is not None:
            self._deliver(paired, self._sent_at.get(input_seq, self._last_output_at))

    def _deliver(self, frame: OutputFrame, sent: float) -> None:
        now = time.monotonic()
        for s in [s for s in self._sent_at if s <= frame.input_seq]:
            del self._sent_at[s]
        frame.latency_s = now - sent
        self.frames_out += 1
        if len(self.latencies) < 100_000:
            self.latencies.append(frame.latency_s)
        self.on_output(frame)

    def _stage_ended(self, stage: str, end: StageEnd) -> None:
        if self._ended[stage].done():
            return
        self._ended[stage].set_result(end)
        if not self._opened[stage].done():
            self._opened[stage].set_result(end)
            return
        if not end.ok:
            if not self._aborting:
                self._fail(RelayError("runtime_stream_failed", f"{stage} ended the stream: {end.describe()}", stage))
        elif not self._closing:
            self._fail(RelayError("runtime_stream_failed", f"{stage} ended the stream before the session closed",
                                  stage))
        elif not self._aborting:
            # A graceful close: each stage's end ends the next stage's input, after its last frame.
            if stage == "encoder":
                self._send("talker", end=common_pb2.LinkEnd())
            elif stage == "talker":
                self._send("decoder", end=common_pb2.LinkEnd())
        if stage == "decoder":
            self._settled.set()
        if all(f.done() for f in self._ended.values()):
            self._link._forget(self)

    def _stage_lost(self, stage: str, why: str) -> None:
        """The stage's link broke: the session's stream there is gone."""
        self._stage_ended(stage, StageEnd(grpc.StatusCode.UNAVAILABLE, "link_lost", f"link lost: {why}"))

    def _check_stall(self, now: float) -> None:
        """Output is due for every input frame past the model's delay. With frames due and no
        output for `stall_timeout_s` (a backlog that still moves is not a stall), fail typed."""
        if self._failed or self._aborting or self.ready is None:
            return
        due = [t for s, t in self._sent_at.items() if s >= self.output_delay_frames]
        if not due:
            return
        waiting = now - max(self._last_output_at, min(due))
        if waiting > self._stall_timeout_s:
            self._fail(RelayError("stage_stalled", f"no output for {waiting:.1f}s while {len(due)} frame(s) are due"))

    # ---- failure and close -------------------------------------------------

    def _fail(self, err: RelayError) -> None:
        if self._failed is not None:
            return
        self._failed = err
        self._settled.set()
        log.warning("session %s on cell %s failed: %s %s", self.params.stream_id, self.cell.name, err.code, err.message)
        self.on_error(err)

    async def close(self) -> bool:
        """Client close: every queued frame still comes out, then all three streams end OK."""
        self._closing = True
        if self._failed is None and not self._aborting:
            self._send("encoder", end=common_pb2.LinkEnd())
            try:
                await asyncio.wait_for(self._settled.wait(), self._cleanup_timeout_s)
            except asyncio.TimeoutError:
                if self._failed is None:
                    log.warning("session %s: graceful close did not finish in %.1fs", self.params.stream_id,
                                self._cleanup_timeout_s)
        return await self.abort()

    async def abort(self) -> bool:
        """End all three streams now. Returns True when each stage acknowledged the end."""
        self._closing = True
        if self._abort_task is None:  # one cleanup, however many callers
            self._abort_task = asyncio.ensure_future(self._abort())
        return await asyncio.shield(self._abort_task)

    async def _abort(self) -> bool:
        self._aborting = True
        ends = await self._end_stages(self._cleanup_timeout_s)
        # A stage that failed cannot acknowledge; the session's cleanup is confirmed when every
        # stage that is still alive did.
        failed_stage = self._failed.stage if self._failed else None
        self.cleanup_confirmed = all(
            end is not None and (end.ok or s == failed_stage or end.kind in ("link_lost", "not_opened"))
            for s, end in ends.items())
        if self._counted:
            self.cell.live_sessions -= 1
            self._counted = False
        self._link._forget(self)
        if not self.cleanup_confirmed:
            log.error("session %s: cleanup not confirmed within %.1fs by %s", self.params.stream_id,
                      self._cleanup_timeout_s,
                      ", ".join(f"{s} ({end.describe() if end else 'no answer'})" for s, end in ends.items()
                                if end is None or not (end.ok or s == failed_stage)))
        return self.cleanup_confirmed

    async def _end_stages(self, timeout: float) -> dict[str, StageEnd | None]:
        """Half-close every stage still open and wait (bounded) for each to end; cancel the rest."""
        for s in STAGES:
            if not self._ended[s].done():
                self._send(s, end=common_pb2.LinkEnd())
        await asyncio.wait(self._ended.values(), timeout=timeout)
        ends = {s: (f.result() if f.done() else None) for s, f in self._ended.items()}
        for s, end in ends.items():
            if end is None:
                self._send(s, end=common_pb2.LinkEnd(cancel=True))
        return ends


def _describe(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name} {e.details() or ''}".strip()
    return f"{type(e).__name__}: {e}"


def _never_opened(why) -> bool:
    return isinstance(why, StageEnd) and why.kind == "not_opened"


def _open_outcome(fut: asyncio.Future) -> StageEnd | RelayError | None:
    """Why a stage did not open the session (None: it did)."""
    if not fut.done():
        return RelayError("runtime_open_failed", "no answer to the open in time")
    result = fut.result()
    return result if isinstance(result, StageEnd) else None


# The talker's `error-kind` of a refused open -> the Realtime error code the client sees.
_TALKER_REFUSALS = {"bad_voice": "invalid_voice", "bad_persona": "invalid_instructions",
                    "bad_sampling": "invalid_sampling"}


def _open_failure(cell: Cell, failures: dict[str, StageEnd | RelayError]) -> RelayError:
    for stage, end in failures.items():
        if stage == "talker" and isinstance(end, StageEnd) and end.code == grpc.StatusCode.INVALID_ARGUMENT:
            which = _TALKER_REFUSALS.get(end.kind, "invalid_instructions")
            return RelayError(which, end.details or "talker refused the session settings", stage, client_fault=True)
    # Not a client fault: RESOURCE_EXHAUSTED anywhere means full (or, from the talker, a prefill queue
    # too long for a prompt to wait in); anything else is a stage problem.
    busy = failures.get("talker")
    if isinstance(busy, StageEnd) and busy.kind == "prefill_busy":
        return RelayError("server_busy", f"cell {cell.name} is busy starting other sessions: {busy.details}", None,
                          retry_after_s=parse_retry_hint(busy.details))
    if any(isinstance(e, StageEnd) and e.code == grpc.StatusCode.RESOURCE_EXHAUSTED for e in failures.values()):
        return RelayError("resource_exhausted", f"cell {cell.name} has no free slot", None)
    stage, end = next(iter(failures.items()))
    why = end.describe() if isinstance(end, StageEnd) else end.message
    return RelayError("runtime_open_failed", f"{stage} did not open the stream: {why}", stage)


async def open_on_cells(cells: list[Cell], make_params: Callable[[], OpenParams], *, open_timeout_s: float,
                        stall_timeout_s: float, cleanup_timeout_s: float) -> Relay:
    """Admit a session on the first cell (least loaded first) whose three stages all accept it."""
    if not cells:
        raise RelayError("resource_exhausted", "no cell has a free session slot", None)
    errors: list[RelayError] = []
    for cell in cells:
        cell.admitted_since_poll += 1
        try:
            return await Relay.open_on(cell, make_params(), open_timeout_s=open_timeout_s,
                                          stall_timeout_s=stall_timeout_s, cleanup_timeout_s=cleanup_timeout_s)
        except RelayError as e:
            cell.admitted_since_poll -= 1
            if e.client_fault:
                raise
            log.info("cell %s refused a session: %s %s", cell.name, e.code, e.message)
            errors.append(e)
    # Every cell said no: if any was merely full or busy, the client may retry later.
    raise next((e for e in errors if e.code in ("resource_exhausted", "server_busy")), errors[-1])
