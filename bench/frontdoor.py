"""The front door on one GPU: the stack as deployed, N Realtime sessions over WebSocket through the gateway.

    python -m bench.frontdoor --mps --full-context --sessions 96,128,160,168 --duration-s 60
    python -m bench.frontdoor --smoke            # tiny checkpoint on the CPU, 3 sessions, a few seconds

What runs, each a real process:
1. the cell: encoder, talker, decoder with the GPU deployment's flags (bench/cell.py
   `service_args`: fp8 KV and weights, CUDA graphs, compiled kernels, the voice preloaded), under a
   private CUDA MPS daemon with --mps; slots = the largest N;
2. the gateway (`python -m services.gateway`, as tools/run_stack starts it) with --gateway-workers
   worker processes on one port, linked to the cell by one Link stream per worker and stage;
3. per N: `python -m tools.load_driver --procs K` drives N - P steady sessions on the Realtime wire
   (JSON + base64 PCM, paced at 80 ms, every send phase spread over the period), while P probe
   sessions in this process hang up and call again every --probe-cycle-s: each one's time from
   connect to its first audio delta is first audio *under load*.
Per N it reports the talker's ticks within 80 ms, the client-measured frame latency (frame i sent ->
output i received), first audio, frame deficit and underrun (the driver's verdict: PASS, FAIL, or
INVALID when the client itself was too slow to measure), the CPU cores each gateway worker and stage
used, and the link messages per second each stage handled. Writes frontdoor.json (after every N) and
frontdoor.png under --out.

A run passes when the driver's verdict is PASS (every session passed; frame latency p99 within
--driver-args' bound, 250 ms by default), every probe cycle got audio with first audio p99 at most
--max-first-audio-p99-ms (400), at least --min-ticks-pct (99.5) of the talker's ticks ended within
80 ms, and the tick p99 was at most --max-tick-p99-ms (75; exact, since 75 ms is a bucket bound).
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
    BenchConfig, Mps, build_checkpoint, gpu_state, local_only_network, scrape, start_services, stop_services,
    wait_all_free,
)
from bench.cell import parse_args as cell_parse_args
from bench.cell_report import stage_block, talker_block
from bench.cell_stats import counter_by_label, ms_summary
from tools.load_driver.input_audio import input_signal
from tools.load_driver.session import RealtimeSession, realtime_url, session_update
from tools.procs import REPO_ROOT, ServiceStartError, die_with_parent, free_port
from tools.run_stack import GatewayProcess
from services.common.frame import FRAME_S as PERIOD_S, FRAME_SAMPLES as FRAME

STAGES = ("encoder", "talker", "decoder")
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass
class FrontdoorConfig(BenchConfig):
    """bench/cell.py's options for the cell, plus the front door's."""

    sessions: str = "96,128,160,168"
    duration_s: float = 60.0
    repeats: int = 1  # each N this many times in a row on the same stack (fresh sessions each time)
    probe_sessions: int = 2
    gateway_workers: str = "4"  # the gateway's --workers ("" leaves the flag out: the gateway's default)
    gateway_args: str = ""  # extra gateway flags
    driver_procs: int = 8  # load driver processes (tools.load_driver --procs)
    driver_args: str = "--max-frame-latency-p99-ms 250"  # extra load driver flags: the targets' latency bound
    drain_s: float = 3.0  # the driver's observation window after the last frame
    min_ticks_pct: float = 99.5
    max_first_audio_p99_ms: float = 400.0
    max_tick_p99_ms: float = 75.0
    profile_s: float = 0.0  # > 0: py-spy records each gateway process this long, mid-run (raw stacks in --out)


SMOKE = dict(preset="tiny", device="cpu", sessions="3", duration_s=4.0, mps=False, probe_sessions=1, probe_cycle_s=1.5,
             driver_procs=2, gateway_workers="2", min_ticks_pct=0.0, max_first_audio_p99_ms=5000.0,
             max_tick_p99_ms=1e9,
             ready_timeout_s=120.0, open_timeout_s=60.0,
             progress_every_s=1.0, drain_s=2.0, out=os.path.join(tempfile.gettempdir(), "frontdoor-smoke"))


def parse_args(argv: list[str] | None) -> FrontdoorConfig:
    cfg = cell_parse_args(argv, FrontdoorConfig, SMOKE, "python -m bench.frontdoor", __doc__)
    if cfg.driver_procs < 1:
        raise SystemExit("--driver-procs must be >= 1")
    return cfg


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


def profile_gateway(cfg: FrontdoorConfig, pids: dict[str, int], n: int) -> list[asyncio.Task]:
    """With --profile-s: py-spy samples every gateway process from a third into the run."""
    exe = shutil.which("py-spy")
    if cfg.profile_s <= 0 or exe is None:
        return []

    async def one(name: str, pid: int) -> None:
        await asyncio.sleep(cfg.duration_s / 3)
        path = Path(cfg.out) / f"frontdoor-n{n}-{name}.pyspy.txt"
        proc = await asyncio.create_subprocess_exec(exe, "record", "-p", str(pid), "-d", str(cfg.profile_s),
                                                    "-r", "100", "-f", "raw", "-o", str(path), "--nonblocking",
                                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        await proc.wait()

    return [asyncio.create_task(one(name, pid)) for name, pid in pids.items() if name.startswith("gateway")]


# ---- probes: hang up and call again under load ------------------------------------------------------

async def probe_slot(url: str, cfg: FrontdoorConfig, pcm16_b64: list[str], stop: asyncio.Event,
                     cycles: list[dict]) -> None:
    """Open, talk for probe_cycle_s at 80 ms pacing, close; again until `stop`. Each cycle's record:
    open_ms (connect -> session.created), first_audio_ms (connect -> first audio delta), or its error."""
    frames = max(2, round(cfg.probe_cycle_s / PERIOD_S))
    update = session_update(model=None, voice=cfg.voice, persona=cfg.persona, input_format="pcm16")
    while not stop.is_set():
        rec: dict = {"at": time.monotonic()}
        s = RealtimeSession(realtime_url(url, None), cleanup_timeout_s=10.0)
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


# ---- one N ----------------------------------------------------------------------------------------

async def wait_sessions_live(gateway: GatewayProcess, n: int, timeout_s: float) -> None:
    """Until the gateway holds n live sessions (each one's prompt prefilled): the probes' opens then
    meet a loaded cell, not the queue of the steady sessions' prefills."""
    from bench.cell import LOCAL_HTTP
    from bench.cell_stats import parse_metrics

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            text = await asyncio.to_thread(
                lambda: LOCAL_HTTP.open(gateway.http_url + "/metrics", timeout=3).read().decode())
            live = sum(v for (name, _), v in parse_metrics(text).items() if name == "gateway_sessions_active")
            if live >= n:
                return
        except OSError:
            pass
        await asyncio.sleep(0.2)


def driver_summary(result: dict) -> dict:
    """What this report reads of the driver's merged load-result.json (tools/load_driver/__init__.py)."""
    summary = result.get("summary") or {}
    keys = ("sessions", "admitted", "passed_sessions", "driver_procs", "frame_latency_ms", "frame_deficit",
            "underrun_s", "client_own_send_lateness_p99_ms", "client_send_rtf")
    return {"verdict": result.get("verdict"), "reasons": (result.get("reasons") or [])[:10],
            **{k: summary.get(k) for k in keys}}


async def run_n(cfg: FrontdoorConfig, procs, gateway: GatewayProcess, n: int, work: Path, label: str) -> dict:
    """One run of n sessions; label names its files (n160, or n160-r2 for a repeat)."""
    await wait_all_free(procs, n, timeout_s=60)
    steady = n - cfg.probe_sessions
    frames = int(round(cfg.duration_s / PERIOD_S))
    out_dir = work / f"load-{label}"
    shutil.rmtree(out_dir, ignore_errors=True)  # a reused --work-dir's earlier run: the driver never overwrites
    cmd = [sys.executable, "-m", "tools.load_driver", "--url", gateway.ws_url, "--sessions", str(steady),
           "--load-frames", str(frames), "--drain-s", str(cfg.drain_s), "--voice", cfg.voice, "--persona", cfg.persona,
           "--output-dir", str(out_dir), "--procs", str(min(cfg.driver_procs, steady)), "--no-progress", "--plot",
           *cfg.driver_args.split()]
    log(f"N={n}: {steady} steady sessions from {min(cfg.driver_procs, steady)} driver processes, "
        f"{cfg.probe_sessions} probe slot(s)")
    err_path = work / f"driver-{label}.log"
    with open(err_path, "w") as err:
        driver = await asyncio.create_subprocess_exec(*cmd, cwd=REPO_ROOT, stdout=err, stderr=subprocess.STDOUT,
                                                      preexec_fn=die_with_parent)
    stop = asyncio.Event()
    cycles: list[dict] = []
    probes: list[asyncio.Task] = []
    try:
        await wait_sessions_live(gateway, steady, cfg.open_timeout_s)
        pcm, _ = input_signal(None, 200, seed=1)
        pcm16 = [base64.b64encode((np.clip(pcm[i:i + FRAME], -1, 1) * 32767).astype("<i2").tobytes()).decode()
                 for i in range(0, len(pcm) - FRAME + 1, FRAME)]
        probes = [asyncio.create_task(probe_slot(gateway.ws_url, cfg, pcm16, stop, cycles))
                  for _ in range(cfg.probe_sessions)]
        t0 = time.monotonic()
        before = await asyncio.to_thread(scrape, procs)
        pids = {**{s: p.proc.pid for s, p in procs.items()}, **gateway_pids(gateway)}
        cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
        next_note = t0 + cfg.progress_every_s
        profiling = profile_gateway(cfg, pids, n)
        while driver.returncode is None:
            try:
                await asyncio.wait_for(driver.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
            if time.monotonic() >= next_note:
                next_note += cfg.progress_every_s
                log(f"N={n}: {time.monotonic() - t0:5.0f} s, probe cycles {len(cycles)}")
            if time.monotonic() - t0 > cfg.duration_s + cfg.open_timeout_s + 120:
                driver.kill()
                raise RuntimeError("the load driver did not finish in time")
        elapsed = time.monotonic() - t0
        cpu1 = {name: cpu_seconds(pid) for name, pid in pids.items()}
        await asyncio.gather(*profiling, return_exceptions=True)
        after = await asyncio.to_thread(scrape, procs)
    finally:
        stop.set()
        await asyncio.gather(*probes, return_exceptions=True)
        if driver.returncode is None:
            driver.kill()
            await driver.wait()
    result_path = out_dir / "load-result.json"
    if not result_path.is_file():
        raise RuntimeError(f"the driver wrote no result (exit {driver.returncode}):\n{err_path.read_text()[-3000:]}")
    result = json.loads(result_path.read_text())
    talker = talker_block(before["talker"], after["talker"])
    stages = {s: stage_block(before[s], after[s], s) for s in STAGES}
    ticks = talker["tick_ms"]["count"]
    for block in stages.values():  # how often each stage's GPU work runs beside the talker's
        block["steps_per_tick"] = round(block["step_ms"]["count"] / ticks, 2) if ticks else None
    messages = {s: {d: round(v / elapsed, 1)
                    for d, v in counter_by_label(before[s], after[s], "duplex_stage_link_messages",
                                                 "direction", stage=s).items()}
                for s in STAGES}
    probes_ = probe_report(cycles)
    drv = driver_summary(result)
    ticks_pct = None if talker["tick_share_le_80ms"] is None else round(100 * talker["tick_share_le_80ms"], 2)
    checks = {"driver_pass": drv.get("verdict") == "PASS",
              "probes_got_audio": (probes_["cycles"] > 0 and probes_["with_audio"] == probes_["opened"]
                                   and not probes_["errors"]),
              "ticks_within_80ms": ticks_pct is not None and ticks_pct >= cfg.min_ticks_pct,
              "tick_p99": (talker["tick_ms"].get("p99") or float("inf")) <= cfg.max_tick_p99_ms,
              "first_audio": (probes_["first_audio_ms"] or {}).get("p99", float("inf")) <= cfg.max_first_audio_p99_ms}
    if (out_dir / "load-timeline.png").is_file():
        shutil.copy(out_dir / "load-timeline.png", Path(cfg.out) / f"frontdoor-{label}-timeline.png")
    return {"sessions": n, "passed": all(checks.values()), "checks": checks, "steady_sessions": steady,
            "probe_slots": cfg.probe_sessions, "gateway_workers": len([k for k in pids if k.startswith("gateway")]),
            "driver_procs": drv.get("driver_procs", min(cfg.driver_procs, steady)), "full_context": cfg.full_context,
            "ticks_within_80ms_pct": ticks_pct, "e2e_ms": drv.get("frame_latency_ms"),
            "first_audio_ms": probes_["first_audio_ms"], "driver": drv, "probes": probes_,
            "cpu_cores": cores_used(cpu0, cpu1, elapsed), "link_messages_per_s": messages, "talker": talker,
            "stages": stages, "elapsed_s": round(elapsed, 1), "driver_exit": driver.returncode}


# ---- report ---------------------------------------------------------------------------------------

def _q(d: dict | None, k: str):
    return "-" if not d or d.get(k) is None else f"{d[k]:.0f}"


def print_table(result: dict) -> None:
    print(f"\nfront door: {result['mode']}, gateway workers {result['config']['gateway_workers'] or 'default'}")
    print(f"{'N':>4} {'pass':>5} {'ticks<=80':>9} {'e2e p50/p99':>12} {'1st audio p50/p99':>18} {'verdict':>8} "
          f"{'gw cores':>9} {'msgs/s enc/talk/dec (in+out)':>30}")
    for r in result["runs"]:
        if "failed" in r:
            print(f"{r['sessions']:>4} {'FAIL':>5}  {r['failed'][:100]}")
            continue
        gw = sum(v for k, v in r["cpu_cores"].items() if k.startswith("gateway"))
        msgs = "/".join(f"{sum(r['link_messages_per_s'][s].values()):.0f}" for s in STAGES)
        print(f"{r['sessions']:>4} {'yes' if r['passed'] else 'no':>5} {r['ticks_within_80ms_pct'] or '-':>8}% "
              f"{_q(r['e2e_ms'], 'p50') + '/' + _q(r['e2e_ms'], 'p99'):>12} "
              f"{_q(r['first_audio_ms'], 'p50') + '/' + _q(r['first_audio_ms'], 'p99'):>18} "
              f"{str(r['driver'].get('verdict')):>8} {gw:>9.2f} {msgs:>30}")


def no_paths(text: str) -> str:
    """An error for the committed results: the machine's checkout path becomes <repo>."""
    return text.replace(str(REPO_ROOT), "<repo>")


def plot(result: dict, path: Path) -> Path | None:
    runs = [r for r in result["runs"] if "failed" not in r]
    if not runs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [r["sessions"] for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    for key, label in (("e2e_ms", "frame latency"), ("first_audio_ms", "first audio (probes)")):
        for q, style in (("p50", "-o"), ("p99", "--o")):
            ys = [(r[key] or {}).get(q) for r in runs]
            ax.plot(ns, [y if y is not None else np.nan for y in ys], style, label=f"{label} {q}")
    for y, c in ((150, "grey"), (250, "grey"), (400, "tab:red")):
        ax.axhline(y, color=c, lw=0.8, ls=":")
    ax.set(xlabel="sessions", ylabel="ms", title="client-measured latency")
    ax.legend(fontsize=7)
    ax = axes[1]
    ax.plot(ns, [r["ticks_within_80ms_pct"] or np.nan for r in runs], "-o")
    ax.axhline(99.5, color="tab:red", lw=0.8, ls=":")
    ax.set(xlabel="sessions", ylabel="% of talker ticks <= 80 ms", title="talker ticks on time")
    ax = axes[2]
    names = sorted({k for r in runs for k in r["cpu_cores"]})
    for name in names:
        ax.plot(ns, [r["cpu_cores"].get(name, np.nan) for r in runs], "-o", label=name)
    ax.set(xlabel="sessions", ylabel="CPU cores", title="CPU per process")
    ax.legend(fontsize=7)
    fig.suptitle(f"PersonaPlex through the real gateway: {result['mode']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- main -----------------------------------------------------------------------------------------

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
                    "config": conf, "host": {"cpu_cores": os.cpu_count(), "gpu": gpu_state()}, "runs": []}

    def write() -> None:
        passing = [r["sessions"] for r in result["runs"] if r.get("passed")]
        result["largest_passing_sessions"] = max(passing) if passing else None
        (out / "frontdoor.json").write_text(json.dumps(result, indent=2))

    mps = Mps() if cfg.mps else None
    procs: dict = {}
    gateway: GatewayProcess | None = None
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
        write()
        for n, repeat in [(n, r) for n in sweep for r in range(1, cfg.repeats + 1)]:
            label = f"n{n}" if cfg.repeats == 1 else f"n{n}-r{repeat}"
            if deadline - time.monotonic() < cfg.duration_s + 60:
                result["runs"].append({"sessions": n, "passed": False, "failed": "skipped: time budget"})
                write()
                continue
            try:
                run = asyncio.run(run_n(cfg, procs, gateway, n, work, label))
            except Exception as e:  # one N's failure is a row of the report
                run = {"sessions": n, "passed": False, "failed": no_paths(f"{type(e).__name__}: {e}")[-3000:]}
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
        write()
    print_table(result)
    png = plot(result, out / "frontdoor.png")
    log(f"wrote {out / 'frontdoor.json'}" + (f" and {png}" if png else ""))
    return 0 if result["largest_passing_sessions"] is not None else 3


if __name__ == "__main__":
    sys.exit(main())
