"""What every stage service (encoder, talker, decoder) is configured with; each adds its own fields.

`EncoderConfig.load()` reads defaults < ENCODER_* environment < flags (services/common/config.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar, Mapping, Sequence, TypeVar

from services.common.config import load_config, option
from services.common.process import check_gil_switch_ms
from services.common.stage_server import FIRST_MESSAGE_TIMEOUT_S, STREAM_IDLE_TIMEOUT_S

S = TypeVar("S", bound="StageConfig")
# Each service sets its own ports (the k8s manifests' and the README's: encoder 50051, talker 50052, ...).
PORT_HELP = "gRPC port; 0 picks a free one"
METRICS_PORT_HELP = "Prometheus /metrics port; 0 picks a free one, -1 turns it off"


@dataclass(frozen=True)
class StageConfig:
    ENV_PREFIX: ClassVar[str] = ""  # each service's: "ENCODER_", "TALKER_", "DECODER_"

    checkpoint: str = option("", help="checkpoint directory in the published layout (required)")
    host: str = option("127.0.0.1", help="address to listen on (run_stack and k8s give the pod's)")
    port: int = option(0, help=PORT_HELP)
    metrics_port: int = option(0, help=METRICS_PORT_HELP)
    slots: int = option(2, help="concurrent sessions (the rows of every batched step)")
    device: str = option("cpu", help="cpu | cuda | cuda:N")
    # 1 by default: the stages share a machine's cores, and several processes each spinning torch's
    # default thread pool slow one another down many times over.
    threads: int = option(1, help="torch intra-op threads (0 = torch's default)")
    cuda_graph: bool = option(False, help="replay the step as a captured CUDA graph (CUDA only)")
    drain_deadline_s: float = option(30.0, help="on SIGTERM, how long live sessions may continue")
    stream_idle_timeout_s: float = option(STREAM_IDLE_TIMEOUT_S, help="a stream that sends nothing this long "
                                                                      "ends (0 = never)")
    first_message_timeout_s: float = option(FIRST_MESSAGE_TIMEOUT_S, help="an RPC whose first message (a "
                                            "stream's open, a link's first) is later than this ends (0 = never)")
    # services/common/process.py: why a busy gRPC loop otherwise stalls the compute thread's every torch call.
    gil_switch_ms: float = option(0.2, help="how often CPython makes a thread holding the GIL yield it "
                                            "(CPython's default is 5)")
    log_level: str = option("INFO", help="DEBUG | INFO | WARNING | ERROR")

    def __post_init__(self) -> None:
        check_gil_switch_ms(self.gil_switch_ms)
        if self.slots < 1:
            raise ValueError(f"slots must be >= 1, got {self.slots}")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (0 = torch's default), got {self.threads}")
        if self.drain_deadline_s < 0 or self.stream_idle_timeout_s < 0 or self.first_message_timeout_s < 0:
            raise ValueError("drain_deadline_s, stream_idle_timeout_s and first_message_timeout_s must be >= 0")
        if not isinstance(logging.getLevelName(self.log_level.upper()), int):
            raise ValueError(f"log_level must be DEBUG, INFO, WARNING or ERROR, got {self.log_level[:20]!r}")

    @classmethod
    def load(cls: type[S], argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> S:
        """The service's config from flags and environment; a stage cannot serve without a checkpoint."""
        name = cls.ENV_PREFIX.rstrip("_").lower()
        prefix = cls.ENV_PREFIX

        def need_checkpoint(values: dict) -> None:
            if not values["checkpoint"]:
                raise ValueError(f"--checkpoint (or {prefix}CHECKPOINT) is required")

        return load_config(cls, prefix, argv, env, prog=f"python -m services.{name}", derive=need_checkpoint)
