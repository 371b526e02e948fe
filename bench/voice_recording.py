"""Recording a new voice never delays another session's ticks: a loaded talker, quiet against recording.

    python -m bench.voice_recording [--sessions 128] [--phase-s 15] [--voice-seconds 10] [--out DIR]
    python -m bench.voice_recording --smoke [--out DIR]    # tiny checkpoint on the CPU, 2 sessions, under a minute

1. checkpoint: --checkpoint DIR, or built (bench.cell.build_checkpoint: the full random one on the GPU,
   30-45 s; --smoke: the tiny one on the CPU).
2. one talker process with the GPU deployment's flags (k8s/overlays/gpu: fp8 KV and weights, CUDA
   graphs, compiled kernels, NATF2.pt preloaded), slots = --sessions + 1, an empty voice cache (every
   voice is recorded, none read back), --max-prefill-wait-s 0 (the bench's own opens queue instead of
   being refused) and, with --full-context (the default), --bench-full-context: every step costs what
   the steady state at a full ring costs, so the period has the slack it has at full load.
3. --sessions bystander Talk streams straight on the talker (no codecs: the talker's ticks are what is
   measured), each sending one frame every 80 ms on an absolute schedule, spread over the period as
   independent users are; every output's arrival time is kept.
4. phases of --phase-s each, alternating: quiet, recording, quiet, recording (an A/B/A/B, so a drift
   over the run shows). In a recording phase a client keeps the talker's voice recorder busy, one
   voice after another: a session opens shipping --voice-seconds of fresh speech-like audio (never the
   same twice: each is really recorded, its Mimi encode in the talker's niced child process, then the
   embedding lookup and the voice's KV prefix in prefill pieces on the GPU), waits for `ready`, sends 2
   frames and closes. A recording still running at the phase's end is waited for before the next
   quiet phase starts, so no quiet phase holds recording work.
5. per phase: from the talker's /metrics (deltas) the ticks, ticks over the period (by cause), tick
   p50/p99, lateness p99, catch-up steps, frames skipped and prefill pieces, and each piece of recording
   work the compute thread ran (duplex_talker_voice_compute_seconds{part}: the embedding lookup, a KV
   prefix piece riding a main step or alone; count, mean, p99 and the bucket bound over the largest);
   from the bystanders the
   outputs against those due, the largest gap between two outputs of one session and the gaps over
   two periods; the recordings made (open -> ready each); the CPU seconds of the talker and of its
   recorder process; this client's own event-loop lag (its gap figures mean little above a period).

At the end, from the talker's log, every recording's lookup and every KV prefix piece as the talker
timed them on its compute thread ("recording_compute_log").

Writes voice_recording.json under --out (rewritten after every phase, so a run cut short keeps what it
measured). "pass": over the recording phases, at most as many ticks over the period as the quiet phases'
share of them predicts plus max(2, 0.5 % of the ticks), a p99 tick at most the quiet p99 x 1.1 + 2 ms, and
at least one voice recorded. Exit 0 pass, 3 measured and failed. The first recording phase also pays for
the recorder process's start (Python, torch and Mimi's encoder, niced), as the first voice a talker
records does. On a shared CPU (--smoke) the verdict is noise; the smoke checks that the run works.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import numpy as np

from bench.cell import build_checkpoint, gpu_profile_args, gpu_state, local_only_network, log, parse_args
from bench.cell_stats import bucket_quantile, counter_delta, histogram_delta, parse_metrics
from duplex.v1 import common_pb2, talker_pb2, talker_pb2_grpc
from services.common.frame import FRAME_S as PERIOD_S
from services.talker.metrics import VOICE_COMPUTE_PARTS
from tools.procs import ServiceProcess, ServiceStartError

SAMPLE_RATE = 24_000
BYSTANDER_VOICE = "NATF2.pt"
# Ticks over the period the recording phases may have beyond the quiet phases' rate: at least this many,
# or this share of their ticks (one slow tick in 200 is 0.5 %: a count this small is noisy).
SLOW_MARGIN_TICKS, SLOW_MARGIN_SHARE = 2, 0.005
P99_FACTOR, P99_MARGIN_S = 1.1, 0.002


@dataclass
class VoiceBenchConfig:
    """Every option (flag = field name with dashes; BENCH_<FIELD> in the environment). Defaults: the GPU run."""

    preset: str = "full"  # checkpoint to build when --checkpoint is not given: tiny | full
    checkpoint: str = ""
    seed: int = 0
    device: str = "cuda"
    sessions: int = 128  # bystanders
    phase_s: float = 15.0  # each of quiet, recording, quiet, recording
    voice_seconds: float = 10.0  # audio per recorded voice (the gateway allows 2-30 s)
    full_context: bool = True  # talker --bench-full-context
    talker_args: str = ""  # extra talker flags (after the profile's)
    out: str = "bench/results"
    ready_timeout_s: float = 300.0
    open_timeout_s: float = 180.0  # all bystanders live
    smoke: bool = False

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def __post_init__(self) -> None:
        if self.sessions < 1 or self.phase_s <= 0 or not 0.5 <= self.voice_seconds <= 60:
            raise ValueError("--sessions >= 1, --phase-s > 0 and --voice-seconds in [0.5, 60] are required")


SMOKE = dict(preset="tiny", device="cpu", sessions=2, phase_s=3.0, voice_seconds=2.0, full_context=False,
             ready_timeout_s=120.0, open_timeout_s=60.0,
             out=os.path.join(tempfile.gettempdir(), "voice-recording-smoke"))  # never over the GPU results


def speech_like(seconds: float, seed: int) -> bytes:
    """Voiced harmonics under a syllable-rate envelope plus a little noise, as TalkOpen.voice_audio ships it."""
    g = np.random.default_rng(seed)
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    f0 = 100.0 + 40 * g.random() + 20 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / SAMPLE_RATE
    voiced = sum(np.sin(k * phase) / k for k in range(1, 8))
    x = 0.1 * (0.5 + 0.5 * np.sin(2 * np.pi * 4.0 * t)) * voiced + 0.002 * g.standard_normal(t.size)
    return np.clip(x, -1, 1).astype("<f4").tobytes()


# ---- the talker -----------------------------------------------------------------------------------

def talker_args(cfg: VoiceBenchConfig, checkpoint: Path, voices: Path) -> list[str]:
    profile = gpu_profile_args()["talker"] if cfg.cuda else ["--threads", "1"]
    args = ["--checkpoint", str(checkpoint), "--slots", str(cfg.sessions + 1), "--device", cfg.device, *profile,
            "--max-prefill-wait-s", "0", "--voice-cache-dir", str(voices)]
    if BYSTANDER_VOICE not in profile:
        args += ["--preload-voices", BYSTANDER_VOICE]
    if cfg.full_context:
        args += ["--bench-full-context", "true"]
    return args + cfg.talker_args.split()


def scrape(talker: ServiceProcess) -> dict:
    with urllib.request.urlopen(talker.metrics_url, timeout=5) as r:
        return parse_metrics(r.read().decode())


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def recorder_pids(pid: int) -> list[int]:
    """The talker's spawned children (its voice recorder)."""
    kids = [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]
    return [k for k in kids if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]


