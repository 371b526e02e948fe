"""The whole stack on this machine: encoder, talker, decoder (one or more cells) and the gateway.

    python -m tools.run_stack                       # what `make run` runs: tiny checkpoint, 2 sessions
    python -m tools.run_stack --checkpoint DIR --sessions 4 --device cuda --port 8000 --gateway-workers auto

Every service is its own process (started with tools.procs). The script waits for each
to be healthy, prints the URLs, and stops everything on Ctrl-C (SIGTERM, then SIGKILL).

`Stack` is also what the end-to-end tests use: each process is reachable so a test can
kill one stage of one cell.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from services.common.config import load_config, option
from services.common.stage_gate import LINK_TOKEN_ENV
from services.common.stage_server import ADMIN_TOKEN_ENV
from tools.procs import REPO_ROOT, ServiceProcess, ServiceStartError, die_with_parent, free_port
from tools.tls_cert import LocalTls, ensure_local_tls, trust_hint


ENV_PREFIX = "RUN_STACK_"  # every option also reads RUN_STACK_<OPTION> (services/common/config.py)
TLS_DIR = REPO_ROOT / ".cache" / "tls"  # git-ignored


@dataclass
class CellProcs:
    encoder: ServiceProcess
    talker: ServiceProcess
    decoder: ServiceProcess

    @property
    def spec(self) -> str:
        return f"{self.encoder.address},{self.talker.address},{self.decoder.address}"

    def all(self) -> list[ServiceProcess]:
        return [self.encoder, self.talker, self.decoder]


class GatewayProcess:
    """`python -m services.gateway` as a subprocess; ready when /health says 200. With `tls`, https and
    wss (its URLs say so, and its own health checks trust `tls.ca`)."""

    def __init__(self, cells: str, port: int = 0, host: str = "127.0.0.1", args: list[str] = (),
                 env: dict | None = None, tls: LocalTls | None = None):
        self.host, self.port = host, port or free_port(host)
        self.tls = tls
        tls_args = ["--tls-cert", str(tls.cert), "--tls-key", str(tls.key)] if tls else []
        self.cmd = [sys.executable, "-m", "services.gateway", "--host", host, "--port", str(self.port),
                    "--cells", cells, *tls_args, *args]
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.TemporaryFile(mode="w+", prefix="gateway-", suffix=".log")

    @property
    def http_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"{'wss' if self.tls else 'ws'}://{self.host}:{self.port}/v1/realtime?duplex=1"

    def log_tail(self, chars: int = 6000) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read()[-chars:]

    def health(self) -> tuple[int, dict] | None:
        try:
            trust = ssl.create_default_context(cafile=self.tls.ca) if self.tls else None
            with urllib.request.urlopen(self.http_url + "/health", timeout=1.0, context=trust) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def start(self, timeout: float = 60.0) -> "GatewayProcess":
        self.proc = subprocess.Popen(self.cmd, cwd=REPO_ROOT, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     preexec_fn=die_with_parent)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise ServiceStartError(f"gateway exited with code {self.proc.returncode}:\n{self.log_tail()}")
            h = self.health()
            if h is not None and h[0] == 200:
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise ServiceStartError(f"gateway not healthy after {timeout:g}s (last: {h}):\n{self.log_tail()}")
            time.sleep(0.1)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Stack:
    checkpoint: Path
    sessions: int = 2
    cells: int = 1
    device: str = "cpu"
    port: int = 0
    host: str = "127.0.0.1"
    talker_args: list[str] = field(default_factory=list)
    codec_args: list[str] = field(default_factory=list)
    gateway_args: list[str] = field(default_factory=list)
    gateway_env: dict = field(default_factory=dict)
    gateway_workers: str = "1"  # gateway worker processes on its one port: N or "auto"
    tls: LocalTls | None = None  # https and wss on the gateway's port
    progress: callable = lambda msg: None
    # The stages' Drain token (their DUPLEX_ADMIN_TOKEN): the operator's, else a fresh one per stack.
    admin_token: str = field(default_factory=lambda: os.environ.get(ADMIN_TOKEN_ENV) or secrets.token_hex(16))
    # The token the stages' session RPCs need and the gateway presents (stage_gate.py): the
    # operator's DUPLEX_LINK_TOKEN, else none (no check).
    link_token: str | None = field(default_factory=lambda: os.environ.get(LINK_TOKEN_ENV) or None)
    with_gateway: bool = True  # False: the cells only (a test that drives them without the gateway)
    cell_procs: list[CellProcs] = field(default_factory=list)
    gateway: GatewayProcess | None = None

    def start(self) -> "Stack":
        try:
            # All stage processes start at once (each loads its model); then the gateway.
            procs = []
            for i in range(self.cells):
                common = ["--checkpoint", str(self.checkpoint), "--slots", str(self.sessions), "--device", self.device]
                stage_args = {"encoder": self.codec_args, "talker": self.talker_args, "decoder": self.codec_args}
                env = {ADMIN_TOKEN_ENV: self.admin_token, **self.link_env}
                procs.append({stage: ServiceProcess(f"services.{stage}", [*common, *extra], host=self.host,
                                                    ready_timeout=180, env=env)
                              for stage, extra in stage_args.items()})
            self.cell_procs = [CellProcs(**p) for p in procs]
            self.progress(f"starting {3 * self.cells} stage processes ...")
            # Spawned from this thread (their die-with-parent signal is tied to the spawning
            # thread), all at once; then waited for one by one.
            t0 = time.monotonic()
            for p in procs:
                for proc in p.values():
                    proc.spawn()
            for i, p in enumerate(procs):
                for stage, proc in p.items():
                    proc.wait_ready()
                    self.progress(f"cell {i}: {stage} serving on {proc.address} ({time.monotonic() - t0:.1f}s)")
            if not self.with_gateway:
                return self
            self.progress("starting gateway ...")
            spec = ";".join(c.spec for c in self.cell_procs)
            self.gateway = GatewayProcess(spec, port=self.port, host=self.host,
                                          env={**self.link_env, **self.gateway_env}, tls=self.tls,
                                          args=["--workers", str(self.gateway_workers), *self.gateway_args])
            self.gateway.start()
            self.progress(f"gateway healthy on {self.gateway.http_url}")
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def link_env(self) -> dict:
        return {LINK_TOKEN_ENV: self.link_token} if self.link_token else {}

    def stop(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
        procs = [p for cell in self.cell_procs for p in cell.all()]
        for p in procs:
            p.terminate()  # all drain at once
        for p in procs:
            p.close()  # waits, then SIGKILL; safe on a process that never started

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass(frozen=True)
class StackOptions:
    """The whole stack on this machine: encoder, talker, decoder (one or more cells) and the gateway."""

    checkpoint: Path | None = option(None, help="checkpoint directory (default: the embedded tiny random one)")
    sessions: int = option(2, help="concurrent sessions per cell (slots of every stage)")
    cells: int = option(1, help="cells to start (each: encoder, talker, decoder)")
    port: int = option(8000, help="gateway port")
    host: str = option("127.0.0.1", help="address every process listens on")
    device: str = option("cpu", help="the stages' device: cpu | cuda | cuda:N")
    talker_tick_ms: float | None = option(None, help="talker clock period (default: the talker's, 80)")
    gateway_workers: str = option("1", help="gateway processes on its port: N or 'auto'")
    gateway_args: str = option("", help="extra gateway flags, e.g. '--stall-timeout 10'")
    tls: bool = option(False, help="https and wss, with a certificate for localhost from a local CA made under "
                                   f"{TLS_DIR.relative_to(REPO_ROOT)} (tools/tls_cert.py, openssl)")

    def __post_init__(self) -> None:
        if self.sessions < 1 or self.cells < 1:
            raise ValueError(f"sessions and cells must be >= 1, got {self.sessions} and {self.cells}")


def main(argv: list[str] | None = None) -> int:
    a = load_config(StackOptions, ENV_PREFIX, argv, prog="python -m tools.run_stack")
    say = lambda msg: print(f"[run_stack] {msg}", flush=True)  # noqa: E731
    if a.checkpoint:
        ckpt = a.checkpoint
    else:
        from tools.make_checkpoint import ensure_checkpoint

        say("preparing the embedded tiny checkpoint ...")
        ckpt = ensure_checkpoint("tiny", seed=0)
    talker_args = ["--tick-ms", str(a.talker_tick_ms)] if a.talker_tick_ms else []
    tls = None
    if a.tls:
        hosts = list(dict.fromkeys(["localhost", "127.0.0.1", "::1", a.host]))
        tls = ensure_local_tls(TLS_DIR, hosts)
        say(f"TLS: {tls.cert} for {', '.join(hosts)}")
    stack = Stack(ckpt, sessions=a.sessions, cells=a.cells, device=a.device, port=a.port, host=a.host, progress=say,
                  talker_args=talker_args, gateway_workers=a.gateway_workers, gateway_args=a.gateway_args.split(),
                  tls=tls)
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    try:
        stack.start()
        g = stack.gateway
        voices = sorted(x.name for x in (ckpt / "voices").glob("*.pt")) if (ckpt / "voices").is_dir() else []
        chat = f"{g.ws_url.split('/v1/')[0]}/api/chat?voice_prompt={voices[0] if voices else 'NATF2.pt'}"
        print(
            f"""
