"""The cell on one GPU: encoder, talker and decoder processes under CUDA MPS, N live sessions.

    python -m bench.cell --mps --sessions 160 --duration-s 120 [--fallback-sessions 128] [--out DIR]
        [--probe-sessions K] [--probe-cycle-s 4]   # K of the N reopen over and over: first audio at load
    python -m bench.cell --smoke [--out DIR]       # tiny checkpoint on the CPU, 2 sessions (1 a probe), 4 s

Phases (each timed and printed):
1. checkpoint: `--checkpoint DIR`, or build one (`--preset full` on the GPU: tools.make_checkpoint
   --device cuda into a work dir, removed at the end unless --keep-checkpoint).
2. MPS (`--mps`): a control daemon with private pipe/log dirs, exported to the three services;
   `quit` in a finally. No GPU setting (compute mode, clocks) is touched.
3. services: encoder, talker, decoder as real processes (tools/procs.py), slots = the largest N,
   the talker with fp8 KV and CUDA-graph replay on CUDA. If they do not start (say the talker's KV
   does not fit), the next smaller N of --sessions/--fallback-sessions is tried. Each stage's GPU
   memory (its CUDA memory gauges; none on the CPU) is read once they serve.
4. for each N of --sessions, a fresh set of sessions: --client-procs load processes
   (bench/cell_load.py) open N-K steady sessions (gateway Relay: voice + persona +
   sampling), all admitted before one shared start, then one 1920-sample frame per session every
   80 ms on an absolute schedule for --duration-s, then a graceful close. From the same start, K =
   --probe-sessions probe slots measure time to first audio at full load: each opens a session,
   talks for --probe-cycle-s, closes and reopens at once, until the steady schedule ends, so about
   N sessions are always live and every probe open meets a loaded system (the burst's open
   latency is that of N simultaneous arrivals, not of one caller arriving at a busy system).
   Every probe slot runs in one load process (the one the steady round-robin left lightest), so
   its probes can take turns claiming a free slot (bench/cell_load.py says why that matters:
   a stage frees a slot a moment after it acknowledged the stream's end). Each service's /metrics
   is scraped about once a second.
5. report (bench/cell_report.py): table, cell.json (rewritten after every phase, so a
   run cut short still leaves what it measured) and cell.png under --out.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2

from bench.cell_report import gpu_memory_lines, plot, print_table, summarize_run
from bench.cell_stats import bucket_quantile, gpu_memory, histogram_delta, parse_metrics
from duplex.v1 import common_pb2, decoder_pb2_grpc, encoder_pb2_grpc, talker_pb2_grpc
from services.common.config import load_config
from tools.procs import REPO_ROOT, ServiceProcess, ServiceStartError, die_with_parent, health_status
from services.common.frame import FRAME_S as FRAME_PERIOD_S

STAGES = ("encoder", "talker", "decoder")
START_LEAD_S = 0.5  # "all admitted" -> shared first send: time for every load process to get the start


@dataclass
class BenchConfig:
    """Every option of the benchmark (flag = field name with dashes). Defaults are the GPU run."""

    preset: str = "full"  # checkpoint to build when --checkpoint is not given: tiny | full
    checkpoint: str = ""  # an existing checkpoint directory (published layout)
    seed: int = 0
    device: str = "cuda"  # the three services' device: cuda | cpu
    sessions: str = "160"  # N, or a sweep "64,128,160" (services start once, slots = the largest)
    fallback_sessions: str = ""  # run only if the services do not start with the larger slot count
    extra_slots: int = 0  # slots beyond the largest N (the talker's KV for 160 slots nearly fills an H200)
    duration_s: float = 120.0  # input audio per session
    probe_sessions: int = 1  # K of the N slots reopen over and over: time to first audio at full load (0: none)
    probe_cycle_s: float = 4.0  # input audio per probe session before it closes and reopens
    # When in the 80 ms period each steady session sends its frames. "spread": session j of S at
    # j/S of a period after the start, as independent users do. "together": all in one burst
    # (lockstep). A burst lands at a place in the talker's tick grid that differs from run to run
    # (start times are not grid-aligned), and whether its frames reach the talker before or after
    # a deadline decides skipped frames and catch-up steps, so a burst makes runs of the same code
    # disagree (bench/RESULTS.md).
    send_phases: str = "spread"
    client_procs: int = min(8, max(1, (os.cpu_count() or 2) // 2))
    mps: bool = False
    out: str = "bench/results"
    work_dir: str = ""  # built checkpoint and load records ("" = a temporary dir, removed at the end)
    keep_checkpoint: bool = False
    voice: str = "NATF2.pt"
    persona: str = "You are a helpful assistant."
    # Every session attends over a full ring (3000 frames) from its first frame (talker
    # --bench-full-context): the target's steady state without talking 4 minutes first; what the
    # model says is then meaningless, which this benchmark does not read.
    full_context: bool = False
    no_compile: bool = False  # the talker without torch.compile'd elementwise kernels (A/B)
    talker_args: str = ""  # extra talker flags, e.g. "--max-backlog-s 3"
    codec_args: str = ""  # extra encoder/decoder flags
    # Extra flags of one codec (after --codec-args), e.g. a decoder that steps as soon as a tick's
    # outputs are in: --decoder-args "--batch-wait-ms 3"
    encoder_args: str = ""
    decoder_args: str = ""
    # Extra environment of a stage process (after the overlay's MPS settings under --mps), e.g. the
    # codecs' work at below-normal MPS priority:
    # --stage-env "encoder:CUDA_MPS_CLIENT_PRIORITY=1 decoder:CUDA_MPS_CLIENT_PRIORITY=1"
    stage_env: str = ""
    window_s: float = 10.0  # output-rate windows
    backlog_growth_frames: float = 2.0  # backlog growth over a run above this = falling behind
    ready_timeout_s: float = 240.0
    # Wall-clock budget of the whole script: a fallback start or a further N that could not finish
    # inside it is skipped (and says so), so the report is always written before an outer limit.
    time_budget_s: float = 570.0
    open_timeout_s: float = 120.0
    stall_timeout_s: float = 10.0
    cleanup_timeout_s: float = 30.0
    progress_every_s: float = 5.0
    smoke: bool = False

    @property
    def sweep(self) -> list[int]:
        return sorted({int(n) for n in self.sessions.split(",") if n.strip()})

    @property
    def fallbacks(self) -> list[int]:
        return sorted({int(n) for n in self.fallback_sessions.split(",") if n.strip()})

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def __post_init__(self) -> None:
        if self.preset not in ("tiny", "full"):
            raise ValueError(f"--preset must be tiny or full, got {self.preset!r}")
        if not self.sweep or min(self.sweep + self.fallbacks) < 1:
            raise ValueError(f"--sessions needs positive counts, got {self.sessions!r}")
        if self.duration_s < 1 or self.client_procs < 1 or self.window_s <= 0:
            raise ValueError("--duration-s >= 1, --client-procs >= 1 and --window-s > 0 are required")
        if self.mps and not self.cuda:
            raise ValueError("--mps needs --device cuda")
        if self.probe_sessions < 0 or self.probe_sessions >= min(self.sweep + self.fallbacks):
            raise ValueError(f"--probe-sessions K needs 0 <= K < every N of --sessions/--fallback-sessions (the "
                             f"other N-K sessions are the steady load); got K={self.probe_sessions} and N="
                             f"{min(self.sweep + self.fallbacks)}")
        if self.send_phases not in ("spread", "together"):
            raise ValueError(f"--send-phases must be spread or together, got {self.send_phases!r}")
        if self.probe_cycle_s < 2 * FRAME_PERIOD_S:
            raise ValueError(f"--probe-cycle-s must be >= {2 * FRAME_PERIOD_S:g} (first audio needs two input frames)")


ENV_PREFIX = "BENCH_"
# --smoke: the same script on the CPU with the tiny checkpoint (explicit flags still win).
SMOKE = dict(preset="tiny", device="cpu", sessions="2", duration_s=4.0, client_procs=1, mps=False, window_s=2.0,
             probe_sessions=1, probe_cycle_s=1.5,  # short cycles: the 4 s run reopens the probe
             ready_timeout_s=120.0, open_timeout_s=60.0, progress_every_s=1.0,
             out=os.path.join(tempfile.gettempdir(), "cell-smoke"))  # never over the GPU results


def parse_args(argv: list[str] | None, cls=None, smoke: dict | None = None, prog: str = "python -m bench.cell",
               doc: str | None = None) -> BenchConfig:
    """A flag and a BENCH_<FIELD> variable for every field of `cls` (BenchConfig or a subclass; the loader of
    services/common/config.py); --smoke starts from `smoke`, and explicit flags and variables still win."""
    return load_config(cls or BenchConfig, ENV_PREFIX, argv, prog=prog, description=doc or __doc__,
                       presets={"smoke": SMOKE if smoke is None else smoke})


def public_config(cfg: BenchConfig) -> dict:
    """The config for cell.json, without this machine's paths (results may be committed)."""
    d = asdict(cfg)
    for k in ("checkpoint", "out", "work_dir"):
        if d[k] and os.path.isabs(d[k]):
            d[k] = "<" + k + ">"
    return d


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- phase 1: checkpoint ------------------------------------------------------------------------

