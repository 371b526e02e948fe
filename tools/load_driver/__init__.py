"""Paced multi-session load driver and lifecycle checker for Realtime duplex servers.

    python -m tools.load_driver --url ws://HOST:PORT/v1/realtime?duplex=1            # lifecycle
    python -m tools.load_driver --url ... --sessions 2 --load-frames 1000 --drain-s 2 \\
        --server-revision REV --server-hardware H200 --output-dir runs/n2 --plot       # load
    python -m tools.load_driver --url ... --sessions 160 --procs 8 --output-dir runs/n160 --plot
    python -m tools.load_driver --url ... --sessions 160 --procs 8 --traffic arrivals --open sdk \\
        --arrival-rate 2 --hold-s 60 --call-mean-s 80 --call-min-s 10 --output-dir runs/a160   # real traffic
    python -m tools.load_driver --url ... --sessions 160 --procs 8 --traffic burst --burst-window-s 2 \\
        --open sdk --output-dir runs/b160                                                    # a failover

Load mode: `--procs K` (default 1; `auto` = one process per 20 sessions, at most one per CPU) runs the
sessions in K driver processes on this host, session g in process g % K, all on one shared input start
with session g of N sending g/N of a period later; their rows merge into one result as if one driver
ran them. `--traffic` (traffic.py): `together` (the default: everyone admitted, then one shared start),
`arrivals` (callers dial over time, stream once their own open is done, calls end and lines dial again)
or `burst` (N callers within a few seconds); `--open autostart0|sdk` says how a session opens. In
`arrivals` and `burst` a caller refused with a typed retry-later retries after the server's delay
(refusal.py, calls.py) and a row is one caller. Bounds: `--max-underrun-s` (0.5),
`--max-frame-latency-p99-ms` (400: ITU-T G.114's limit for interactive speech; the H200 target is 250).

Exit status: 0 PASS, 1 FAIL (a session failed or a server bound was missed), 3 INVALID (the client
itself fell behind: own send lateness p99 > 40 ms or client real-time factor > 1.02 in a driver
process or merged, or a driver process died; rerun with more --procs), 2 bad options or an existing
result file, 130 interrupted. See verdict.py for the rules and metrics.py for each definition.

load-result.json (schema_version 3: 2 plus traffic, calls, window and the rows' traffic fields), the
fields a benchmark reads:
    verdict ("PASS" | "FAIL" | "INVALID"), passed (verdict == PASS; `ok` is the same), reasons [str],
    driver_procs, driver_processes [{index, pid, sessions [g], exit_code, error}],
    summary {sessions, admitted, passed_sessions, passed, verdict, driver_procs,
             frame_latency_ms {count, p50, p90, p99, max}   (input frame i send -> output frame i received,
                                                              pooled over every frame of every session),
             first_audio_ms {count, p50, p90, p99, max}     (over sessions),
             frame_deficit {max, total, missing_frames_pct}, underrun_s {count, p50, p90, p99, max},
             client_own_send_lateness_p99_ms, client_send_rtf, send_schedule_rtf},
             (frame_latency_ms in the arrivals traffic: the frames sent in the steady window)
    traffic {pattern, open, seed, ramp_end_s, end_s, ...its flags}, calls {...}, window {...}
             (traffic_stats.py),
    client {merged, per_process [{index, ...}]}: {sessions, frames_sent, own_send_lateness_ms,
             send_blocked_ms, client_send_rtf, send_schedule_rtf},
    bounds {max_underrun_s, max_frame_latency_p99_ms, client_own_send_lateness_p99_ms, client_send_rtf},
    sessions [per-session row: index, driver_proc, ok, status (passed | failed | killed | refused), error,
             killed_by, line, call, tries, refusals [{type, after_created, retry_after_s, at_s}],
             frame_latency_ms, audio_underrun_s, frame_deficit, client_first_audio_after_stream_start_ms,
             client_first_audio_after_connect_ms, time_to_served_ms, client_own_send_lateness_ms,
             client_send_rtf, input_timeline, audio_packet_timeline, ...].

Modules: config (options), input_audio (WAV / synthetic input, append events), session (one raw
WebSocket), validate (audio packets and session acceptance), metrics (definitions), traffic (who dials
when, call lengths, send phases), refusal (typed retry-later), load (the together traffic, a call's
state and row), calls (the arrivals and burst traffic), procs (the same over K processes), verdict
(PASS / FAIL / INVALID), traffic_stats (callers, refusals, the steady window), lifecycle (admission
and slot reuse), report (progress, table, JSON, plot).
"""

from .calls import run_traffic
from .config import DriverConfig
from .lifecycle import run_lifecycle
from .load import run_load

__all__ = ["DriverConfig", "run_load", "run_lifecycle", "run_traffic"]
