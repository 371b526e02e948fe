"""One load-generator process of bench/pipeline.py: a share of the sessions, driven like the gateway.

    python -m bench.pipeline_load        (started by bench/pipeline.py; talks JSON lines)

Each session is the gateway's own `Pipeline` (services/gateway/pipeline.py): an Encode, a Talk
(voice + persona + sampling) and a Decode stream on one cell, with the gateway's pumps moving
encoder codes to the talker and talker agent codes to the decoder. So the benchmark measures the
serving path people use, minus the WebSocket.

Protocol with the parent (one JSON object per line; stdout carries nothing else):
    stdin   {"cell": [enc, talk, dec], "stream_ids": [...], "voice", "persona", "frames",
             "period_s", "open_timeout_s", "stall_timeout_s", "cleanup_timeout_s", "result_path"}
    stdout  {"admitted": [ids], "refused": [{"stream_id", "code", "message"}]}
    stdin   {"start_at": T}            T on time.monotonic(), a system-wide clock on Linux
    stdout  {"progress": {"sent", "recv", "errors", "late_max_ms"}}   about once a second
    stdout  {"done": result_path}      the per-frame records, written as JSON

Pacing: session frame i is due at T + i * period (an absolute schedule). A send that is more than
RESYNC_S late re-anchors that session's schedule at now instead of bursting to catch up; every
frame's lateness is recorded, so an overloaded client shows up in the report.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
import zlib
from dataclasses import dataclass, field

import grpc
import numpy as np

from duplex.v1 import talker_pb2
from services.gateway.audio import FRAME_SAMPLES, SAMPLE_RATE
from duplex.v1 import decoder_pb2_grpc, encoder_pb2_grpc, talker_pb2_grpc
from services.gateway.cells import Cell
from services.gateway.config import CellAddress
from services.gateway.pipeline import OpenParams, OutputFrame, Pipeline, PipelineError

log = logging.getLogger("bench.pipeline_load")

RESYNC_S = 0.02  # same rule as tools/load_driver: later than this re-anchors, no catch-up burst
INPUT_FRAMES = 25  # distinct synthetic frames, cycled (2 s of "speech")


def synthetic_frames(seed: int) -> list[np.ndarray]:
    """Speech-like input: a few drifting harmonics under an envelope, plus a little noise. The
    codecs' and the model's cost does not depend on the content; this only keeps it audio-shaped."""
    rng = np.random.default_rng(seed)
    n = INPUT_FRAMES * FRAME_SAMPLES
    t = np.arange(n) / SAMPLE_RATE
    f0 = 140 + 40 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / SAMPLE_RATE
    voiced = sum(np.sin(k * phase) / k for k in range(1, 5))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 2.5 * t) ** 2
    x = (0.15 * envelope * voiced + 0.01 * rng.standard_normal(n)).astype(np.float32)
    return [x[i * FRAME_SAMPLES:(i + 1) * FRAME_SAMPLES] for i in range(INPUT_FRAMES)]


@dataclass
class SessionRun:
    stream_id: str
    pipeline: Pipeline | None = None
    open_s: float = 0.0
    send_t: list[float] = field(default_factory=list)  # monotonic send time of input frame i
    late: list[float] = field(default_factory=list)  # seconds behind the session's schedule
    reanchors: int = 0
    recv: list[tuple[int, float]] = field(default_factory=list)  # (input_seq, monotonic receive time)
    error: dict | None = None
    cleanup_confirmed: bool | None = None

    def on_output(self, out: OutputFrame) -> None:
        self.recv.append((out.input_seq, time.monotonic()))

    def on_error(self, err: PipelineError) -> None:
        if self.error is None:
            self.error = {"code": err.code, "stage": err.stage, "message": err.message}


def make_cell(encoder: str, talker: str, decoder: str) -> Cell:
    """The gateway's Cell for one (encoder, talker, decoder) triple: one channel per stage, shared by
    this process's sessions as a gateway shares them."""
    options = [("grpc.max_receive_message_length", 16 * 1024 * 1024)]
    channels = {"encoder": grpc.aio.insecure_channel(encoder, options=options),
                "talker": grpc.aio.insecure_channel(talker, options=options),
                "decoder": grpc.aio.insecure_channel(decoder, options=options)}
    stubs = {"encoder": encoder_pb2_grpc.EncoderStub(channels["encoder"]),
             "talker": talker_pb2_grpc.TalkerStub(channels["talker"]),
             "decoder": decoder_pb2_grpc.DecoderStub(channels["decoder"])}
    return Cell(address=CellAddress(encoder, talker, decoder), channels=channels, stubs=stubs)


def emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def read_json_line() -> dict:
    line = await asyncio.to_thread(sys.stdin.readline)
    if not line:
        raise SystemExit("parent closed the pipe")
    return json.loads(line)


async def open_session(cell, run: SessionRun, cfg: dict, seed: int) -> None:
    params = OpenParams(stream_id=run.stream_id, voice=cfg["voice"], persona=cfg["persona"],
                        sampling=talker_pb2.Sampling(seed=seed))
    t = time.monotonic()
    try:
        run.pipeline = await Pipeline.open_on(cell, params, open_timeout_s=cfg["open_timeout_s"],
                                              stall_timeout_s=cfg["stall_timeout_s"],
                                              cleanup_timeout_s=cfg["cleanup_timeout_s"])
    except PipelineError as e:
        run.error = {"code": e.code, "stage": e.stage, "message": e.message}
        return
    except Exception as e:  # a timeout or transport error while opening
        run.error = {"code": "open_failed", "stage": None, "message": f"{type(e).__name__}: {e}"}
        return
    run.open_s = time.monotonic() - t
    run.pipeline.on_output = run.on_output
    run.pipeline.on_error = run.on_error


async def drive(run: SessionRun, frames: list[np.ndarray], offset: int, n_frames: int, start_at: float,
                period: float) -> None:
    """Send n_frames on the absolute schedule, then close gracefully (every queued frame comes out)."""
    p = run.pipeline
    anchor = start_at
    for i in range(n_frames):
        due = anchor + i * period
        wait = due - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        now = time.monotonic()
        late = max(0.0, now - due)
        if late > RESYNC_S:
            anchor += late  # later frames keep the period from here: no burst
            run.reanchors += 1
        run.send_t.append(now)
        run.late.append(late)
        try:
            await p.send_frame(frames[(offset + i) % len(frames)])
        except PipelineError as e:
            run.on_error(e)
            run.send_t.pop()  # never reached the encoder
            run.late.pop()
            break
        if run.error is not None:
            break
    run.cleanup_confirmed = await (p.abort() if run.error is not None else p.close())
    if run.error is None and p.failed is not None:  # failed before on_error was attached, or while closing
        run.on_error(p.failed)


async def report_progress(runs: list[SessionRun], every_s: float = 1.0) -> None:
    while True:
        await asyncio.sleep(every_s)
        emit({"progress": {"sent": sum(len(r.send_t) for r in runs), "recv": sum(len(r.recv) for r in runs),
                           "errors": sum(r.error is not None for r in runs),
                           "late_max_ms": round(1000 * max((max(r.late, default=0.0) for r in runs), default=0.0), 1)}})


async def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = await read_json_line()
    cell = make_cell(*cfg["cell"])
    runs = [SessionRun(sid) for sid in cfg["stream_ids"]]
    # All of this process's sessions open at once, like simultaneous arrivals at a gateway.
    # Seeds from the stream ids: distinct across load processes, the same on a rerun (0 would be random).
    await asyncio.gather(*(open_session(cell, r, cfg, seed=1 + zlib.crc32(r.stream_id.encode())) for r in runs))
    live = [r for r in runs if r.pipeline is not None]
    emit({"admitted": [r.stream_id for r in live],
          "refused": [{"stream_id": r.stream_id, **r.error} for r in runs if r.pipeline is None]})

    start_at = (await read_json_line())["start_at"]
    frames = synthetic_frames(seed=len(cfg["stream_ids"]))
    progress = asyncio.create_task(report_progress(live))
    try:
        await asyncio.gather(*(drive(r, frames, i % len(frames), cfg["frames"], start_at, cfg["period_s"])
                               for i, r in enumerate(live)))
    finally:
        progress.cancel()

    def rel(t: float) -> float:
        return round(t - start_at, 6)

    result = {"start_at": start_at, "sessions": [{
        "stream_id": r.stream_id, "admitted": r.pipeline is not None, "open_s": round(r.open_s, 4),
        "prefill_ms": float(r.pipeline.ready.prefill_ms) if r.pipeline else None,
        "output_delay_frames": r.pipeline.output_delay_frames if r.pipeline else None,
        "send_t": [rel(t) for t in r.send_t], "late_s": [round(x, 6) for x in r.late], "reanchors": r.reanchors,
        "recv": [[s, rel(t)] for s, t in r.recv], "error": r.error, "cleanup_confirmed": r.cleanup_confirmed,
    } for r in runs]}
    with open(cfg["result_path"], "w") as f:
        json.dump(result, f)
    for ch in cell.channels.values():
        await ch.close()
    emit({"done": cfg["result_path"]})


if __name__ == "__main__":
    asyncio.run(main())
