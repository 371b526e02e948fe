"""The gateway's configuration: one typed place, defaults that run on a laptop CPU."""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

STATIC_DIR = Path(__file__).resolve().parent / "static"
API_KEY_ENV = "PERSONAPLEX_GATEWAY_API_KEY"
TRUTHY = ("1", "true", "yes", "on")
ENV_PREFIX = "GATEWAY_"
WORKERS_ENV = "GATEWAY_WORKERS"
CGROUP_ROOT = Path("/sys/fs/cgroup")

# Other vendors' voice names -> a bundled voice, so clients that send their default voice
# (LiveKit's `marin`, the openai SDK's `alloy`, ...) work unmodified. Operators replace the
# table with --voice-aliases; a name that is neither an alias nor a bundled voice is refused.
DEFAULT_VOICE_ALIASES: tuple[tuple[str, str], ...] = (
    ("alloy", "NATF2.pt"), ("coral", "NATF2.pt"), ("marin", "NATF2.pt"), ("sage", "NATF2.pt"), ("shimmer", "NATF2.pt"),
    ("ash", "NATM1.pt"), ("ballad", "NATM1.pt"), ("cedar", "NATM1.pt"), ("echo", "NATM1.pt"), ("verse", "NATM1.pt"),
)


def parse_voice_aliases(text: str) -> tuple[tuple[str, str], ...]:
    """'marin=NATF2.pt,cedar=NATM1.pt' -> pairs ('' -> no aliases)."""
    pairs = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, voice = (x.strip() for x in part.partition("="))
        if not sep or not name or not voice.endswith(".pt"):
            raise ValueError(f"a voice alias is 'name=VOICE.pt', got {part!r}")
        pairs.append((name.lower(), voice))
    return tuple(pairs)


@dataclass(frozen=True)
class CellAddress:
    """One cell: the addresses (host:port) of its encoder, talker and decoder."""

    encoder: str
    talker: str
    decoder: str

    @property
    def name(self) -> str:
        return f"{self.encoder},{self.talker},{self.decoder}"

    @classmethod
    def parse(cls, text: str) -> "CellAddress":
        parts = [p.strip() for p in text.split(",")]
        if len(parts) != 3 or not all(_is_host_port(p) for p in parts):
            raise ValueError(f"a cell is 'encoder_host:port,talker_host:port,decoder_host:port', got {text!r}")
        return cls(*parts)


def _is_host_port(text: str) -> bool:
    host, sep, port = text.rpartition(":")
    return bool(host) and bool(sep) and port.isdigit() and 0 < int(port) < 65536


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        raise SystemExit(f"environment variable {name}={os.environ[name]!r} is not a number") from None


def usable_cpus(cgroup_root: Path = CGROUP_ROOT) -> int:
    """The CPUs this process may use: its affinity mask, capped by the cgroup's CPU quota rounded up
    (a container limited to 1.5 CPUs gets 2, as Kubernetes rounds a resourceFieldRef)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cgroup_cpu_quota(cgroup_root)
    return max(1, min(cpus, math.ceil(quota)) if quota else cpus)


def _cgroup_cpu_quota(root: Path) -> float | None:
    """CPUs allowed by cgroup v2 cpu.max or v1 cpu.cfs_quota_us; None when unlimited or unreadable."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def _defaults_from_env(parser: argparse.ArgumentParser, prefix: str) -> None:
    """Every flag also reads PREFIX + its name from the environment (GATEWAY_OPEN_TIMEOUT for
    --open-timeout), as every stage service's do; the command line wins."""
    for action in parser._actions:
        var = prefix + action.dest.upper()
        if action.option_strings and action.dest != "help" and var in os.environ:
            value = os.environ[var]
            # argparse converts a string default with the flag's type, as if it were given.
            parser.set_defaults(**{action.dest: value.lower() in TRUTHY if action.nargs == 0 else value})


def parse_workers(text: str) -> int:
    """'auto' -> usable_cpus(); else a positive integer."""
    if text.strip().lower() == "auto":
        return usable_cpus()
    n = int(text)
    if n < 1:
        raise ValueError(f"workers must be >= 1 or 'auto', got {text!r}")
    return n