def cpu_now(talker: ServiceProcess) -> dict:
    pid = talker.proc.pid
    try:
        rec = sum(cpu_s(k) for k in recorder_pids(pid))
    except (FileNotFoundError, ProcessLookupError):  # the recorder restarted meanwhile
        rec = math.nan
    return {"talker_cpu_s": cpu_s(pid), "recorder_cpu_s": rec}


# ---- the clients ----------------------------------------------------------------------------------

class Bystander:
    """One paced Talk stream: a frame every period at its own offset in the period, every output's arrival."""

    def __init__(self, stub, index: int, offset_s: float):
        self.stub, self.id, self.offset_s = stub, f"bystander-{index}", offset_s
        self.arrivals: list[float] = []
        self.error: str | None = None
        self.call = None

    async def open(self) -> None:
        self.call = self.stub.Talk()
        await self.call.write(talker_pb2.TalkRequest(open=talker_pb2.TalkOpen(
            stream=common_pb2.StreamOpen(stream_id=self.id), voice=BYSTANDER_VOICE, persona="Hi.",
            sampling=talker_pb2.Sampling(greedy=True, seed=1))))
        first = await self.call.read()
        if first is grpc.aio.EOF or first.WhichOneof("kind") != "ready":
            raise RuntimeError(f"{self.id}: no ready ({first})")

    async def run(self, start: float, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.create_task(self._read())
        try:
            seq = 0
            while not stop.is_set():
                await asyncio.sleep(max(0.0, start + self.offset_s + seq * PERIOD_S - loop.time()))
                await self.call.write(talker_pb2.TalkRequest(frame=common_pb2.CodesFrame(seq=seq,
                                                                                          codes=[seq % 2048] * 8)))
                seq += 1
            await self.call.done_writing()
            await asyncio.wait_for(reader, 30)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError) as e:
            self.error = f"{type(e).__name__}: {getattr(e, 'details', lambda: '')()}"
            reader.cancel()

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        while (msg := await self.call.read()) is not grpc.aio.EOF:
            if msg.WhichOneof("kind") == "output":
                self.arrivals.append(loop.time())