def dir_bytes(path: Path) -> int:
    total = 0
    for f in path.rglob("*") if path.exists() else ():
        try:
            total += f.stat().st_size if f.is_file() else 0
        except OSError:  # a file replaced while the builder writes
            pass
    return total


def build_checkpoint(cfg: BenchConfig, work: Path) -> Path:
    """Build the preset's random checkpoint into the work dir, on the GPU when the services run
    there (seconds instead of the minutes a CPU init of the full model takes). The tiny preset
    takes the same path, so --smoke runs exactly the code the GPU run does."""
    out = work / "checkpoint"
    cmd = [sys.executable, "-m", "tools.make_checkpoint", "--preset", cfg.preset, "--seed", str(cfg.seed),
           "--out", str(out), "--device", "cuda" if cfg.cuda else "cpu"]
    log(f"checkpoint: {' '.join(cmd[1:])}")
    build_log = work / "make_checkpoint.log"
    t0 = time.monotonic()
    with open(build_log, "w+") as f:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=f, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        next_note = t0 + 10
        while proc.poll() is None:
            time.sleep(0.5)
            if time.monotonic() >= next_note:
                log(f"checkpoint: building, {time.monotonic() - t0:.0f} s ({dir_bytes(out) / 1e9:.1f} GB written)")
                next_note += 10
        f.seek(0)
        text = f.read()
    if proc.returncode != 0:
        raise SystemExit(f"tools.make_checkpoint failed (exit {proc.returncode}):\n{text[-4000:]}")
    if not (out / "config.json").is_file():
        raise SystemExit(f"tools.make_checkpoint did not leave a checkpoint at {out}:\n{text[-4000:]}")
    log(f"checkpoint: {dir_bytes(out) / 1e9:.2f} GB")
    return out