PersonaPlex stack is up ({a.cells} cell(s), {a.sessions} session(s) each, {a.gateway_workers} gateway worker(s),
checkpoint {ckpt}).

  browser page:   {g.http_url}/
  Realtime wire:  {g.ws_url}
  native chat:    {chat}&text_prompt=Hello
  health/metrics: {g.http_url}/health   {g.http_url}/metrics
  voices:         {', '.join(voices) or 'none'}
  stage Drain:    'authorization: Bearer ${ADMIN_TOKEN_ENV}' ({"yours" if os.environ.get(ADMIN_TOKEN_ENV) else
                   f"not set: a fresh secret; set {ADMIN_TOKEN_ENV} before starting to drain by hand"})

  client:         {sys.executable} -m tools.client --url '{g.ws_url}' --input in.wav --output out.wav
{chr(10) + trust_hint(tls) + chr(10) if tls else ""}
Ctrl-C stops everything.""",
            flush=True,
        )
        reported = set()
        while not stopping:
            time.sleep(0.5)
            # A stage that exits takes only its cell out; the gateway sends new sessions elsewhere.
            for i, cell in enumerate(stack.cell_procs):
                for proc in cell.all():
                    if proc.proc.poll() is not None and proc not in reported:
                        reported.add(proc)
                        say(f"cell {i}: {proc.module} on {proc.address} exited with code {proc.proc.returncode}; "
                            f"its cell is out of service. Last output:\n{proc.stderr_tail(1500)}")
            if g.proc.poll() is not None:
                say(f"gateway exited with code {g.proc.returncode}:\n{g.log_tail(2000)}")
                stopping = True
    except KeyboardInterrupt:
        pass
    except ServiceStartError as e:
        say(f"start failed: {e}")
        return 1
    finally:
        say("stopping ...")
        stack.stop()
        say("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
