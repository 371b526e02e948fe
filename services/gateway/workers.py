"""`--workers N`: N gateway processes on one port, and the parent process that supervises them.

Sharing the port. The parent binds N listening sockets to the one address with SO_REUSEPORT and hands
socket i to worker i; the kernel spreads new connections over them by a hash of each connection's
addresses. Chosen over one socket that every worker accepts from, because asyncio accepts every queued
connection on one wake-up (a burst of callers would land on whichever worker woke first), and because a
socket the parent holds outlives its worker: connections queued on it while the worker restarts wait for
the new one instead of being reset. Linux only (elsewhere SO_REUSEPORT does not balance). Any process of
the same user could join the port the same way; run the gateway as its own user.

Supervision.
- SIGTERM or SIGINT: the parent closes its copies of the sockets and forwards SIGTERM to every worker, which
  closes its sessions as a lone gateway does; the parent exits 0 when all have. Another signal more than
  REPEAT_S later kills the workers (SIGKILL); one sooner is the same request arriving twice (Ctrl-C reaches
  the whole process group, and a launcher such as run_stack then sends its own SIGTERM).
- A worker that exits while the parent is not stopping is restarted on its socket. Its sessions are gone:
  their clients see the connection drop, and each stage frees the slots when the worker's gRPC
  connections close. A crash loop (more than MAX_RESTARTS within RESTART_WINDOW_S) stops every worker and
  the parent exits 1, so a bad deployment fails loudly instead of spinning.
- Workers die with the parent: each asks the kernel for SIGTERM when the parent dies (PR_SET_PDEATHSIG).
- A worker is `python -m services.gateway.workers INDEX FD PARENT_PID` (so ps and py-spy name it) with the
  parent's config pickled on its stdin; the parent's only children are its workers.
- Metrics: a private PROMETHEUS_MULTIPROC_DIR per start, removed at exit; a dead worker's live gauges
  (sessions active, its connections) are dropped from the sums at once (mark_process_dead; metrics.py).
- Resumes: a private directory per start (0700, removed at exit, named to the workers by RELAY_DIR_ENV)
  where each worker listens on a Unix socket of its own; a resume that lands on another worker than its
  session's is piped there (resume_relay.py). A restarted worker binds its socket afresh.

Per worker, not per gateway: each worker polls every stage's GetCapacity (N times the polls), and its
least-loaded ordering counts only its own sessions and admissions. The stage's slot refusal is the
authority on admission: a worker that picks a cell another worker has just filled is refused there and
tries the next cell, so no session is admitted twice and a refusal holds no slot.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import pickle
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from prometheus_client.multiprocess import mark_process_dead

from services.gateway.config import GatewayConfig

log = logging.getLogger("gateway.workers")

MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
REPEAT_S = 1.0
LISTEN_BACKLOG = 100  # asyncio's create_server default, as a lone gateway listens
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
RELAY_DIR_ENV = "GATEWAY_RESUME_RELAY_DIR"


def supervise(config: GatewayConfig) -> int:
    """Run config.workers gateway workers on config.host:port until signalled; the exit code."""
    if not sys.platform.startswith("linux"):
        log.error("--workers %d needs Linux (SO_REUSEPORT balancing); run one worker here", config.workers)
        return 2
    try:
        sockets = _listen(config.host, config.port, config.workers)
    except OSError as e:
        log.error("cannot listen on %s:%d: %s", config.host, config.port, e)
        return 1
    metrics_dir = tempfile.mkdtemp(prefix="gateway-metrics-")
    relay_dir = tempfile.mkdtemp(prefix="gateway-resume-")  # mkdtemp makes it 0700: only this user connects
    try:
        return _Supervisor(config, sockets, metrics_dir, relay_dir).run()
    finally:
        for s in sockets:
            s.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
        shutil.rmtree(relay_dir, ignore_errors=True)


def _listen(host: str, port: int, n: int) -> list[socket.socket]:
    """n listening sockets on one address (the first that host resolves to); port 0 picks one port for all."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, type_, proto, _, addr = infos[0]
    sockets: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(family, type_, proto)
            sockets.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind(addr if len(sockets) == 1 else (addr[0], sockets[0].getsockname()[1], *addr[2:]))
            s.listen(LISTEN_BACKLOG)
    except OSError:
        for s in sockets:
            s.close()
        raise
    return sockets


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


