"""bench/frontdoor.py --smoke: the front-door benchmark's own code path on the CPU (tiny checkpoint).

The whole stack as real processes (cell, a 2-worker gateway, a 2-process load driver), with the traffic
patterns the GPU runs, in order on one stack as the GPU run does (`--traffic realistic,burst`): callers
arriving with the SDK open and churn, the old together pattern with a probe, then a burst beyond the
cell's slots. One bench run serves the two smoke tests (a stack start and the bench's own start and plot
once, not twice). The report must hold what the GPU run reports and nothing machine-specific. The pass
rules themselves are tested on hand-made rows.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from bench.frontdoor import bounding, parse_args
from bench.frontdoor_report import checks
from tools.procs import REPO_ROOT

STAGES = ("encoder", "talker", "decoder")


SMOKE_DURATION_S = 6.0  # --duration-s: realistic after its last arrival, together per session, burst after its window
BURST_WINDOW_S = 1.0  # the smoke's --burst-window-s


def frontdoor(out, *args: str) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-m", "bench.frontdoor", "--smoke", "--out", str(out), *args],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=230)
    assert proc.returncode in (0, 3), proc.stdout[-3000:] + proc.stderr[-3000:]
    text = (out / "frontdoor.json").read_text()
    assert str(out) not in text  # no machine paths in a result that may be committed
    return json.loads(text), proc.stdout


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, tiny_checkpoint) -> tuple[dict, str, object]:
    """One smoke run of the three patterns on one stack: realistic, together, then a burst of 6 callers
    on the 3-slot cell. Returns (frontdoor.json, stdout, the --out directory)."""
    out = tmp_path_factory.mktemp("frontdoor")
    result, stdout = frontdoor(out, "--checkpoint", str(tiny_checkpoint), "--traffic", "realistic,together,burst",
                               "--sessions", "3", "--burst", "6", "--duration-s", str(SMOKE_DURATION_S),
                               "--burst-window-s", str(BURST_WINDOW_S))
    return result, stdout, out


def assert_rode_the_stack(run: dict) -> None:
    for stage in STAGES:  # the sessions rode the links: every stage handled link messages both ways
        assert run["link_messages_per_s"][stage]["in"] > 0 and run["link_messages_per_s"][stage]["out"] > 0, stage
        assert run["stages"][stage]["steps_per_tick"] > 0
    assert set(STAGES) <= set(run["cpu_cores"]) and sum(k.startswith("gateway-") for k in run["cpu_cores"]) == 2
    assert run["gateway_workers"] == 2 and run["full_context"] is False
    assert run["passed"] == all(run["checks"].values())


@pytest.mark.timeout(260)
def test_arrivals_with_the_sdk_open_and_churn_then_together(smoke):
    result, stdout, out = smoke
    real, together, _ = result["runs"]
    assert "failed" not in real and "failed" not in together, result["runs"]
    assert result["headline_traffic"] == "realistic" and set(result["largest_passing_by_traffic"]) == {
        "realistic", "together", "burst"}

    # Realistic: 3 lines dialled at 4/s (Poisson), SDK open, calls of 1 + Exp(1) s and redials: churn.
    assert (real["traffic"], real["open"], real["sessions"], real["steady_sessions"]) == ("realistic", "sdk", 3, 3)
    plan = real["traffic_plan"]
    assert plan["pattern"] == "arrivals" and plan["arrivals"] == "poisson" and plan["arrival_rate_per_s"] == 4.0
    calls = real["callers"]
    assert calls["callers"] > 3, "no call ended and no line dialled again: no churn"
    assert calls["status"]["killed"] == 0 and calls["served"] >= 3 and real["kills"] == 0
    assert calls["first_audio_ms"]["count"] == calls["served"] and real["first_audio_ms"]["p50"] > 0
    assert real["first_audio_after_connect_ms"]["p50"] > real["first_audio_ms"]["p50"]
    assert real["opens"] >= calls["callers"]  # every caller's session was opened by the gateway
    assert real["probes"] is None and real["driver"]["verdict"] in ("PASS", "FAIL", "INVALID")
    # Statistics from the steady window: settle_s (1) after the ramp's last arrival to the end.
    assert real["window"]["start_s"] == pytest.approx(plan["ramp_end_s"] + 1.0, abs=0.01)
    assert real["window"]["length_s"] == pytest.approx(plan["end_s"] - plan["ramp_end_s"] - 1.0, abs=0.01)
    ticks = real["talker"]["tick_ms"]["count"]
    assert 0 < ticks <= real["window"]["length_s"] / 0.08 + 2  # the window's ticks, not the whole run's
    assert real["e2e_ms"]["count"] > 0 and real["e2e_ms"]["p99"] >= real["e2e_ms"]["p50"]
    assert real["session_latency_p50_ms"]["count"] >= 3 and real["sessions_behind"]["count"] > 0
    assert {"p50", "p90", "mean"} <= set(real["sessions_behind"]) and "catch_up_steps" in real["talker"]
    assert real["prompts_per_open"] is None or real["prompts_per_open"] >= 1  # the talker may not count prompts
    assert set(real["checks"]) == {"client_valid", "admitted_pass", "callers_served", "ticks_within_80ms", "tick_p99",
                                   "frame_latency_p50", "frame_latency_p99", "first_audio", "sessions_behind"}
    assert_rode_the_stack(real)

    # Together, the comparison: 2 steady sessions and a probe that calls again and again.
    assert together["traffic_note"].startswith("a comparison") and real["traffic_note"].startswith("the headline")
    assert (together["sessions"], together["steady_sessions"], together["probe_slots"]) == (3, 2, 1)
    assert together["driver"]["sessions"] == 2 and together["driver_procs"] == 2
    assert together["e2e_ms"]["p50"] > 0 and together["e2e_ms"]["p99"] >= together["e2e_ms"]["p50"]
    assert together["probes"]["opened"] >= 1 and together["first_audio_ms"]["p50"] > 0
    assert 0 <= together["ticks_within_80ms_pct"] <= 100
    assert set(together["checks"]) == {"driver_pass", "probes_got_audio", "ticks_within_80ms", "tick_p99",
                                       "first_audio"}
    assert_rode_the_stack(together)
    assert (out / "frontdoor.png").is_file()
    assert "front door: smoke" in stdout and "realistic" in stdout and "together" in stdout


@pytest.mark.timeout(260)
def test_a_burst_beyond_the_slots_is_refused_up_front_then_served(smoke):
    """6 callers within 1 s on a 3-slot cell (after the other two patterns, on the same stack): those
    refused get a typed retry-later before any audio, retry after its delay and are served once earlier
    calls hang up; none is killed."""
    result, stdout, _ = smoke
    *_, run = result["runs"]
    assert "burst" in stdout
    assert "failed" not in run, run
    assert (run["traffic"], run["sessions"], run["burst_callers"]) == ("burst", 3, 6)
    calls = run["callers"]
    refusals = calls["refusals"]
    assert calls["callers"] == 6 and calls["status"]["killed"] == 0 and calls["server_error_events"] == 0
    assert refusals["callers_refused"] >= 1 and refusals["retries"] >= refusals["callers_refused"]
    assert set(refusals["by_type"]) <= {"error:resource_exhausted", "error:server_busy", "close:1013", "http:503"}
    assert refusals["after_created"] == 0  # up front: before session.created
    assert calls["refused_callers_served"] == refusals["callers_refused"] and calls["all_refused_served_in_time"]
    assert calls["served"] == 6 and calls["time_to_served_ms"]["count"] == refusals["callers_refused"]
    assert calls["time_to_served_ms"]["p50"] > 1000  # each waited its delay and a slot, then was served
    assert sum(run["gateway_refusals"].values()) == refusals["total"]  # the gateway counted the same refusals
    assert run["window"] == {"start_s": 0.0, "length_s": pytest.approx(BURST_WINDOW_S + SMOKE_DURATION_S)}
    assert run["first_audio_ms"]["count"] == 6
    assert set(run["checks"]) == {"client_valid", "no_kills", "no_server_error", "callers_served", "refusals_up_front"}
    assert run["checks"]["callers_served"] and run["checks"]["refusals_up_front"] and run["checks"]["no_kills"]
    assert_rode_the_stack(run)


# -- the pass rules and the window's scrapes ------------------------------------------------------

REALISTIC = {
    "traffic": "realistic", "ticks_within_80ms_pct": 99.9, "talker": {"tick_ms": {"p99": 70.0}},
    "e2e_ms": {"p50": 100.0, "p99": 200.0}, "first_audio_ms": {"p99": 350.0}, "sessions_behind": {"p50": 1.0},
    "driver": {"verdict": "PASS"},
    "callers": {"callers": 10, "served": 10, "admitted": 10, "admitted_passed": 10, "all_refused_served_in_time": True,
                "status": {"killed": 0}, "server_error_events": 0, "refusals": {"after_created": 0}},
}


def changed(row: dict, path: str, value) -> dict:
    row = copy.deepcopy(row)
    *keys, last = path.split(".")
    target = row
    for key in keys:
        target = target[key]
    target[last] = value
    return row


def test_the_realistic_rule_is_the_issue_targets():
    cfg = parse_args([])
    assert all(checks(REALISTIC, cfg).values())
    for path, value, check in [("ticks_within_80ms_pct", 99.4, "ticks_within_80ms"), ("talker.tick_ms.p99", 76.0,
                                                                                        "tick_p99"),
                               ("e2e_ms.p50", 121.0, "frame_latency_p50"), ("e2e_ms.p99", 251.0, "frame_latency_p99"),
                               ("first_audio_ms.p99", 401.0, "first_audio"), ("sessions_behind.p50", 2.5,
                                                                              "sessions_behind"),
                               ("callers.admitted_passed", 9, "admitted_pass"), ("callers.served", 9, "callers_served"),
                               ("callers.all_refused_served_in_time", False, "callers_served"),
                               ("driver.verdict", "INVALID", "client_valid")]:
        failed = [name for name, ok in checks(changed(REALISTIC, path, value), cfg).items() if not ok]
        assert failed == [check], (path, failed)
    assert not checks(changed(REALISTIC, "sessions_behind", {"count": 0}), cfg)["sessions_behind"]  # unmeasured


def test_the_burst_rule_judges_kills_errors_and_refusals_not_latency():
    cfg = parse_args([])
    burst = changed(changed(REALISTIC, "traffic", "burst"), "e2e_ms.p99", 900.0)
    assert all(checks(burst, cfg).values())  # a burst's latency is reported, not judged
    for path, value, check in [("callers.status.killed", 1, "no_kills"), ("callers.server_error_events", 2,
                                                                          "no_server_error"),
                               ("callers.refusals.after_created", 1, "refusals_up_front"),
                               ("callers.served", 9, "callers_served")]:
        failed = [name for name, ok in checks(changed(burst, path, value), cfg).items() if not ok]
        assert failed == [check], (path, failed)


def test_the_window_is_bounded_by_the_scrapes_inside_it():
    snaps = [(t, {"talker": {"t": t}, "gateway": {}}) for t in (0.5, 1.5, 2.5, 3.5, 4.5)]
    snaps[2] = (2.5, {"talker": None, "gateway": {}})  # a scrape the talker did not answer is skipped
    first, last = bounding(snaps, 1.0, 4.0)
    assert (first["talker"]["t"], last["talker"]["t"]) == (1.5, 3.5)
    with pytest.raises(RuntimeError, match="fewer than two"):
        bounding(snaps, 1.0, 2.0)


def test_bad_traffic_is_refused():
    with pytest.raises(SystemExit):
        parse_args(["--traffic", "realistic,rush"])
