"""The front door on one GPU: the stack as deployed, N callers on the Realtime wire through the gateway,
with the traffic a real server sees.

    # The headline, one device call (about 6-7 minutes: setup 2, realistic 160 about 2.6, burst 160 about 1.3):
    bash bench/device.sh python3 -m bench.frontdoor --mps --full-context --sessions 160 --traffic realistic,burst \\
        --duration-s 60
    python -m bench.frontdoor --mps --full-context --sessions 128 --traffic realistic,burst --duration-s 60
    python -m bench.frontdoor --mps --full-context --sessions 160 --traffic together --open autostart0  # the old runs
    python -m bench.frontdoor --smoke [--traffic realistic,together]   # tiny checkpoint on the CPU, 3 sessions
    python -m bench.frontdoor --smoke --traffic burst --sessions 3 --burst 6 --duration-s 10  # a burst beyond the slots

What runs, each a real process:
1. the cell: encoder, talker, decoder with the GPU deployment's flags (bench/cell.py
   `service_args`: fp8 KV and weights, CUDA graphs, compiled kernels, the voice preloaded), under a
   private CUDA MPS daemon with --mps; slots = the largest N;
2. the gateway (`python -m services.gateway`, as tools/run_stack starts it) with --gateway-workers
   worker processes on one port, linked to the cell by one Link stream per worker and stage;
3. per N and per pattern of --traffic (in order, on the same stack), `python -m tools.load_driver --procs K`
   on the Realtime wire (JSON + base64 PCM, paced at 80 ms; tools/load_driver/traffic.py defines each):
   - realistic (the default, and the headline): N lines. Callers dial at --arrival-rate per second
     (--arrivals poisson, or steady), open as --open says (sdk: connect with ?model=, send session.update
     at once, stream after the first session.updated, as the openai SDK, LiveKit's openai plugin and
     pipecat do; autostart0: ?autostart=0), and each streams as soon as its own open is done, from a
     random send phase. Calls last --call-min-s + Exp(--call-mean-s - --call-min-s) s (10 + Exp(70), a
     mean of 80 s: at 160 lines about 2 hang up and 2 dial per second, the ramp's rate), and a line
     dials again --redial-gap-s after a hang-up. The traffic goes on --duration-s after the ramp's last
     arrival. The steady window: from --settle-s after that arrival to the end (--duration-s minus
     --settle-s long); the ticks, frame latency and sessions behind are the window's.
   - burst: --burst callers (0: N) dial within --burst-window-s (a cell failing over, a rolling
     update), one call each (the same lengths), for --duration-s after the window; the window is the
     whole run.
   - together (a comparison: the flattering pattern of the runs before 2026-12-03, which had
     --open autostart0): N - P steady sessions all open first, then stream from one shared start, send
     phases spread evenly over the period, for --duration-s; P = --probe-sessions probe sessions in
     this process hang up and call again every --probe-cycle-s (first audio under load).
   A caller refused up front with a typed retry-later (an `error` server_busy / resource_exhausted, a
   close 1013, HTTP 503) retries after the delay the server gave (else 1 s) for --served-within-s.
4. the talker's and the gateway's /metrics every second: the talker's figures are the deltas between
   the scrapes that bound the window, prompts per open the talker's prompts started
   (`duplex_talker_prompts_started_total`, when it exports it) over the gateway's sessions opened.
Per run it reports the talker's ticks within 80 ms and tick p99, sessions behind per tick (the
`duplex_talker_sessions_behind` histogram: p50 / p90 / mean), catch-up steps, client frame latency
p50 / p99 (frame i sent -> output i received), the per-session latency p50 across sessions (p10 / p50 /
p90 / max), first audio (the caller's first frame sent -> first audio delta, and from its connect),
callers by status (passed, failed, killed: ended by a server_error or a close it did not ask for;
refused: never served), refusals by type, retries and time to served, the CPU cores of each gateway
worker and stage, and the link messages per second each stage handled. Writes frontdoor.json (after
every run) and frontdoor.png under --out. The pass rule of each pattern: bench/frontdoor_report.py.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from bench.cell import (
    LOCAL_HTTP, BenchConfig, Mps, build_checkpoint, gpu_state, local_only_network, scrape, start_services,
    stop_services, wait_all_free,
)
from bench.cell import parse_args as cell_parse_args
from bench.cell_report import PROMPTS_STARTED, stage_block, stage_timeline, talker_block
from bench.cell_stats import counter_by_label, counter_delta, ms_summary, parse_metrics
from bench.frontdoor_report import TRAFFIC_NOTES, checks, plot, print_table
from tools.load_driver.__main__ import parse_args as driver_parse_args
from tools.load_driver.input_audio import input_signal
from tools.load_driver.session import RawRealtimeClient, realtime_url, session_update
from tools.load_driver.traffic import make_plan
from tools.procs import REPO_ROOT, ServiceStartError, die_with_parent, free_port
from tools.run_stack import GatewayProcess
from services.common.frame import FRAME_S as PERIOD_S, FRAME_SAMPLES as FRAME

STAGES = ("encoder", "talker", "decoder")
CLK_TCK = os.sysconf("SC_CLK_TCK")
TRAFFICS = ("realistic", "burst", "together")
# This bench's pattern names -> the load driver's (--traffic).
DRIVER_TRAFFIC = {"realistic": "arrivals", "burst": "burst", "together": "together"}
SCRAPE_EVERY_S = 1.0  # as bench.cell: a scrape holds a stage's GIL for a moment


@dataclass
class FrontdoorConfig(BenchConfig):
    """bench/cell.py's options for the cell, plus the front door's."""

    sessions: str = "160"
    traffic: str = "realistic"  # patterns to run in order on one stack: realistic, burst, together (comma list)
    open: str = "sdk"  # how a caller opens: sdk | autostart0 (tools/load_driver/session.py)
    arrivals: str = "poisson"  # realistic: poisson | steady
    arrival_rate: float = 2.0  # realistic: callers per second in the ramp
    duration_s: float = 60.0  # realistic: after the last arrival; burst: after the window; together: per session
    settle_s: float = 2.0  # realistic: the steady window starts this long after the last arrival
    call_mean_s: float = 80.0  # realistic, burst: mean call length (--call-min-s + exponential)
    call_min_s: float = 10.0  # the shortest call
    redial_gap_s: float = 1.0  # realistic: a line dials again this long after a hang-up
    burst: int = 0  # burst: callers (0: N)
    burst_window_s: float = 2.0  # burst: every caller dials within this
    traffic_seed: int = 0  # the arrivals', call lengths' and send phases' seed
    served_within_s: float = 30.0  # a refused caller retries this long; all must be served within it
    repeats: int = 1  # each N and pattern this many times in a row on the same stack (fresh sessions each time)
    probe_sessions: int = 2  # together only
    gateway_workers: str = "4"  # the gateway's --workers ("" leaves the flag out: the gateway's default)
    gateway_args: str = ""  # extra gateway flags
    driver_procs: int = 8  # load driver processes (tools.load_driver --procs)
    driver_args: str = ""  # extra load driver flags
    drain_s: float = 3.0  # the driver's observation window after a call's last frame
    min_ticks_pct: float = 99.5
    max_tick_p99_ms: float = 75.0
    max_frame_latency_p50_ms: float = 120.0
    max_frame_latency_p99_ms: float = 250.0
    max_first_audio_p99_ms: float = 400.0
    max_sessions_behind_p50: float = 2.0
    profile_s: float = 0.0  # > 0: py-spy records each gateway process this long, mid-run (raw stacks in --out)

    @property
    def traffics(self) -> list[str]:
        return [t.strip() for t in self.traffic.split(",") if t.strip()]

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.traffics or set(self.traffics) - set(TRAFFICS):
            raise ValueError(f"--traffic must list some of {', '.join(TRAFFICS)}, got {self.traffic!r}")
        if self.burst < 0 or self.driver_procs < 1:
            raise ValueError("--burst must be >= 0 and --driver-procs >= 1")


SMOKE = dict(preset="tiny", device="cpu", sessions="3", duration_s=6.0, mps=False, probe_sessions=1, probe_cycle_s=1.5,
             arrival_rate=4.0, settle_s=1.0, call_mean_s=2.0, call_min_s=1.0, redial_gap_s=0.3, burst_window_s=1.0,
             driver_procs=2, gateway_workers="2", min_ticks_pct=0.0, max_first_audio_p99_ms=5000.0,
             max_tick_p99_ms=1e9, max_frame_latency_p50_ms=1e9, max_frame_latency_p99_ms=10000.0,
             max_sessions_behind_p50=1e9, ready_timeout_s=120.0, open_timeout_s=60.0,
             progress_every_s=1.0, drain_s=1.0, out=os.path.join(tempfile.gettempdir(), "frontdoor-smoke"))


def parse_args(argv: list[str] | None) -> FrontdoorConfig:
    return cell_parse_args(argv, FrontdoorConfig, SMOKE, "python -m bench.frontdoor", __doc__)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- CPU per process ----------------------------------------------------------------------------

def cpu_seconds(pid: int) -> float | None:
    """utime + stime of one process, in seconds (None once it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(stat[11]) + int(stat[12])) / CLK_TCK


