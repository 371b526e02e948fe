"""bench/cell.py: its numbers on hand-made data, and the whole script on the CPU (--smoke).

The smoke run is the real thing at toy size: three service processes on the tiny checkpoint,
a load process driving two gateway Relays over real gRPC sockets, Prometheus scraped over HTTP.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from bench.cell import deal_sessions, send_offsets
from bench.cell import main as cell_main
from bench.cell_load import probe_frames
from bench.cell_report import (talker_block, gpu_memory_lines, late_tick_line, probe_summary, slow_intervals,
                                   stage_timeline, summarize_run)
from bench.cell_stats import (
    SessionRecord,
    backlog_series,
    backlog_trend,
    bucket_quantile,
    counter_delta,
    fraction_le,
    gpu_memory,
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


# ---- probe sessions -----------------------------------------------------------------------------


def test_probe_cycles_send_no_frame_due_after_the_steady_schedule():
    assert probe_frames(10.0, 20.0, 0.08, 50) == 50  # a whole cycle fits
    assert probe_frames(10.0, 11.0, 0.08, 50) == 13  # due at 10.00 .. 10.96; 11.04 would be past the end
    assert probe_frames(10.0, 10.96, 0.08, 50) == 12  # exactly at the end: not sent
    assert probe_frames(10.0, 10.0, 0.08, 50) == 0
    assert probe_frames(12.0, 10.0, 0.08, 50) == 0  # the open returned after the end


def test_steady_sessions_are_dealt_round_robin_and_every_probe_to_one_process():
    steady, probes = deal_sessions(10, 2, 4)
    assert [len(a) for a in steady] == [2, 2, 2, 2]
    assert sorted(i for share in steady for i in share) == [f"bench-n10-{i:03d}" for i in range(8)]
    assert probes == [["bench-n10-probe0", "bench-n10-probe1"], [], [], []]
    steady, probes = deal_sessions(10, 1, 4)  # 9 steady: 3, 2, 2, 2; the probe joins the first with 2
    assert [len(a) for a in steady] == [3, 2, 2, 2] and probes == [[], ["bench-n10-probe0"], [], []]
    steady, probes = deal_sessions(2, 1, 1)
    assert steady == [["bench-n2-000"]] and probes == [["bench-n2-probe0"]]
    assert deal_sessions(3, 0, 2)[1] == [[], []]


def _cycle(j: int, open_s: float | None = 0.2, first: float | None = 0.5, sent: int = 20, out: int = 19,
           error: dict | None = None, confirmed: bool | None = True) -> dict:
    return {"stream_id": f"bench-n3-probe0-{j}", "slot_wait_s": 0.01 * j, "t_open": 2.0 * j, "open_s": open_s,
            "prefill_ms": None if open_s is None else 150.0, "output_delay_frames": None if open_s is None else 1,
            "frames_sent": sent, "frames_out": out, "first_output_s": first, "first_output_seq": 1 if first else None,
            "error": error, "cleanup_confirmed": confirmed}


def test_spread_sessions_send_at_even_places_in_the_period_and_together_ones_at_its_start():
    shares, _ = deal_sessions(10, 2, 3)  # 8 steady sessions over 3 processes
    spread = send_offsets(shares, 0.08, "spread")
    assert [len(o) for o in spread] == [len(ids) for ids in shares]
    at = dict(zip((sid for ids in shares for sid in ids), (x for o in spread for x in o)))
    assert sorted(at.values()) == pytest.approx([j * 0.01 for j in range(8)])  # 80 ms / 8 sessions
    assert at["bench-n10-000"] == 0.0 and at["bench-n10-007"] == pytest.approx(0.07)
    assert spread[0] == pytest.approx([0.0, 0.03, 0.06])  # a process's round-robin share spans the period
    many, _ = deal_sessions(1002, 2, 1)  # ids 000 .. 999, 1000: numbered, not sorted as text
    assert send_offsets(many, 0.08, "spread")[0][-1] == pytest.approx(0.08 * 999 / 1000)
    assert send_offsets(shares, 0.08, "together") == [[0.0] * len(ids) for ids in shares]


def test_slow_intervals_are_set_against_the_probe_opens_and_their_base_rate():
    timeline = [{"t0": -0.5, "t": 0.0, "talker_tick_p99_ms": 300.0},  # before the start: not counted
                {"t0": 0.0, "t": 1.0, "talker_tick_p99_ms": 70.0},
                {"t0": 1.0, "t": 2.0, "talker_tick_p99_ms": 95.0},  # an open at 0.8: its prefill lands here
                {"t0": 2.0, "t": 3.0, "talker_tick_p99_ms": 60.0},  # an open at 2.5, on time
                {"t0": 3.0, "t": 4.0, "talker_tick_p99_ms": 120.0},  # no open near
                {"t0": 4.0, "t": 5.0}]  # no talker sample: not counted
    w = slow_intervals(timeline, [{"t_open": 0.8}, {"t_open": 2.5}, {"t_open": None}])
    assert w == {"intervals": 4, "slow": 2, "slow_at": [1.0, 3.0], "slow_with_probe_open": 1,
                 "intervals_with_probe_open": 3}  # 0.8 is in [0, 1) and within 0.3 s of 1.0; 2.5 in [2, 3)
    assert slow_intervals([], []) == {"intervals": 0, "slow": 0, "slow_at": [], "slow_with_probe_open": 0,
                                      "intervals_with_probe_open": 0}


def test_probe_summary_counts_every_cycle_and_every_kind_of_failure():
    assert probe_summary([], 0, 4.0) is None
    ok = probe_summary([_cycle(0, 0.2, 0.45), _cycle(1, 0.4, 0.65)], 1, 4.0)
    assert ok["cycles"] == 2 and ok["errors"] == [] and ok["errors_total"] == 0
    assert ok["open_ms"]["count"] == 2 and ok["open_ms"]["max"] == pytest.approx(400.0)
    assert ok["prefill_ms"]["p50"] == pytest.approx(150.0)
    assert ok["first_audio_ms"]["max"] == pytest.approx(650.0)
    assert ok["first_audio_after_open_ms"]["p50"] == pytest.approx(250.0)
    assert ok["frames_in"] == 40 and ok["frames_out"] == 38 and ok["no_first_audio"] == 0
    assert ok["slot_wait_ms"]["max"] == pytest.approx(10.0)

    refused = {"code": "runtime_open_failed", "stage": "talker", "message": "no free slot"}
    bad = probe_summary([_cycle(0), _cycle(1, None, None, 0, 0, refused, None), _cycle(2, confirmed=False),
                         _cycle(3, out=5), _cycle(4, first=None, sent=0, out=0)], 1, 4.0)
    assert [e["code"] for e in bad["errors"]] == ["runtime_open_failed", "cleanup_unconfirmed", "outputs_missing"]
    assert bad["cycles"] == 5 and bad["open_ms"]["count"] == 4 and bad["first_audio_ms"]["count"] == 3
    assert bad["no_first_audio"] == 1  # opened, closed at the end before sending: not an error


def _steady(sid: str, frames: int = 10) -> dict:
    return {"stream_id": sid, "admitted": True, "open_s": 0.3, "prefill_ms": 100.0, "output_delay_frames": 1,
            "send_t": [i * 0.08 for i in range(frames)], "late_s": [0.0] * frames, "reanchors": 0,
            "recv": [[i, i * 0.08 + 0.1] for i in range(1, frames)], "error": None, "cleanup_confirmed": True}


def test_run_summary_keeps_the_steady_checks_on_the_steady_sessions():
    unscraped = {s: None for s in ("encoder", "talker", "decoder")}
    snaps = [(-0.5, unscraped), (1.0, unscraped)]
    kw = dict(duration_s=1.0, frames=10, window_s=0.5, backlog_growth_frames=2.0, probe_cycle_s=0.5)
    results = [{"sessions": [_steady("a"), _steady("b")], "probes": [_cycle(0), _cycle(1)]}]
    run = summarize_run(3, results, [], snaps, probe_slots=1, **kw)
    assert (run["sessions"], run["steady_sessions"], run["probe_slots"], run["admitted"]) == (3, 2, 1, 2)
    assert run["checks"]["all_admitted"] and run["checks"]["all_outputs_delivered"] and run["checks"]["probes_ok"]
    assert run["frames"]["in_total"] == 20 and run["open_ms"]["count"] == 2  # the burst's opens, not the probes'
    assert run["probes"]["cycles"] == 2
    assert run["gpu_memory"] == {"before": None, "after": None}

    results[0]["probes"][1]["error"] = {"code": "stage_stalled", "stage": None, "message": "x"}
    assert summarize_run(3, results, [], snaps, probe_slots=1, **kw)["checks"]["probes_ok"] is False
    no_probes = summarize_run(2, [{"sessions": [_steady("a"), _steady("b")]}], [], snaps, **kw)
    assert no_probes["probes"] is None and no_probes["checks"]["probes_ok"] is True
    assert no_probes["steady_sessions"] == 2 and no_probes["checks"]["all_admitted"]


# ---- GPU memory gauges --------------------------------------------------------------------------


def _gpu_scrape(stage: str, allocated: float, reserved: float, free: float) -> dict:
    reg = CollectorRegistry()
    for name, v in (("allocated", allocated), ("reserved", reserved), ("free", free)):
        Gauge(f"duplex_stage_gpu_memory_{name}_bytes", name, ["stage"], registry=reg).labels(stage).set(v)
    Gauge("duplex_stage_free_slots", "slots", ["stage"], registry=reg).labels(stage).set(4)
    return parse_metrics(generate_latest(reg).decode())


def test_gpu_memory_from_the_stage_gauges_and_none_without_them():
    mib = 1024 * 1024
    snaps = {"encoder": _gpu_scrape("encoder", 100 * mib, 128 * mib, 9000 * mib),
             "talker": _gpu_scrape("talker", 70_000 * mib, 72_000.5 * mib, 8000 * mib),
             "decoder": None}  # did not answer the scrape
    mem = gpu_memory(snaps)
    assert mem["stages"]["encoder"] == {"allocated_mib": 100.0, "reserved_mib": 128.0}
    assert mem["stages"]["talker"] == {"allocated_mib": 70_000.0, "reserved_mib": 72_000.5}
    assert mem["stages"]["decoder"] is None
    assert mem["device_free_mib"] == 8000.0  # the lowest view of the one device
    assert len(gpu_memory_lines(mem)) == 4

    reg = CollectorRegistry()  # a CPU service: slot gauges, no GPU gauges
    Gauge("duplex_stage_free_slots", "slots", ["stage"], registry=reg).labels("talker").set(4)
    cpu = parse_metrics(generate_latest(reg).decode())
    assert gpu_memory({"encoder": cpu, "talker": cpu, "decoder": None}) is None
    assert gpu_memory_lines(None) == ["gpu memory: the stages export no GPU memory gauges (not on CUDA)"]


def test_stage_timeline_puts_each_interval_gc_time_beside_the_steps():
    """The per-second timeline: a stage's GC pause time (duplex_stage_gc_pause_seconds, summed over
    generations) in the interval it happened, absent where none happened."""
    reg = CollectorRegistry()
    gc = Histogram("duplex_stage_gc_pause_seconds", "gc", ["stage", "generation"], registry=reg)
    step = Histogram("duplex_stage_step_seconds", "step", ["stage"], registry=reg)
    step.labels("talker").observe(0.05)

    def snap():
        return {"talker": parse_metrics(generate_latest(reg).decode())}

    snaps = [(0.0, snap())]
    gc.labels("talker", "0").observe(0.002)
    gc.labels("talker", "2").observe(0.010)
    snaps.append((1.0, snap()))
    snaps.append((2.0, snap()))  # no collection in this second
    rows = stage_timeline(snaps)
    assert rows[0]["talker_gc_ms"] == pytest.approx(12.0) and "talker_gc_ms" not in rows[1]


def test_what_late_ticks_held_is_read_from_the_talkers_own_metrics():
    """Forced catch-ups, slow ticks by cause, dropped periods and sessions behind, from a real
    TalkerMetrics registry: in the run's talker block, the console line and the per-second timeline
    (only in the interval where they happened)."""
    from services.common.metrics import StageMetrics
    from services.talker.metrics import TalkerMetrics

    m = TalkerMetrics(StageMetrics("talker"))

    def snap():
        return {"talker": parse_metrics(generate_latest(m.stage.registry).decode())}

    snaps = [(0.0, snap())]
    m.catch_up_steps.labels(rows="8").inc(2)
    m.catch_up_steps.labels(rows="160").inc()
    m.catch_up_forced.inc(2)
    m.slow_ticks.labels(cause="catch_up").inc(2)
    m.slow_ticks.labels(cause="late_start").inc()
    m.ticks_dropped.inc()
    for n in (0, 0, 4, 30):
        m.sessions_behind.observe(n)
    m.step_part.labels(part="gpu_wait").observe(0.045)
    m.step_part.labels(part="loop_resume").observe(0.009)
    m.prefill_pieces.labels(where="step").inc(5)
    snaps.append((1.0, snap()))
    snaps.append((2.0, snap()))  # a quiet second
    block = talker_block(snaps[0][1]["talker"], snaps[-1][1]["talker"])
    assert (block["catch_up_steps"], block["catch_up_steps_forced"], block["ticks_dropped"]) == (3, 2, 1)
    assert block["catch_up_steps_by_rows"] == {"8": 2, "160": 1}
    assert block["slow_ticks_by_cause"] == {"catch_up": 2, "late_start": 1}
    assert block["sessions_behind"]["count"] == 4
    assert block["prefill_pieces"] == {"step": 5}  # none alone: zeros are left out
    assert block["sessions_behind"]["mean"] == pytest.approx(8.5)
    parts = block["step_parts_ms"]
    assert parts["gpu_wait"]["count"] == parts["loop_resume"]["count"] == 1 and parts["launch"]["count"] == 0
    assert 40 <= parts["gpu_wait"]["p50"] <= 50  # bucket resolution: (40, 50] ms
    line = late_tick_line({"sessions": 144, "talker": block})
    assert "gpu_wait " in line and "loop_resume " in line and "launch " not in line
    assert "catch_up 2, late_start 1" in line and "dropped 1" in line
    assert "catch-up steps 3 (8 rows 2, 160 rows 1; 2 forced past the deadline)" in line
    rows = stage_timeline(snaps)
    assert {k: v for k, v in rows[0].items() if k.startswith(("talker_catch", "talker_slow", "talker_ticks"))} == {
        "talker_catch_ups": 3, "talker_catch_ups_forced": 2, "talker_ticks_dropped": 1,
        "talker_slow_catch_up": 2, "talker_slow_late_start": 1}
    assert not any(k.startswith(("talker_catch", "talker_slow", "talker_ticks")) for k in rows[1])


# ---- options ------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--smoke", "--sessions", "0"], "positive"),
    (["--smoke", "--mps"], "--mps needs --device cuda"),
    (["--smoke", "--preset", "huge"], "tiny or full"),
    (["--smoke", "--probe-sessions", "2"], "--probe-sessions K needs"),  # smoke N is 2: no steady session left
    (["--smoke", "--sessions", "4", "--fallback-sessions", "1"], "--probe-sessions K needs"),
    (["--smoke", "--probe-cycle-s", "0.1"], "two input frames"),
    (["--smoke", "--send-phases", "random"], "spread or together"),
])
def test_bad_options_are_refused_before_anything_starts(argv, message, tmp_path):
    with pytest.raises(SystemExit, match=message):
        cell_main([*argv, "--out", str(tmp_path)])
    assert not (tmp_path / "cell.json").exists()


# ---- the whole script on the CPU ----------------------------------------------------------------


@pytest.mark.timeout(180)
def test_smoke_run_measures_the_real_cell(tmp_path, tiny_checkpoint):
    proc = subprocess.run([sys.executable, "-m", "bench.cell", "--smoke", "--out", str(tmp_path)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=170)
    # 0 = passed, 3 = measured but not passing (a loaded CPU may be late); anything else is a crash.
    assert proc.returncode in (0, 3), proc.stdout[-3000:] + proc.stderr[-3000:]
    text = (tmp_path / "cell.json").read_text()
    assert str(tmp_path) not in text  # no machine paths in a result that may be committed
    result = json.loads(text)
    assert result["mps"]["enabled"] is False
    assert set(result["services"]["ready_s"]) == {"encoder", "talker", "decoder"}
    assert result["phases_s"]["checkpoint"] >= 0 and result["phases_s"]["services_start"] > 0

    assert result["services"]["gpu_memory"] is None  # the GPU gauges exist only on CUDA
    assert "gpu memory: the stages export no GPU memory gauges" in proc.stdout

    (run,) = result["runs"]
    # N = 2: one steady session for the whole schedule, one probe slot reopening beside it.
    assert (run["sessions"], run["steady_sessions"], run["probe_slots"], run["admitted"]) == (2, 1, 1, 1)
    assert run["errors_total"] == 0 and run["cleanup_unconfirmed"] == []
    assert 0 <= run["start_in_tick_grid_ms"] < 80
    assert run["checks"]["all_admitted"] and run["checks"]["no_errors"] and run["checks"]["all_outputs_delivered"]

    frames, delay = run["frames"], run["output_delay_frames"]
    assert delay == 0  # stated in TalkReady: the default personaplex alignment answers every input
    assert frames["in_per_session_min"] == frames["in_per_session_max"] == run["frames_per_session"] == 50
    assert frames["out_total"] == frames["in_total"] - delay  # graceful close: every owed frame came out

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
        assert block["gc_full_collections"]["count"] >= 0, stage
    # GC time per interval appears only where a collection happened (none in 4 s is possible)
    assert all(v > 0 for row in run["stage_timeline"] for k, v in row.items() if k.endswith("_gc_ms"))
    # Time to first audio at full load: the probe slot opened, talked and closed, beside the steady session.
    probes = run["probes"]
    assert run["checks"]["probes_ok"] and probes["errors"] == [] and probes["errors_total"] == 0
    assert probes["cycles"] >= 1 and probes["open_ms"]["count"] == probes["prefill_ms"]["count"] == probes["cycles"]
    assert probes["first_audio_ms"]["count"] == probes["cycles"] and probes["no_first_audio"] == 0
    assert 0 < probes["open_ms"]["p50"] < probes["first_audio_ms"]["p50"]
    # First audio answers input frame `delay` (sent delay * 80 ms after the open returned): the first
    # frame in the default personaplex alignment, the second in moshi's.
    assert probes["first_audio_after_open_ms"]["p50"] > max(0.0, 80.0 * delay - 1.0)
    assert probes["frames_out"] == probes["frames_in"] - probes["cycles"] * delay
    assert f"N=2 probes (1 of N, {probes['cycles']} opens beside 1 steady)" in proc.stdout
    assert run["gpu_memory"] == {"before": None, "after": None}

    # The services' own counters agree with what the clients saw (steady sessions and probes).
    assert run["stages"]["encoder"]["frames_in"] == frames["in_total"] + probes["frames_in"]
    assert run["stages"]["talker"]["frames_out"] == frames["out_total"] + probes["frames_out"]
    assert run["stages"]["decoder"]["frames_out"] == frames["out_total"] + probes["frames_out"]

    talker = run["talker"]
    assert talker["tick_ms"]["count"] > 0 and talker["tick_ms"]["p99"] > 0
    assert 0.0 <= talker["tick_share_le_80ms"] <= 1.0
    # One step per input, give or take one per stream, as the talker steps ahead: the step of a
    # stream's last input runs too when it comes before the input ends, and a steady session's step 0
    # (at go-live, before any input) can fall before the counters' first scrape.
    surplus = talker["frames_advanced"] - (frames["in_total"] + probes["frames_in"])
    assert -run["steady_sessions"] <= surplus <= run["steady_sessions"] + probes["cycles"]
    assert talker["backlog_refusals"] == 0

    assert run["backlog_frames"]["growing"] in (True, False)
    assert any(row["p99_ms"] is not None for row in run["latency_per_second"])
    assert any(row.get("talker_tick_p99_ms") is not None for row in run["stage_timeline"])
    assert run["pass"] == all(run["checks"].values())
    assert result["largest_passing_sessions"] == (2 if run["pass"] else None)
    assert proc.returncode == (0 if run["pass"] else 3)

    assert (tmp_path / "cell.png").stat().st_size > 10_000
    assert "largest passing N" in proc.stdout
    for stage in ("encoder", "talker", "decoder"):
        assert (tmp_path / f"cell-{stage}.log").exists()


def test_per_codec_flags_go_to_that_codec_only_and_last(tmp_path):
    from bench.cell import parse_args, service_args

    cfg = parse_args(["--smoke", "--codec-args", "--batch-wait-ms 9", "--encoder-args", "--gil-switch-ms 0.5",
                      "--decoder-args", "--batch-wait-ms 3"])
    args = service_args(cfg, tmp_path, 4)
    assert args["encoder"][-4:] == ["--batch-wait-ms", "9", "--gil-switch-ms", "0.5"]
    assert args["decoder"][-4:] == ["--batch-wait-ms", "9", "--batch-wait-ms", "3"]  # the last wins
    assert "0.5" not in args["decoder"] + args["talker"]


def test_the_benchmarks_run_the_gpu_overlays_profile(tmp_path):
    """One GPU serving profile: the benchmarks' stage command lines on CUDA come from the gpu overlay's
    ENCODER_* / TALKER_* / DECODER_* settings (slots and device are set per run), so the two cannot
    drift apart; a changed overlay changes the benchmark."""
    from bench.cell import GPU_PROFILE, gpu_profile_args, parse_args, service_args

    cfg = parse_args(["--device", "cuda", "--preset", "full"])
    args = service_args(cfg, tmp_path, 8)

    def value(stage: str, flag: str) -> str:
        line = args[stage]
        return line[len(line) - 1 - line[::-1].index(flag) + 1]  # the last occurrence wins

    assert [value("talker", f) for f in ("--kv-fp8", "--weights-fp8", "--cuda-graph", "--compile")] == ["true"] * 4
    assert value("encoder", "--cuda-graph") == value("decoder", "--cuda-graph") == "true"
    assert (value("encoder", "--batch-wait-ms"), value("decoder", "--batch-wait-ms")) == ("20", "2")
    assert value("talker", "--catch-up-lag-frames") == "3"
    assert value("talker", "--slots") == "8" and value("talker", "--device") == "cuda"
    changed = tmp_path / "kustomization.yaml"
    changed.write_text(GPU_PROFILE.read_text().replace("DECODER_BATCH_WAIT_MS=2", "DECODER_BATCH_WAIT_MS=7"))
    assert gpu_profile_args(changed)["decoder"][-2:] == ["--batch-wait-ms", "7"]


def test_the_benchmarks_stages_are_mps_clients_as_the_overlays_containers_are(tmp_path):
    """Under --mps each stage process gets its container's MPS client settings from the gpu overlay
    (e.g. the codecs' memory limit), not the daemon's directories; --stage-env adds or overrides one
    (an A/B of an MPS setting), and a malformed entry stops the benchmark with a message."""
    from bench.cell import GPU_CELL_PATCH, gpu_profile_env, parse_args, service_env

    env = service_env(parse_args(["--device", "cuda", "--mps"]))
    assert env["encoder"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == env["decoder"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in env["talker"]
    # the codecs below normal MPS priority, the talker at normal (the overlay's choice, bench/RESULTS.md run 24)
    assert env["encoder"]["CUDA_MPS_CLIENT_PRIORITY"] == env["decoder"]["CUDA_MPS_CLIENT_PRIORITY"] == "1"
    assert "CUDA_MPS_CLIENT_PRIORITY" not in env["talker"]
    assert not any("DIRECTORY" in name for stage in env.values() for name in stage)
    assert service_env(parse_args(["--device", "cuda"])) == {"encoder": {}, "talker": {}, "decoder": {}}
    ab = service_env(parse_args(["--device", "cuda", "--mps", "--stage-env",
                                 "encoder:CUDA_MPS_CLIENT_PRIORITY=1 decoder:CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=9G "
                                 "talker:X=a=b"]))
    assert ab["encoder"]["CUDA_MPS_CLIENT_PRIORITY"] == "1" and ab["talker"]["X"] == "a=b"
    assert ab["decoder"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=9G"
    assert ab["encoder"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == env["encoder"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]
    for bad in ("gateway:X=1", "encoder:X", "encoderX=1"):
        with pytest.raises(SystemExit, match="--stage-env"):
            service_env(parse_args(["--device", "cuda", "--stage-env", bad]))
    changed = tmp_path / "cell-gpu.yaml"
    changed.write_text(GPU_CELL_PATCH.read_text().replace('value: "0=8G"', 'value: "0=6G"', 1))
    assert gpu_profile_env(changed)["encoder"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=6G"
