"""The Talker service's configuration: the stage fields (services/common/stage_config.py) and the talker's own.

Precedence: dataclass default < environment (TALKER_<FIELD>, e.g. TALKER_SLOTS=8) < command line (--slots 8).
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from services.common.config import option
from services.common.frame import FRAME_MS
from services.common.stage_config import METRICS_PORT_HELP, PORT_HELP, StageConfig
from services.talker import say, voice_recorder
from services.talker.tick_policy import LAG_FRAMES, check_lag_frames

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class TalkerConfig(StageConfig):
    """PersonaPlex Talker gRPC service: 8 user codes per frame in, 8 agent codes and text out."""

    ENV_PREFIX = "TALKER_"

    port: int = option(50052, help=PORT_HELP)
    metrics_port: int = option(9102, help=METRICS_PORT_HELP)
    dtype: str = option("auto", help=f"auto (float32 on CPU, bfloat16 on CUDA) | {' | '.join(DTYPES)}")
    # "personaplex" reproduces NVIDIA's reference server (a user frame is first read one step later; N inputs
    # give N outputs; attention over context-1 frames), "moshi" upstream moshi 0.2.13 (read in the same step;
    # N-1 outputs; attention over context). services/talker/engine.py.
    alignment: str = option("personaplex", help="live-step timing: personaplex | moshi")
    context: int = option(0, help="the model's context in frames (0 = the checkpoint's)")
    kv_fp8: bool = option(False, help="store the KV ring in fp8 (half the memory per slot; as --kv-bits 8)")
    # 0.44 GB per full-context session instead of fp8's 0.80 (services/talker/kv_int4.py); its quality against
    # fp8 is bench/quality.py's (README).
    kv_bits: int = option(0, help="bits per stored KV value: 8 = fp8, 4 = int4 with per-half-vector scales "
                                  "(0 = the compute dtype, or fp8 with --kv-fp8)")
    # 6.6 GB instead of 13.2 at full size: what lets the codecs fit beside 160 sessions.
    weights_fp8: bool = option(False, help="the 32 temporal layers' matrices in fp8 with per-row scales")
    # A few thousand fewer kernels per step; start-up compiles them.
    compile: bool = option(False, help="fuse the step's elementwise chains with torch.compile (CUDA only)")
    # The ring's unwritten part is zeros, so what the model says is meaningless; a step costs what it does in
    # the steady state (4 minutes into a session at full size), measured without waiting for it.
    bench_full_context: bool = option(False, help="BENCHMARK ONLY: every session attends over its whole ring "
                                                  "from its first frame")
    tick_ms: float = option(float(FRAME_MS), help="the conversation clock's period (one Mimi frame)")
    tick_phase_ms: float = option(0.0, help="deadlines at k * tick_ms + this, the cell's frame grid "
                                            "(services/common/frame_grid.py)")
    # A session whose frames arrive just after the deadline is stepped on time instead of alternating
    # between a skipped tick and a catch-up step.
    input_wait_ms: float = option(15.0, help="at a deadline, wait up to this long for frames that are due "
                                             "but not here yet (0 = tick on the deadline)")
    # Below it a session stays that many frames late; at it the tick runs late. The H200 profile
    # (k8s/overlays/gpu) sets 3: at 160 sessions a catch-up step rarely fits in the period, and with 2
    # the forced ones made the ticks miss their target (bench/RESULTS.md, front door runs 12-17).
    catch_up_lag_frames: int = option(LAG_FRAMES, help="frames behind a session must be for a catch-up step "
                                                       "past the deadline")
    # Admission looks at the prefill queue: a caller whose first audio would come this late is told to
    # retry (RESOURCE_EXHAUSTED prefill_busy, with a retry hint) before its slot is taken. Off by default
    # (a CPU's prefill is slow and uneven); the GPU profile (k8s/overlays/gpu) sets 2 s.
    max_prefill_wait_s: float = option(0.0, help="refuse an open whose prompt would wait longer than this in the "
                                                 "prefill queue (0 = never refuse)")
    max_backlog_s: float = option(2.0, help="queued input beyond this is refused with RESOURCE_EXHAUSTED")
    max_persona_chars: int = option(4000, help="longer persona text is INVALID_ARGUMENT")
    prefill_chunk_frames: int = option(64, help="most prompt frames one prefill chunk runs (with cuda_graph also "
                                                "the captured chunk's length)")
    # Each costs its frames of KV (about 0.27 MB per frame at full size, fp8) for the life of the process.
    preload_voices: str = option("", help="voices whose KV prefix is computed at start, e.g. NATF2.pt,NATM1.pt")
    # Named by a digest of the audio and the model files.
    voice_cache_dir: str = option("", help="where voices recorded from audio are kept as .pt "
                                           "(\"\" = personaplex-voices in the temp folder)")
    max_voice_seconds: float = option(voice_recorder.MAX_SECONDS,
                                      help="longer voice audio is INVALID_ARGUMENT (bad_voice)")
    # Text an application has the model say (TalkSay, services/talker/say.py).
    max_say_chars: int = option(say.MAX_SAY_CHARS, help="a longer say is refused (say_too_long)")
    max_say_tokens: int = option(say.MAX_SAY_TOKENS, help="say tokens a session may have queued (beyond: "
                                                          "say_queue_full)")
    say_max_wait_frames: int = option(say.MAX_WAIT_FRAMES, help="frames a said word waits for the model to "
                                                                "start a word before it is forced")
    # Recordings of enrolled voices (audio shipped with opens; services/talker/recording_store.py): each holds
    # its embeddings and, once used, its KV prefix on the device (about 0.27 MB per frame at full size, fp8:
    # 1 GiB is about 5 min of voices). Least recently used evicted first; bundled voices are not counted.
    voice_memory_bytes: int = option(voice_recorder.MEMORY_BYTES,
                                     help="bytes of recorded enrolled voices held in memory (host and device); at "
                                          "least one max_voice_seconds voice")
    voice_cache_bytes: int = option(voice_recorder.DISK_BYTES,
                                    help="bytes of recorded enrolled voices kept in voice_cache_dir (least recently "
                                         "used removed first)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (1.0 <= self.tick_ms <= 10_000.0):
            raise ValueError(f"tick_ms must be in [1, 10000], got {self.tick_ms}")
        if not 0.0 <= self.tick_phase_ms < self.tick_ms:
            raise ValueError(f"tick_phase_ms must be in [0, tick_ms), got {self.tick_phase_ms}")
        if not 0.0 <= self.input_wait_ms < self.tick_ms:
            raise ValueError(f"input_wait_ms must be in [0, tick_ms), got {self.input_wait_ms}")
        check_lag_frames(self.catch_up_lag_frames)
        if self.max_prefill_wait_s < 0:
            raise ValueError(f"max_prefill_wait_s must be >= 0, got {self.max_prefill_wait_s}")
        if self.max_backlog_s <= 0:
            raise ValueError(f"max_backlog_s must be > 0, got {self.max_backlog_s}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.cuda_graph and not self.device.startswith("cuda"):
            raise ValueError(f"cuda_graph needs a CUDA device, got device {self.device!r}")
        if self.compile and not self.device.startswith("cuda"):
            raise ValueError(f"compile needs a CUDA device (the CPU runs the eager kernels), got {self.device!r}")
        from services.talker.engine import ALIGNMENTS  # the engine's fact; it does not import this module

        if self.alignment not in ALIGNMENTS:
            raise ValueError(f"alignment must be one of {', '.join(ALIGNMENTS)}, got {self.alignment!r}")
        if self.kv_bits not in (0, 4, 8):
            raise ValueError(f"kv_bits must be 4, 8 or 0 (the compute dtype), got {self.kv_bits}")
        if self.kv_fp8 and self.kv_bits not in (0, 8):
            raise ValueError(f"kv_fp8 is kv_bits 8: it cannot go with kv_bits {self.kv_bits} (unset one)")
        if self.context < 0:
            raise ValueError(f"context must be >= 0 (0 = the checkpoint's), got {self.context}")
        if self.prefill_chunk_frames < 1:
            raise ValueError(f"prefill_chunk_frames must be >= 1, got {self.prefill_chunk_frames}")
        if not 0.5 <= self.max_voice_seconds <= 600.0:
            raise ValueError(f"max_voice_seconds must be in [0.5, 600], got {self.max_voice_seconds}")
        if self.voice_memory_bytes < 1 or self.voice_cache_bytes < 1:
            raise ValueError(f"voice_memory_bytes and voice_cache_bytes must be >= 1, got {self.voice_memory_bytes} "
                             f"and {self.voice_cache_bytes}")
        if self.max_persona_chars < 1:
            raise ValueError(f"max_persona_chars must be >= 1, got {self.max_persona_chars}")
        say.check_bounds(self.max_say_tokens, self.say_max_wait_frames, self.max_say_chars)

    @property
    def voices_to_preload(self) -> tuple[str, ...]:
        return tuple(v.strip() for v in self.preload_voices.split(",") if v.strip())

    @property
    def voice_cache_path(self) -> Path:
        if self.voice_cache_dir:
            return Path(self.voice_cache_dir)
        return Path(tempfile.gettempdir()) / "personaplex-voices"

    @property
    def kv_storage_bits(self) -> int | None:
        """What the KV ring stores per value: 8 (fp8), 4 (int4), or None (the compute dtype)."""
        return 8 if self.kv_fp8 else self.kv_bits or None

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        return DTYPES[self.dtype]

    @property
    def max_backlog_frames(self) -> int:
        """Queued input frames a session may hold (at least 1): the backlog bound in frames."""
        return max(1, math.ceil(self.max_backlog_s * 1000.0 / self.tick_ms))
