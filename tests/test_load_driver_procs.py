"""`--procs K` and the PASS / FAIL / INVALID verdict, against the controlled Realtime servers of
test_load_driver (real `websockets` servers on 127.0.0.1; the driver processes are real processes).

Merged numbers are recomputed here from the raw per-frame timelines, independently of the driver.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.test_load_driver import Behavior, eventually, fake_server, load_args, run_driver, run_traffic_driver
from tools.load_driver.__main__ import parse_args
from tools.load_driver.config import FRAME_PERIOD_S, FRAME_SAMPLES
from tools.load_driver.metrics import frame_latencies_ms, own_lateness_s, send_rtfs
from tools.load_driver.report import timeline_bands
from tools.load_driver.traffic import make_plan

REPO = Path(__file__).resolve().parents[1]


def drive(server, tmp_path: Path, *extra: str, sessions: int, frames: int = 8, throttled: bool = False):
    return run_driver(server, tmp_path, *extra, rerun_invalid=not throttled, sessions=sessions, frames=frames)


def pooled_frame_latencies_ms(rows: list[dict]) -> list[float]:
    """Input frame i's send start -> arrival of the packet that completes output frame i, every session."""
    latencies = []
    for row in rows:
        starts = [s["send_started_at_s"] for s in row["input_timeline"]]
        packets = row["audio_packet_timeline"]
        received = np.cumsum([p["samples"] for p in packets])
        frames = min(len(starts), int(received[-1]) // FRAME_SAMPLES if len(received) else 0)
        for i in range(frames):
            arrival = packets[int(np.searchsorted(received, (i + 1) * FRAME_SAMPLES))]["received_at_s"]
            latencies.append((arrival - starts[i]) * 1000)
    return latencies


def pooled_own_lateness_ms(rows: list[dict]) -> list[float]:
    """Send start - the later of its (re-anchored) target and the previous send's completion."""
    lateness = []
    for row in rows:
        previous_done = -math.inf
        for s in row["input_timeline"]:
            lateness.append(max(0.0, s["send_started_at_s"] - max(s["target_at_s"], previous_done)) * 1000)
            previous_done = s["send_completed_at_s"]
    return lateness


# -- merging ------------------------------------------------------------------------------------


def test_two_processes_merge_into_one_result(tmp_path, capsys):
    with fake_server(Behavior(capacity=8)) as server:
        code, result = drive(server, tmp_path, "--procs", "2", "--plot", sessions=5)
        assert server.connections % 5 == 0 and eventually(lambda: server.live == 0)  # % 5: a rerun, see drive
    rows = result["sessions"]
    assert code == 0 and result["verdict"] == "PASS" and result["passed"], result["reasons"]
    assert result["driver_procs"] == 2 and result["summary"]["driver_procs"] == 2
    assert result["requested_sessions"] == 5 and result["summary"]["sessions"] == 5
    assert result["passed_sessions"] == 5 and result["summary"]["passed_sessions"] == 5

    # Two real processes, each on its round-robin share, on one shared input start.
    procs = result["driver_processes"]
    assert [p["sessions"] for p in procs] == [[0, 2, 4], [1, 3]]
    assert [p["exit_code"] for p in procs] == [0, 0] and [p["error"] for p in procs] == [None, None]
    assert len({p["pid"] for p in procs} | {os.getpid()}) == 3
    assert [row["index"] for row in rows] == [0, 1, 2, 3, 4]
    assert [row["driver_proc"] for row in rows] == [0, 1, 0, 1, 0]
    for row in rows:
        assert row["ok"] and row["input_frames"] == 8 and row["output_frames"] == 7
        assert row["input_timeline"][0]["planned_at_s"] == pytest.approx(
            result["stream_start_s"] + row["index"] * FRAME_PERIOD_S / 5, abs=1e-9)
    assert len({row["session_id"] for row in rows}) == 5 and result["shared_response_ids"] == []

    # Percentiles over the pooled samples of both processes.
    summary, merged = result["summary"], result["client"]["merged"]
    latencies = pooled_frame_latencies_ms(rows)
    assert summary["frame_latency_ms"]["count"] == len(latencies) == 5 * 7
    for q in (50, 90, 99):
        assert summary["frame_latency_ms"][f"p{q}"] == pytest.approx(np.percentile(latencies, q))
    assert summary["frame_latency_ms"]["max"] == pytest.approx(max(latencies))
    first_audio = [row["client_first_audio_after_stream_start_ms"] for row in rows]
    assert summary["first_audio_ms"]["p99"] == pytest.approx(np.percentile(first_audio, 99))
    own = pooled_own_lateness_ms(rows)
    assert merged["frames_sent"] == len(own) == 40
    assert merged["own_send_lateness_ms"]["p99"] == pytest.approx(np.percentile(own, 99))
    assert summary["client_own_send_lateness_p99_ms"] == merged["own_send_lateness_ms"]["p99"]
    per_process = result["client"]["per_process"]
    assert [p["sessions"] for p in per_process] == [3, 2] and [p["frames_sent"] for p in per_process] == [24, 16]
    assert per_process[1]["own_send_lateness_ms"]["p99"] == pytest.approx(
        np.percentile(pooled_own_lateness_ms([r for r in rows if r["driver_proc"] == 1]), 99))
    # The real-time factor merges as total wall time over total audio (equal frames: the mean).
    assert merged["client_send_rtf"] == pytest.approx(np.mean([row["client_send_rtf"] for row in rows]))
    assert 1.0 <= merged["client_send_rtf"] < 1.02
    assert summary["frame_deficit"] == {"max": 1, "total": 5, "missing_frames_pct": pytest.approx(100 / 8)}
    assert (tmp_path / "run" / "load-timeline.png").stat().st_size > 1000
    assert "PASS: 5/5 sessions passed" in capsys.readouterr().out


def test_arrivals_over_two_processes_follow_one_plan(tmp_path):
    """Each driver process dials its own lines at the times of the one seeded plan, from one shared start;
    the steady window's numbers pool the frames of both."""
    with fake_server(Behavior(capacity=4)) as server:
        code, result = run_traffic_driver(
            server, tmp_path, "--procs", "2", "--sessions", "4", "--traffic", "arrivals", "--arrivals", "poisson",
            "--arrival-rate", "8", "--hold-s", "1.5", "--settle-s", "0.2", "--call-min-s", "0.5", "--open", "sdk")
    rows = result["sessions"]
    assert code == 0, [(r["status"], r["error"]) for r in rows]
    assert [p["sessions"] for p in result["driver_processes"]] == [[0, 2], [1, 3]]
    assert [r["driver_proc"] for r in rows] == [0, 1, 0, 1]
    config = parse_args(["--sessions", "4", "--traffic", "arrivals", "--arrivals", "poisson", "--arrival-rate", "8",
                         "--hold-s", "1.5", "--settle-s", "0.2", "--call-min-s", "0.5", "--traffic-seed", "3"])
    plan = make_plan(config)
    for row in rows:
        assert row["dialed_at_s"] == pytest.approx(result["stream_start_s"] + plan.first_dial_s[row["line"]])
    window = (result["stream_start_s"] + plan.window_s[0], result["stream_start_s"] + plan.window_s[1])
    assert (result["window"]["start_s"], result["window"]["end_s"]) == pytest.approx(window)
    in_window = [ms for row in rows for start, ms in zip([s["send_started_at_s"] for s in row["input_timeline"]],
                                                         pooled_frame_latencies_ms([row]))
                 if window[0] <= start <= window[1]]
    assert result["window"]["frame_latency_ms"]["count"] == len(in_window) > 0
    assert result["window"]["frame_latency_ms"]["p99"] == pytest.approx(np.percentile(in_window, 99))


def test_response_ids_shared_across_processes_fail_both(tmp_path):
    # One session per process: only the merge sees the duplicate.
    with fake_server(Behavior(fault="shared_rid")) as server:
        code, result = drive(server, tmp_path, "--procs", "2", sessions=2)
    assert code == 1 and result["verdict"] == "FAIL" and result["shared_response_ids"] == ["resp-shared"]
    assert [row["ok"] for row in result["sessions"]] == [False, False]
    assert all(row["error"].startswith("response id shared") for row in result["sessions"])


# -- the verdict --------------------------------------------------------------------------------


def test_a_throttled_driver_process_makes_the_run_invalid(tmp_path, monkeypatch):
    """Process 1 burns 60 ms of CPU after each send: its two sessions need 120 ms per 80 ms period."""
    monkeypatch.setenv("TEST_LOAD_DRIVER_BURN_MS", "60")
    monkeypatch.setenv("TEST_LOAD_DRIVER_BURN_PROC", "1")
    with fake_server(Behavior(capacity=8)) as server:
        code, result = drive(server, tmp_path, "--procs", "2", "--plot", sessions=4, throttled=True)
    assert code == 3 and result["verdict"] == "INVALID" and not result["passed"] and not result["ok"]
    slow, fast = result["client"]["per_process"][1], result["client"]["per_process"][0]
    assert slow["own_send_lateness_ms"]["p99"] > 40 and slow["client_send_rtf"] > 1.02
    assert fast["own_send_lateness_ms"]["p99"] < slow["own_send_lateness_ms"]["p99"]
    assert any(reason.startswith("client (driver process 1)") for reason in result["reasons"])
    assert result["summary"]["verdict"] == "INVALID"


def test_a_saturated_single_driver_is_invalid_not_pass(tmp_path, monkeypatch):
    # The server answers every frame correctly; only the client is slow (100 ms of CPU a send).
    monkeypatch.setenv("TEST_LOAD_DRIVER_BURN_MS", "100")
    with fake_server() as server:
        code, result = drive(server, tmp_path, "--max-underrun-s", "10", "--max-frame-latency-p99-ms", "10000",
                             sessions=1, throttled=True)
    assert code == 3 and result["verdict"] == "INVALID", result["reasons"]
    assert result["sessions"][0]["ok"] and result["client"]["merged"]["client_send_rtf"] > 1.02


@pytest.mark.parametrize(
    "bounds, code, reason",
    [(["--max-frame-latency-p99-ms", "5000"], 1, "underrun:"),
     (["--max-underrun-s", "5"], 1, "frame latency: p99"),
     (["--max-underrun-s", "5", "--max-frame-latency-p99-ms", "5000"], 0, None)],
)
def test_an_output_stall_fails_on_underrun_and_frame_latency(tmp_path, bounds, code, reason):
    """The server's output pauses 0.8 s before output frame 2 and then catches up: 0.8 s of underrun,
    frame latencies up to ~0.9 s, every frame still delivered."""
    with fake_server(Behavior(stall_s=0.8)) as server:
        exit_code, result = drive(server, tmp_path, "--drain-s", "1.5", *bounds, sessions=1, frames=10)
    row = result["sessions"][0]
    assert row["audio_underrun_s"] == pytest.approx(0.8, abs=0.15) and row["output_frames"] == 9
    assert exit_code == code and result["verdict"] == ("PASS" if code == 0 else "FAIL"), result["reasons"]
    if reason is not None:
        assert any(r.startswith(reason) for r in result["reasons"]), result["reasons"]
    assert (reason == "underrun:") == (not row["ok"])  # an underrun fails the session itself


# -- definitions --------------------------------------------------------------------------------


def test_client_lateness_excludes_time_blocked_on_the_server():
    """Frame 1's send blocks 150 ms (the server stopped reading), so frame 2 starts 70 ms after its
    target: the schedule slipped, but not by the client's doing. The same slip from a late wakeup is."""
    blocked = [(0.00, 0.00, 0.00, 0.001), (0.08, 0.08, 0.08, 0.23), (0.16, 0.16, 0.23, 0.231),
               (0.24, 0.31, 0.31, 0.311)]  # frame 3's target re-anchored by frame 2's 70 ms
    late_wakeup = [(0.00, 0.00, 0.00, 0.001), (0.08, 0.08, 0.08, 0.081), (0.16, 0.16, 0.23, 0.231),
                   (0.24, 0.31, 0.31, 0.311)]
    audio_s = 4 * FRAME_PERIOD_S
    assert own_lateness_s(blocked) == pytest.approx([0, 0, 0, 0])
    assert send_rtfs(blocked) == pytest.approx((1.0, (audio_s + 0.07) / audio_s))
    assert own_lateness_s(late_wakeup) == pytest.approx([0, 0, 0.07, 0])
    assert send_rtfs(late_wakeup) == pytest.approx(((audio_s + 0.07) / audio_s,) * 2)
    # A 15 ms late wakeup (under RESYNC_S) is absorbed by the schedule, unless it is the last frame's.
    jitter = [(0.00, 0.00, 0.00, 0.001), (0.08, 0.08, 0.095, 0.096), (0.16, 0.16, 0.175, 0.176)]
    assert send_rtfs(jitter) == pytest.approx(((3 * FRAME_PERIOD_S + 0.015) / (3 * FRAME_PERIOD_S),) * 2)
    assert send_rtfs([]) == (None, None)


def test_frame_latency_pairs_input_and_output_frames_by_index():
    # Packets of 1.5, 0.5 and 2 frames: output frame 0 completes with packet 0, frame 1 with packet 1,
    # frames 2 and 3 with packet 2; input frame 3 was never sent, so output frame 3 has no latency.
    latencies = frame_latencies_ms([0.0, 0.08, 0.16], [0.10, 0.25, 0.40],
                                   [3 * FRAME_SAMPLES // 2, FRAME_SAMPLES // 2, 2 * FRAME_SAMPLES])
    assert latencies == pytest.approx([100, 170, 240])
    assert frame_latencies_ms([0.0, 0.08], [], []) == []


# -- the plot -----------------------------------------------------------------------------------


def test_the_timeline_has_bands_not_a_legend_entry_per_session(tmp_path):
    with fake_server(Behavior(capacity=64)) as server:
        code, result = drive(server, tmp_path, "--procs", "2", "--plot", sessions=40, frames=6)
    assert code == 0, result["reasons"]
    assert (tmp_path / "run" / "load-timeline.png").stat().st_size > 1000
    bands = timeline_bands(result)
    bins = len(bands["t_s"])
    for panel in ("frame_latency_ms", "own_send_lateness_ms", "output_backlog_s"):
        stacked = np.array([bands[panel][k] for k in ("p50", "p90", "p99", "max")])
        assert stacked.shape == (4, bins)
        filled = ~np.isnan(stacked).any(axis=0)
        assert filled.sum() >= 2 and (np.diff(stacked[:, filled], axis=0) >= -1e-9).all()
    # At the end every session has received all but its last frame: a backlog of one frame each.
    assert bands["output_backlog_s"]["p50"][-1] == pytest.approx(FRAME_PERIOD_S)


def test_plot_legend_is_fixed_whatever_the_session_count(tmp_path):
    from tools.load_driver.report import plot_timeline

    with fake_server() as server:
        _, result = drive(server, tmp_path, sessions=2, frames=6)
    many = dict(result, sessions=result["sessions"] * 80)  # the same rows, 160 times over
    labels_two = plot_timeline(result, tmp_path / "two.png")
    labels_many = plot_timeline(many, tmp_path / "many.png")
    assert labels_two == labels_many and max(len(panel) for panel in labels_many) <= 5


# -- options and process lifecycle ------------------------------------------------------------------


def test_procs_options():
    assert parse_args(["--sessions", "4", "--procs", "2"]).resolved_procs() == 2
    auto = parse_args(["--sessions", "160", "--procs", "auto"]).resolved_procs()
    assert auto == min(8, os.cpu_count())
    assert parse_args(["--sessions", "3", "--procs", "auto"]).resolved_procs() == 1
    for bad in (["--sessions", "2", "--procs", "3"], ["--procs", "2"], ["--sessions", "2", "--procs", "x"],
                ["--sessions", "2", "--procs", "0"]):
        with pytest.raises(SystemExit):
            parse_args([*bad, "--no-progress"])


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _start_parent(server, tmp_path: Path, frames: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "tools.load_driver", "--procs", "2",
                             *load_args(server, tmp_path / "run", sessions=2, frames=frames)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert eventually(lambda: len(server.appends) == 2 and min(server.appends) >= 2, timeout_s=20)
    return proc


def test_a_killed_driver_process_fails_its_sessions_and_invalidates_the_run(tmp_path):
    with fake_server() as server:
        parent = _start_parent(server, tmp_path, frames=30)
        try:
            victim = _children(parent.pid)[0]
            os.kill(victim, signal.SIGKILL)
            out, err = parent.communicate(timeout=30)
        finally:
            if parent.poll() is None:
                parent.kill()
        assert eventually(lambda: server.live == 0)
    result = json.loads((tmp_path / "run" / "load-result.json").read_text())
    assert parent.returncode == 3 and result["verdict"] == "INVALID", (out, err)
    killed = next(p for p in result["driver_processes"] if p["pid"] == victim)
    assert killed["exit_code"] == -signal.SIGKILL and "exited with code" in killed["error"]
    lost = result["sessions"][killed["index"]]
    assert not lost["ok"] and lost["error"].startswith(f"driver process {killed['index']}")
    survivor = result["sessions"][1 - killed["index"]]
    assert survivor["ok"] and survivor["input_frames"] == 30


def test_children_stop_when_the_parent_dies(tmp_path):
    with fake_server() as server:
        parent = _start_parent(server, tmp_path, frames=500)  # 40 s of input
        children = _children(parent.pid)
        assert len(children) == 2
        parent.kill()
        parent.wait(10)
        # Each child sees its stdin close, cancels its sessions and closes their sockets.
        assert eventually(lambda: server.live == 0, timeout_s=10)
        assert eventually(lambda: all(_gone(pid) for pid in children), timeout_s=10)
        assert max(server.appends) < 200