# ---- phase 2: MPS -------------------------------------------------------------------------------

class Mps:
    """A private MPS control daemon. Its pipe/log dirs go into os.environ, so every process started
    afterwards (the services) is an MPS client of it."""

    def __init__(self) -> None:
        self.exe = shutil.which("nvidia-cuda-mps-control")
        # Short: the pipe dir holds a Unix socket, whose path must stay under ~100 characters.
        self.root = Path(tempfile.mkdtemp(prefix="pmps-", dir="/tmp" if os.path.isdir("/tmp") else None))
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": str(self.root / "pipe"),
                    "CUDA_MPS_LOG_DIRECTORY": str(self.root / "log")}
        self.started = False

    def _run(self, args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([self.exe, *args], input=stdin, text=True, capture_output=True, timeout=30,
                              env={**os.environ, **self.env})

    def start(self) -> None:
        if self.exe is None:
            raise SystemExit("--mps: nvidia-cuda-mps-control is not on PATH")
        for d in self.env.values():
            Path(d).mkdir(parents=True)
        r = self._run(["-d"])
        if r.returncode != 0:
            raise SystemExit(f"nvidia-cuda-mps-control -d failed ({r.returncode}): "
                             f"{r.stderr.strip() or r.stdout.strip()}")
        self.started = True
        os.environ.update(self.env)

    def probe(self) -> str | None:
        """One tiny CUDA client through the daemon; the error text if that fails, else None."""
        code = "import torch; x = torch.ones(8, device='cuda'); torch.cuda.synchronize(); print(float(x.sum()))"
        try:
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                               env={**os.environ, **self.env})
        except subprocess.TimeoutExpired:
            return "a CUDA client did not finish within 180 s under MPS"
        if r.returncode != 0 or r.stdout.strip() != "8.0":
            return f"a CUDA client failed under MPS (exit {r.returncode}): {(r.stderr or r.stdout)[-2000:]}"
        return None

    def query(self, command: str) -> str:
        r = self._run([], stdin=command + "\n")
        return (r.stdout + r.stderr).strip()

    def control_log(self, chars: int = 3000) -> str:
        p = Path(self.env["CUDA_MPS_LOG_DIRECTORY"]) / "control.log"
        return p.read_text(errors="replace")[-chars:] if p.exists() else ""

    def stop(self) -> str:
        """quit the daemon (after the services are gone); returns the control log's tail."""
        text = ""
        if self.started:
            r = self._run([], stdin="quit\n")
            if r.returncode != 0:
                log(f"mps: quit answered {r.returncode}: {r.stderr.strip()}")
            time.sleep(0.5)
            text = self.control_log()
            for k in self.env:
                os.environ.pop(k, None)
            self.started = False
        shutil.rmtree(self.root, ignore_errors=True)
        return text


