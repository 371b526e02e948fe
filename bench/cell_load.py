"""One load-generator process of bench/cell.py: a share of the sessions, driven like the gateway.

    python -m bench.cell_load        (started by bench/cell.py; talks JSON lines)

Each session is the gateway's own `Relay` (services/gateway/relay.py): an Encode, a Talk
(voice + persona + sampling) and a Decode stream on one cell, with the gateway's pumps moving
encoder codes to the talker and talker agent codes to the decoder. So the benchmark measures the
serving path people use, minus the WebSocket.

Protocol with the parent (one JSON object per line; stdout carries nothing else):
    stdin   {"cell": [enc, talk, dec], "stream_ids": [...], "probe_ids": [...], "offsets_s": [...], "voice", "persona",
             "frames", "period_s", "probe_cycle_s", "open_timeout_s", "stall_timeout_s",
             "cleanup_timeout_s", "result_path"}
    stdout  {"admitted": [ids], "refused": [{"stream_id", "code", "message"}]}
    stdin   {"start_at": T}            T on time.monotonic(), a system-wide clock on Linux
    stdout  {"progress": {"sent", "recv", "errors", "late_max_ms", "probe_cycles"}}   about once a second
    stdout  {"done": result_path}      the per-frame records and the probe cycles, written as JSON

The steady sessions (`stream_ids`) open together before T and send `frames` frames from T.
Each probe slot (`probe_ids`, none opened before T) measures time to first audio while the
steady sessions run: from T until the steady schedule ends (T + frames * period) it opens a
session `<probe id>-<cycle>`, sends frames on an absolute schedule anchored where the open
returned for `probe_cycle_s`, closes gracefully and reopens at once. A new cycle starts only
while a whole one still fits before the end (the first always starts), and no probe frame is due
after the end, so every probe sample is taken beside the steady sessions.

Reopening "at once" means as soon as every stage has a free slot again: a stage acknowledges a
stream's end before it frees the slot (services/common/slots.py frees it only after any batched
step still touching it), and with slots = N an open in that gap is refused `no_free_slot`, a
refusal of the benchmark's own making that would also count as a stage error. So a probe polls
GetCapacity first (the wait is recorded as slot_wait_s, outside open_s), and this process's
probes take turns at "wait for a free slot, open" so that two never claim the same one (the
parent puts every probe slot in one load process for this).

Pacing: session frame i is due at T + offset + i * period (an absolute schedule; `offsets_s`, one
per stream id, place the sessions in the period: bench/cell.py --send-phases). A send that is more than
RESYNC_S late re-anchors that session's schedule at now instead of bursting to catch up; every
frame's lateness is recorded, so an overloaded client shows up in the report.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import sys
import time
import zlib
from dataclasses import dataclass, field

import grpc
import numpy as np

from duplex.v1 import common_pb2, talker_pb2
from services.gateway.audio import FRAME_SAMPLES, SAMPLE_RATE
from duplex.v1 import decoder_pb2_grpc, encoder_pb2_grpc, talker_pb2_grpc
from services.gateway.cells import Cell
from services.gateway.config import CellAddress
from services.gateway.relay import OpenParams, OutputFrame, Relay, RelayError

log = logging.getLogger("bench.cell_load")

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
    relay: Relay | None = None
    open_t: float = 0.0  # monotonic time the open call started
    slot_wait_s: float = 0.0  # probes: waiting for every stage to free a slot before the open
    open_s: float = 0.0
    send_t: list[float] = field(default_factory=list)  # monotonic send time of input frame i
    late: list[float] = field(default_factory=list)  # seconds behind the session's schedule
    reanchors: int = 0
    recv: list[tuple[int, float]] = field(default_factory=list)  # (input_seq, monotonic receive time)
    error: dict | None = None
    cleanup_confirmed: bool | None = None

    # The relay's listener (relay.RelayListener): its outputs and its failure count; the rest is not asked for.

    def relay_output(self, out: OutputFrame) -> None:
        self.recv.append((out.input_seq, time.monotonic()))

    def relay_failed(self, err: RelayError) -> None:
        if self.error is None:
            self.error = {"code": err.code, "stage": err.stage, "message": err.message}

    def relay_live(self, ready) -> None:
        pass

    def relay_prime_refused(self, prime: int, err: RelayError) -> None:
        pass

    def relay_say(self, answer) -> None:
        pass


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
    t = run.open_t = time.monotonic()
    try:
        run.relay = await Relay.open_on(cell, params, run, open_timeout_s=cfg["open_timeout_s"],
                                        stall_timeout_s=cfg["stall_timeout_s"],
                                        cleanup_timeout_s=cfg["cleanup_timeout_s"])
    except RelayError as e:
        run.error = {"code": e.code, "stage": e.stage, "message": e.message}
        return
    except Exception as e:  # a timeout or transport error while opening
        run.error = {"code": "open_failed", "stage": None, "message": f"{type(e).__name__}: {e}"}
        return
    run.open_s = time.monotonic() - t


async def drive(run: SessionRun, frames: list[np.ndarray], offset: int, n_frames: int, start_at: float,
                period: float) -> None:
    """Send n_frames on the absolute schedule, then close gracefully (every queued frame comes out)."""
    p = run.relay
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
        except RelayError as e:
            run.relay_failed(e)
            run.send_t.pop()  # never reached the encoder
            run.late.pop()
            break
        if run.error is not None:
            break
    run.cleanup_confirmed = await (p.abort() if run.error is not None else p.close())
    if run.error is None and p.failed is not None:  # failed while its open was answered, or while closing
        run.relay_failed(p.failed)


def seed_of(stream_id: str) -> int:
    """Sampling seed from the stream id: distinct across sessions and load processes, the same on a
    rerun (0 would mean random)."""
    return 1 + zlib.crc32(stream_id.encode())


def probe_frames(anchor: float, end_at: float, period: float, cycle_frames: int) -> int:
    """Frames a probe cycle sends: `cycle_frames` on the schedule anchor + i * period, but none due
    at or after `end_at` (the end of the steady schedule), so probes never run on an emptier system."""
    if end_at <= anchor:
        return 0
    return min(cycle_frames, math.ceil((end_at - anchor) / period - 1e-9))


async def wait_for_free_slot(cell, timeout_s: float, poll_s: float = 0.01) -> dict | None:
    """Until every stage reports a free slot: None then, else the error to record."""
    deadline = time.monotonic() + timeout_s
    while True:
        full = None
        for stage in ("encoder", "talker", "decoder"):
            try:
                cap = await cell.stubs[stage].GetCapacity(common_pb2.CapacityRequest(), timeout=5)
            except grpc.aio.AioRpcError as e:
                return {"code": "capacity_failed", "stage": stage,
                        "message": f"GetCapacity: {e.code().name} {e.details()}"}
            if cap.free_slots < 1:
                full = stage
                break
        if full is None:
            return None
        if time.monotonic() > deadline:
            return {"code": "no_free_slot", "stage": full,
                    "message": f"no free {full} slot {timeout_s:g} s after the last probe closed"}
        await asyncio.sleep(poll_s)


async def probe_slot(cell, cfg: dict, probe_id: str, frames: list[np.ndarray], start_at: float, end_at: float,
                     cycles: list[SessionRun], claim: asyncio.Lock) -> None:
    """One probe slot: open, talk for probe_cycle_s, close gracefully, reopen, from the shared start
    until the steady schedule ends. Every cycle is appended to `cycles` as it starts."""
    period, cycle_s = cfg["period_s"], cfg["probe_cycle_s"]
    cycle_frames = max(1, round(cycle_s / period))
    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    c = 0
    while c == 0 or end_at - time.monotonic() >= cycle_s:
        run = SessionRun(f"{probe_id}-{c}")
        cycles.append(run)
        async with claim:  # one probe at a time claims the free slot it waited for
            t = time.monotonic()
            run.error = await wait_for_free_slot(cell, cfg["cleanup_timeout_s"])
            run.slot_wait_s = time.monotonic() - t
            if run.error is not None:
                return  # no slot comes back: this probe slot ends
            await open_session(cell, run, cfg, seed=seed_of(run.stream_id))
        if run.relay is None:  # refused or failed: recorded; a pause, not a tight retry loop
            await asyncio.sleep(min(1.0, max(0.0, end_at - time.monotonic())))
        else:
            anchor = time.monotonic()  # the first frame goes out as soon as the session is ready
            await drive(run, frames, c, probe_frames(anchor, end_at, period, cycle_frames), anchor, period)
        c += 1


def probe_record(run: SessionRun, rel) -> dict:
    """One probe cycle for the result file; first_output_s is open call -> first decoded frame."""
    p = run.relay
    first = run.recv[0] if run.recv else None
    return {"stream_id": run.stream_id, "slot_wait_s": round(run.slot_wait_s, 4),
            "t_open": rel(run.open_t) if run.open_t else None, "open_s": round(run.open_s, 4) if p else None,
            "prefill_ms": float(p.ready.prefill_ms) if p else None,
            "output_delay_frames": p.output_delay_frames if p else None,
            "frames_sent": len(run.send_t), "frames_out": len(run.recv),
            "first_output_s": round(first[1] - run.open_t, 4) if first else None,
            "first_output_seq": first[0] if first else None,
            "error": run.error, "cleanup_confirmed": run.cleanup_confirmed}


async def report_progress(runs: list[SessionRun], probes: list[SessionRun], every_s: float = 1.0) -> None:
    """Steady sessions' totals (what the parent's progress line divides by the steady count) and
    the number of probe cycles started so far."""
    while True:
        await asyncio.sleep(every_s)
        emit({"progress": {"sent": sum(len(r.send_t) for r in runs), "recv": sum(len(r.recv) for r in runs),
                           "errors": sum(r.error is not None for r in runs),
                           "late_max_ms": round(1000 * max((max(r.late, default=0.0) for r in runs), default=0.0), 1),
                           "probe_cycles": len(probes)}})


async def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = await read_json_line()
    cell = make_cell(*cfg["cell"])
    runs = [SessionRun(sid) for sid in cfg["stream_ids"]]
    # All of this process's steady sessions open at once, like simultaneous arrivals at a gateway.
    await asyncio.gather(*(open_session(cell, r, cfg, seed=seed_of(r.stream_id)) for r in runs))
    live = [r for r in runs if r.relay is not None]
    emit({"admitted": [r.stream_id for r in live],
          "refused": [{"stream_id": r.stream_id, **r.error} for r in runs if r.relay is None]})

    start_at = (await read_json_line())["start_at"]
    frames = synthetic_frames(seed=len(cfg["stream_ids"]))
    end_at = start_at + cfg["frames"] * cfg["period_s"]
    probes: list[SessionRun] = []
    claim = asyncio.Lock()
    progress = asyncio.create_task(report_progress(live, probes))
    try:
        offset = dict(zip(cfg["stream_ids"], cfg.get("offsets_s") or [0.0] * len(runs), strict=True))
        await asyncio.gather(*(drive(r, frames, i % len(frames), cfg["frames"], start_at + offset[r.stream_id],
                                     cfg["period_s"]) for i, r in enumerate(live)),
                             *(probe_slot(cell, cfg, pid, frames, start_at, end_at, probes, claim)
                               for pid in cfg.get("probe_ids", [])))
    finally:
        progress.cancel()

    def rel(t: float) -> float:
        return round(t - start_at, 6)

    result = {"start_at": start_at, "sessions": [{
        "stream_id": r.stream_id, "admitted": r.relay is not None, "open_s": round(r.open_s, 4),
        "prefill_ms": float(r.relay.ready.prefill_ms) if r.relay else None,
        "output_delay_frames": r.relay.output_delay_frames if r.relay else None,
        "send_t": [rel(t) for t in r.send_t], "late_s": [round(x, 6) for x in r.late], "reanchors": r.reanchors,
        "recv": [[s, rel(t)] for s, t in r.recv], "error": r.error, "cleanup_confirmed": r.cleanup_confirmed,
    } for r in runs], "probes": [probe_record(r, rel) for r in probes]}
    with open(cfg["result_path"], "w") as f:
        json.dump(result, f)
    for ch in cell.channels.values():
        await ch.close()
    emit({"done": cfg["result_path"]})


if __name__ == "__main__":
    asyncio.run(main())
