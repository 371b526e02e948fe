"""The gateway's configuration: one typed place, defaults that run on a laptop CPU."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from services.common.config import load_config, option
from services.gateway import tls
from services.gateway.client_address import Network, parse_networks

STATIC_DIR = Path(__file__).resolve().parent / "static"
API_KEY_ENV = "PERSONAPLEX_GATEWAY_API_KEY"
ENV_PREFIX = "GATEWAY_"
WORKERS_ENV = ENV_PREFIX + "WORKERS"
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


def parse_workers(text: str) -> int:
    """'auto' -> usable_cpus(); else a positive integer."""
    if text.strip().lower() == "auto":
        return usable_cpus()
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"expected a positive integer or 'auto', got {text[:40]!r}")
    return n


def parse_cells(text: str) -> tuple[CellAddress, ...]:
    """'enc:p,talk:p,dec:p;enc:p,talk:p,dec:p' -> cells."""
    return tuple(CellAddress.parse(c) for c in text.split(";") if c.strip())


def read_cells_file(path: str) -> tuple[CellAddress, ...]:
    """A JSON file holding a list of {encoder, talker, decoder} -> cells."""
    try:
        with open(path) as f:
            return tuple(CellAddress(c["encoder"], c["talker"], c["decoder"]) for c in json.load(f))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cells file {path[:80]!r}: {type(e).__name__}: {str(e)[:120]}") from None


def parse_ports(text: str) -> tuple[int, int, int]:
    """'50051,50052,50053' -> the encoder, talker and decoder ports."""
    try:
        ports = tuple(int(x) for x in text.split(","))
    except ValueError:
        ports = ()
    if len(ports) != 3 or not all(0 < p < 65536 for p in ports):
        raise ValueError(f"expected three ports 'encoder,talker,decoder', got {text[:40]!r}")
    return ports  # type: ignore[return-value]


@dataclass(frozen=True)
class GatewayConfig:
    """PersonaPlex Realtime gateway."""

    host: str = option("127.0.0.1", help="address to listen on")
    port: int = option(8000, help="HTTP and WebSocket port")
    workers: int = option(1, parse=parse_workers, help="processes serving the port (services/gateway/workers.py): "
                                                       "N or 'auto' (the CPUs it may use)")
    # Cells: a static list, or the DNS name of a headless Service whose A records are pods that each run the
    # three stages on dns_ports.
    cells: tuple[CellAddress, ...] = option((), parse=parse_cells,
                                            help="static cells: 'enc:port,talk:port,dec:port;...'")
    cells_file: str = option("", help="JSON file: a list of {encoder, talker, decoder}, added to --cells")
    cells_dns: str | None = option(None, help="headless Service name; each of its addresses is one cell")
    dns_ports: tuple[int, int, int] = option((50051, 50052, 50053), parse=parse_ports,
                                             help="encoder,talker,decoder ports for --cells-dns")
    dns_refresh_s: float = option(5.0, help="how often --cells-dns is resolved again")
    poll_interval_s: float = option(0.5, aliases=("--poll-interval",), help="how often each stage's GetCapacity "
                                                                            "is polled")
    poll_timeout_s: float = option(0.4, help="how long one GetCapacity poll may take")
    open_timeout_s: float = option(30.0, aliases=("--open-timeout",), help="bound on opening a session's three "
                                                                           "streams (with the talker's prefill)")
    # Every cell full while this gateway releases a session (a client reconnecting at once).
    admission_wait_s: float = option(1.0, aliases=("--admission-wait",), help="seconds a new session may wait "
                                                                              "for a slot this gateway is releasing")
    cleanup_timeout_s: float = option(3.0, aliases=("--cleanup-timeout",), help="bound on all three stages "
                                                                                "acknowledging a close")
    stall_timeout_s: float = option(3.0, aliases=("--stall-timeout",), help="input outstanding and no output "
                                                                            "this long: the stage is stalled")
    # An SDK connects with ?model= and sends its session.update at once: the autostarted session takes its
    # slot but prefills nothing until that update, its first audio, or this long (one prompt per open).
    autostart_hold_ms: int = option(500, help="an autostarted session's prompt waits this long for its first "
                                              "session.update or audio before it starts with the defaults")
    # Each re-runs the prompt on the GPU; SDKs send one or two.
    max_reprimes_per_10s: int = option(5, help="session.update prompt changes before audio, per connection and 10 s; "
                                               "more are refused (rate_limit_exceeded)")
    early_outputs: bool = option(True, help="the talker sends each output at its step's end and the relay holds it "
                                            "for its input frame (false: the talker holds it; TalkOpen.early_outputs)")
    api_key_env: str = option(API_KEY_ENV, help="environment variable holding the bearer key (unset: no check)")
    api_key: str | None = option(None, settable=False)  # read from api_key_env: a secret stays off command lines
    client_secret_ttl_s: float = option(60.0, aliases=("--client-secret-ttl",), help="seconds a browser's client "
                                                                                     "secret may open its connection")
    client_secret_rate: float = option(10.0, help="client secrets minted per second per key and process, after a "
                                                  "burst of --client-secret-burst (0 = no limit); more get 429")
    client_secret_burst: int = option(20, help="client secrets minted at once before --client-secret-rate applies")
    model: str = option("nvidia/personaplex-7b-v1", help="the model name clients see")
    default_voice: str = option("", help="a session's voice when the client names none ('' = the talker's own)")
    voice_aliases: tuple[tuple[str, str], ...] = option(
        DEFAULT_VOICE_ALIASES, parse=parse_voice_aliases,
        help="other vendors' voice names -> bundled voices: 'marin=NATF2.pt,...' ('' for none)")
    default_instructions: str = option("You enjoy having a good conversation.",
                                       help="a session's persona when the client gives none")
    max_instructions_chars: int = option(4000, help="longer instructions are refused")
    max_packet_samples: int = option(240_000, help="samples one input packet may hold (10 s)")
    max_message_bytes: int = option(2 * 1024 * 1024, help="bytes one client message may hold")
    # A client that reads slower than this is cut off (whichever bound comes first).
    output_queue_events: int = option(400, help="output events buffered for one client")
    output_queue_bytes: int = option(2 * 1024 * 1024, help="output bytes buffered for one client")
    # With the queue above, what a client that stops reading can hold up is bounded.
    send_buffer_bytes: int = option(256 * 1024, help="kernel send buffer per client socket (0 = the OS default, "
                                                     "which can autotune to MBs)")
    # A client that does not read at all: its socket is aborted (client_connection.py).
    send_timeout_s: float = option(10.0, aliases=("--send-timeout",), help="seconds a write (a message, close or "
                                                                           "ping) may wait for a client that does "
                                                                           "not read; then the socket is aborted")
    write_buffer_bytes: int = option(1024 * 1024, help="bytes unsent in one open WebSocket's transport (pongs "
                                                       "included); past it the socket is aborted")
    close_timeout_s: float = option(5.0, aliases=("--close-timeout",), help="seconds a client has to close after "
                                                                            "its close frame or HTTP answer")
    request_timeout_s: float = option(30.0, aliases=("--request-timeout",), help="seconds a request's head and "
                                                                                 "body may take to arrive (408)")
    body_buffer_bytes: int = option(32 * 1024 * 1024, help="bytes of request bodies all connections may hold at "
                                                           "once; more get 503")
    # Each idle one holds buffers, not slots.
    max_connections: int = option(2048, help="open WebSockets per gateway process (counted until the socket is "
                                             "gone); more get HTTP 503")
    idle_connection_timeout_s: float = option(30.0, aliases=("--idle-connection-timeout",),
                                              help="seconds a WebSocket may stay open without a session (0 = no bound)")
    idle_session_timeout_s: float = option(30.0, aliases=("--idle-session-timeout",),
                                           help="seconds a session may go without audio (0 = no bound)")
    # A Realtime session whose connection drops holds its slot this long for a resume (services/gateway/resume.py).
    resume_grace_s: float = option(15.0, aliases=("--resume-grace",),
                                   help="seconds a dropped Realtime session stays paused in its slot for the client "
                                        "to resume it (0 = a drop ends the session; no resume)")
    # https and wss on the same port (services/gateway/tls.py); both or neither.
    tls_cert: str = option("", help="PEM certificate chain for https/wss on --port (with --tls-key; '' = plain)")
    tls_key: str = option("", help="PEM private key of --tls-cert")
    # A proxy in front (ingress) names the client in X-Forwarded-For; believed only from these peers.
    trusted_proxies: tuple[Network, ...] = option(
        (), parse=parse_networks, help="CIDRs of proxies whose X-Forwarded-For names the client in logs ('' = none)")
    static_dir: Path = option(STATIC_DIR, help="the browser page's files")
    # Voice enrollment (services/gateway/voices.py).
    voice_upload: bool = option(False, help="enable PUT/DELETE /v1/voices/NAME (needs the API key)")
    voices_dir: str = option("", help="folder of enrolled voices, shared by workers and replicas "
                                      "('' = personaplex-gateway-voices in the temp folder)")
    voice_upload_bytes: int = option(10 * 1024 * 1024, help="bytes one enrolled voice's audio may hold")
    voice_min_seconds: float = option(2.0, help="shorter enrollment audio is refused")
    voice_max_seconds: float = option(30.0, help="longer enrollment audio is refused")
    max_voices: int = option(64, help="enrolled voices in --voices-dir; more get 409 voice_limit_reached")
    voices_total_bytes: int = option(256 * 1024 * 1024, help="bytes of enrolled audio (24 kHz float32) in "
                                                             "--voices-dir; more get 409 voice_limit_reached")
    voice_forget_timeout_s: float = option(2.0, help="how long a DELETE (or replacing PUT) waits for each talker "
                                                     "to forget the voice's recording")

    def __post_init__(self) -> None:
        if not self.cells and not self.cells_dns:
            raise ValueError("give --cells, --cells-file or --cells-dns")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        for name in ("poll_interval_s", "poll_timeout_s", "dns_refresh_s", "open_timeout_s", "cleanup_timeout_s",
                     "stall_timeout_s", "client_secret_ttl_s", "send_timeout_s", "close_timeout_s",
                     "request_timeout_s", "voice_forget_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("admission_wait_s", "idle_connection_timeout_s", "idle_session_timeout_s", "send_buffer_bytes",
                     "client_secret_rate", "resume_grace_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("max_connections", "output_queue_events", "output_queue_bytes", "max_message_bytes",
                     "max_packet_samples", "max_instructions_chars", "voice_upload_bytes", "client_secret_burst",
                     "write_buffer_bytes", "body_buffer_bytes", "max_voices", "voices_total_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("give both --tls-cert and --tls-key, or neither")
        if self.tls_cert:
            tls.server_context(self.tls_cert, self.tls_key)  # refuses unreadable or mismatched files at start
        if self.voice_upload and not self.api_key:
            raise ValueError(f"--voice-upload needs an API key: set {self.api_key_env}")
        if self.body_buffer_bytes < self.voice_upload_bytes:
            raise ValueError(f"body_buffer_bytes ({self.body_buffer_bytes}) must hold one upload "
                             f"(voice_upload_bytes, {self.voice_upload_bytes})")

    @classmethod
    def from_args(cls, argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> "GatewayConfig":
        """Defaults < GATEWAY_* environment < flags (services/common/config.py); the key from api_key_env."""
        env = os.environ if env is None else env

        def derive(values: dict) -> None:
            if values["cells_file"]:
                values["cells"] = values["cells"] + read_cells_file(values["cells_file"])
            values["api_key"] = env.get(values["api_key_env"]) or None

        return load_config(cls, ENV_PREFIX, argv, env, prog="python -m services.gateway", derive=derive)