def gpu_state() -> dict | None:
    """Name and memory of GPU 0 from nvidia-smi (a read-only query), or None without one."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    r = subprocess.run([exe, "--query-gpu=name,memory.used,memory.total", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True, timeout=20)
    if r.returncode != 0 or not r.stdout.strip():
        return None
    name, used, total = [x.strip() for x in r.stdout.strip().splitlines()[0].split(",")]
    return {"name": name, "memory_used_mib": int(used), "memory_total_mib": int(total)}


# ---- phase 3: services --------------------------------------------------------------------------

# The GPU serving profile has one definition, the gpu overlay's config (ENCODER_*, TALKER_*, DECODER_*
# literals); the benchmarks run the stages with exactly those settings. The benchmark sets these itself.
GPU_PROFILE = REPO_ROOT / "k8s" / "overlays" / "gpu" / "kustomization.yaml"
GPU_CELL_PATCH = GPU_PROFILE.parent / "cell-gpu.yaml"
SET_PER_RUN = {"SLOTS", "DEVICE"}
# The MPS client settings a container sets for itself (the daemon's directories are the benchmark's own).
MPS_OWN = {"CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"}


def gpu_profile_args(path: Path = GPU_PROFILE) -> dict[str, list[str]]:
    """Each stage's flags for the GPU deployment's settings (the overlay's config literals)."""
    import yaml

    doc = yaml.safe_load(path.read_text())
    args: dict[str, list[str]] = {s: [] for s in STAGES}
    for gen in doc.get("configMapGenerator", []):
        for literal in gen.get("literals", []):
            key, _, value = literal.partition("=")
            stage, _, field = key.partition("_")
            if stage.lower() in args and field not in SET_PER_RUN:
                args[stage.lower()] += ["--" + field.lower().replace("_", "-"),
                                        {"1": "true", "0": "false"}.get(value, value)]
    return args


def gpu_profile_env(path: Path = GPU_CELL_PATCH) -> dict[str, dict[str, str]]:
    """Each stage container's MPS client settings in the GPU overlay (CUDA_MPS_*, e.g. its memory
    limit and scheduling priority), so a benchmark's stages are MPS clients as the deployed ones are."""
    import yaml

    doc = yaml.safe_load(path.read_text())
    env: dict[str, dict[str, str]] = {s: {} for s in STAGES}
    for c in doc["spec"]["template"]["spec"]["containers"]:
        for e in c.get("env", []):
            if c["name"] in env and e["name"].startswith("CUDA_MPS_") and e["name"] not in MPS_OWN:
                env[c["name"]][e["name"]] = str(e["value"])
    return env


def service_env(cfg: BenchConfig) -> dict[str, dict[str, str]]:
    """Each stage's extra environment: under --mps the overlay's MPS client settings, then --stage-env
    ("stage:NAME=VALUE ..."), which overrides."""
    env = gpu_profile_env() if cfg.mps else {s: {} for s in STAGES}
    for item in shlex.split(cfg.stage_env):
        stage, _, assignment = item.partition(":")
        name, eq, value = assignment.partition("=")
        if stage not in env or not name or not eq:
            raise SystemExit(f"--stage-env: {item!r} is not STAGE:NAME=VALUE with STAGE one of {', '.join(STAGES)}")
        env[stage][name] = value
    return env


def service_args(cfg: BenchConfig, checkpoint: Path, slots: int) -> dict[str, list[str]]:
    """Each stage's command line: on the GPU the deployment's profile (gpu_profile_args), on the CPU one
    thread each; then the benchmark's own switches, then --codec-args / --encoder-args / --decoder-args /
    --talker-args, which override."""
    common = ["--checkpoint", str(checkpoint), "--slots", str(slots), "--device", cfg.device]
    profile = gpu_profile_args() if cfg.cuda else {"encoder": [], "talker": ["--threads", "1"], "decoder": []}
    talker = [] if cfg.voice in profile["talker"] else ["--preload-voices", cfg.voice]
    if cfg.cuda and cfg.no_compile:
        talker += ["--compile", "false"]
    if cfg.full_context:
        talker += ["--bench-full-context", "true"]
    codec = ["--threads", "1"]
    codec_args = shlex.split(cfg.codec_args)
    return {"encoder": common + codec + profile["encoder"] + codec_args + shlex.split(cfg.encoder_args),
            "talker": common + profile["talker"] + talker + shlex.split(cfg.talker_args),
            "decoder": common + codec + profile["decoder"] + codec_args + shlex.split(cfg.decoder_args)}


def start_services(cfg: BenchConfig, checkpoint: Path, slots: int) -> tuple[dict[str, ServiceProcess], dict]:
    """All three at once (each loads its model); returns once every one answers SERVING."""
    args, env = service_args(cfg, checkpoint, slots), service_env(cfg)
    procs = {s: ServiceProcess(f"services.{s}", args[s], env=env[s], ready_timeout=cfg.ready_timeout_s)
             for s in STAGES}
    t0 = time.monotonic()
    ready: dict[str, float] = {}
    try:
        for p in procs.values():
            p.spawn()
        next_note = t0 + 10
        while len(ready) < len(procs):
            for s, p in procs.items():
                if s in ready:
                    continue
                code = p.proc.poll()
                if code is not None:
                    raise ServiceStartError(f"{s} exited with code {code} before serving:\n{p.stderr_tail()}")
                if health_status(p.address, timeout=0.5) == health_pb2.HealthCheckResponse.SERVING:
                    ready[s] = round(time.monotonic() - t0, 2)
                    log(f"services: {s} serving on {p.address} after {ready[s]:.1f} s")
            now = time.monotonic()
            if now - t0 > cfg.ready_timeout_s:
                waiting = [s for s in procs if s not in ready]
                raise ServiceStartError(f"{', '.join(waiting)} not SERVING after {cfg.ready_timeout_s:g} s:\n" +
                                        "\n".join(procs[s].stderr_tail() for s in waiting))
            if now >= next_note and len(ready) < len(procs):
                log(f"services: waiting for {', '.join(s for s in procs if s not in ready)} ({now - t0:.0f} s)")
                next_note += 10
            time.sleep(0.2)
    except BaseException:
        stop_services(procs)
        raise
    return procs, {"slots": slots, "ready_s": ready, "args": {s: " ".join(a) for s, a in args.items()}, "env": env}


def stop_services(procs: dict[str, ServiceProcess]) -> None:
    for p in procs.values():
        p.terminate()  # all drain at once
    for p in procs.values():
        p.close()


def save_service_logs(procs: dict[str, ServiceProcess], out: Path) -> None:
    for s, p in procs.items():
        (out / f"cell-{s}.log").write_text(p.stderr_tail(200_000))


# ---- phase 4: one N -----------------------------------------------------------------------------

_STUBS = {"encoder": encoder_pb2_grpc.EncoderStub, "talker": talker_pb2_grpc.TalkerStub,
          "decoder": decoder_pb2_grpc.DecoderStub}


async def wait_all_free(procs: dict[str, ServiceProcess], need: int, timeout_s: float) -> None:
    """Until every stage reports all slots free (the previous N's sessions are confirmed gone)."""
    deadline = time.monotonic() + timeout_s
    last = {}
    while True:
        ok = True
        for s, p in procs.items():
            async with grpc.aio.insecure_channel(p.address) as ch:
                try:
                    cap = await _STUBS[s](ch).GetCapacity(common_pb2.CapacityRequest(), timeout=5)
                except grpc.aio.AioRpcError as e:
                    raise RuntimeError(f"{s} GetCapacity failed: {e.code().name} {e.details()}") from None
            last[s] = (cap.free_slots, cap.total_slots, cap.active_streams)
            if cap.total_slots < need:
                raise RuntimeError(f"{s} has {cap.total_slots} slots, {need} sessions need more")
            ok &= cap.free_slots == cap.total_slots and cap.active_streams == 0
        if ok:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"slots not all free after {timeout_s:g} s: (free, total, active) = {last}")
        await asyncio.sleep(0.2)


