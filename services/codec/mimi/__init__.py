"""Mimi, the 24 kHz neural audio codec of Moshi/PersonaPlex: our own torch implementation.

    MimiConfig.tiny() / MimiConfig.full()      shapes
    MimiModel(cfg)                             modules with the published state_dict key names
    MimiModel.load(path, cfg, device, dtype)   strict loading of tokenizer-e351c8d8-checkpoint125.safetensors
    model.keep_only("encode" | "decode")       drop the other half (or load(..., keep=...)); DroppedHalfError if used
    model.encode(pcm [B,1,T]) / model.decode(codes [B,8,F])     one-shot
    StreamingEncoder(model, slots) / StreamingDecoder(model, slots)   80 ms steps, per-slot state
"""

from .config import MimiConfig
from .halves import DroppedHalfError
from .model import InvalidFrame, MimiModel
from .streaming import StreamingDecoder, StreamingEncoder

__all__ = ["MimiConfig", "MimiModel", "StreamingEncoder", "StreamingDecoder", "InvalidFrame", "DroppedHalfError"]
