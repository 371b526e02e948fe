"""`--procs K`: the paced load mode spread over K driver processes, merged as if one driver ran it.

Each child is `python -m tools.load_driver` with the same options on one Shard (sessions p, p+K, ...).
The protocol, over the child's stdin and stdout:
  1. the child admits its sessions (in the arrivals and burst traffic: none, they dial later), then prints
     ADMITTED (and, with --progress, a PROGRESS line of
     counts every second from the start, which the parent sums into its own progress line);
  2. once every child has, the parent writes one shared input start (time.monotonic(): one clock for
     every process of the host) to each child's stdin; session g of N starts g/N of a period after it;
  3. the child streams, drains, closes, writes its result (calls.run_traffic's) to its --shard-result file
     and exits 0. If its stdin closes before that (the parent died), it stops and closes its sessions.
The parent merges the rows (shared response ids are checked across processes too). A child that dies
or hangs turns its sessions into failed rows and the verdict INVALID (a client-side cause).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from .config import ENV_PREFIX, FRAME_PERIOD_S, DriverConfig
from .input_audio import frame_count
from .calls import run_traffic
from .load import Shard, mark_shared_response_ids, new_run, session_row
from .report import merge_counts, progress_counts

ADMITTED = "load_driver:admitted"
PROGRESS = "load_driver:progress "
# Lead time between the start being chosen and the first send: covers the pipe and the children's wakeup.
PROCS_START_LEAD_S = 0.25
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding tools/


def config_argv(config: DriverConfig) -> list[str]:
    """Command-line options that parse back to `config` (None fields left out)."""
    argv = []
    for f in fields(DriverConfig):
        value, flag = getattr(config, f.name), "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            argv += [flag, str(value)]
    return argv


# -- the child ------------------------------------------------------------------------------


class ProgressFeed:
    """A child's progress: its counts as a PROGRESS line on stdout every second, for the parent."""

    def __init__(self) -> None:
        self._task: asyncio.Task[None] | None = None

    def watch(self, runs: list, frames_per_session: int) -> None:
        self._task = asyncio.create_task(self._loop(runs, frames_per_session))

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _loop(self, runs: list, frames_per_session: int) -> None:
        while True:
            print(PROGRESS + json.dumps(progress_counts(runs, frames_per_session)), flush=True)
            await asyncio.sleep(1.0)


async def run_shard(config: DriverConfig, shard: Shard, pcm: np.ndarray) -> dict[str, Any]:
    """One child's part: calls.run_traffic on its shard, started by the parent's shared input start."""
    loop = asyncio.get_running_loop()
    start: asyncio.Future[float] = loop.create_future()
    task = asyncio.current_task()
    finished = False

    def on_parent(line: bytes) -> None:
        if line.strip() and not start.done():
            start.set_result(float(line))
        elif not finished and task is not None:
            task.cancel()  # stdin closed: the parent is gone

    def read_parent() -> None:
        # os.read, not sys.stdin: a daemon thread blocked in a buffered read can abort interpreter exit.
        for _ in range(2):  # the start, then end of file
            line = _read_line(0)
            try:
                loop.call_soon_threadsafe(on_parent, line)
            except RuntimeError:  # the run is over and its loop closed
                return

    threading.Thread(target=read_parent, daemon=True, name="parent-link").start()

    async def start_at() -> float:
        print(ADMITTED, flush=True)
        return await start

    try:
        feed = ProgressFeed() if config.progress else None
        return await run_traffic(config, pcm, feed, shard=shard, start_at=start_at)
    finally:
        finished = True


def _read_line(fd: int) -> bytes:
    """Bytes up to a newline, or b"" at end of file."""
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(fd, 1)
        if not chunk:
            return b""
        line += chunk
    return line


# -- the parent -----------------------------------------------------------------------------


@dataclass
class Child:
    shard: Shard
    result_path: Path
    proc: asyncio.subprocess.Process | None = None
    admitted: bool = False
    error: str | None = None
    counts: dict[str, Any] | None = None  # its latest PROGRESS
    reader: asyncio.Task[None] | None = None
    told: asyncio.Event = field(default_factory=asyncio.Event)  # admitted, or its stdout ended


async def _spawn(child: Child, config: DriverConfig) -> None:
    options = replace(config, procs=1, output_dir=None, plot=False)
    argv = [*config_argv(options), "--shard", f"{child.shard.index}/{child.shard.count}",
            "--shard-result", str(child.result_path)]
    # The child's whole config is its argv: none of the parent's LOAD_DRIVER_* variables (output_dir, say).
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")]))
    child.proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tools.load_driver", *argv,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env,
    )
    child.reader = asyncio.create_task(_read_child(child))