def children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, ValueError, IndexError):
                pass
    return sorted(out)


def gateway_pids(gateway: GatewayProcess) -> dict[str, int]:
    """The gateway's worker processes (its own process when it runs no workers)."""
    kids = children(gateway.proc.pid)
    return {f"gateway-{i}": pid for i, pid in enumerate(kids)} if kids else {"gateway": gateway.proc.pid}


def cores_used(before: dict[str, float | None], after: dict[str, float | None], seconds: float) -> dict[str, float]:
    return {name: round((after[name] - before[name]) / seconds, 3) for name in before
            if before[name] is not None and after.get(name) is not None and seconds > 0}


def profile_gateway(cfg: FrontdoorConfig, pids: dict[str, int], label: str, at_s: float) -> list[asyncio.Task]:
    """With --profile-s: py-spy samples every gateway process from at_s into the run."""
    exe = shutil.which("py-spy")
    if cfg.profile_s <= 0 or exe is None:
        return []

    async def one(name: str, pid: int) -> None:
        await asyncio.sleep(at_s)
        path = Path(cfg.out) / f"frontdoor-{label}-{name}.pyspy.txt"
        proc = await asyncio.create_subprocess_exec(exe, "record", "-p", str(pid), "-d", str(cfg.profile_s),
                                                    "-r", "100", "-f", "raw", "-o", str(path), "--nonblocking",
                                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        await proc.wait()

    return [asyncio.create_task(one(name, pid)) for name, pid in pids.items() if name.startswith("gateway")]


# ---- probes (together): hang up and call again under load ---------------------------------------------

async def probe_slot(url: str, cfg: FrontdoorConfig, pcm16_b64: list[str], stop: asyncio.Event,
                     cycles: list[dict]) -> None:
    """Open, talk for probe_cycle_s at 80 ms pacing, close; again until `stop`. Each cycle's record:
    open_ms (connect -> session.created), first_audio_ms (connect -> first audio delta), or its error."""
    frames = max(2, round(cfg.probe_cycle_s / PERIOD_S))
    update = session_update(model=None, voice=cfg.voice, persona=cfg.persona, input_format="pcm16")
    while not stop.is_set():
        rec: dict = {"at": time.monotonic()}
        s = RawRealtimeClient(realtime_url(url, None), cleanup_timeout_s=10.0)
        t0 = time.monotonic()
        try:
            await s.connect(cfg.open_timeout_s)
            first = await s.open(update, cfg.open_timeout_s)
            if first["type"] == "error":
                rec["error"] = (first.get("error") or {}).get("code", "error")
                cycles.append(rec)
                await asyncio.sleep(0.1)  # a slot frees a moment after its session closed
                continue
            rec["open_ms"] = round((time.monotonic() - t0) * 1e3, 1)
            start = time.monotonic()
            for i in range(frames):
                await asyncio.sleep(max(0.0, start + i * PERIOD_S - time.monotonic()))
                await s.send({"type": "input_audio_buffer.append", "audio": pcm16_b64[i % len(pcm16_b64)]}, 10.0)
                if "first_audio_ms" not in rec:
                    got = next((at for e, at in zip(s.events, s.received_at)
                                if e["type"].endswith("audio.delta")), None)
                    if got is not None:
                        rec["first_audio_ms"] = round((got - t0) * 1e3, 1)
            await s.request_close(10.0)
            if "first_audio_ms" not in rec:
                got = next((at for e, at in zip(s.events, s.received_at) if e["type"].endswith("audio.delta")), None)
                rec["first_audio_ms"] = None if got is None else round((got - t0) * 1e3, 1)
            errors = [(e.get("error") or {}).get("code") for e in s.errors()]
            if errors:
                rec["error"] = ",".join(str(c) for c in errors)
        except Exception as e:  # one cycle's failure is a row, not the end of the probes
            rec["error"] = f"{type(e).__name__}: {e}"[:300]
        finally:
            await s.close()
        cycles.append(rec)


def probe_report(cycles: list[dict]) -> dict:
    done = [c for c in cycles if "open_ms" in c]
    first = [c["first_audio_ms"] for c in done if c.get("first_audio_ms") is not None]
    return {"cycles": len(cycles), "opened": len(done), "with_audio": len(first),
            "refused": sum(1 for c in cycles if c.get("error") == "resource_exhausted"),
            "errors": [c["error"] for c in cycles if "error" in c and c["error"] != "resource_exhausted"][:10],
            "open_ms": ms_summary(np.asarray([c["open_ms"] for c in done]) / 1e3) if done else None,
            "first_audio_ms": ms_summary(np.asarray(first) / 1e3) if first else None}


async def start_probes(cfg: FrontdoorConfig, gateway: GatewayProcess, steady: int, stop: asyncio.Event,
                       cycles: list[dict]) -> list[asyncio.Task]:
    """Once the gateway holds the steady sessions live (each one's prompt prefilled), so that the probes'
    opens meet a loaded cell, not the queue of the steady sessions' prefills."""
    deadline = time.monotonic() + cfg.open_timeout_s
    while time.monotonic() < deadline:
        snap = await asyncio.to_thread(scrape_gateway, gateway)
        if snap is not None and sum(v for (name, _), v in snap.items() if name == "gateway_sessions_active") >= steady:
            break
        await asyncio.sleep(0.2)
    pcm, _ = input_signal(None, 200, seed=1)
    pcm16 = [base64.b64encode((np.clip(pcm[i:i + FRAME], -1, 1) * 32767).astype("<i2").tobytes()).decode()
             for i in range(0, len(pcm) - FRAME + 1, FRAME)]
    return [asyncio.create_task(probe_slot(gateway.ws_url, cfg, pcm16, stop, cycles))
            for _ in range(cfg.probe_sessions)]


# ---- scrapes ------------------------------------------------------------------------------------------

def scrape_gateway(gateway: GatewayProcess) -> dict | None:
    try:
        with LOCAL_HTTP.open(gateway.http_url + "/metrics", timeout=3) as r:
            return parse_metrics(r.read().decode())
    except OSError:
        return None


async def scrape_loop(procs, gateway: GatewayProcess, snaps: list[tuple[float, dict]], stop: asyncio.Event) -> None:
    """The talker's and the gateway's metrics every SCRAPE_EVERY_S until `stop` (and once more then)."""
    while True:
        t = time.monotonic()
        talker = await asyncio.to_thread(scrape, {"talker": procs["talker"]})
        snaps.append((t, {"talker": talker["talker"], "gateway": await asyncio.to_thread(scrape_gateway, gateway)}))
        if stop.is_set():
            return
        try:
            await asyncio.wait_for(stop.wait(), max(0.0, t + SCRAPE_EVERY_S - time.monotonic()))
        except asyncio.TimeoutError:
            pass


def bounding(snaps: list[tuple[float, dict]], lo: float, hi: float) -> tuple[dict, dict]:
    """The first scrape at or after `lo` and the last at or before `hi` (both answered by the talker)."""
    answered = [(t, s) for t, s in snaps if s["talker"] is not None and s["gateway"] is not None]
    inside = [s for t, s in answered if lo <= t <= hi]
    if len(inside) < 2:
        raise RuntimeError(f"fewer than two metric scrapes inside the steady window ({hi - lo:.1f} s long)")
    return inside[0], inside[-1]


# ---- one run ------------------------------------------------------------------------------------------

def driver_argv(cfg: FrontdoorConfig, url: str, n: int, traffic: str, out_dir: Path) -> list[str]:
    """The load driver's flags for one run of `traffic` at N (its --sessions: lines, callers or steady ones)."""
    common = ["--url", url, "--traffic", DRIVER_TRAFFIC[traffic], "--open", cfg.open, "--drain-s", str(cfg.drain_s),
              "--voice", cfg.voice, "--persona", cfg.persona, "--output-dir", str(out_dir),
              "--max-frame-latency-p99-ms", str(cfg.max_frame_latency_p99_ms)]
    if traffic == "together":
        frames = int(round(cfg.duration_s / PERIOD_S))
        return [*common, "--sessions", str(n - cfg.probe_sessions), "--load-frames", str(frames),
                *cfg.driver_args.split()]
    calls = ["--hold-s", str(cfg.duration_s), "--call-mean-s", str(cfg.call_mean_s), "--call-min-s",
             str(cfg.call_min_s), "--traffic-seed", str(cfg.traffic_seed), "--retry-for-s", str(cfg.served_within_s)]
    if traffic == "burst":
        calls += ["--sessions", str(cfg.burst or n), "--burst-window-s", str(cfg.burst_window_s)]
    else:
        calls += ["--sessions", str(n), "--arrivals", cfg.arrivals, "--arrival-rate", str(cfg.arrival_rate),
                  "--settle-s", str(cfg.settle_s), "--redial-gap-s", str(cfg.redial_gap_s)]
    return [*common, *calls, *cfg.driver_args.split()]


def run_length_s(cfg: FrontdoorConfig, n: int, traffic: str) -> float:
    """How long the driver's traffic lasts, from its own plan (a Poisson ramp's length is drawn)."""
    return make_plan(driver_parse_args(driver_argv(cfg, "ws://127.0.0.1:1/", n, traffic, Path(".")))).end_s


def driver_summary(result: dict) -> dict:
    """What this report reads of the driver's merged load-result.json (tools/load_driver/__init__.py)."""
    summary = result.get("summary") or {}
    keys = ("sessions", "admitted", "passed_sessions", "driver_procs", "frame_latency_ms", "frame_deficit",
            "underrun_s", "client_own_send_lateness_p99_ms", "client_send_rtf")
    return {"verdict": result.get("verdict"), "reasons": (result.get("reasons") or [])[:10],
            **{k: summary.get(k) for k in keys}}


def opens_and_prompts(first: dict, last: dict) -> dict:
    """Sessions the gateway opened, prompts the talker began (None if it does not say; by its `why`
    label), and the gateway's refusals by code."""
    opens = int(counter_delta(first["gateway"], last["gateway"], "gateway_sessions_opened"))
    prompts = talker_block(first["talker"], last["talker"])["prompts_started"]
    why = counter_by_label(first["talker"], last["talker"], PROMPTS_STARTED, "why")
    return {"opens": opens, "prompts_started": prompts, "prompts_started_by": {k: int(v) for k, v in why.items()},
            "prompts_per_open": None if prompts is None or not opens else round(prompts / opens, 3),
            "gateway_refusals": {k: int(v) for k, v in counter_by_label(first["gateway"], last["gateway"],
                                                                        "gateway_sessions_refused", "code").items()}}


async def run_one(cfg: FrontdoorConfig, procs, gateway: GatewayProcess, n: int, traffic: str, work: Path,
                  label: str) -> dict:
    """One run of `traffic` at N; label names its files (n160-realistic, or n160-realistic-r2 for a repeat)."""
    await wait_all_free(procs, n, timeout_s=60)
    out_dir = work / f"load-{label}"
    shutil.rmtree(out_dir, ignore_errors=True)  # a reused --work-dir's earlier run: the driver never overwrites
    argv = driver_argv(cfg, gateway.ws_url, n, traffic, out_dir)
    lines = driver_parse_args(argv).sessions
    k = min(cfg.driver_procs, lines)
    who = {"realistic": "lines", "burst": "callers", "together": "steady sessions"}[traffic]
    log(f"{label}: {lines} {who} from {k} driver processes"
        + (f", {cfg.probe_sessions} probe slot(s)" if traffic == "together" else ""))
    err_path = work / f"driver-{label}.log"
    with open(err_path, "w") as err:
        driver = await asyncio.create_subprocess_exec(sys.executable, "-m", "tools.load_driver", *argv, "--procs",
                                                      str(k), "--no-progress", "--plot", cwd=REPO_ROOT, stdout=err,
                                                      stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
    stop = asyncio.Event()
    snaps: list[tuple[float, dict]] = []
    scraper = asyncio.create_task(scrape_loop(procs, gateway, snaps, stop))
    cycles: list[dict] = []
    probes: list[asyncio.Task] = []
    length_s = run_length_s(cfg, n, traffic)
    limit_s = length_s + cfg.served_within_s + cfg.open_timeout_s + 120
    try:
        if traffic == "together":
            probes = await start_probes(cfg, gateway, lines, stop, cycles)
        t0 = time.monotonic()
        before = await asyncio.to_thread(scrape, procs)
        pids = {**{s: p.proc.pid for s, p in procs.items()}, **gateway_pids(gateway)}
        cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
        next_note = t0 + cfg.progress_every_s
        profiling = profile_gateway(cfg, pids, label, length_s / 3)
        while driver.returncode is None:
            try:
                await asyncio.wait_for(driver.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
            if time.monotonic() >= next_note:
                next_note += cfg.progress_every_s
                log(f"{label}: {time.monotonic() - t0:5.0f} s" + (f", probe cycles {len(cycles)}" if probes else ""))
            if time.monotonic() - t0 > limit_s:
                driver.kill()
                raise RuntimeError("the load driver did not finish in time")
        elapsed = time.monotonic() - t0
        cpu1 = {name: cpu_seconds(pid) for name, pid in pids.items()}
        await asyncio.gather(*profiling, return_exceptions=True)
        after = await asyncio.to_thread(scrape, procs)
    finally:
        stop.set()
        await asyncio.gather(scraper, *probes, return_exceptions=True)
        if driver.returncode is None:
            driver.kill()
            await driver.wait()
    result_path = out_dir / "load-result.json"
    if not result_path.is_file():
        raise RuntimeError(f"the driver wrote no result (exit {driver.returncode}):\n{err_path.read_text()[-3000:]}")
    result = json.loads(result_path.read_text())
    start, window = result["stream_start_s"], result["window"]
    if traffic == "together":  # as the runs before: from the steady sessions live to the driver's end
        talker = talker_block(before["talker"], after["talker"])
    else:
        talker = talker_block(*[s["talker"] for s in bounding(snaps, window["start_s"], window["end_s"])])
    stages = {s: stage_block(before[s], after[s], s) for s in STAGES}
    ticks = talker["tick_ms"]["count"]
    for block in stages.values():  # how often each stage's GPU work runs beside the talker's
        block["steps_per_tick"] = round(block["step_ms"]["count"] / ticks, 2) if ticks else None
    messages = {s: {d: round(v / elapsed, 1)
                    for d, v in counter_by_label(before[s], after[s], "duplex_stage_link_messages",
                                                 "direction", stage=s).items()}
                for s in STAGES}
    drv = driver_summary(result)
    calls = result["calls"]
    probes_ = probe_report(cycles) if traffic == "together" else None
    answered = [s for _, s in snaps if s["talker"] is not None and s["gateway"] is not None]
    if (out_dir / "load-timeline.png").is_file():
        shutil.copy(out_dir / "load-timeline.png", Path(cfg.out) / f"frontdoor-{label}-timeline.png")
    row = {"sessions": n, "traffic": traffic, "traffic_note": TRAFFIC_NOTES[traffic], "open": cfg.open,
           "steady_sessions": lines if traffic != "burst" else n,
           "burst_callers": lines if traffic == "burst" else None,
           "probe_slots": cfg.probe_sessions if traffic == "together" else 0,
           "gateway_workers": len([k for k in pids if k.startswith("gateway")]),
           "driver_procs": drv.get("driver_procs", k), "full_context": cfg.full_context,
           "ticks_within_80ms_pct": None if talker["tick_share_le_80ms"] is None
                                    else round(100 * talker["tick_share_le_80ms"], 2),
           "e2e_ms": drv.get("frame_latency_ms"),
           "first_audio_ms": probes_["first_audio_ms"] if probes_ else calls["first_audio_ms"],
           "first_audio_after_connect_ms": None if probes_ else calls["first_audio_after_connect_ms"],
           "session_latency_p50_ms": window["session_latency_p50_ms"],
           "sessions_behind": talker["sessions_behind"],
           **(opens_and_prompts(answered[0], answered[-1]) if len(answered) >= 2 else {}),
           "callers": calls, "kills": calls["status"]["killed"], "server_errors": calls["server_error_events"],
           "window": {"start_s": round(window["start_s"] - start, 2), "length_s": window["length_s"]},
           "traffic_plan": result["traffic"],
           "driver": drv, "probes": probes_,
           "cpu_cores": cores_used(cpu0, cpu1, elapsed), "link_messages_per_s": messages, "talker": talker,
           "stages": stages, "timeline": stage_timeline([(t - start, s) for t, s in snaps]),
           "elapsed_s": round(elapsed, 1), "driver_exit": driver.returncode}
    row["checks"] = checks(row, cfg)
    row["passed"] = all(row["checks"].values())
    return row


# ---- main -----------------------------------------------------------------------------------------

def no_paths(text: str) -> str:
    """An error for the committed results: the machine's checkout path becomes <repo>."""
    return text.replace(str(REPO_ROOT), "<repo>")


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    if cfg.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {cfg.repeats}")
    deadline = time.monotonic() + cfg.time_budget_s
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    local_only_network()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(cfg.work_dir or tempfile.mkdtemp(prefix="frontdoor-"))
    work.mkdir(parents=True, exist_ok=True)
    conf = {k: ("<" + k + ">" if k in ("checkpoint", "out", "work_dir") and v and os.path.isabs(v) else v)
            for k, v in asdict(cfg).items()}
    result: dict = {"bench": "frontdoor", "mode": "smoke (cpu, tiny)" if cfg.smoke else f"{cfg.preset} on {cfg.device}",
                    "headline_traffic": cfg.traffics[0],
                    "traffic_notes": {t: TRAFFIC_NOTES[t] for t in cfg.traffics}, "config": conf,
                    "host": {"cpu_cores": os.cpu_count(), "gpu": gpu_state()}, "runs": []}

    def write() -> None:
        by_traffic = {t: max([r["sessions"] for r in result["runs"] if r.get("passed") and r.get("traffic") == t],
                             default=None) for t in cfg.traffics}
        result["largest_passing_sessions"] = by_traffic[cfg.traffics[0]]
        result["largest_passing_by_traffic"] = by_traffic
        (out / "frontdoor.json").write_text(json.dumps(result, indent=2))

    mps = Mps() if cfg.mps else None
    procs: dict = {}
    gateway: GatewayProcess | None = None
    t_start = time.monotonic()
    try:
        checkpoint = Path(cfg.checkpoint) if cfg.checkpoint else build_checkpoint(cfg, work)
        if mps is not None:
            mps.start()
            problem = mps.probe()
            if problem is not None:
                raise SystemExit(f"mps: {problem}")
        sweep = cfg.sweep
        for slots in sorted(sweep, reverse=True):  # the largest N that starts (its KV may not fit)
            log(f"services: encoder, talker, decoder with {slots} slots on {cfg.device}")
            try:
                procs, info = start_services(cfg, checkpoint, slots)
                break
            except ServiceStartError as e:
                log(f"services: did not start with {slots} slots: {str(e)[-1500:]}")
                result["runs"].append({"sessions": slots, "passed": False,
                                       "failed": f"services did not start: {no_paths(str(e))[-1500:]}"})
                write()
        else:
            return 3
        sweep = [n for n in sweep if n <= slots]
        info["args"] = {s: a.replace(str(checkpoint), "<checkpoint>") for s, a in info["args"].items()}
        result["services"] = info
        spec = ",".join(procs[s].address for s in STAGES)
        args = (["--workers", cfg.gateway_workers] if cfg.gateway_workers else []) + cfg.gateway_args.split()
        gateway = GatewayProcess(spec, port=free_port(), args=args).start(timeout=60)
        log(f"gateway: {gateway.http_url} ({' '.join(args) or 'default flags'}), pids {gateway_pids(gateway)}")
        result["setup_s"] = round(time.monotonic() - t_start, 1)
        write()
        for n, traffic, repeat in [(n, t, r) for n in sweep for t in cfg.traffics for r in range(1, cfg.repeats + 1)]:
            label = f"n{n}-{traffic}" + ("" if cfg.repeats == 1 else f"-r{repeat}")
            if deadline - time.monotonic() < run_length_s(cfg, n, traffic) + 60:
                result["runs"].append({"sessions": n, "traffic": traffic, "passed": False,
                                       "failed": "skipped: time budget"})
                write()
                continue
            try:
                run = asyncio.run(run_one(cfg, procs, gateway, n, traffic, work, label))
            except Exception as e:  # one run's failure is a row of the report
                run = {"sessions": n, "traffic": traffic, "passed": False,
                       "failed": no_paths(f"{type(e).__name__}: {e}")[-3000:]}
            run["run"] = label
            verdict = "PASS" if run.get("passed") else "FAIL"
            log(f"{label}: {verdict} {json.dumps(run.get('checks', run.get('failed')))}")
            result["runs"].append(run)
            write()
    finally:
        if gateway is not None:
            (out / "frontdoor-gateway.log").write_text(gateway.log_tail(400_000))
            gateway.stop()
        if procs:
            for s, p in procs.items():
                (out / f"frontdoor-{s}.log").write_text(p.stderr_tail(200_000))
            stop_services(procs)
        if mps is not None:
            mps.stop()
        if not cfg.work_dir and not cfg.keep_checkpoint:
            shutil.rmtree(work, ignore_errors=True)
        result["wall_s"] = round(time.monotonic() - t_start, 1)
        write()
    print_table(result)
    png = plot(result, out / "frontdoor.png")
    log(f"wrote {out / 'frontdoor.json'}" + (f" and {png}" if png else ""))
    return 0 if result["largest_passing_sessions"] is not None else 3


if __name__ == "__main__":
    sys.exit(main())
