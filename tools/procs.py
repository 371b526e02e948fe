"""Start and stop real service processes (for tests and the local stack).

    with ServiceProcess("services.encoder", ["--checkpoint", str(ckpt), "--slots", "4"]) as enc:
        channel = grpc.insecure_channel(enc.address)      # "127.0.0.1:<free port>"
        ... enc.metrics_url                               # "http://127.0.0.1:<port>/metrics"

The process runs `python -m <module> --port P --metrics-port M <args>` from the
repo root with this interpreter. `start()` returns once the process's standard
grpc.health.v1 check answers SERVING; if the process exits first or the timeout
passes, ServiceStartError carries the tail of its stderr. `stop()` sends
SIGTERM (the services drain and exit), then SIGKILL after a timeout.
To start several at once: `spawn()` each, then `wait_ready()` each.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parent.parent


class ServiceStartError(RuntimeError):
    """A service process exited or did not become SERVING in time; the message has its stderr tail."""


def die_with_parent() -> None:
    """In the child, before exec: get SIGTERM if the parent (a test run) dies, so no service is orphaned."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the kernel's pick for port 0), never one this process
    handed out before: the kernel can pick a closed port again, and two services of a stack
    given the same port would have one answer for both (its health check passes for either)."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise RuntimeError("no fresh free port after 100 tries")


def health_status(address: str, service: str = "", timeout: float = 1.0) -> int | None:
    """The grpc.health.v1 status of `service` at `address`, or None if it does not answer."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=timeout)
        except grpc.RpcError:
            return None
        return reply.status


class ServiceProcess:
    def __init__(
        self,
        module: str,
        args: Sequence[str] = (),
        *,
        port: int | None = None,
        metrics_port: int | None = None,
        env: dict[str, str] | None = None,
        ready_timeout: float = 60.0,
        host: str = "127.0.0.1",
    ):
        self.module = module
        self.args = list(args)
        self.host = host
        self.port = port or free_port(host)
        self.metrics_port = metrics_port or free_port(host)
        self.env = {**os.environ, **(env or {})}
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen | None = None
        self._stderr = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def stderr_tail(self, chars: int = 4000) -> str:
        if self._stderr is None:
            return ""
        self._stderr.flush()
        self._stderr.seek(0)
        return self._stderr.read()[-chars:]

    def spawn(self) -> "ServiceProcess":
        """Start the process without waiting (to start several in parallel; then wait_ready each)."""
        if self.proc is not None:
            raise RuntimeError(f"{self.module} was already started (pid {self.proc.pid})")
        cmd = [sys.executable, "-m", self.module, "--host", self.host, "--port", str(self.port), "--metrics-port",
               str(self.metrics_port), *self.args]
        # stderr to a file, not a pipe: a chatty service must never block on a full pipe.
        self._stderr = tempfile.TemporaryFile(mode="w+", prefix=f"{self.module}-", suffix=".stderr")
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=self.env, stdout=subprocess.DEVNULL, stderr=self._stderr,
                                     preexec_fn=die_with_parent)
        self._deadline = time.monotonic() + self.ready_timeout
        return self

    def wait_ready(self) -> "ServiceProcess":
        """Block until health says SERVING; ServiceStartError (with stderr) if it exits or times out."""
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ServiceStartError(f"{self.module} exited with code {code} before serving:\n{self.stderr_tail()}")
            if health_status(self.address, timeout=0.5) == health_pb2.HealthCheckResponse.SERVING:
                return self
            if time.monotonic() > self._deadline:
                self.stop()
                raise ServiceStartError(f"{self.module} not SERVING on {self.address} after "
                                        f"{self.ready_timeout:g}s:\n{self.stderr_tail()}")
            time.sleep(0.1)

    def start(self) -> "ServiceProcess":
        return self.spawn().wait_ready()

    def terminate(self) -> None:
        """Send SIGTERM (the service starts draining) without waiting."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, wait up to `timeout`, then SIGKILL. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def close(self) -> None:
        self.stop()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def __enter__(self) -> "ServiceProcess":
        """Start (or, if already spawned, wait for) the process."""
        return self.start() if self.proc is None else self.wait_ready()

    def __exit__(self, *exc) -> None:
        self.close()
