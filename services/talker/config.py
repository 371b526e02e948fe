"""The Talker service's configuration: one typed place, CPU defaults, env-var overrides.

Precedence: dataclass default < environment (TALKER_<FIELD>, e.g. TALKER_SLOTS=8) < command line
(--slots 8), through the common loader.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from services.common.process import check_gil_switch_ms
from services.common.stage_server import STREAM_IDLE_TIMEOUT_S
from services.common.stage_config import load_config

ENV_PREFIX = "TALKER_"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class TalkerConfig:
    checkpoint: str = ""  # checkpoint directory in the published layout (required)
    host: str = "127.0.0.1"
    port: int = 50052  # gRPC; 0 picks a free port
    metrics_port: int = 9102  # Prometheus HTTP; 0 picks a free port, -1 disables it
    slots: int = 2  # concurrent sessions = the batch size of every step
    device: str = "cpu"
    dtype: str = "auto"  # "auto" (float32 on CPU, bfloat16 on CUDA) or one of DTYPES
    # Live-step timing (services/talker/engine.py): "personaplex" reproduces NVIDIA's reference server
    # (a user frame is first read one step later; N inputs give N outputs; attention over context-1
    # frames), "moshi" upstream moshi 0.2.13 (read in the same step; N-1 outputs; attention over context).
    alignment: str = "personaplex"
    context: int = 0  # the model's context in frames (0 = the checkpoint's); the KV ring follows alignment
    kv_fp8: bool = False  # store the KV ring in fp8 (half the memory per slot)
    # The 32 temporal layers' matrices in fp8 with per-row scales (6.6 GB instead of 13.2 at full
    # size: what lets the codecs fit beside 160 sessions); the rest of the model stays in `dtype`.
    weights_fp8: bool = False
    cuda_graph: bool = False  # replay the step as a captured CUDA graph (CUDA only; much faster there)
    # Fuse the step's elementwise chains (norms, fp8 quantization, RoPE, SiLU gate) with
    # torch.compile (CUDA only): a few thousand fewer kernels per step; start-up compiles them.
    compile: bool = False
    # BENCHMARK ONLY: every session attends over its whole ring from its first live frame, as a
    # session does once it has talked for `context` frames (4 minutes at full size). The ring's
    # unwritten part is zeros, so what the model says is meaningless; what a step costs is that of
    # the steady state, measured without waiting minutes for it (bench/pipeline.py --full-context).
    bench_full_context: bool = False
    tick_ms: float = 80.0  # the conversation clock's period (one Mimi frame)
    # Deadlines at k * tick_ms + tick_phase_ms of the machine's monotonic clock: the cell's frame
    # grid (services/common/frame_grid.py), which a phased encoder steps just before.
    tick_phase_ms: float = 0.0
    # At a tick's deadline, wait up to this long for frames that are due (their session sent one
    # within the last 1.5 periods) but not here yet, while the step still ends before the next
    # deadline: a session whose frames arrive just after the deadline is stepped on time instead
    # of alternating between a skipped tick and a catch-up step. 0 = tick on the deadline.
    input_wait_ms: float = 15.0
    # How many frames behind a session must be (queued before a tick's main step, besides the one
    # it takes) for the tick to give it a catch-up step even past the deadline; fewer wait for a
    # period with room for one. Below it a session stays that many frames late, at it the tick
    # runs late: at 144-160 full-context sessions on the H200 such ticks took 105-150 ms
    # (bench/results, 2026-11-30).
    catch_up_lag_frames: int = 2
    max_backlog_s: float = 2.0  # queued input beyond this is refused with RESOURCE_EXHAUSTED
    max_persona_chars: int = 4000  # longer persona text is INVALID_ARGUMENT
    # Most prompt frames one prefill chunk runs (in a period's slack); with cuda_graph also the length
    # of the captured chunk (shorter ones are padded to it).
    prefill_chunk_frames: int = 64
    # Voices (comma-separated basenames, e.g. "NATF2.pt,NATM1.pt") whose KV prefix is computed at
    # start instead of by the first session that asks for one. Each costs its frames of KV (about
    # 0.27 MB per frame at full size, fp8) for the life of the process.
    preload_voices: str = ""
    # Voices recorded from audio (voices/*.wav or audio shipped with an open) are kept here as .pt,
    # named by a digest of the audio and the model files ("" = personaplex-voices in the temp dir).
    voice_cache_dir: str = ""
    max_voice_seconds: float = 60.0  # longer voice audio is INVALID_ARGUMENT (bad_voice)
    drain_deadline_s: float = 30.0  # SIGTERM: how long live sessions may continue
    stream_idle_timeout_s: float = STREAM_IDLE_TIMEOUT_S  # a stream that sends nothing this long ends (0 = never)
    # torch intra-op threads. 1 by default: the stages share a machine's cores, and several
    # processes each spinning torch's default thread pool slow one another down many times over.
    threads: int = 1
    # How often CPython makes a thread holding the GIL yield it (services/common/process.py: why a
    # busy gRPC loop otherwise stalls the compute thread's every torch call; CPython's default is 5).
    gil_switch_ms: float = 0.2
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        check_gil_switch_ms(self.gil_switch_ms)
        if self.slots < 1:
            raise ValueError(f"slots must be >= 1, got {self.slots}")
        if not (1.0 <= self.tick_ms <= 10_000.0):
            raise ValueError(f"tick_ms must be in [1, 10000], got {self.tick_ms}")
        if not 0.0 <= self.tick_phase_ms < self.tick_ms:
            raise ValueError(f"tick_phase_ms must be in [0, tick_ms), got {self.tick_phase_ms}")
        if not 0.0 <= self.input_wait_ms < self.tick_ms:
            raise ValueError(f"input_wait_ms must be in [0, tick_ms), got {self.input_wait_ms}")
        if self.catch_up_lag_frames < 1:
            raise ValueError(f"catch_up_lag_frames must be >= 1, got {self.catch_up_lag_frames}")
        if self.max_backlog_s <= 0:
            raise ValueError(f"max_backlog_s must be > 0, got {self.max_backlog_s}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.cuda_graph and not self.device.startswith("cuda"):
            raise ValueError(f"cuda_graph needs a CUDA device, got device {self.device!r}")
        if self.compile and not self.device.startswith("cuda"):
            raise ValueError(f"compile needs a CUDA device (the CPU runs the eager kernels), got device {self.device!r}")
        from services.talker.engine import ALIGNMENTS  # the engine's fact; it does not import this module

        if self.alignment not in ALIGNMENTS:
            raise ValueError(f"alignment must be one of {', '.join(ALIGNMENTS)}, got {self.alignment!r}")
        if self.context < 0:
            raise ValueError(f"context must be >= 0 (0 = the checkpoint's), got {self.context}")
        if self.prefill_chunk_frames < 1:
            raise ValueError(f"prefill_chunk_frames must be >= 1, got {self.prefill_chunk_frames}")
        if not 0.5 <= self.max_voice_seconds <= 600.0:
            raise ValueError(f"max_voice_seconds must be in [0.5, 600], got {self.max_voice_seconds}")
        if self.max_persona_chars < 1:
            raise ValueError(f"max_persona_chars must be >= 1, got {self.max_persona_chars}")

    @property
    def voices_to_preload(self) -> tuple[str, ...]:
        return tuple(v.strip() for v in self.preload_voices.split(",") if v.strip())

    @property
    def voice_cache_path(self) -> Path:
        if self.voice_cache_dir:
            return Path(self.voice_cache_dir)
        return Path(tempfile.gettempdir()) / "personaplex-voices"

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        return DTYPES[self.dtype]

    @property
    def max_backlog_frames(self) -> int:
        """Queued input frames a session may hold (at least 1): the backlog bound in frames."""
        return max(1, math.ceil(self.max_backlog_s * 1000.0 / self.tick_ms))

    @classmethod
    def load(cls, argv: list[str] | None = None, env: dict[str, str] | None = None) -> "TalkerConfig":
        """Defaults < TALKER_* environment < command line (services/common/stage_config.py)."""
        try:
            cfg = load_config(cls, ENV_PREFIX, argv=argv, env=env, description="PersonaPlex Talker gRPC service")
        except ValueError as e:
            raise SystemExit(f"talker config: {e}") from None
        if not cfg.checkpoint:
            raise SystemExit("talker config: --checkpoint (or TALKER_CHECKPOINT) is required")
        return cfg