async def record_voices(stub, until: float, seconds: float, first_seed: int, made: list[dict]) -> None:
    """One new voice after another until `until` (the one in flight then finishes): open -> ready is its
    recording (the encode in the recorder process, the embedding lookup, the KV prefix's prefill)."""
    loop = asyncio.get_running_loop()
    k = first_seed
    while loop.time() < until:
        audio = await asyncio.to_thread(speech_like, seconds, k)
        call, t0 = stub.Talk(), loop.time()
        try:
            await call.write(talker_pb2.TalkRequest(open=talker_pb2.TalkOpen(
                stream=common_pb2.StreamOpen(stream_id=f"recording-{k}"), voice=f"bench_voice_{k}", persona="Hi.",
                voice_audio=audio, sampling=talker_pb2.Sampling(greedy=True, seed=1))))
            first = await call.read()
            ready_s = loop.time() - t0
            for seq in range(2):
                await call.write(talker_pb2.TalkRequest(frame=common_pb2.CodesFrame(seq=seq, codes=[1] * 8)))
            await call.done_writing()
            while await call.read() is not grpc.aio.EOF:
                pass
            made.append({"voice": k, "ready_s": round(ready_s, 3), "first": first.WhichOneof("kind")})
        except grpc.aio.AioRpcError as e:
            kind = dict(e.trailing_metadata() or ()).get("error-kind", "")
            made.append({"voice": k, "error": f"{e.code().name} {kind}", "after_s": round(loop.time() - t0, 3)})
            await asyncio.sleep(0.5)
        k += 1


