"""Decoder service configuration: defaults, then DECODER_* environment variables, then flags."""

from __future__ import annotations

from dataclasses import dataclass

from services.codec.stage import CodecServiceConfig
from services.common.config import option
from services.common.stage_config import METRICS_PORT_HELP, PORT_HELP


@dataclass(frozen=True)
class DecoderConfig(CodecServiceConfig):
    """Mimi decoder service: 8 codes per frame in, 24 kHz PCM frames out."""

    ENV_PREFIX = "DECODER_"

    port: int = option(50053, help=PORT_HELP)
    metrics_port: int = option(9103, help=METRICS_PORT_HELP)
