"""bench/pipeline.py: its numbers on hand-made data, and the whole script on the CPU (--smoke).

The smoke run is the real thing at toy size: three service processes on the tiny checkpoint,
a load process driving two gateway Pipelines over real gRPC sockets, Prometheus scraped over HTTP.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from bench.pipeline import main as pipeline_main
from bench.pipeline_stats import (
    SessionRecord,
    backlog_series,
    backlog_trend,
    bucket_quantile,
    counter_delta,
    fraction_le,
    histogram_delta,
    output_rate_windows,
    parse_metrics,
)
from tools.procs import REPO_ROOT

# ---- bucket quantiles from real prometheus_client expositions -----------------------------------


def _snapshots():
    reg = CollectorRegistry()
    h = Histogram("duplex_stage_step_seconds", "step", ["stage"], buckets=(0.01, 0.08, 0.1), registry=reg)
    other = h.labels("decoder")
    for _ in range(5):  # before the interval: must not count
        h.labels("talker").observe(0.2)
    other.observe(0.5)
    before = parse_metrics(generate_latest(reg).decode())
    for _ in range(98):
        h.labels("talker").observe(0.005)
    h.labels("talker").observe(0.05)
    h.labels("talker").observe(0.09)
    other.observe(0.5)
    after = parse_metrics(generate_latest(reg).decode())
    return before, after


def test_bucket_quantiles_use_only_the_interval_and_the_right_stage():
    before, after = _snapshots()
    h = histogram_delta(before, after, "duplex_stage_step_seconds", stage="talker")
    assert h.count == 100
    assert h.sum == pytest.approx(98 * 0.005 + 0.05 + 0.09)
    # rank 50 of 98 in [0, 10 ms]; rank 99 is the single observation in (10, 80] ms: its top.
    assert bucket_quantile(h, 0.5) == pytest.approx(0.01 * 50 / 98)
    assert bucket_quantile(h, 0.99) == pytest.approx(0.08)
    assert bucket_quantile(h, 1.0) == pytest.approx(0.1)
    assert fraction_le(h, 0.08) == pytest.approx(0.99)
    with pytest.raises(ValueError, match="not a bucket bound"):
        fraction_le(h, 0.05)
    dec = histogram_delta(before, after, "duplex_stage_step_seconds", stage="decoder")
    assert dec.count == 1
    assert bucket_quantile(dec, 0.99) == pytest.approx(0.1)  # in +Inf: the largest finite bound, a lower bound
    empty = histogram_delta(after, after, "duplex_stage_step_seconds", stage="talker")
    assert math.isnan(bucket_quantile(empty, 0.99))


def test_counter_delta_reads_the_total_sample():
    reg = CollectorRegistry()
    from prometheus_client import Counter

    c = Counter("duplex_talker_frames_skipped", "skipped", registry=reg)
    c.inc(3)
    before = parse_metrics(generate_latest(reg).decode())
    c.inc(4)
    after = parse_metrics(generate_latest(reg).decode())
    assert counter_delta(before, after, "duplex_talker_frames_skipped") == 4


# ---- backlog and output rate -------------------------------------------------------------------


def _record(frames: int, out_period: float, first_out: float, delay: int = 1) -> SessionRecord:
    send = [i * 0.08 for i in range(frames)]
    recv = [(delay + j, first_out + j * out_period) for j in range(frames - delay)]
    return SessionRecord(send, recv, delay)


def test_backlog_is_flat_when_outputs_keep_pace_and_grows_when_they_do_not():
    grid = np.arange(0.0, 20.0, 0.5)
    steady = [_record(250, 0.08, 0.08 + 0.12) for _ in range(3)]
    b = backlog_series(steady, grid)
    trend = backlog_trend(grid, b, skip_s=2.0, max_growth_frames=2.0)
    assert trend["growing"] is False
    assert abs(trend["growth_frames"]) < 0.5
    assert 1.0 <= trend["end"] <= 3.0  # ~120 ms in flight plus the frame being sent

    slow = [_record(250, 0.09, 0.2) for _ in range(3)]  # 11.1 fps out for 12.5 in: falls behind
    trend = backlog_trend(grid, backlog_series(slow, grid), skip_s=2.0, max_growth_frames=2.0)
    assert trend["growing"] is True
    assert trend["slope_frames_per_s"] == pytest.approx(12.5 - 1 / 0.09, abs=0.2)


def test_output_rate_windows_show_the_slowest_session():
    recs = [_record(250, 0.08, 0.2), _record(250, 0.1, 0.2)]
    rows = output_rate_windows(recs, duration_s=20.0, window_s=10.0)
    assert [r["t0"] for r in rows] == [0.0, 10.0]
    assert rows[1]["min_fps"] == pytest.approx(10.0, abs=0.15)
    assert rows[1]["mean_fps"] == pytest.approx(11.25, abs=0.15)


# ---- options ------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--smoke", "--sessions", "0"], "positive"),
    (["--smoke", "--mps"], "--mps needs --device cuda"),
    (["--smoke", "--preset", "huge"], "tiny or full"),
])
def test_bad_options_are_refused_before_anything_starts(argv, message, tmp_path):
    with pytest.raises(SystemExit, match=message):
        pipeline_main([*argv, "--out", str(tmp_path)])
    assert not (tmp_path / "pipeline.json").exists()


# ---- the whole script on the CPU ----------------------------------------------------------------


@pytest.mark.timeout(180)
def test_smoke_run_measures_the_real_pipeline(tmp_path, tiny_checkpoint):
    proc = subprocess.run([sys.executable, "-m", "bench.pipeline", "--smoke", "--out", str(tmp_path)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=170)
    # 0 = passed, 3 = measured but not passing (a loaded CPU may be late); anything else is a crash.
    assert proc.returncode in (0, 3), proc.stdout[-3000:] + proc.stderr[-3000:]
    text = (tmp_path / "pipeline.json").read_text()
    assert str(tmp_path) not in text  # no machine paths in a result that may be committed
    result = json.loads(text)
    assert result["mps"]["enabled"] is False
    assert set(result["services"]["ready_s"]) == {"encoder", "talker", "decoder"}
    assert result["phases_s"]["checkpoint"] >= 0 and result["phases_s"]["services_start"] > 0

    (run,) = result["runs"]
    assert run["sessions"] == 2 and run["admitted"] == 2
    assert run["errors_total"] == 0 and run["cleanup_unconfirmed"] == []
    assert run["checks"]["all_admitted"] and run["checks"]["no_errors"] and run["checks"]["all_outputs_delivered"]

    frames, delay = run["frames"], run["output_delay_frames"]
    assert delay >= 1
    assert frames["in_per_session_min"] == frames["in_per_session_max"] == run["frames_per_session"] == 50
    assert frames["out_total"] == frames["in_total"] - 2 * delay  # graceful close: every owed frame came out

    e2e = run["e2e_ms"]
    assert e2e["count"] == frames["out_total"]
    assert all(math.isfinite(e2e[k]) and e2e[k] > 0 for k in ("p50", "p99", "max"))
    assert e2e["p50"] <= e2e["p99"] <= e2e["max"]
    assert run["client_send_lateness_ms"]["count"] == frames["in_total"]

    for stage in ("encoder", "talker", "decoder"):
        block = run["stages"][stage]
        assert block["step_ms"]["count"] > 0, stage
        assert 0 < block["step_ms"]["p50"] <= block["step_ms"]["p99"], stage
        assert block["errors"] == {}, stage
    # The services' own counters agree with what the client saw.
    assert run["stages"]["encoder"]["frames_in"] == frames["in_total"]
    assert run["stages"]["talker"]["frames_out"] == frames["out_total"]
    assert run["stages"]["decoder"]["frames_out"] == frames["out_total"]

    talker = run["talker"]
    assert talker["tick_ms"]["count"] > 0 and talker["tick_ms"]["p99"] > 0
    assert 0.0 <= talker["tick_share_le_80ms"] <= 1.0
    assert talker["frames_advanced"] == frames["in_total"]
    assert talker["backlog_refusals"] == 0

    assert run["backlog_frames"]["growing"] in (True, False)
    assert any(row["p99_ms"] is not None for row in run["latency_per_second"])
    assert any(row.get("talker_tick_p99_ms") is not None for row in run["stage_timeline"])
    assert run["pass"] == all(run["checks"].values())
    assert result["largest_passing_sessions"] == (2 if run["pass"] else None)
    assert proc.returncode == (0 if run["pass"] else 3)

    assert (tmp_path / "pipeline.png").stat().st_size > 10_000
    assert "largest passing N" in proc.stdout
    for stage in ("encoder", "talker", "decoder"):
        assert (tmp_path / f"pipeline-{stage}.log").exists()
