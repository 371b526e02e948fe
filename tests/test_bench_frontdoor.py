"""bench/frontdoor.py --smoke: the front-door benchmark's own code path on the CPU (tiny checkpoint).

The whole stack as real processes (cell, a 2-worker gateway, a 2-process load driver, a probe), one
N; the report must hold what the GPU run reports and nothing machine-specific.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tools.procs import REPO_ROOT

pytestmark = pytest.mark.timeout(300)


def test_smoke_run_measures_through_the_real_gateway(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.frontdoor", "--smoke", "--out", str(tmp_path)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode in (0, 3), proc.stdout[-3000:] + proc.stderr[-3000:]
    text = (tmp_path / "frontdoor.json").read_text()
    assert str(tmp_path) not in text  # no machine paths in a result that may be committed
    result = json.loads(text)
    (run,) = result["runs"]
    assert "failed" not in run, run
    assert (run["sessions"], run["steady_sessions"], run["probe_slots"], run["driver_procs"]) == (3, 2, 1, 2)
    assert run["gateway_workers"] == 2 and run["full_context"] is False
    assert run["driver"]["verdict"] in ("PASS", "FAIL", "INVALID") and run["driver"]["sessions"] == 2
    assert run["e2e_ms"]["p50"] > 0 and run["e2e_ms"]["p99"] >= run["e2e_ms"]["p50"]
    assert run["probes"]["opened"] >= 1 and run["first_audio_ms"]["p50"] > 0
    assert 0 <= run["ticks_within_80ms_pct"] <= 100
    assert set(run["checks"]) == {"driver_pass", "probes_got_audio", "ticks_within_80ms", "tick_p99", "first_audio"}
    assert run["passed"] == all(run["checks"].values())
    # The sessions rode the links: every stage handled link messages both ways.
    for stage in ("encoder", "talker", "decoder"):
        assert run["link_messages_per_s"][stage]["in"] > 0 and run["link_messages_per_s"][stage]["out"] > 0, stage
    assert {"encoder", "talker", "decoder"} <= set(run["cpu_cores"])
    assert all(run["stages"][s]["steps_per_tick"] > 0 for s in ("encoder", "talker", "decoder")), run["stages"]
    assert sum(1 for k in run["cpu_cores"] if k.startswith("gateway-")) == 2
    assert (tmp_path / "frontdoor.png").is_file()
    assert "front door: smoke" in proc.stdout