async def loop_lag(stop: asyncio.Event, worst: list[float]) -> None:
    """This client's event-loop lag: how late a 10 ms sleep wakes (its gap figures are only as good)."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        t = loop.time()
        await asyncio.sleep(0.01)
        worst[0] = max(worst[0], loop.time() - t - 0.01)


# ---- one phase's figures ---------------------------------------------------------------------------

def compute_figures(before: dict, after: dict) -> dict:
    """Each part of the recording work on the talker's compute thread (metrics.VOICE_COMPUTE_PARTS): how many
    pieces, their mean and p99, and the bucket bound over the largest (at most that long)."""
    out = {}
    for part in VOICE_COMPUTE_PARTS:
        h = histogram_delta(before, after, "duplex_talker_voice_compute_seconds", part=part)
        top = next((b for b, c in zip(h.bounds, h.cumulative) if c >= h.count), math.inf) if h.count else math.nan
        out[part] = {"pieces": int(h.count), "mean_ms": round(1e3 * h.mean, 2) if h.count else math.nan,
                     "p99_ms": round(1e3 * bucket_quantile(h, 0.99), 2), "max_at_most_ms": round(1e3 * top, 1)}
    return out


def compute_log(talker_log: str) -> list[str]:
    """The talker's own lines on each recording's work on its compute thread: the lookup ("recorded") and the
    KV prefix pieces (engine._VoicePrefix), times stripped of paths."""
    keep = ("its embedding lookup", "KV prefix of")
    return [line.split(": ", 1)[-1].split(", cached as")[0] for line in talker_log.splitlines()
            if any(k in line for k in keep)]


def talker_figures(before: dict, after: dict) -> dict:
    ticks = histogram_delta(before, after, "duplex_talker_tick_seconds")
    late = histogram_delta(before, after, "duplex_talker_tick_lateness_seconds")
    slow = counter_delta(before, after, "duplex_talker_slow_ticks")
    causes = {c: counter_delta(before, after, "duplex_talker_slow_ticks", cause=c)
              for c in ("catch_up", "late_start", "wait_and_step")}
    return {"ticks": int(ticks.count), "slow_ticks": int(slow), "slow_share": round(slow / ticks.count, 4)
            if ticks.count else math.nan, "slow_by_cause": {c: int(v) for c, v in causes.items()},
            "tick_p50_ms": round(1e3 * bucket_quantile(ticks, 0.5), 2),
            "tick_p99_ms": round(1e3 * bucket_quantile(ticks, 0.99), 2),
            "tick_mean_ms": round(1e3 * ticks.mean, 2) if ticks.count else math.nan,
            "lateness_p99_ms": round(1e3 * bucket_quantile(late, 0.99), 2),
            "catch_up_steps": int(counter_delta(before, after, "duplex_talker_catch_up_steps")),
            "frames_skipped": int(counter_delta(before, after, "duplex_talker_frames_skipped")),
            "prefill_pieces": int(counter_delta(before, after, "duplex_talker_prefill_pieces")),
            "recording_compute": compute_figures(before, after)}


def client_figures(bystanders: list[Bystander], t0: float, t1: float) -> dict:
    largest, over, got = 0.0, 0, 0
    for b in bystanders:
        times = [t0, *(t for t in b.arrivals if t0 < t <= t1), t1]
        gaps = np.diff(times)
        largest = max(largest, float(gaps.max()))
        over += int((gaps[1:-1] > 2 * PERIOD_S).sum()) if gaps.size > 2 else 0
        got += len(times) - 2
    due = len(bystanders) * (t1 - t0) / PERIOD_S
    return {"outputs_per_due": round(got / due, 4) if due else math.nan, "largest_gap_ms": round(1e3 * largest, 1),
            "gaps_over_2_periods": over}


def combine(phases: list[dict], kind: str) -> dict:
    """The phases of one kind together: ticks summed, the worst p99 and gap."""
    mine = [p for p in phases if p["kind"] == kind]
    ticks = sum(p["talker"]["ticks"] for p in mine)
    slow = sum(p["talker"]["slow_ticks"] for p in mine)
    worst = {part: max((p["talker"]["recording_compute"][part]["max_at_most_ms"] for p in mine
                        if p["talker"]["recording_compute"][part]["pieces"]), default=math.nan)
             for part in VOICE_COMPUTE_PARTS}
    return {"phases": len(mine), "ticks": ticks, "slow_ticks": slow,
            "slow_share": round(slow / ticks, 4) if ticks else math.nan,
            "tick_p99_ms": max((p["talker"]["tick_p99_ms"] for p in mine), default=math.nan),
            "largest_gap_ms": max((p["clients"]["largest_gap_ms"] for p in mine), default=math.nan),
            "recordings": sum(p["recordings_made"] for p in mine),
            "recording_compute_max_at_most_ms": worst}


def verdict(quiet: dict, recording: dict) -> dict:
    expected = (quiet["slow_share"] if quiet["ticks"] else 0.0) * recording["ticks"]
    slow_ok = recording["slow_ticks"] <= expected + max(SLOW_MARGIN_TICKS, SLOW_MARGIN_SHARE * recording["ticks"])
    p99_ok = recording["tick_p99_ms"] <= quiet["tick_p99_ms"] * P99_FACTOR + 1e3 * P99_MARGIN_S
    return {"slow_share_within_margin": slow_ok, "tick_p99_within_margin": p99_ok,
            "voices_recorded": recording["recordings"] > 0,
            "pass": bool(slow_ok and p99_ok and recording["recordings"] > 0)}


# ---- the run --------------------------------------------------------------------------------------

async def measure(cfg: VoiceBenchConfig, talker: ServiceProcess, result: dict, write) -> None:
    loop = asyncio.get_running_loop()
    async with grpc.aio.insecure_channel(talker.address, options=[
            ("grpc.max_send_message_length", 16 * 2**20)]) as ch:
        stub = talker_pb2_grpc.TalkerStub(ch)
        bystanders = [Bystander(stub, i, PERIOD_S * i / cfg.sessions) for i in range(cfg.sessions)]
        t = loop.time()
        await asyncio.wait_for(asyncio.gather(*(b.open() for b in bystanders)), cfg.open_timeout_s)
        result["phases_s"]["bystanders_open"] = round(loop.time() - t, 1)
        log(f"{cfg.sessions} bystanders live in {result['phases_s']['bystanders_open']:.1f} s")
        stop, lag_stop = asyncio.Event(), asyncio.Event()
        start = loop.time() + 0.2
        runs = [asyncio.create_task(b.run(start, stop)) for b in bystanders]
        worst_lag = [0.0]
        lag = asyncio.create_task(loop_lag(lag_stop, worst_lag))
        await asyncio.sleep(max(2.0, 2 * cfg.phase_s / 10))  # settle: every bystander stepping
        seed = 1
        for i, kind in enumerate(("quiet", "recording", "quiet", "recording")):
            before, cpu0, t0 = await asyncio.to_thread(scrape, talker), cpu_now(talker), loop.time()
            worst_lag[0] = 0.0
            made: list[dict] = []
            if kind == "recording":
                await record_voices(stub, t0 + cfg.phase_s, cfg.voice_seconds, seed, made)  # the last one finishes
                seed += len(made)
            else:
                await asyncio.sleep(cfg.phase_s)
            t1 = loop.time()
            after, cpu1 = await asyncio.to_thread(scrape, talker), cpu_now(talker)
            phase = {"kind": kind, "seconds": round(t1 - t0, 2), "talker": talker_figures(before, after),
                     "clients": client_figures(bystanders, t0, t1),
                     "talker_cpu_s": round(cpu1["talker_cpu_s"] - cpu0["talker_cpu_s"], 2),
                     "recorder_cpu_s": round(cpu1["recorder_cpu_s"] - cpu0["recorder_cpu_s"], 2),
                     "client_loop_lag_max_ms": round(1e3 * worst_lag[0], 1),
                     "recordings_made": sum("ready_s" in m and m["first"] == "ready" for m in made),
                     "recordings": made}
            result["phases"].append(phase)
            tk = phase["talker"]
            log(f"phase {i + 1} {kind}: {phase['seconds']:.1f} s, {tk['ticks']} ticks, {tk['slow_ticks']} over the "
                f"period, p99 {tk['tick_p99_ms']} ms; largest bystander gap {phase['clients']['largest_gap_ms']} ms; "
                f"{phase['recordings_made']} voices recorded; on the compute thread "
                + ", ".join(f"{part} {c['pieces']}x at most {c['max_at_most_ms']} ms"
                            for part, c in tk["recording_compute"].items() if c["pieces"]))
            write()
        stop.set()
        await asyncio.gather(*runs)
        lag_stop.set()
        await lag
        result["bystander_errors"] = [b.error for b in bystanders if b.error]
        final = await asyncio.to_thread(scrape, talker)
        result["voice_store"] = {k: final.get((f"duplex_talker_voice_{k}", ()), math.nan)
                                 for k in ("recordings", "recording_bytes")}


def exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally: the talker stopped, the JSON written


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv, cls=VoiceBenchConfig, smoke=SMOKE, prog="python -m bench.voice_recording", doc=__doc__)
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    local_only_network()
    t_start = time.monotonic()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="voice-recording-bench-"))
    config = asdict(cfg)
    config.update({k: f"<{k}>" for k in ("checkpoint", "out") if config[k] and os.path.isabs(config[k])})
    result: dict = {"bench": "voice_recording", "mode": "smoke (cpu, tiny)" if cfg.smoke else
                    f"{cfg.preset} on {cfg.device}", "config": config,
                    "host": {"cpu_cores": os.cpu_count(), "gpu": gpu_state()}, "phases_s": {}, "phases": []}

    def write() -> None:
        result["phases_s"]["total"] = round(time.monotonic() - t_start, 1)
        if any(p["kind"] == "recording" for p in result["phases"]) and any(p["kind"] == "quiet"
                                                                           for p in result["phases"]):
            quiet, recording = combine(result["phases"], "quiet"), combine(result["phases"], "recording")
            result["summary"] = {"quiet": quiet, "recording": recording, **verdict(quiet, recording)}
        (out / "voice_recording.json").write_text(json.dumps(result, indent=2))

    talker = None
    try:
        t = time.monotonic()
        checkpoint = Path(cfg.checkpoint) if cfg.checkpoint else build_checkpoint(cfg, work)
        result["phases_s"]["checkpoint"] = round(time.monotonic() - t, 1)
        args = talker_args(cfg, checkpoint, work / "voices")
        result["talker_args"] = " ".join(args).replace(str(checkpoint), "<checkpoint>").replace(str(work), "<work>")
        t = time.monotonic()
        talker = ServiceProcess("services.talker", args, ready_timeout=cfg.ready_timeout_s)
        try:
            talker.start()
        except ServiceStartError as e:
            result["error"] = str(e)[-4000:]
            log(f"talker did not start: {str(e)[:2000]}")
            return 3
        result["phases_s"]["talker_start"] = round(time.monotonic() - t, 1)
        log(f"talker serving with {cfg.sessions + 1} slots after {result['phases_s']['talker_start']:.1f} s")
        write()
        asyncio.run(measure(cfg, talker, result, write))
        result["host"]["gpu_at_end"] = gpu_state()
    finally:
        if talker is not None:
            talker_log = talker.stderr_tail(200_000)
            (out / "voice_recording-talker.log").write_text(talker_log)
            result["recording_compute_log"] = compute_log(talker_log)
            talker.close()
        shutil.rmtree(work, ignore_errors=True)
        write()
    summary = result.get("summary", {})
    log(f"wrote {out / 'voice_recording.json'}: quiet {summary.get('quiet')}, recording {summary.get('recording')}, "
        f"pass {summary.get('pass')}; phases (s): {json.dumps(result['phases_s'])}")
    return 0 if summary.get("pass") else 3


if __name__ == "__main__":
    sys.exit(main())
