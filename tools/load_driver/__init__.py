"""Paced multi-session load driver and lifecycle checker for Realtime duplex servers.

    python -m tools.load_driver --url ws://HOST:PORT/v1/realtime?duplex=1            # lifecycle
    python -m tools.load_driver --url ... --sessions 2 --load-frames 1000 --drain-s 2 \\
        --server-revision REV --server-hardware H200 --output-dir runs/n2 --plot       # load
    python -m tools.load_driver --url ... --sessions 160 --procs 8 --output-dir runs/n160 --plot

Load mode: `--procs K` (default 1; `auto` = one process per 20 sessions, at most one per CPU) runs the
sessions in K driver processes on this host, session g in process g % K, all on one shared input start
with session g of N sending g/N of a period later; their rows merge into one result as if one driver
ran them. Bounds: `--max-underrun-s` (0.5), `--max-frame-latency-p99-ms` (400: ITU-T G.114's limit
for interactive speech; the H200 target is 250).

Exit status: 0 PASS, 1 FAIL (a session failed or a server bound was missed), 3 INVALID (the client
itself fell behind: own send lateness p99 > 40 ms or client real-time factor > 1.02 in a driver
process or merged, or a driver process died; rerun with more --procs), 2 bad options or an existing
result file, 130 interrupted. See verdict.py for the rules and metrics.py for each definition.

load-result.json (schema_version 2), the fields a benchmark reads:
    verdict ("PASS" | "FAIL" | "INVALID"), passed (verdict == PASS; `ok` is the same), reasons [str],
    driver_procs, driver_processes [{index, pid, sessions [g], exit_code, error}],
    summary {sessions, admitted, passed_sessions, passed, verdict, driver_procs,
             frame_latency_ms {count, p50, p90, p99, max}   (input frame i send -> output frame i received,
                                                              pooled over every frame of every session),
             first_audio_ms {count, p50, p90, p99, max}     (over sessions),
             frame_deficit {max, total, missing_frames_pct}, underrun_s {count, p50, p90, p99, max},
             client_own_send_lateness_p99_ms, client_send_rtf, send_schedule_rtf},
    client {merged, per_process [{index, ...}]}: {sessions, frames_sent, own_send_lateness_ms,
             send_blocked_ms, client_send_rtf, send_schedule_rtf},
    bounds {max_underrun_s, max_frame_latency_p99_ms, client_own_send_lateness_p99_ms, client_send_rtf},
    sessions [per-session row: index, driver_proc, ok, error, frame_latency_ms, audio_underrun_s,
             frame_deficit, client_first_audio_after_stream_start_ms, client_own_send_lateness_ms,
             client_send_rtf, input_timeline, audio_packet_timeline, ...].

Modules: config (options), input_audio (WAV / synthetic input, append events), session (one raw
WebSocket), validate (audio packets and session acceptance), metrics (definitions), load (paced
N-session mode), procs (the same over K processes), verdict (PASS / FAIL / INVALID), lifecycle
(admission and slot reuse), report (progress, table, JSON, plot).
"""

from .config import DriverConfig
from .lifecycle import run_lifecycle
from .load import run_load

__all__ = ["DriverConfig", "run_load", "run_lifecycle"]