LOCAL_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy


def scrape(procs: dict[str, ServiceProcess]) -> dict:
    """One /metrics snapshot per stage (None for a stage that did not answer)."""
    snaps = {}
    for s, p in procs.items():
        try:
            with LOCAL_HTTP.open(p.metrics_url, timeout=3) as r:
                snaps[s] = parse_metrics(r.read().decode())
        except OSError:
            snaps[s] = None
    return snaps


class LoadProcessError(RuntimeError):
    pass


class LoadProcess:
    """One bench/cell_load.py process: JSON lines in and out, its stderr kept in a file."""

    def __init__(self, index: int, proc: asyncio.subprocess.Process, stderr_path: Path):
        self.index = index
        self.proc = proc
        self.stderr_path = stderr_path
        self.progress: dict = {}
        self.messages: asyncio.Queue = asyncio.Queue()
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def start(cls, index: int, work: Path) -> "LoadProcess":
        stderr_path = work / f"load-{index}.stderr"
        with open(stderr_path, "w") as err:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "bench.cell_load", cwd=REPO_ROOT, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=err, preexec_fn=die_with_parent, limit=4 * 1024 * 1024)
        return cls(index, proc, stderr_path)

    async def _read(self) -> None:
        while line := await self.proc.stdout.readline():
            msg = json.loads(line)
            if "progress" in msg:
                self.progress = msg["progress"]
            else:
                self.messages.put_nowait(msg)
        self.messages.put_nowait(None)  # EOF

    async def send(self, obj: dict) -> None:
        self.proc.stdin.write((json.dumps(obj) + "\n").encode())
        await self.proc.stdin.drain()

    async def expect(self, key: str, timeout_s: float) -> dict:
        try:
            msg = await asyncio.wait_for(self.messages.get(), timeout_s)
        except asyncio.TimeoutError:
            raise LoadProcessError(f"load process {self.index}: no {key!r} within {timeout_s:g} s") from None
        if msg is None or key not in msg:
            code = await self.proc.wait() if msg is None else None
            raise LoadProcessError(f"load process {self.index} ended (exit {code}) without {key!r}:\n"
                                   f"{self.stderr_path.read_text()[-3000:]}")
        return msg

    async def close(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
        await self.proc.wait()
        self._reader.cancel()


async def run_sessions(cfg: BenchConfig, procs: dict[str, ServiceProcess], n: int, work: Path) -> dict:
    """N fresh sessions through the three services (N-K steady, K probe slots); returns the run's
    summary (cell_report)."""
    await wait_all_free(procs, n, timeout_s=60)
    frames = int(round(cfg.duration_s / FRAME_PERIOD_S))
    steady = n - cfg.probe_sessions
    k = min(cfg.client_procs, n)
    shares, probe_shares = deal_sessions(n, cfg.probe_sessions, k)
    offsets = send_offsets(shares, FRAME_PERIOD_S, cfg.send_phases)
    loaders = [await LoadProcess.start(i, work) for i in range(k)]
    phases: dict[str, float] = {}
    done: list[asyncio.Task] = []
    try:
        t0 = time.monotonic()
        for i, lp in enumerate(loaders):
            await lp.send({"cell": [procs[s].address for s in STAGES], "stream_ids": shares[i],
                           "probe_ids": probe_shares[i], "offsets_s": offsets[i], "voice": cfg.voice,
                           "persona": cfg.persona,
                           "frames": frames, "period_s": FRAME_PERIOD_S, "probe_cycle_s": cfg.probe_cycle_s,
                           "open_timeout_s": cfg.open_timeout_s, "stall_timeout_s": cfg.stall_timeout_s,
                           "cleanup_timeout_s": cfg.cleanup_timeout_s,
                           "result_path": str(work / f"load-n{n}-{i}.json")})
        admissions = [await lp.expect("admitted", cfg.open_timeout_s + 60) for lp in loaders]
        admitted = sum(len(a["admitted"]) for a in admissions)
        refused = [r for a in admissions for r in a["refused"]]
        phases["admission_s"] = round(time.monotonic() - t0, 2)
        log(f"N={n}: {admitted}/{steady} steady sessions admitted in {phases['admission_s']:.1f} s over {k} load "
            f"processes" + (f"; {cfg.probe_sessions} probe slot(s) open from the start" if cfg.probe_sessions else "")
            + (f"; refused: {refused[:3]}" if refused else ""))

        before = await asyncio.to_thread(scrape, procs)  # first: a slow scrape must not eat the lead time
        start_at = time.monotonic() + START_LEAD_S
        snapshots = [(-START_LEAD_S, before)]
        for lp in loaders:
            await lp.send({"start_at": start_at})
        done = [asyncio.create_task(lp.expect("done", cfg.duration_s + cfg.probe_cycle_s + cfg.cleanup_timeout_s + 120))
                for lp in loaders]
        service_exits: dict[str, int] = {}
        next_scrape = start_at + 1.0
        next_note = start_at + cfg.progress_every_s
        while not all(d.done() for d in done):
            await asyncio.wait(done, timeout=max(0.0, next_scrape - time.monotonic()))
            now = time.monotonic()
            if now < next_scrape:
                continue  # one load process finished early; keep the once-a-second rhythm
            snapshots.append((round(now - start_at, 3), await asyncio.to_thread(scrape, procs)))
            next_scrape = max(next_scrape + 1.0, time.monotonic() + 0.5)  # a slow scrape never piles up
            for s, p in procs.items():
                if p.proc.poll() is not None and s not in service_exits:
                    service_exits[s] = p.proc.returncode
                    log(f"N={n}: {s} exited with code {p.proc.returncode} during the run")
            if now >= next_note:
                next_note += cfg.progress_every_s
                log(progress_line(n, steady, start_at, cfg.duration_s, loaders, snapshots))
        results = [json.loads(Path((await d)["done"]).read_text()) for d in done]
        phases["run_and_close_s"] = round(time.monotonic() - start_at, 2)
        snapshots.append((round(time.monotonic() - start_at, 3), await asyncio.to_thread(scrape, procs)))
    finally:
        for d in done:
            d.cancel()
        for lp in loaders:
            await lp.close()
    try:
        summary = summarize_run(n, results, refused, snapshots, duration_s=cfg.duration_s, frames=frames,
                                window_s=cfg.window_s, backlog_growth_frames=cfg.backlog_growth_frames,
                                probe_slots=cfg.probe_sessions, probe_cycle_s=cfg.probe_cycle_s)
    except Exception as e:
        # Keep what was measured: the raw records can be summarized again offline.
        raw = Path(cfg.out) / f"cell-raw-n{n}.json"
        raw.write_text(json.dumps({"results": results, "refused": refused,
                                   "snapshots": [[t, {s: None if snap is None
                                                      else [[k[0], list(k[1]), v] for k, v in snap.items()]
                                                      for s, snap in snaps.items()}] for t, snaps in snapshots]}))

        raise RuntimeError(f"summarizing N={n} failed ({type(e).__name__}: {e}); raw records in {raw.name}") from e
    summary["client_procs"] = k
    # Where the start fell in the talker's tick grid (grid times are multiples of the period on
    # CLOCK_MONOTONIC, services/common/frame_grid.py): with --send-phases together, where the burst lands.
    summary["start_in_tick_grid_ms"] = round((start_at % FRAME_PERIOD_S) * 1e3, 2)
    summary["phases_s"] = phases
    if service_exits:
        summary["errors"].append({"code": "service_exited", "message": json.dumps(service_exits)})
        summary["checks"]["no_errors"] = False
        summary["pass"] = False
    return summary


def deal_sessions(n: int, probes: int, procs: int) -> tuple[list[list[str]], list[list[str]]]:
    """Stream ids of the steady sessions and the probe slots, per load process. Steady sessions
    round-robin from process 0; every probe slot goes to the process that round-robin would have
    served next (one with the fewest steady sessions), because probes must be in one process to
    take turns claiming a free slot."""
    ids = [f"bench-n{n}-{i:03d}" for i in range(n - probes)]
    steady = [ids[i::procs] for i in range(procs)]
    probe: list[list[str]] = [[] for _ in range(procs)]
    probe[(n - probes) % procs] = [f"bench-n{n}-probe{j}" for j in range(probes)]
    return steady, probe


def send_offsets(shares: list[list[str]], period: float, how: str) -> list[list[float]]:
    """Per load process, each steady session's send offset in the period (seconds after the start):
    "together" all 0; "spread" session j of S (in stream-id order, so each process's round-robin
    share is spread over the whole period too) at j/S * period."""
    if how == "together":
        return [[0.0] * len(ids) for ids in shares]
    # Ids are numbered: sort 999 before 1000.
    order = sorted((sid for ids in shares for sid in ids), key=lambda sid: (len(sid), sid))
    at = {sid: j * period / len(order) for j, sid in enumerate(order)}
    return [[round(at[sid], 6) for sid in ids] for ids in shares]


def progress_line(n: int, steady: int, start_at: float, duration_s: float, loaders: list[LoadProcess],
                  snapshots: list) -> str:
    sent = sum(lp.progress.get("sent", 0) for lp in loaders)
    recv = sum(lp.progress.get("recv", 0) for lp in loaders)
    errors = sum(lp.progress.get("errors", 0) for lp in loaders)
    late = max((lp.progress.get("late_max_ms", 0.0) for lp in loaders), default=0.0)
    probes = sum(lp.progress.get("probe_cycles", 0) for lp in loaders)
    tick = "-"
    window = [s for _, s in snapshots[-6:] if s.get("talker") is not None]
    if len(window) >= 2:
        q = bucket_quantile(histogram_delta(window[0]["talker"], window[-1]["talker"], "duplex_talker_tick_seconds"),
                            0.99)
        tick = "-" if q != q else f"{q * 1000:.1f} ms"
    t = min(duration_s, time.monotonic() - start_at)
    return (f"N={n}: {t:5.1f}/{duration_s:g} s  frames/steady session in {sent / steady:.1f} out {recv / steady:.1f}  "
            f"errors {errors}  talker tick p99 (last 5 s) {tick}  client late max {late:.1f} ms  probe opens {probes}")


# ---- main ---------------------------------------------------------------------------------------

async def sweep(cfg: BenchConfig, procs: dict[str, ServiceProcess], ns: list[int], work: Path, result: dict,
                write, deadline: float) -> None:
    for n in ns:
        t0 = time.monotonic()
        if deadline - t0 < cfg.duration_s + 45:
            log(f"N={n}: skipped, {deadline - t0:.0f} s left of --time-budget-s")
            result["runs"].append({"sessions": n, "pass": False,
                                   "failed": "skipped: not enough of --time-budget-s left"})
            write()
            continue
        try:
            summary = await run_sessions(cfg, procs, n, work)
        except Exception as e:  # one N's failure is a row of the report, not the end of the sweep
            log(f"N={n}: run failed: {type(e).__name__}: {e}")
            summary = {"sessions": n, "pass": False, "failed": str(e)[-4000:]}
        summary["wall_s"] = round(time.monotonic() - t0, 1)
        if "checks" in summary:
            failed = [c for c, ok in summary["checks"].items() if not ok]
            log(f"N={n}: {'PASS' if summary['pass'] else 'FAIL (' + ', '.join(failed) + ')'} in "
                f"{summary['wall_s']:.0f} s")
        result["runs"].append(summary)
        write()


def local_only_network() -> None:
    """Everything this bench talks to is on 127.0.0.1: keep any HTTP/gRPC proxy setting out of it."""
    for var in ("no_proxy", "NO_PROXY", "no_grpc_proxy"):
        os.environ[var] = ",".join(x for x in ("127.0.0.1", "localhost", os.environ.get(var, "")) if x)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks: services stopped, MPS quit


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    deadline = time.monotonic() + cfg.time_budget_s
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    local_only_network()
    t_start = time.monotonic()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    own_work = not cfg.work_dir
    work = Path(cfg.work_dir or tempfile.mkdtemp(prefix="cell-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    result: dict = {"bench": "cell", "mode": "smoke (cpu, tiny)" if cfg.smoke else f"{cfg.preset} on {cfg.device}",
                    "config": public_config(cfg), "host": {"cpu_cores": os.cpu_count(), "gpu": gpu_state()},
                    "phases_s": {}, "services": None, "mps": {"enabled": cfg.mps}, "runs": [],
                    "largest_passing_sessions": None}

    def write() -> None:
        passing = [r["sessions"] for r in result["runs"] if r.get("pass")]
        result["largest_passing_sessions"] = max(passing) if passing else None
        result["phases_s"]["total"] = round(time.monotonic() - t_start, 1)
        (out / "cell.json").write_text(json.dumps(result, indent=2))

    mps = Mps() if cfg.mps else None
    procs: dict[str, ServiceProcess] = {}
    checkpoint = Path(cfg.checkpoint) if cfg.checkpoint else None
    try:
        t = time.monotonic()
        if checkpoint is None:
            checkpoint = build_checkpoint(cfg, work)
        result["phases_s"]["checkpoint"] = round(time.monotonic() - t, 1)
        result["checkpoint"] = "given (--checkpoint)" if cfg.checkpoint else f"built: {cfg.preset} seed {cfg.seed}"
        log(f"checkpoint ready in {result['phases_s']['checkpoint']:.1f} s: {checkpoint}")
        write()

        if mps is not None:
            t = time.monotonic()
            mps.start()
            problem = mps.probe()
            result["phases_s"]["mps_start"] = round(time.monotonic() - t, 1)
            if problem is None:
                result["mps"]["server_list_after_probe"] = mps.query("get_server_list")
                log(f"mps: control daemon up, a CUDA client ran through it ({result['phases_s']['mps_start']:.1f} s)")
            else:
                # Measure without MPS rather than not at all; the report says so everywhere.
                result["mps"] = {"enabled": False, "requested": True, "error": problem,
                                 "control_log_tail": mps.stop()}
                mps = None
                log(f"mps: NOT IN USE, continuing without it: {problem}")
            write()

        # Services: slots = the largest N; if they do not start, the next smaller N.
        ns = cfg.sweep
        candidates = [max(ns)] + [c for c in sorted(set(ns) | set(cfg.fallbacks), reverse=True) if c < max(ns)]
        result["service_start_failures"] = []
        t = time.monotonic()
        for slots in candidates:
            if slots != candidates[0] and deadline - time.monotonic() < cfg.ready_timeout_s / 2 + cfg.duration_s + 60:
                log(f"services: no time left in --time-budget-s to try {slots} slots")
                result["service_start_failures"].append({"slots": slots, "error": "skipped: time budget"})
                continue
            slots_total = slots + cfg.extra_slots
            log(f"services: starting encoder, talker, decoder with {slots_total} slots on {cfg.device}")
            try:
                procs, info = start_services(cfg, checkpoint, slots_total)
                ns = [n for n in ns if n <= slots] or [slots]
                break
            except ServiceStartError as e:
                log(f"services: did not start with {slots_total} slots: {str(e)[:2000]}")
                result["service_start_failures"].append({"slots": slots_total, "error": str(e)[-4000:]})
                write()
        else:
            log("services: no slot count started; see cell.json")
            return 3
        result["phases_s"]["services_start"] = round(time.monotonic() - t, 1)
        info["args"] = {st: a.replace(str(checkpoint), "<checkpoint>") for st, a in info["args"].items()}
        info["gpu_after_start"] = gpu_state()
        info["gpu_memory"] = gpu_memory(scrape(procs))
        for line in gpu_memory_lines(info["gpu_memory"]):
            log(line)
        result["services"] = info
        if mps is not None:  # evidence that the three services are clients of our MPS server
            servers = mps.query("get_server_list")
            result["mps"]["server_list"] = servers
            result["mps"]["client_lists"] = {pid: mps.query(f"get_client_list {pid}") for pid in servers.split()
                                             if pid.isdigit()}
            result["mps"]["service_pids"] = {st: p.proc.pid for st, p in procs.items()}
            log(f"mps: servers {servers or '-'}; clients {result['mps']['client_lists']}")
        write()

        asyncio.run(sweep(cfg, procs, ns, work, result, write, deadline))
        result["host"]["gpu_at_end"] = gpu_state()
    finally:
        if procs:
            save_service_logs(procs, out)
            stop_services(procs)
        if mps is not None:
            result["mps"]["control_log_tail"] = mps.stop()
        if cfg.keep_checkpoint:
            log(f"kept the work dir (checkpoint, load records): {work}")
        elif own_work:
            shutil.rmtree(work, ignore_errors=True)
        elif not cfg.checkpoint:
            shutil.rmtree(work / "checkpoint", ignore_errors=True)
        write()

    try:
        print_table(result)
        png = plot(result, out / "cell.png")
    except Exception as e:  # the JSON is written; a report glitch must not hide it
        log(f"report: table/plot failed: {type(e).__name__}: {e}")
        png = None
    result["png"] = png.name if png else None
    write()
    log(f"wrote {out / 'cell.json'}" + (f" and {png}" if png else "") +
        f"; phases (s): {json.dumps(result['phases_s'])}")
    # 0: some N passed; 3: measured, none passed (1 is left to crashes, 2 to bad flags).
    return 0 if result["largest_passing_sessions"] is not None else 3


if __name__ == "__main__":
    sys.exit(main())
