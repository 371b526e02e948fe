"""One session's three gRPC streams on one cell: encoder -> talker -> decoder.

    client frame --send_frame--> Encode stream --codes--> Talk stream --output--> Decode stream --pcm--> on_output

Three small pump tasks move each stage's responses to the next stage. The gateway
(not the talker) does all per-frame conversion, so nothing here runs on a stage's clock.

Lifecycle:
- `open_on_cells` opens the three streams of one cell concurrently; if any stage
  refuses, the streams that did open are closed again (nothing is half-opened) and the
  next cell is tried. All full -> PipelineError("resource_exhausted").
- `close()` (client close): half-closes the encoder; each pump half-closes the next
  stage when its input ends, so every queued frame still comes out; all three must end
  with OK within `cleanup_timeout_s`.
- `abort()` (socket drop, stage failure, slow client): stop the pumps, half-close every
  stream that is still open and wait (bounded) for each to end. Anything not confirmed
  in time is cancelled, logged and counted.
- Any stage error, or no progress for `stall_timeout_s` while output is due, fails the
  session once through `on_error` with a typed PipelineError.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable

import grpc
import numpy as np

from duplex.v1 import common_pb2, decoder_pb2, encoder_pb2, talker_pb2
from services.common.errors import error_kind
from services.gateway.audio import FRAME_SAMPLES, f32_frame_bytes, f32_from_frame_bytes
from services.gateway.cells import STAGES, Cell

log = logging.getLogger("gateway.pipeline")


class PipelineError(Exception):
    """A typed failure. `code` is the wire error code; `client_fault` picks invalid_request_error."""

    def __init__(self, code: str, message: str, stage: str | None = None, client_fault: bool = False):
        super().__init__(message)
        self.code = code
        self.stage = stage
        self.client_fault = client_fault
        self.message = message

    @property
    def error_type(self) -> str:
        if self.code == "resource_exhausted":
            return "rate_limit_error"
        return "invalid_request_error" if self.client_fault else "server_error"


@dataclass(frozen=True)
class OpenParams:
    stream_id: str
    voice: str
    persona: str
    sampling: talker_pb2.Sampling


@dataclass
class OutputFrame:
    seq: int  # output frame number: 0, 1, 2, ...
    input_seq: int  # the input frame whose model step produced it
    pcm: np.ndarray  # 1920 float32 samples
    text: str  # text piece ('' for no text)
    latency_s: float  # from handing the input frame to the encoder to having its output PCM


_EOF = grpc.aio.EOF


async def _open_stream(stub_method, first_request, expect: str, timeout: float):
    """Start one bidi stream, send its open message, wait for the opened/ready answer."""
    call = stub_method()
    try:
        await call.write(first_request)
        resp = await asyncio.wait_for(call.read(), timeout)
        if resp is _EOF:
            raise grpc.aio.AioRpcError(await call.code(), grpc.aio.Metadata(), grpc.aio.Metadata(), await call.details())
        if resp.WhichOneof("kind") != expect:
            raise PipelineError("runtime_open_failed", f"stage answered {resp.WhichOneof('kind')!r} to open, expected {expect!r}")
        return call, resp
    except BaseException:
        call.cancel()
        raise


async def _shutdown_stream(call, timeout: float) -> bool:
    """Half-close a stream and wait for it to end. True when the server ended it with OK."""
    if call.done():
        return (await call.code()) == grpc.StatusCode.OK
    try:
        await call.done_writing()
    except Exception:  # already half-closed, or the RPC ended meanwhile
        pass

    async def drain():
        while (await call.read()) is not _EOF:
            pass

    try:
        await asyncio.wait_for(drain(), timeout)
        return (await call.code()) == grpc.StatusCode.OK
    except Exception:
        call.cancel()
        return False


def _grpc_error(e: BaseException) -> tuple[str, str]:
    if isinstance(e, grpc.aio.AioRpcError):
        return e.code().name, e.details() or ""
    return type(e).__name__, str(e)


def _stream_failed(stage: str, e: BaseException) -> PipelineError:
    return PipelineError("runtime_stream_failed", f"{stage} stream failed: {' '.join(_grpc_error(e))}".strip(), stage)


async def _to(stage: str, write) -> None:
    """A pump's write to the next stage's stream: its failure is that stage's, not the pump's.
    (A killed decoder used to surface as "talker stream failed: RPC already finished" from the
    talker pump's write, and the dead decoder then counted as an unconfirmed cleanup.)"""
    try:
        await write
    except asyncio.CancelledError:
        raise
    except Exception as e:
        raise _stream_failed(stage, e) from None


class Pipeline:
    def __init__(self, cell: Cell, params: OpenParams, calls: dict, ready: talker_pb2.TalkReady, stall_timeout_s: float, cleanup_timeout_s: float):
        self.cell = cell
        self.params = params
        self.ready = ready
        self._calls = calls
        self._stall_timeout_s = stall_timeout_s
        self._cleanup_timeout_s = cleanup_timeout_s
        self.on_output: Callable[[OutputFrame], None] = lambda f: None
        self.on_error: Callable[[PipelineError], None] = lambda e: None
        self.frames_in = 0
        self.frames_out = 0
        self.latencies: list[float] = []  # per output frame, seconds (for the session's summary)
        self._sent_at: dict[int, float] = {}
        self._text: dict[int, tuple[int, str]] = {}
        self._failed: PipelineError | None = None
        self._closing = False
        self._aborting = False  # abort() runs: pumps only drain their streams, nothing is forwarded
        self._writing: asyncio.Future | None = None  # the encoder write in flight, if any
        self._tasks: list[asyncio.Task] = []
        self._decoder_done = asyncio.Event()
        self._last_output_at = 0.0
        self.cleanup_confirmed: bool | None = None
        self._abort_task: asyncio.Future | None = None

    @property
    def output_delay_frames(self) -> int:
        return int(self.ready.output_delay_frames)

    def latency_summary(self) -> dict:
        if not self.latencies:
            return {"frames": 0}
        ms = np.asarray(self.latencies) * 1000.0
        return {"frames": int(ms.size), "p50_ms": round(float(np.median(ms)), 1), "p99_ms": round(float(np.percentile(ms, 99)), 1),
                "max_ms": round(float(ms.max()), 1)}

    @property
    def failed(self) -> PipelineError | None:
        return self._failed

    # ---- open -------------------------------------------------------------

    @classmethod
    async def open_on(cls, cell: Cell, params: OpenParams, *, open_timeout_s: float, stall_timeout_s: float, cleanup_timeout_s: float) -> "Pipeline":
        stubs = cell.stubs
        opening = {
            "encoder": _open_stream(stubs["encoder"].Encode, encoder_pb2.EncodeRequest(open=common_pb2.StreamOpen(stream_id=params.stream_id)), "opened", open_timeout_s),
            "talker": _open_stream(
                stubs["talker"].Talk,
                talker_pb2.TalkRequest(
                    open=talker_pb2.TalkOpen(
                        stream=common_pb2.StreamOpen(stream_id=params.stream_id), voice=params.voice, persona=params.persona, sampling=params.sampling
                    )
                ),
                "ready",
                open_timeout_s,
            ),
            "decoder": _open_stream(stubs["decoder"].Decode, decoder_pb2.DecodeRequest(open=common_pb2.StreamOpen(stream_id=params.stream_id)), "opened", open_timeout_s),
        }
        results = dict(zip(opening, await asyncio.gather(*opening.values(), return_exceptions=True)))
        failures = {s: r for s, r in results.items() if isinstance(r, BaseException)}
        if failures:
            # Nothing half-opened: close what did open and wait until each stage acknowledges.
            opened = [r[0] for r in results.values() if not isinstance(r, BaseException)]
            await asyncio.gather(*(_shutdown_stream(c, cleanup_timeout_s) for c in opened))
            raise _open_failure(cell, failures)
        calls = {s: results[s][0] for s in STAGES}
        p = cls(cell, params, calls, results["talker"][1].ready, stall_timeout_s, cleanup_timeout_s)
        cell.live_sessions += 1
        p._start()
        return p

    def _start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._guard("encoder", self._pump_encoder()), name=f"{self.params.stream_id}-enc"),
            asyncio.create_task(self._guard("talker", self._pump_talker()), name=f"{self.params.stream_id}-talk"),
            asyncio.create_task(self._guard("decoder", self._pump_decoder()), name=f"{self.params.stream_id}-dec"),
            asyncio.create_task(self._watchdog(), name=f"{self.params.stream_id}-watch"),
        ]

    # ---- frames in ---------------------------------------------------------

    async def send_frame(self, frame: np.ndarray) -> int:
        """Hand one 1920-sample frame to the encoder. Returns its input seq."""
        if self._failed:
            raise self._failed
        assert frame.shape == (FRAME_SAMPLES,)
        seq = self.frames_in
        self._sent_at[seq] = time.monotonic()
        # Shielded: a caller cancelled mid-write (the session's reader, when its socket drops)
        # must not cancel the encoder RPC with it (grpc.aio does); abort() waits for the write.
        self._writing = asyncio.ensure_future(self._calls["encoder"].write(
            encoder_pb2.EncodeRequest(frame=common_pb2.PcmFrame(seq=seq, pcm_f32le=f32_frame_bytes(frame)))
        ))
        self._writing.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved here or by the caller
        try:
            await asyncio.shield(self._writing)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            code, details = _grpc_error(e)
            err = self._failed or PipelineError("runtime_append_failed", f"encoder refused frame {seq}: {code} {details}".strip(), "encoder")
            self._fail(err)
            raise err from None
        self.frames_in += 1
        return seq

    # ---- pumps -------------------------------------------------------------

    async def _guard(self, stage: str, pump) -> None:
        try:
            await pump
        except asyncio.CancelledError:
            raise
        except Exception as e:
            err = e if isinstance(e, PipelineError) else _stream_failed(stage, e)
            if self._aborting:  # the session is already ending: nothing to report to the client
                log.info("session %s: %s stream ended during abort: %s", self.params.stream_id, stage, err.message)
                return
            self._fail(err)

    async def _pump_encoder(self) -> None:
        enc, talk = self._calls["encoder"], self._calls["talker"]
        while (resp := await enc.read()) is not _EOF:
            codes = resp.codes
            if not self._aborting:
                await _to("talker", talk.write(talker_pb2.TalkRequest(frame=common_pb2.CodesFrame(seq=codes.seq, codes=codes.codes))))
        await self._expect_ok("encoder")
        await _to("talker", talk.done_writing())

    async def _pump_talker(self) -> None:
        talk, dec = self._calls["talker"], self._calls["decoder"]
        while (resp := await talk.read()) is not _EOF:
            out = resp.output
            if self._aborting:
                continue
            self._text[out.seq] = (out.input_seq, out.text_piece)
            await _to("decoder", dec.write(decoder_pb2.DecodeRequest(frame=common_pb2.CodesFrame(seq=out.seq, codes=out.agent_codes))))
        await self._expect_ok("talker")
        await _to("decoder", dec.done_writing())

    async def _pump_decoder(self) -> None:
        dec = self._calls["decoder"]
        while (resp := await dec.read()) is not _EOF:
            pcm = resp.pcm
            if self._aborting:
                continue
            input_seq, text = self._text.pop(pcm.seq, (None, ""))
            if input_seq is None:
                raise PipelineError("runtime_stream_failed", f"decoder returned frame {pcm.seq} the talker never produced", "decoder")
            now = self._last_output_at = time.monotonic()
            sent = self._sent_at.get(input_seq, now)
            for s in [s for s in self._sent_at if s <= input_seq]:
                del self._sent_at[s]
            self.frames_out += 1
            if len(self.latencies) < 100_000:
                self.latencies.append(now - sent)
            self.on_output(OutputFrame(pcm.seq, input_seq, f32_from_frame_bytes(pcm.pcm_f32le), text, now - sent))
        await self._expect_ok("decoder")
        self._decoder_done.set()

    async def _expect_ok(self, stage: str) -> None:
        call = self._calls[stage]
        code = await call.code()
        if code != grpc.StatusCode.OK:
            raise PipelineError("runtime_stream_failed", f"{stage} ended the stream: {code.name} {await call.details()}".strip(), stage)
        if not self._closing:
            raise PipelineError("runtime_stream_failed", f"{stage} ended the stream before the session closed", stage)

    async def _watchdog(self) -> None:
        """Output is due for every input frame past the model's delay. With frames due and no
        output for `stall_timeout_s` (a backlog that still moves is not a stall), fail typed."""
        period = min(0.25, self._stall_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            due = [t for s, t in self._sent_at.items() if s >= self.output_delay_frames]
            if not due:
                continue
            waiting = time.monotonic() - max(self._last_output_at, min(due))
            if waiting > self._stall_timeout_s:
                self._fail(PipelineError("stage_stalled", f"no output for {waiting:.1f}s while {len(due)} frame(s) are due"))
                return

    # ---- failure and close -------------------------------------------------

    def _fail(self, err: PipelineError) -> None:
        if self._failed is not None:
            return
        self._failed = err
        log.warning("session %s on cell %s failed: %s %s", self.params.stream_id, self.cell.name, err.code, err.message)
        self.on_error(err)

    async def close(self) -> bool:
        """Client close: every queued frame still comes out, then all three streams end OK."""
        self._closing = True
        if self._failed is None:
            try:
                await self._calls["encoder"].done_writing()
                await asyncio.wait_for(self._decoder_done.wait(), self._cleanup_timeout_s)
            except Exception as e:
                if self._failed is None:
                    log.warning("session %s: graceful close did not finish: %s", self.params.stream_id, _grpc_error(e))
        return await self.abort()

    async def abort(self) -> bool:
        """End all three streams now. Returns True when each stage acknowledged the end."""
        self._closing = True
        if self._abort_task is None:  # one cleanup, however many callers
            self._abort_task = asyncio.ensure_future(self._abort())
        return await asyncio.shield(self._abort_task)

    async def _abort(self) -> bool:
        # Half-close every stream and let each pump read its stream to the end, forwarding
        # nothing. Not a plain cancel of the pumps: cancelling a task that waits in
        # call.read() cancels the RPC itself (grpc.aio), and a cancelled stream is never a
        # confirmed end. A pump still reading after the cleanup bound is cancelled (unconfirmed).
        self._aborting = True
        self._tasks[-1].cancel()  # the watchdog
        if self._writing is not None:  # one write at a time on a stream: let the last one finish
            await asyncio.wait([self._writing], timeout=self._cleanup_timeout_s)
        for s in STAGES:
            call = self._calls[s]
            if not call.done():
                try:
                    await asyncio.wait_for(call.done_writing(), self._cleanup_timeout_s)
                except Exception:  # already half-closed, ended meanwhile, or stuck (then cancelled)
                    pass
        _, stuck = await asyncio.wait(self._tasks[:-1], timeout=self._cleanup_timeout_s)
        for t in stuck:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        oks = await asyncio.gather(*(_shutdown_stream(self._calls[s], self._cleanup_timeout_s) for s in STAGES))
        # A stage that failed cannot acknowledge; the session's cleanup is confirmed when
        # every stage that is still alive did.
        failed_stage = self._failed.stage if self._failed else None
        self.cleanup_confirmed = all(ok or s == failed_stage for s, ok in zip(STAGES, oks))
        self.cell.live_sessions -= 1
        if not self.cleanup_confirmed:
            log.error(
                "session %s: cleanup not confirmed within %.1fs by %s",
                self.params.stream_id,
                self._cleanup_timeout_s,
                ", ".join(s for s, ok in zip(STAGES, oks) if not ok and s != failed_stage),
            )
        return self.cleanup_confirmed


# The talker's `error-kind` of a refused open -> the Realtime error code the client sees.
_TALKER_REFUSALS = {"bad_voice": "invalid_voice", "bad_persona": "invalid_instructions", "bad_sampling": "invalid_sampling"}


def _open_failure(cell: Cell, failures: dict[str, BaseException]) -> PipelineError:
    for stage, e in failures.items():
        if isinstance(e, PipelineError):
            return e
        code = e.code() if isinstance(e, grpc.aio.AioRpcError) else None
        details = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e) or type(e).__name__
        if code == grpc.StatusCode.INVALID_ARGUMENT and stage == "talker":
            which = _TALKER_REFUSALS.get(error_kind(e), "invalid_instructions")
            return PipelineError(which, details or "talker refused the session settings", stage, client_fault=True)
    # Not a client fault: RESOURCE_EXHAUSTED anywhere means full; anything else is a stage problem.
    if any(isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in failures.values()):
        return PipelineError("resource_exhausted", f"cell {cell.name} has no free slot", None)
    stage, e = next(iter(failures.items()))
    code, details = _grpc_error(e)
    return PipelineError("runtime_open_failed", f"{stage} did not open the stream: {code} {details}".strip(), stage)


async def open_on_cells(cells: list[Cell], make_params: Callable[[], OpenParams], *, open_timeout_s: float, stall_timeout_s: float, cleanup_timeout_s: float) -> Pipeline:
    """Admit a session on the first cell (least loaded first) whose three stages all accept it."""
    if not cells:
        raise PipelineError("resource_exhausted", "no cell has a free session slot", None)
    errors: list[PipelineError] = []
    for cell in cells:
        cell.admitted_since_poll += 1
        try:
            return await Pipeline.open_on(cell, make_params(), open_timeout_s=open_timeout_s, stall_timeout_s=stall_timeout_s, cleanup_timeout_s=cleanup_timeout_s)
        except PipelineError as e:
            cell.admitted_since_poll -= 1
            if e.client_fault:
                raise
            log.info("cell %s refused a session: %s %s", cell.name, e.code, e.message)
            errors.append(e)
    # Every cell said no: if any was merely full, the client may retry later.
    raise next((e for e in errors if e.code == "resource_exhausted"), errors[-1])
