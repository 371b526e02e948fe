"""Encoder service configuration: defaults, then ENCODER_* environment variables, then flags."""

from __future__ import annotations

from dataclasses import dataclass

from services.codec.stage import CodecServiceConfig
from services.common.config import option
from services.common.stage_config import METRICS_PORT_HELP, PORT_HELP


@dataclass(frozen=True)
class EncoderConfig(CodecServiceConfig):
    """Mimi encoder service: 24 kHz PCM frames in, 8 codes per frame out."""

    ENV_PREFIX = "ENCODER_"

    port: int = option(50051, help=PORT_HELP)
    metrics_port: int = option(9101, help=METRICS_PORT_HELP)
