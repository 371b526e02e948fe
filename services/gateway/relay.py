"""One session's relay through a cell: its three streams (encoder -> talker -> decoder) and its state machine.

    client frame --send_frame--> encoder --codes--> talker --output--> decoder --pcm--> listener

The session's streams are entries on the cell's shared links (links.py: the transport); which stage
is opened when, what an answer means and where an output goes are the stage chain's data
(stages.py). This file is one session's life on them. The relay between stages stays in the
gateway: each hop is one entry in a message that arrives anyway, and the stages stay independent
processes that know only their neighbours' contract (direct stage-to-stage feeding would save one
loop turn per hop, and couple the stages' failure handling).

A relay tells its holder what happens through one `RelayListener`, given at the open: its outputs,
its failure, a prompt gone live, a refused re-prime, a say's answer. Events come from the link
tasks, so a listener only queues and never waits. A relay can fail while its open is still being
answered (a stage that errors just after accepting): its holder reads `failed` when it takes it.

Status (`RelayStatus`; the legal moves are `_NEXT`, in one place):

    OPENING -> OPEN -> CLOSING -> ABORTING -> ENDED
       |        |         |          ^
       |        +---------+-> FAILED-+
       +--------------------> FAILED
       +--> REFUSED <---------- FAILED   (the open did not succeed, or its caller went away)

- `open_on_cells` / `Relay.open_on` send the session's opens in OPEN_ORDER; if any stage refuses, the
  stages that did open get an end and are waited for (nothing is half-opened: REFUSED), then the
  next cell is tried. All full -> RelayError("resource_exhausted"). A relay that opened counts in
  `cell.live_sessions` until it is ENDED.
- A session may open on hold (`OpenParams.hold_prompt_ms`, the Realtime wire's autostart): the
  talker takes the slot and answers `held`, and the prompt runs at the first `prime()` (new
  settings, re-primed in place as often as the client changes them before its audio), at the first
  frame (the open's settings), or when the hold ends. The session is live at the talker's `ready`
  for the latest prime (`relay_live`); earlier readies are stale and ignored.
- Audio before go-live is held here, at most PRELIVE_FRAMES (the newest; older ones are dropped and
  counted in `prelive_dropped`), and leaves for the encoder at go-live: the session lives however
  long its prompt waited, and it starts at most that many frames behind.
- Frames: the talker is opened with early_outputs (the gateway's --early-outputs), so a tick's
  outputs leave its step together and the decoder steps once per tick. Output k can then be decoded
  before the client sent frame k (the model computes it from frames up to k-1); the relay delivers
  it once frame k is in, so the client still gets N outputs for N frames, in order. At most one
  output waits so: the talker computes output k+1 only after frame k reached it.
- `close()` (client close, CLOSING): the first stage gets an end; each stage's OK status ends the
  next stage's input, so every queued frame still comes out; all three must end OK within
  `cleanup_timeout_s`. An output still waiting for its frame then is the last input's surplus
  step: dropped.
- `abort()` (socket drop, stage failure, slow client, and the end of every close: ABORTING): every
  stage still open gets an end now and is waited for (bounded); one that does not confirm in time is
  cancelled, logged and counted. Nothing is forwarded any more.
- A stage's error status, a broken link, or no progress for `stall_timeout_s` while output is due
  fails the session once (FAILED) through `relay_failed` with a typed RelayError.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import grpc
import numpy as np

from duplex.v1 import common_pb2, encoder_pb2, talker_pb2
from services.common.pairing import OutputPairing, PairingError
from services.common.status import transition
from services.gateway.audio import FRAME_SAMPLES, f32_frame_bytes, f32_from_frame_bytes
from services.gateway.cells import STAGES, Cell
from services.gateway.links import CellLink
from services.gateway.stages import (
    CHAIN, OPEN_ORDER, OpenParams, RelayError, StageEnd, open_failure, settings_refusal, stage_end,
)

__all__ = ["PRELIVE_FRAMES", "OpenParams", "OutputFrame", "Relay", "RelayError",
           "RelayListener", "RelayStatus", "StageEnd", "open_on_cells"]

log = logging.getLogger("gateway.relay")

# Client frames held while the prompt is not live (the newest are kept): 1 s of audio. The talker
# catches a session up a frame per catch-up step, so a short hold costs a few ticks, not the call.
PRELIVE_FRAMES = 12
_FIRST = next(iter(CHAIN))  # the stage a client frame and a graceful close go to


@dataclass
class OutputFrame:
    seq: int  # output frame number: 0, 1, 2, ...
    input_seq: int  # the input frame whose model step produced it
    pcm: np.ndarray  # 1920 float32 samples
    text: str  # text piece ('' for no text)
    latency_s: float  # from handing the input frame to the encoder to delivering its output (about 0 for an
    # output decoded before the frame came: early_outputs)


class RelayListener(Protocol):
    """What a relay tells its holder (services/gateway/session.py's ClientSession is one). Called from
    link tasks: queue, never wait."""

    def relay_output(self, frame: OutputFrame) -> None:
        """One output frame, in order."""

    def relay_failed(self, err: RelayError) -> None:
        """The session failed (once): a stage error, a broken link or a stall."""

    def relay_live(self, ready: talker_pb2.TalkReady) -> None:
        """The latest prompt is live (a held open's or a re-prime's): frames flow."""

    def relay_prime_refused(self, prime: int, err: RelayError) -> None:
        """The talker refused prime `prime`'s settings: the session goes on with its last prompt."""

    def relay_say(self, answer: talker_pb2.TalkResponse) -> None:
        """The talker's say_done or say_refused for a say sent with `talk` (services/gateway/say.py)."""


class RelayStatus(enum.Enum):
    OPENING = "opening"  # the opens are out; the stages' answers awaited
    OPEN = "open"  # every stage accepted: frames flow
    CLOSING = "closing"  # client close: the first stage has its end, queued frames still come out
    FAILED = "failed"  # a stage error, a broken link or a stall, reported once (`failed` says which)
    ABORTING = "aborting"  # every stream still open gets an end now; nothing is forwarded
    ENDED = "ended"  # every stage ended or was cancelled; off the cell's count
    REFUSED = "refused"  # the open failed or its caller left: what did open is ended; never counted


S = RelayStatus
_NEXT: dict[RelayStatus, frozenset[RelayStatus]] = {
    S.OPENING: frozenset({S.OPEN, S.FAILED, S.REFUSED}),
    S.OPEN: frozenset({S.CLOSING, S.FAILED, S.ABORTING}),
    S.CLOSING: frozenset({S.FAILED, S.ABORTING}),
    S.FAILED: frozenset({S.ABORTING, S.REFUSED}),  # REFUSED: it failed while the open was still answered
    S.ABORTING: frozenset({S.ENDED}),
    S.ENDED: frozenset(),
    S.REFUSED: frozenset(),
}
# Its streams are being ended: nothing is forwarded, a stage's end (even an error) is expected.
_ENDING = frozenset({S.ABORTING, S.ENDED, S.REFUSED})


def advance(status: RelayStatus, to: RelayStatus) -> RelayStatus:
    """`to`, if a relay in `status` may move there; else IllegalTransition."""
    return transition(_NEXT, status, to)


# ---- one session --------------------------------------------------------------------------------

class Relay:
    def __init__(self, cell: Cell, link: CellLink, params: OpenParams, listener: RelayListener,
                 stall_timeout_s: float, cleanup_timeout_s: float):
        self.cell = cell
        self.params = params
        self.status = RelayStatus.OPENING
        self.ready: talker_pb2.TalkReady | None = None
        self._link = link
        self._listener = listener
        self._stall_timeout_s = stall_timeout_s
        self._cleanup_timeout_s = cleanup_timeout_s
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
        self._failure: RelayError | None = None  # why it failed (it stays after the status moves on)
        self._settled = asyncio.Event()  # the last stage ended, or the session failed: close() waits no more
        self._last_output_at = 0.0
        self.cleanup_confirmed: bool | None = None
        self._abort_task: asyncio.Future | None = None

    @property
    def stream_id(self) -> str:
        return self.params.stream_id

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
        return self._failure

    def _to(self, status: RelayStatus) -> None:
        self.status = advance(self.status, status)

    @property
    def _ending(self) -> bool:
        return self.status in _ENDING

    # ---- open -------------------------------------------------------------

    @classmethod
    async def open_on(cls, cell: Cell, params: OpenParams, listener: RelayListener, *, open_timeout_s: float,
                      stall_timeout_s: float, cleanup_timeout_s: float) -> "Relay":
        link = CellLink.of(cell)
        if link.holds(params.stream_id):
            raise RelayError("runtime_open_failed",
                             f"stream id {params.stream_id!r} is already live on cell {cell.name}")
        p = cls(cell, link, params, listener, stall_timeout_s, cleanup_timeout_s)
        link.add(p)
        try:
            await p._open(open_timeout_s, cleanup_timeout_s)
        except asyncio.CancelledError:
            # The caller went away mid-open (a dropped client): whatever the stages opened is ended in
            # the background, bounded by cleanup_timeout_s, so no slot outlives the caller.
            if p.status is not RelayStatus.REFUSED:
                p._to(RelayStatus.REFUSED)
            asyncio.ensure_future(p._end_then_forget(cleanup_timeout_s))
            raise
        return p

    async def _open(self, open_timeout_s: float, cleanup_timeout_s: float) -> None:
        # The talker first, the codecs once it accepts (OPEN_ORDER): the talker's slot refusal alone
        # decides admission. Opened all at once, concurrent opens (two gateway workers) could get each
        # stage's last slots in a different order, and as a caller refused anywhere is refused
        # whole, a full cell would admit fewer callers than it has slots.
        deadline = time.monotonic() + open_timeout_s
        refused_by: list[str] = []
        for wave in OPEN_ORDER:
            if refused_by:
                for stage in wave:  # never opened there: nothing to end
                    self._stage_ended(stage, StageEnd(grpc.StatusCode.CANCELLED, "not_opened",
                                                      f"the {' and '.join(refused_by)} refused first"))
                continue
            for stage in wave:
                self._send(stage, request=CHAIN[stage].open_request(self.params))
            await asyncio.wait([self._opened[s] for s in wave], timeout=max(0.0, deadline - time.monotonic()))
            refused_by = [s for s in wave if _open_outcome(self._opened[s]) is not None]
        outcomes = {s: _open_outcome(f) for s, f in self._opened.items()}
        failures = {s: why for s, why in outcomes.items() if why is not None and not _never_opened(why)}
        if failures:
            # Nothing half-opened: end what did open and wait until each stage acknowledges.
            self._to(RelayStatus.REFUSED)
            await self._end_then_forget(cleanup_timeout_s)
            raise open_failure(self.cell.name, failures)
        if self.status is RelayStatus.OPENING:  # else FAILED already: the holder reads `failed`
            self._to(RelayStatus.OPEN)
        answer = self._opened["talker"].result()
        if answer.WhichOneof("kind") == "ready":
            self.ready = self._last_ready = answer.ready
        self.cell.live_sessions += 1  # until ENDED (_abort)

    async def _end_then_forget(self, timeout: float) -> None:
        await self._end_stages(timeout)
        self._link.forget(self)

    # ---- the prompt --------------------------------------------------------

    @property
    def live(self) -> bool:
        """The latest prompt is in the talker's slot: frames flow."""
        return self.ready is not None

    def prime(self, voice: str, persona: str, sampling: talker_pb2.Sampling, voice_audio: bytes = b"") -> int:
        """(Re)start the prompt with these settings, in the same slot (allowed until the first frame
        left for the encoder). Returns the prime's number; the session is live again at the talker's
        ready for it, or goes on with its last prompt if the talker refuses it (relay_prime_refused)."""
        if self._failure:
            raise self._failure
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
        if self._failure:
            raise self._failure
        self._send("talker", request=request)

    def _on_ready(self, ready: talker_pb2.TalkReady) -> None:
        self._last_ready = ready
        if ready.prime != self._accepted[-1]:
            return  # an earlier prompt's: replaced since
        self.ready = ready
        self._accepted = [ready.prime]  # the primes before it can no longer go live
        self._listener.relay_live(ready)
        while self._prelive and self._failure is None:
            self._forward(self._prelive.popleft())

    def _on_prime_refused(self, refused: talker_pb2.TalkPrimeRefused) -> None:
        if refused.prime in self._accepted:
            self._accepted.remove(refused.prime)
        self._listener.relay_prime_refused(refused.prime, settings_refusal(refused.kind, refused.details))
        last = self._last_ready
        if self.ready is None and last is not None and last.prime == self._accepted[-1]:
            self._on_ready(last)  # the prompt it goes on with was live already

    # ---- frames in ---------------------------------------------------------

    async def send_frame(self, frame: np.ndarray) -> None:
        """Hand one 1920-sample frame to the encoder, or hold it until the prompt is live (a held
        open's first frame starts its prompt with the open's settings)."""
        if self._failure:
            raise self._failure
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
        await self._link.links[_FIRST].room()

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
            self.link_lost(stage, link.lost)
        else:
            link.send(self.params.stream_id, **kind)

    # ---- entries from the stages (the link's calls: links.LinkSession) ------

    def link_entry(self, stage: str, entry) -> None:
        if entry.WhichOneof("kind") == "status":
            self._stage_ended(stage, stage_end(entry.status))
            return
        resp = entry.response
        kind = resp.WhichOneof("kind")
        spec = CHAIN[stage]
        if kind in spec.open_answers:
            if not self._opened[stage].done():
                self._opened[stage].set_result(resp)
            elif kind == "ready" and not self._ending:
                self._on_ready(resp.ready)
            return
        if kind == "prime_refused":
            self._on_prime_refused(resp.prime_refused)
            return
        if kind in ("say_done", "say_refused"):
            self._listener.relay_say(resp)
            return
        if self._ending:
            return
        try:
            if kind == "output":  # the talker's text waits here for its audio (_on_pcm)
                self._text[resp.output.seq] = (resp.output.input_seq, resp.output.text_piece)
            if spec.next is not None:
                self._send(spec.next, request=spec.forward(resp))
            else:
                self._on_pcm(resp.pcm)
        except RelayError as e:
            self._fail(e)

    def _on_pcm(self, pcm) -> None:
        input_seq, text = self._text.pop(pcm.seq, (None, ""))
        if input_seq is None:
            raise RelayError("runtime_stream_failed", f"decoder returned frame {pcm.seq} the talker never produced",
                             "decoder")
        if len(pcm.pcm_f32le) != 4 * FRAME_SAMPLES:
            raise RelayError("runtime_stream_failed", f"decoder returned frame {pcm.seq} of {len(pcm.pcm_f32le)} "
                             f"bytes, not {4 * FRAME_SAMPLES}", "decoder")
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
        self._listener.relay_output(frame)

    def _stage_ended(self, stage: str, end: StageEnd) -> None:
        if self._ended[stage].done():
            return
        self._ended[stage].set_result(end)
        if not self._opened[stage].done():
            self._opened[stage].set_result(end)
            return
        nxt = CHAIN[stage].next
        if not end.ok:
            if not self._ending:
                self._fail(RelayError("runtime_stream_failed", f"{stage} ended the stream: {end.describe()}", stage))
        elif self.status is RelayStatus.CLOSING:
            # A graceful close: each stage's end ends the next stage's input, after its last frame.
            if nxt is not None:
                self._send(nxt, end=common_pb2.LinkEnd())
        elif not self._ending:
            self._fail(RelayError("runtime_stream_failed", f"{stage} ended the stream before the session closed",
                                  stage))
        if nxt is None:
            self._settled.set()
        if all(f.done() for f in self._ended.values()):
            self._link.forget(self)

    def link_lost(self, stage: str, why: str) -> None:
        """The stage's link broke: the session's stream there is gone."""
        self._stage_ended(stage, StageEnd(grpc.StatusCode.UNAVAILABLE, "link_lost", f"link lost: {why}"))

    def link_error(self, why: str) -> None:
        """A handler of this session raised on the link (a bug): this session fails, typed."""
        self._fail(RelayError("runtime_stream_failed", why))

    def link_watch(self, now: float) -> None:
        """Output is due for every input frame past the model's delay. With frames due and no
        output for `stall_timeout_s` (a backlog that still moves is not a stall), fail typed."""
        if self.status not in (RelayStatus.OPENING, RelayStatus.OPEN, RelayStatus.CLOSING) or self.ready is None:
            return
        due = [t for s, t in self._sent_at.items() if s >= self.output_delay_frames]
        if not due:
            return
        waiting = now - max(self._last_output_at, min(due))
        if waiting > self._stall_timeout_s:
            self._fail(RelayError("stage_stalled", f"no output for {waiting:.1f}s while {len(due)} frame(s) are due"))

    # ---- failure and close -------------------------------------------------

    def _fail(self, err: RelayError) -> None:
        if self._failure is not None:
            return
        self._failure = err
        self._to(RelayStatus.FAILED)
        self._settled.set()
        log.warning("session %s on cell %s failed: %s %s", self.params.stream_id, self.cell.name, err.code, err.message)
        self._listener.relay_failed(err)

    async def close(self) -> bool:
        """Client close: every queued frame still comes out, then all three streams end OK."""
        if self.status in (RelayStatus.OPEN, RelayStatus.CLOSING):
            if self.status is RelayStatus.OPEN:
                self._to(RelayStatus.CLOSING)
                self._send(_FIRST, end=common_pb2.LinkEnd())
            try:
                await asyncio.wait_for(self._settled.wait(), self._cleanup_timeout_s)
            except asyncio.TimeoutError:
                if self._failure is None:
                    log.warning("session %s: graceful close did not finish in %.1fs", self.params.stream_id,
                                self._cleanup_timeout_s)
        return await self.abort()

    async def abort(self) -> bool:
        """End all three streams now. Returns True when each stage acknowledged the end."""
        if self._abort_task is None:  # one cleanup, however many callers
            self._to(RelayStatus.ABORTING)
            self._abort_task = asyncio.ensure_future(self._abort())
        return await asyncio.shield(self._abort_task)

    async def _abort(self) -> bool:
        ends = await self._end_stages(self._cleanup_timeout_s)
        # A stage that failed cannot acknowledge; the session's cleanup is confirmed when every
        # stage that is still alive did.
        failed_stage = self._failure.stage if self._failure else None
        self.cleanup_confirmed = all(
            end is not None and (end.ok or s == failed_stage or end.kind in ("link_lost", "not_opened"))
            for s, end in ends.items())
        self.cell.live_sessions -= 1  # counted since the open (_open)
        self._to(RelayStatus.ENDED)
        self._link.forget(self)
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


def _never_opened(why) -> bool:
    return isinstance(why, StageEnd) and why.kind == "not_opened"


def _open_outcome(fut: asyncio.Future) -> StageEnd | RelayError | None:
    """Why a stage did not open the session (None: it did)."""
    if not fut.done():
        return RelayError("runtime_open_failed", "no answer to the open in time")
    result = fut.result()
    return result if isinstance(result, StageEnd) else None


async def open_on_cells(cells: list[Cell], make_params: Callable[[], OpenParams], listener: RelayListener, *,
                        open_timeout_s: float, stall_timeout_s: float, cleanup_timeout_s: float) -> Relay:
    """Admit a session on the first cell (least loaded first) whose three stages all accept it."""
    if not cells:
        raise RelayError("resource_exhausted", "no cell has a free session slot", None)
    errors: list[RelayError] = []
    for cell in cells:
        cell.admitted_since_poll += 1
        try:
            return await Relay.open_on(cell, make_params(), listener, open_timeout_s=open_timeout_s,
                                       stall_timeout_s=stall_timeout_s, cleanup_timeout_s=cleanup_timeout_s)
        except RelayError as e:
            cell.admitted_since_poll -= 1
            if e.client_fault:
                raise
            log.info("cell %s refused a session: %s %s", cell.name, e.code, e.message)
            errors.append(e)
    # Every cell said no: if any was merely full or busy, the client may retry later.
    raise next((e for e in errors if e.code in ("resource_exhausted", "server_busy")), errors[-1])
