"""Stage faults under live sessions: a stage process SIGKILLed (encoder, decoder) or stalled
(talker SIGSTOPped, later SIGCONTed), on a stack of two cells with a small stall timeout.

Every test: one session on each cell; the cell that is hurt fails its session with a typed
`server_error` within a bound, the gateway stays up (/health answers), the other cell's
session keeps producing output, new sessions go to the healthy cell, the hurt stage is
brought back (restarted on its port, or continued) and takes sessions again, and at the end
every stage of both cells has all its slots free.
(The talker SIGKILL case is covered in test_stack.py.)
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.reliability_helpers import Feeder, gateway_metric, stage_counts, wait_until
from tools.procs import ServiceProcess
from tools.run_stack import Stack

STALL_S = 1.0
# A generous talker backlog: on a loaded 2-core machine the tiny talker can fall seconds behind,
# and these tests are about input handling and faults, not about the backlog bound (churn tests that).
TALKER_ARGS = ["--max-backlog-s", "30"]
GATEWAY_ARGS = ["--stall-timeout", str(STALL_S), "--open-timeout", "120", "--cleanup-timeout", "3", "--poll-interval",
                "0.3"]
FAULTS: list[str] = []


@pytest.fixture(scope="module")
def stack(tiny_checkpoint):
    with Stack(tiny_checkpoint, sessions=2, cells=2, talker_args=TALKER_ARGS, gateway_args=GATEWAY_ARGS) as s:
        yield s
    print(f"\n[faults] injected {len(FAULTS)}: {', '.join(FAULTS)}")


def all_free(stack) -> dict:
    """Every stage of every cell: free slots == total, no stream open."""
    return {k: (2, 0) for k in stage_counts(stack)}


def health(stack) -> dict:
    h = stack.gateway.health()
    assert h is not None, "the gateway stopped answering /health"
    return h[1]


def open_on_both_cells(stack) -> tuple[Feeder, Feeder, int]:
    """Two paced sessions, one per cell (least loaded first). Returns (on cell c, on the other, c)."""
    a = Feeder(stack.gateway.ws_url, instructions="You are on one cell.")
    cell_a = next(i for i in range(2) if stage_counts(stack, [i])[(i, "talker")][1] == 1)
    b = Feeder(stack.gateway.ws_url, instructions="You are on the other.")
    assert stage_counts(stack, [1 - cell_a])[(1 - cell_a, "talker")][1] == 1, "both sessions landed on one cell"
    a.check_alive(3, timeout=60)
    b.check_alive(3, timeout=60)
    return a, b, cell_a


def new_session_works(stack) -> None:
    s = Feeder(stack.gateway.ws_url, instructions="You are new.")
    s.check_alive(3, timeout=60)
    s.stop()


def wait_serving(stack, n: int, timeout: float = 60.0) -> None:
    assert wait_until(lambda: health(stack).get("serving_cells") == n, timeout), health(stack)


def restart(stack, cell: int, stage: str) -> None:
    """Start the stage again on the same ports, as an orchestrator would."""
    old: ServiceProcess = getattr(stack.cell_procs[cell], stage)
    old.close()
    new = ServiceProcess(old.module, old.args, port=old.port, metrics_port=old.metrics_port, host=old.host,
                         ready_timeout=180)
    setattr(stack.cell_procs[cell], stage, new.start())


@pytest.mark.parametrize("stage", ["encoder", "decoder"])
def test_a_killed_codec_stage_fails_only_its_cell_and_comes_back(stack, stage):
    """SIGKILL one cell's encoder (or decoder) mid-session: that session gets a typed
    server_error quickly and its socket is closed; the other cell's session goes on; /health
    answers with one serving cell; a new session lands on the healthy cell and works; the
    surviving stages of the hurt cell free the dead session's slot; after a restart the cell
    serves again, and every slot of both cells is free at the end."""
    assert wait_until(lambda: stage_counts(stack) == all_free(stack), 30), stage_counts(stack)
    unconfirmed = gateway_metric(stack.gateway, "gateway_cleanup_unconfirmed_total")
    victim, survivor, cell = open_on_both_cells(stack)
    proc = getattr(stack.cell_procs[cell], stage).proc
    killed_at = time.monotonic()
    os.kill(proc.pid, signal.SIGKILL)
    FAULTS.append(f"SIGKILL {stage}")

    err, at = victim.wait_failed()
    assert err["error"]["type"] == "server_error" and err["error"]["code"] in ("runtime_stream_failed",
                                                                               "runtime_append_failed"), err
    assert at - killed_at < STALL_S + 1.0, f"typed error {at - killed_at:.2f}s after the kill"
    assert wait_until(lambda: victim.closed is not None, 10) and victim.closed == 1011, victim.closed
    out_before = survivor.frames
    survivor.check_alive(6)
    assert health(stack)["status"] in ("ok",) and wait_until(lambda: health(stack)["serving_cells"] == 1, 10)
    new_session_works(stack)  # can only land on the healthy cell
    survivor.check_alive(3)
    # The hurt cell's stages that still run hold nothing of the dead session.
    alive = [s for s in ("encoder", "talker", "decoder") if s != stage]
    assert wait_until(lambda: set(stage_counts(stack, [cell], alive).values()) == {(2, 0)}, 20), \
        stage_counts(stack, [cell], alive)


    restart(stack, cell, stage)
    wait_serving(stack, 2)
    new_session_works(stack)  # least loaded first: the restarted cell
    closed = survivor.stop()
    assert 0 < closed["frames_out"] <= closed["frames_in"] and closed["frames_out"] > out_before
    assert wait_until(lambda: stage_counts(stack) == all_free(stack), 30), stage_counts(stack)
    # Only the killed session's stage could not acknowledge its end; nothing else went unconfirmed.
    assert gateway_metric(stack.gateway, "gateway_cleanup_unconfirmed_total") == unconfirmed, stack.gateway.log_tail()
    assert gateway_metric(stack.gateway, "gateway_sessions_active") == 0


def test_a_stalled_talker_fails_its_session_within_the_stall_timeout_and_recovers(stack):
    """SIGSTOP one cell's talker mid-session: its session gets `server_error`/`stage_stalled`
    within the stall timeout (plus the watchdog's period and slack); the other cell's session
    goes on; /health answers; new sessions go to the healthy cell. After SIGCONT the talker
    ends the abandoned stream, frees its slot, and takes sessions again."""
    assert wait_until(lambda: stage_counts(stack) == all_free(stack), 30), stage_counts(stack)
    victim, survivor, cell = open_on_both_cells(stack)
    talker = stack.cell_procs[cell].talker.proc
    stopped_at = time.monotonic()
    os.kill(talker.pid, signal.SIGSTOP)
    FAULTS.append("SIGSTOP talker")
    try:
        err, at = victim.wait_failed()
        assert err["error"]["type"] == "server_error" and err["error"]["code"] == "stage_stalled", err
        assert STALL_S - 0.1 < at - stopped_at < STALL_S + 1.5, f"stall reported {at - stopped_at:.2f}s after SIGSTOP"
        assert wait_until(lambda: victim.closed is not None, 15) and victim.closed == 1011, victim.closed
        survivor.check_alive(6)
        assert wait_until(lambda: health(stack)["serving_cells"] == 1, 10), health(stack)
        new_session_works(stack)
        survivor.check_alive(3)
        # The stopped talker's cell: encoder and decoder already let the failed session go.
        assert wait_until(lambda: set(stage_counts(stack, [cell], ("encoder", "decoder")).values()) == {(2, 0)}, 20)
    finally:
        os.kill(talker.pid, signal.SIGCONT)
    FAULTS.append("SIGCONT talker")
    wait_serving(stack, 2)
    assert wait_until(lambda: stage_counts(stack, [cell])[(cell, "talker")] == (2, 0), 20), stage_counts(stack, [cell])
    new_session_works(stack)
    survivor.stop()
    assert wait_until(lambda: stage_counts(stack) == all_free(stack), 30), stage_counts(stack)
    assert gateway_metric(stack.gateway, "gateway_sessions_active") == 0
    assert talker.poll() is None, "the talker died of the stall"