def parse_cells(text: str) -> tuple[CellAddress, ...]:
    """'enc:p,talk:p,dec:p;enc:p,talk:p,dec:p' -> cells."""
    return tuple(CellAddress.parse(c) for c in text.split(";") if c.strip())


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # Worker processes sharing the port (services/gateway/workers.py); 1 = this process serves alone.
    workers: int = 1
    # Cells: a static list, or the DNS name of a headless Service whose A records are
    # pods that each run the three stages on the ports below.
    cells: tuple[CellAddress, ...] = ()
    cells_dns: str | None = None
    dns_ports: tuple[int, int, int] = (50051, 50052, 50053)
    dns_refresh_s: float = 5.0
    # How often each stage's GetCapacity is polled, and how long one poll may take.
    poll_interval_s: float = 0.5
    poll_timeout_s: float = 0.4
    # Opening a session's three streams includes the talker's prompt prefill.
    open_timeout_s: float = 30.0
    # Every cell full while this gateway releases a session (a client reconnecting at once):
    # admission waits this long for the released slot before refusing.
    admission_wait_s: float = 1.0
    # A close must be acknowledged by all three stages within this bound.
    cleanup_timeout_s: float = 3.0
    # With input frames outstanding and no output for this long, a stage is declared stalled.
    stall_timeout_s: float = 3.0
    # Operator-configured bearer key; None (the default) means no check.
    api_key: str | None = None
    # How long a browser's client secret (POST /v1/realtime/client_secrets) may open connections.
    client_secret_ttl_s: float = 60.0
    model: str = "nvidia/personaplex-7b-v1"
    default_voice: str = ""
    voice_aliases: tuple[tuple[str, str], ...] = DEFAULT_VOICE_ALIASES
    default_instructions: str = "You enjoy having a good conversation."
    max_instructions_chars: int = 4000
    # Client input bounds: one packet at most this many samples (10 s), one message this many bytes.
    max_packet_samples: int = 240_000
    max_message_bytes: int = 2 * 1024 * 1024
    # Output buffered for a client before it is declared too slow and cut off: at most this many
    # events and this many bytes (whichever comes first).
    output_queue_events: int = 400
    output_queue_bytes: int = 2 * 1024 * 1024
    # Kernel send buffer per client socket (0 = the OS default, which can autotune to MBs):
    # with the queue above, what a client that stops reading can hold up is bounded.
    send_buffer_bytes: int = 256 * 1024
    # Open WebSockets per gateway process; more get HTTP 503 (each idle one holds buffers, not slots).
    max_connections: int = 2048
    # Idle bounds (0 = none): a WebSocket that opens no session, and a session that appends no audio
    # (since its open or its last audio message), are closed with an `idle_timeout` error after this long.
    idle_connection_timeout_s: float = 30.0
    idle_session_timeout_s: float = 30.0
    static_dir: Path = field(default=STATIC_DIR)
    # Voice enrollment (services/gateway/voices.py): PUT/DELETE /v1/voices/NAME, only with an API key.
    voice_upload: bool = False
    voices_dir: str = ""  # enrolled voices ("" = personaplex-gateway-voices in the temp folder)
    voice_upload_bytes: int = 10 * 1024 * 1024
    voice_min_seconds: float = 2.0
    voice_max_seconds: float = 30.0

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> "GatewayConfig":
        p = argparse.ArgumentParser(prog="python -m services.gateway", description="PersonaPlex Realtime gateway")
        d = cls()
        p.add_argument("--host", default=d.host)
        p.add_argument("--port", type=int, default=d.port)
        p.add_argument("--workers", default=os.environ.get(WORKERS_ENV, str(d.workers)),
                       help=f"processes serving the port: N or 'auto' (the CPUs it may use); env {WORKERS_ENV}")
        p.add_argument("--cells", default="", help="static cells: 'enc:port,talk:port,dec:port;...'")
        p.add_argument("--cells-file", default=None, help="JSON file: list of {encoder, talker, decoder}")
        p.add_argument("--cells-dns", default=None, help="headless Service name; each address is one cell")
        p.add_argument("--dns-ports", default=",".join(map(str, d.dns_ports)), help="encoder,talker,decoder ports for --cells-dns")
        p.add_argument("--poll-interval", type=float, default=d.poll_interval_s)
        p.add_argument("--open-timeout", type=float, default=d.open_timeout_s)
        p.add_argument("--cleanup-timeout", type=float, default=d.cleanup_timeout_s)
        p.add_argument("--admission-wait", type=float, default=d.admission_wait_s,
                       help="seconds a new session may wait for a slot this gateway is releasing")
        p.add_argument("--stall-timeout", type=float, default=d.stall_timeout_s)
        p.add_argument("--api-key-env", default=API_KEY_ENV, help="environment variable holding the bearer key (unset: no check)")
        p.add_argument("--client-secret-ttl", type=float, default=d.client_secret_ttl_s,
                       help="seconds a browser's client secret may open connections")
        p.add_argument("--model", default=d.model)
        p.add_argument("--default-voice", default=d.default_voice)
        p.add_argument("--voice-aliases", default=",".join(f"{k}={v}" for k, v in d.voice_aliases),
                       help="other vendors' voice names -> bundled voices: 'marin=NATF2.pt,...' ('' for none)")
        p.add_argument("--default-instructions", default=d.default_instructions)
        p.add_argument("--output-queue-events", type=int, default=d.output_queue_events)
        p.add_argument("--output-queue-bytes", type=int, default=d.output_queue_bytes)
        p.add_argument("--send-buffer-bytes", type=int, default=d.send_buffer_bytes)
        p.add_argument("--max-connections", type=int, default=d.max_connections, help="open WebSockets per gateway process")
        p.add_argument("--static-dir", default=str(d.static_dir))
        p.add_argument("--idle-connection-timeout", type=float, default=_env_float("GATEWAY_IDLE_CONNECTION_TIMEOUT_S", d.idle_connection_timeout_s),
                       help="seconds a WebSocket may stay open without a session (env GATEWAY_IDLE_CONNECTION_TIMEOUT_S; 0 = no bound)")
        p.add_argument("--idle-session-timeout", type=float, default=_env_float("GATEWAY_IDLE_SESSION_TIMEOUT_S", d.idle_session_timeout_s),
                       help="seconds a session may go without audio (env GATEWAY_IDLE_SESSION_TIMEOUT_S; 0 = no bound)")
        p.add_argument("--voice-upload", action="store_true", default=os.environ.get("GATEWAY_VOICE_UPLOAD", "") in TRUTHY,
                       help="enable PUT/DELETE /v1/voices/NAME (needs the API key; env GATEWAY_VOICE_UPLOAD)")
        p.add_argument("--voices-dir", default=os.environ.get("GATEWAY_VOICES_DIR", d.voices_dir),
                       help="folder of enrolled voices, shared by workers and replicas (env GATEWAY_VOICES_DIR)")
        _defaults_from_env(p, ENV_PREFIX)
        a = p.parse_args(argv)
        cells = parse_cells(a.cells) if a.cells else ()
        if a.cells_file:
            with open(a.cells_file) as f:
                cells += tuple(CellAddress(c["encoder"], c["talker"], c["decoder"]) for c in json.load(f))
        if not cells and not a.cells_dns:
            p.error("give --cells, --cells-file or --cells-dns")
        try:
            workers = parse_workers(a.workers)
        except ValueError:
            p.error(f"--workers (or {WORKERS_ENV}) is a positive integer or 'auto', got {a.workers[:40]!r}")
        if a.voice_upload and not os.environ.get(a.api_key_env):
            p.error(f"--voice-upload needs an API key: set {a.api_key_env}")
        ports = tuple(int(x) for x in a.dns_ports.split(","))
        try:
            aliases = parse_voice_aliases(a.voice_aliases)
        except ValueError as e:
            p.error(str(e))
        if len(ports) != 3:
            p.error("--dns-ports needs three ports")
        return cls(
            host=a.host,
            port=a.port,
            workers=workers,
            cells=cells,
            cells_dns=a.cells_dns,
            dns_ports=ports,  # type: ignore[arg-type]
            poll_interval_s=a.poll_interval,
            open_timeout_s=a.open_timeout,
            cleanup_timeout_s=a.cleanup_timeout,
            admission_wait_s=a.admission_wait,
            stall_timeout_s=a.stall_timeout,
            api_key=os.environ.get(a.api_key_env) or None,
            client_secret_ttl_s=a.client_secret_ttl,
            model=a.model,
            default_voice=a.default_voice,
            voice_aliases=aliases,
            default_instructions=a.default_instructions,
            output_queue_events=a.output_queue_events,
            output_queue_bytes=a.output_queue_bytes,
            send_buffer_bytes=a.send_buffer_bytes,
            max_connections=a.max_connections,
            static_dir=Path(a.static_dir),
            idle_connection_timeout_s=a.idle_connection_timeout,
            idle_session_timeout_s=a.idle_session_timeout,
            voice_upload=a.voice_upload,
            voices_dir=a.voices_dir,
        )
