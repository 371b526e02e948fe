"""Encoder service configuration: defaults, then ENCODER_* environment variables, then flags."""

from __future__ import annotations

from dataclasses import dataclass

from services.codec.stage import CodecServiceConfig
from services.common.stage_config import load_config


@dataclass
class EncoderConfig(CodecServiceConfig):
    """Mimi encoder service: 24 kHz PCM frames in, 8 codes per frame out."""

    port: int = 50051
    metrics_port: int = 9101


def from_args(argv=None, env=None) -> EncoderConfig:
    try:
        return load_config(EncoderConfig, env_prefix="ENCODER_", argv=argv, env=env)
    except ValueError as e:  # a value out of its range (__post_init__): a clear exit, not a traceback
        raise SystemExit(f"encoder config: {e}") from None
