"""`--workers 2`: two gateway processes on one port in front of one cell of 4 talker slots.

Real encoder, talker and decoder processes on the tiny checkpoint, the real gateway with its
supervisor, real WebSocket clients: admission across workers, /metrics and /health merged over
workers, a worker killed mid-session, and the stop. `auto` and the cgroup quota are plain unit tests.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.error
import urllib.request
import json
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.exceptions import ConnectionClosed

from duplex.v1 import common_pb2, decoder_pb2_grpc, encoder_pb2_grpc, talker_pb2_grpc
from services.gateway.config import GatewayConfig, parse_workers, usable_cpus
from services.gateway.workers import MAX_RESTARTS, RESTART_WINDOW_S
from tests.realtime_client import RT, eventually, pcm16_b64, tone
from tools.run_stack import GatewayProcess, Stack

SLOTS = 4
GATEWAY_ARGS = ["--stall-timeout", "30", "--open-timeout", "120", "--cleanup-timeout", "20", "--poll-interval", "0.2"]
_STUBS = {"encoder": encoder_pb2_grpc.EncoderStub, "talker": talker_pb2_grpc.TalkerStub,
          "decoder": decoder_pb2_grpc.DecoderStub}


@pytest.fixture(scope="module")
def stack(tiny_checkpoint):
    # Every stage has SLOTS slots, as deployed. The gateway opens a session on the talker first and on
    # the codecs once it accepts, so racing callers from two workers cannot take each stage's last
    # slots in different orders (a caller refused by any stage is refused whole).
    with Stack(tiny_checkpoint, sessions=SLOTS, gateway_workers="2", gateway_args=GATEWAY_ARGS) as s:
        yield s


# ---- helpers ---------------------------------------------------------------------------------


def active_streams(stack, stage: str) -> int:
    with grpc.insecure_channel(getattr(stack.cell_procs[0], stage).address) as ch:
        return _STUBS[stage](ch).GetCapacity(common_pb2.CapacityRequest(), timeout=5).active_streams


def stage_load(stack) -> dict[str, int]:
    return {s: active_streams(stack, s) for s in _STUBS}


def health(gateway: GatewayProcess) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(gateway.http_url + "/health", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def samples(gateway: GatewayProcess) -> dict[tuple[str, tuple], float]:
    """One /metrics answer: (sample name, sorted labels) -> value."""
    with urllib.request.urlopen(gateway.http_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    families = text_string_to_metric_families(text)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in families for s in fam.samples}


def total(gateway: GatewayProcess, name: str) -> float:
    return sum(v for (n, _), v in samples(gateway).items() if n == name)


def per_worker(gateway: GatewayProcess, name: str) -> dict[str, float]:
    return {dict(labels)["worker"]: v for (n, labels), v in samples(gateway).items() if n == name}


def worker_pids(gateway: GatewayProcess, timeout: float = 30.0) -> dict[int, int]:
    """worker index -> pid, from /health answers: each new connection is hashed to one worker's socket."""
    seen: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    while len(seen) < 2 and time.monotonic() < deadline:
        status, body = health(gateway)
        assert status == 200 and body["worker"]["workers"] == 2, body
        seen[body["worker"]["index"]] = body["worker"]["pid"]
    assert set(seen) == {0, 1}, f"only workers {sorted(seen)} answered /health"
    return seen