async def _read_child(child: Child) -> None:
    """The child's stdout for its whole life: ADMITTED once, PROGRESS lines, end of file."""
    assert child.proc is not None and child.proc.stdout is not None
    try:
        while True:
            try:
                raw = await child.proc.stdout.readline()
                if not raw:
                    return
                line = raw.decode(errors="replace").strip()
                if line == ADMITTED:
                    child.admitted = True
                    child.told.set()
                elif line.startswith(PROGRESS):
                    child.counts = json.loads(line[len(PROGRESS):])
            except ValueError:  # an overlong or garbled line is skipped (reading on keeps the pipe flowing)
                continue
    finally:
        child.told.set()


async def _await_admission(child: Child, timeout_s: float) -> None:
    assert child.proc is not None
    try:
        await asyncio.wait_for(child.told.wait(), timeout_s)
    except TimeoutError:
        child.error = f"did not finish admission within {timeout_s:.0f} s"
        return
    if not child.admitted:
        child.error = f"exited with code {await child.proc.wait()} before admission"


async def _send_start(child: Child, start: float) -> None:
    assert child.proc is not None and child.proc.stdin is not None
    try:
        child.proc.stdin.write(f"{start!r}\n".encode())
        await child.proc.stdin.drain()
    except (BrokenPipeError, ConnectionResetError):
        child.error = f"exited with code {await child.proc.wait()} before the start"


async def _await_exit(child: Child, timeout_s: float) -> None:
    assert child.proc is not None
    try:
        code = await asyncio.wait_for(child.proc.wait(), timeout_s)
    except TimeoutError:
        child.error = f"did not finish within {timeout_s:.0f} s"
        return
    if code != 0:
        child.error = f"exited with code {code}"


async def _stop(child: Child, grace_s: float) -> None:
    """Interrupt a child still running (it closes its sessions), then kill it after `grace_s`."""
    proc = child.proc
    if proc is None:
        return
    if proc.returncode is None:
        proc.send_signal(signal.SIGINT)
        try:
            await asyncio.wait_for(proc.wait(), grace_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()
    if proc.stdin is not None:
        proc.stdin.close()
    if child.reader is not None:
        await child.reader


async def run_procs(config: DriverConfig, procs: int, pcm: np.ndarray, progress=None) -> dict[str, Any]:
    """Run the load over `procs` child processes; returns run_load's result for all of them, merged."""
    note = progress.note if progress is not None else (lambda message: None)
    stream_s = frame_count(pcm) * FRAME_PERIOD_S
    with tempfile.TemporaryDirectory(prefix="load_driver-") as tmp:
        children = [Child(Shard(p, procs), Path(tmp) / f"proc-{p}.json") for p in range(procs)]
        if progress is not None:
            progress.watch_counts(lambda: merge_counts([c.counts for c in children if c.counts is not None]))
        try:
            for child in children:
                await _spawn(child, config)
            await asyncio.gather(*(_await_admission(c, 2 * config.timeout_s + 30) for c in children))
            start = time.monotonic() + PROCS_START_LEAD_S
            for child in (c for c in children if c.admitted):
                await _send_start(child, start)
            note(f"{sum(c.admitted for c in children)}/{procs} driver processes admitted their sessions; streaming")
            # A stream that falls behind re-anchors rather than ends early: allow it twice its length.
            run_timeout_s = stream_s * 2 + config.drain_s + 2 * config.cleanup_timeout_s + config.timeout_s + 30
            await asyncio.gather(*(_await_exit(c, run_timeout_s) for c in children if c.error is None))
        finally:
            if progress is not None:
                progress.stop()
            await asyncio.gather(*(_stop(c, 2 * config.cleanup_timeout_s + 5) for c in children))
        return merge(config, children, start, frame_count(pcm))


def merge(config: DriverConfig, children: list[Child], start: float, frames: int) -> dict[str, Any]:
    """The children's results as one run_load result; a failed child's sessions become failed rows."""
    rows, processes, capabilities = [], [], None
    for child in children:
        part = None
        if child.error is None:
            try:
                part = json.loads(child.result_path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                child.error = f"no readable result ({type(exc).__name__})"
        if part is None:
            rows += lost_rows(config, child)
        else:
            rows += part["sessions"]
            capabilities = capabilities or part["capabilities"]
        processes.append({
            "index": child.shard.index,
            "pid": child.proc.pid if child.proc is not None else None,
            "sessions": list(child.shard.sessions(config.sessions or 0)),
            "exit_code": child.proc.returncode if child.proc is not None else None,
            "error": child.error,
        })
    rows.sort(key=lambda row: row["index"])
    return {
        "frames_per_session": frames,
        "stream_start_s": start,
        "capabilities": capabilities,
        "shared_response_ids": mark_shared_response_ids(rows),
        "driver_processes": processes,
        "sessions": rows,
    }


def lost_rows(config: DriverConfig, child: Child) -> list[dict[str, Any]]:
    """Failed rows for the sessions of a child that left no result."""
    rows = []
    for index in child.shard.sessions(config.sessions or 0):
        run = new_run(index, config, child.shard)
        run.error = f"driver process {child.shard.index} {child.error}"
        rows.append(session_row(run, config))
    return rows
