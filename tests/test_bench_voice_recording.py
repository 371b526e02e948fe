"""bench/voice_recording.py: its verdict and gap figures on hand-made numbers, and the whole script on the CPU
(--smoke: a real talker process on the tiny checkpoint, paced Talk streams, voices really recorded)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.voice_recording import Bystander, client_figures, verdict
from bench.voice_recording import main as bench_main
from tools.procs import REPO_ROOT


def kinds(ticks: int, slow: int, p99: float, recordings: int = 0) -> dict:
    return {"ticks": ticks, "slow_ticks": slow, "slow_share": slow / ticks, "tick_p99_ms": p99,
            "recordings": recordings}


@pytest.mark.parametrize("recording, passes", [
    (kinds(400, 4, 60.0, 5), True),  # the quiet rate (1 %) plus two
    (kinds(400, 5, 60.0, 5), False),
    (kinds(400, 0, 68.0, 5), True),  # p99 within x1.1 + 2 ms of 60
    (kinds(400, 0, 68.1, 5), False),
    (kinds(400, 0, 50.0, 0), False),  # nothing recorded: nothing shown
])
def test_the_verdict_compares_the_recording_phases_with_the_quiet_ones(recording, passes):
    quiet = kinds(200, 1, 60.0)
    assert verdict(quiet, recording)["pass"] is passes


def test_a_bystanders_gaps_count_the_phase_edges_and_only_its_window():
    b = Bystander(None, 0, 0.0)
    b.arrivals = [0.5, 1.0, 1.08, 1.16, 1.6, 2.4]  # 0.5 s before the phase: not counted
    figures = client_figures([b], 1.0, 2.0)
    assert figures["largest_gap_ms"] == pytest.approx(440.0)  # 1.16 -> 1.6
    assert figures["gaps_over_2_periods"] == 1  # 1.6 -> the edge is not an output gap
    assert figures["outputs_per_due"] == pytest.approx(3 / 12.5)


def test_bad_options_are_refused_before_anything_starts(tmp_path):
    with pytest.raises(SystemExit, match="--voice-seconds"):
        bench_main(["--smoke", "--voice-seconds", "0.1", "--out", str(tmp_path)])
    assert not (tmp_path / "voice_recording.json").exists()


@pytest.mark.timeout(180)
def test_smoke_run_records_voices_while_bystanders_tick(tmp_path, tiny_checkpoint):
    # 2 s phases (the smoke's default is 3): 25 ticks each, over twice the 10 checked, and a recording phase
    # runs until its last recording ends, so each still records.
    proc = subprocess.run([sys.executable, "-m", "bench.voice_recording", "--smoke", "--phase-s", "2",
                           "--out", str(tmp_path)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=170)
    # 0 = passed, 3 = measured but not passing (a shared CPU is late now and then); anything else is a crash.
    assert proc.returncode in (0, 3), proc.stdout[-3000:] + proc.stderr[-3000:]
    text = (tmp_path / "voice_recording.json").read_text()
    assert str(tmp_path) not in text  # no machine paths in a result that may be committed
    result = json.loads(text)
    phases = result["phases"]
    assert [p["kind"] for p in phases] == ["quiet", "recording", "quiet", "recording"]
    assert all(p["talker"]["ticks"] > 10 and p["clients"]["outputs_per_due"] > 0.8 for p in phases)
    assert [p["recordings_made"] > 0 for p in phases] == [False, True, False, True]
    assert phases[1]["recorder_cpu_s"] > 0  # the encode ran in the recorder process
    assert result["bystander_errors"] == []
    assert result["voice_store"]["recordings"] == sum(p["recordings_made"] for p in phases)
    assert set(result["summary"]) >= {"quiet", "recording", "pass"}
    assert "--max-prefill-wait-s 0" in result["talker_args"]
    # Each recording's work on the talker's compute thread, measured there: one lookup per voice recorded,
    # and its KV prefix in pieces (riding main steps or alone), none of it in a quiet phase.
    work = [p["talker"]["recording_compute"] for p in phases]
    assert [w["lookup"]["pieces"] for w in work[1::2]] == [p["recordings_made"] for p in phases[1::2]]
    assert all(w["prefix_step"]["pieces"] + w["prefix_alone"]["pieces"] > 0 for w in work[1::2])
    assert all(c["pieces"] == 0 for w in work[0::2] for c in w.values())
    prefixes = [line for line in result["recording_compute_log"] if line.startswith("voice @") and "KV prefix" in line]
    assert len(prefixes) == result["voice_store"]["recordings"]  # the enrolled ones (the bystanders' is preloaded)