def children(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        out += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
    return out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def all_gone(pids: list[int], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(alive(p) for p in pids)


async def at_baseline(stack) -> None:
    g = stack.gateway
    assert await eventually(lambda: stage_load(stack) == {"encoder": 0, "talker": 0, "decoder": 0}), stage_load(stack)
    assert await eventually(lambda: total(g, "gateway_sessions_active") == 0), total(g, "gateway_sessions_active")
    assert await eventually(lambda: set(per_worker(g, "gateway_worker_websockets_open").values()) == {0}), \
        per_worker(g, "gateway_worker_websockets_open")


# ---- the cell's slots are the authority across workers -----------------------------------------


async def test_twelve_concurrent_opens_admit_exactly_four_across_two_workers(stack):
    g = stack.gateway
    worker_pids(g)
    await at_baseline(stack)
    taken_before = per_worker(g, "gateway_worker_websockets_total")

    async def call(i: int) -> tuple[RT, dict]:
        rt = await RT.connect(g.ws_url)
        return rt, await rt.open(instructions=f"Caller {i}.")

    results = await asyncio.gather(*(call(i) for i in range(12)))
    admitted = [rt for rt, first in results if first["type"] == "session.created"]
    refused = [(rt, first) for rt, first in results if first["type"] != "session.created"]
    assert len(admitted) == SLOTS and len(refused) == 12 - SLOTS, [first["type"] for _, first in results]
    for rt, first in refused:
        # Typed, before any session.created, and the socket closes with "try again later".
        assert first["type"] == "error" and first["error"]["code"] == "resource_exhausted", first
        assert first["error"]["type"] == "rate_limit_error"
        with pytest.raises(ConnectionClosed):
            while True:
                assert (await rt.recv(30))["type"] != "session.created"
        assert rt.ws.close_code == 1013

    # Both workers took some of the 12 connections (all on one has probability 2^-11 under the kernel's hash).
    taken = {w: v - taken_before.get(w, 0) for w, v in per_worker(g, "gateway_worker_websockets_total").items()}
    assert set(taken) == {"0", "1"} and sum(taken.values()) == 12 and min(taken.values()) > 0, taken
    # One /metrics answer, whichever worker gave it, sums the sessions of both.
    assert stage_load(stack)["talker"] == SLOTS
    assert await eventually(lambda: total(g, "gateway_sessions_active") == SLOTS)
    assert await eventually(lambda: sum(per_worker(g, "gateway_worker_websockets_open").values()) == SLOTS)
    assert total(g, "gateway_sessions_refused_total") >= 12 - SLOTS

    for rt in admitted:
        await rt.close()
    await at_baseline(stack)


# ---- a worker dies -----------------------------------------------------------------------------


async def feed_until_frames(rt: RT, frames: int) -> None:
    x = tone(frames + 4)
    for i in range(frames + 4):
        await rt.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(x[i * 1920 : (i + 1) * 1920])})
    assert await rt.wait_frames(frames) >= frames


async def test_a_killed_worker_loses_only_its_sessions_and_is_replaced(stack):
    g = stack.gateway
    pids = worker_pids(g)
    sessions = []
    for i in range(SLOTS):
        rt = await RT.connect(g.ws_url)
        assert (await rt.open(instructions=f"Caller {i}."))["type"] == "session.created"
        sessions.append(rt)
    held = per_worker(g, "gateway_worker_websockets_open")
    victim = max(held, key=held.get)
    lost = int(held[victim])
    assert lost >= 1 and sum(held.values()) == SLOTS, held

    os.kill(pids[int(victim)], signal.SIGKILL)

    async def dropped(rt: RT) -> bool:
        try:
            await asyncio.wait_for(rt.ws.wait_closed(), 5)
            return True
        except asyncio.TimeoutError:
            return False

    gone = await asyncio.gather(*(dropped(rt) for rt in sessions))
    survivors = [rt for rt, d in zip(sessions, gone) if not d]
    assert sum(gone) == lost, (gone, held)
    # The dead worker's part leaves the sums at once, and the stages free its slots.
    assert await eventually(lambda: total(g, "gateway_sessions_active") == SLOTS - lost)
    assert per_worker(g, "gateway_worker_websockets_open").get(victim, 0) == 0
    assert await eventually(lambda: stage_load(stack)["talker"] == SLOTS - lost), stage_load(stack)
    # The other worker's sessions go on; the supervisor restarted the dead one on its socket.
    await asyncio.gather(*(feed_until_frames(rt, 3) for rt in survivors))
    restarted = worker_pids(g)
    assert restarted[int(victim)] != pids[int(victim)] and restarted[1 - int(victim)] == pids[1 - int(victim)]
    for rt in survivors:
        await rt.close()
    await at_baseline(stack)
    # Its freed slots admit new sessions again.
    again = [await RT.connect(g.ws_url) for _ in range(SLOTS)]
    assert [(await rt.open())["type"] for rt in again] == ["session.created"] * SLOTS
    for rt in again:
        await rt.close()
    await at_baseline(stack)


# ---- processes ---------------------------------------------------------------------------------


def test_one_worker_is_the_gateway_process_alone(stack):
    spec = stack.cell_procs[0].spec
    with_one = GatewayProcess(spec, args=[*GATEWAY_ARGS, "--workers", "1"]).start()
    try:
        assert children(with_one.proc.pid) == []
        status, body = health(with_one)
        assert status == 200 and body["worker"] == {"index": 0, "pid": with_one.proc.pid, "workers": 1}
    finally:
        with_one.stop()
    assert with_one.proc.returncode == 0