class _Supervisor:
    def __init__(self, config: GatewayConfig, sockets: list[socket.socket], metrics_dir: str, relay_dir: str):
        self.config, self.sockets, self.metrics_dir, self.relay_dir = config, sockets, metrics_dir, relay_dir
        self.procs: dict[int, subprocess.Popen] = {}
        self.exits: dict[int, int] = {}  # worker index -> a pidfd readable once that worker has exited
        self.restarts: collections.deque[float] = collections.deque()
        self.first_signal_at: float | None = None
        self.kill_requested = False
        self.stopping = self.killing = False
        self.exit_code = 0

    def run(self) -> int:
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)  # a signal wakes the wait below at once
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        host, port = self.sockets[0].getsockname()[:2]
        log.info("gateway: %d workers on %s://%s:%d (one SO_REUSEPORT socket each)", len(self.sockets),
                 "https" if self.config.tls_cert else "http", host, port)
        for i in range(len(self.sockets)):
            self._start(i)
        try:
            while self.procs:
                select.select([*self.exits.values(), wake_r], [], [])
                while True:
                    try:
                        if not os.read(wake_r, 64):
                            break
                    except BlockingIOError:
                        break
                if self.kill_requested and not self.killing:
                    log.warning("second signal: killing the workers")
                    self.killing = True
                    self._stop(signal.SIGKILL)
                elif self.first_signal_at is not None and not self.stopping:
                    log.info("stopping: %d workers close their sessions", len(self.procs))
                    self._stop(signal.SIGTERM)
                self._reap()
        finally:
            signal.set_wakeup_fd(-1)
            os.close(wake_r)
            os.close(wake_w)
        log.info("gateway stopped")
        return self.exit_code

    def _on_signal(self, signum, frame) -> None:
        now = time.monotonic()
        if self.first_signal_at is None:
            self.first_signal_at = now
        elif now - self.first_signal_at > REPEAT_S:
            self.kill_requested = True

    def _start(self, i: int) -> None:
        fd = self.sockets[i].fileno()
        cmd = [sys.executable, "-m", "services.gateway.workers", str(i), str(fd), str(os.getpid())]
        env = {**os.environ, METRICS_DIR_ENV: self.metrics_dir, RELAY_DIR_ENV: self.relay_dir}
        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, pass_fds=[fd], env=env)
        self.procs[i], self.exits[i] = p, os.pidfd_open(p.pid)
        log.info("worker %d started (pid %d)", i, p.pid)
        try:
            p.stdin.write(pickle.dumps(self.config))
            p.stdin.close()
        except BrokenPipeError:  # it died at once: reaped like any exit
            pass

    def _stop(self, sig: signal.Signals) -> None:
        if not self.stopping:
            self.stopping = True
            for s in self.sockets:
                s.close()  # the workers hold their own copies until they stop listening
        for p in self.procs.values():
            try:
                os.kill(p.pid, sig)
            except ProcessLookupError:
                pass

    def _reap(self) -> None:
        for i, p in list(self.procs.items()):
            if p.poll() is None:
                continue
            del self.procs[i]
            os.close(self.exits.pop(i))
            mark_process_dead(p.pid, self.metrics_dir)
            if self.stopping:
                log.info("worker %d (pid %d) %s", i, p.pid, _exit_reason(p.returncode))
            else:
                self._crashed(i, p)

    def _crashed(self, i: int, p: subprocess.Popen) -> None:
        now = time.monotonic()
        while self.restarts and now - self.restarts[0] > RESTART_WINDOW_S:
            self.restarts.popleft()
        if len(self.restarts) >= MAX_RESTARTS:
            log.critical("worker %d (pid %d) %s: %d restarts within %.0f s, stopping the gateway",
                         i, p.pid, _exit_reason(p.returncode), len(self.restarts), RESTART_WINDOW_S)
            self.exit_code = 1
            self._stop(signal.SIGTERM)
            return
        self.restarts.append(now)
        log.error("worker %d (pid %d) %s; its sessions are lost; restarting it", i, p.pid, _exit_reason(p.returncode))
        self._start(i)


def _worker_main(argv: list[str]) -> None:
    """`python -m services.gateway.workers INDEX FD PARENT_PID`, started by _Supervisor._start: a Gateway on
    the parent's socket until SIGTERM/SIGINT, its metrics and its resume relay socket in the parent's
    directories."""
    index, fd, parent_pid = (int(a) for a in argv)
    _die_with_parent(parent_pid)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s gateway[w{index}] %(name)s: %(message)s")
    logging.getLogger("websockets").setLevel(logging.WARNING)
    metrics_dir = os.environ.get(METRICS_DIR_ENV)  # set before prometheus_client was imported, as it needs
    if not metrics_dir:
        raise SystemExit(f"gateway worker {index}: no {METRICS_DIR_ENV}; start workers with --workers N")
    config: GatewayConfig = pickle.load(sys.stdin.buffer)  # the parent's own config, over a pipe only it holds
    from services.gateway.server import Gateway, serve_until_signalled

    gateway = Gateway(config, worker=index, listen_socket=socket.socket(fileno=fd), metrics_dir=metrics_dir,
                      relay_dir=os.environ.get(RELAY_DIR_ENV))
    asyncio.run(serve_until_signalled(gateway))


def _die_with_parent(parent_pid: int) -> None:
    """SIGTERM (so this worker closes its sessions) when the parent dies; exit now if it already has."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:
        raise SystemExit("the gateway supervisor is gone")


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
