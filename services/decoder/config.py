"""Decoder service configuration: defaults, then DECODER_* environment variables, then flags."""

from __future__ import annotations

from dataclasses import dataclass

from services.codec.stage import CodecServiceConfig
from services.common.stage_config import load_config


@dataclass
class DecoderConfig(CodecServiceConfig):
    """Mimi decoder service: 8 codes per frame in, 24 kHz PCM frames out."""

    port: int = 50053
    metrics_port: int = 9103


def from_args(argv=None, env=None) -> DecoderConfig:
    try:
        return load_config(DecoderConfig, env_prefix="DECODER_", argv=argv, env=env)
    except ValueError as e:  # a value out of its range (__post_init__): a clear exit, not a traceback
        raise SystemExit(f"decoder config: {e}") from None