def test_workers_die_with_a_killed_supervisor(stack):
    extra = GatewayProcess(stack.cell_procs[0].spec, args=[*GATEWAY_ARGS, "--workers", "2"]).start()
    try:
        workers = list(worker_pids(extra).values())
        extra.proc.kill()
        extra.proc.wait(10)
        assert all_gone(workers), extra.log_tail()
    finally:
        extra.stop()


def test_a_crash_loop_stops_the_gateway_loudly(stack):
    extra = GatewayProcess(stack.cell_procs[0].spec, args=[*GATEWAY_ARGS, "--workers", "2"]).start()
    try:
        killed: set[int] = set()
        deadline = time.monotonic() + 60
        while extra.proc.poll() is None and time.monotonic() < deadline:
            for pid in set(children(extra.proc.pid)) - killed:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            time.sleep(0.05)
        # Crashes are restarted up to MAX_RESTARTS within the window; the next stops the gateway: exit 1, said why.
        assert extra.proc.wait(30) == 1, extra.log_tail()
        log = extra.log_tail(20000)
        assert len(killed) > MAX_RESTARTS and log.count("restarting it") == MAX_RESTARTS, (killed, log)
        assert f"{MAX_RESTARTS} restarts within {RESTART_WINDOW_S:.0f} s, stopping the gateway" in log
    finally:
        extra.stop()


async def test_zz_ctrl_c_under_a_launcher_drains_every_worker_and_removes_the_metrics_dir(stack):
    g = stack.gateway
    procs = children(g.proc.pid)
    workers = worker_pids(g)
    assert sorted(workers.values()) == sorted(procs)  # the supervisor's only children are its workers
    pairs = Path(f"/proc/{workers[0]}/environ").read_bytes().split(b"\0")
    environ = dict(kv.split(b"=", 1) for kv in pairs if b"=" in kv)
    metrics_dir = Path(environ[b"PROMETHEUS_MULTIPROC_DIR"].decode())
    assert metrics_dir.is_dir() and any(metrics_dir.glob("*.db"))
    sessions = [await RT.connect(g.ws_url) for _ in range(SLOTS)]
    assert [(await rt.open())["type"] for rt in sessions] == ["session.created"] * SLOTS
    # Ctrl-C reaches the supervisor, then its launcher's SIGTERM: one stop, the workers drain.
    g.proc.send_signal(signal.SIGINT)
    g.proc.send_signal(signal.SIGTERM)
    for rt in sessions:
        await asyncio.wait_for(rt.ws.wait_closed(), 30)
        assert rt.ws.close_code == 1001, rt.ws.close_code  # "going away", as a lone gateway closes
    assert await asyncio.to_thread(g.proc.wait, 30) == 0, g.log_tail()
    assert all_gone(procs), [Path(f"/proc/{p}/cmdline").read_bytes() for p in procs if alive(p)]
    assert not metrics_dir.exists()
    log = g.log_tail()
    for i, pid in workers.items():
        assert f"worker {i} (pid {pid}) exited with code 0" in log, log
    assert "killing" not in log and "gateway stopped" in log
    assert await eventually(lambda: stage_load(stack) == {"encoder": 0, "talker": 0, "decoder": 0}), stage_load(stack)


# ---- auto --------------------------------------------------------------------------------------


def test_auto_is_the_usable_cpus_capped_by_the_cgroup_quota(tmp_path, monkeypatch):
    affinity = len(os.sched_getaffinity(0))
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cpus(tmp_path) == affinity
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # half a CPU: one worker
    assert usable_cpus(tmp_path) == 1
    (tmp_path / "cpu.max").write_text(f"{affinity * 100000 + 1} 100000\n")  # more quota than CPUs
    assert usable_cpus(tmp_path) == affinity
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("150000\n")  # cgroup v1, 1.5 CPUs rounds up
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert usable_cpus(tmp_path) == min(2, affinity)
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert usable_cpus(tmp_path) == affinity

    assert parse_workers("auto") == usable_cpus() and parse_workers("3") == 3
    with pytest.raises(ValueError):
        parse_workers("0")
    cells = ["--cells", "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3"]
    monkeypatch.setenv("GATEWAY_WORKERS", "3")
    assert GatewayConfig.from_args(cells).workers == 3
    assert GatewayConfig.from_args([*cells, "--workers", "2"]).workers == 2  # the flag wins over the environment
    monkeypatch.setenv("GATEWAY_WORKERS", "lots")
    with pytest.raises(SystemExit):
        GatewayConfig.from_args(cells)
