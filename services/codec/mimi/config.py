"""Shapes of the Mimi codec, in one typed place.

`full()` is the published model (the values of moshi's `loaders._seanet_kwargs`,
`_transformer_kwargs` and `_quantizer_kwargs`). `tiny()` keeps the same structure
and the same framing (24 kHz, 1920 samples = one 12.5 Hz frame of codes, 2048 bins,
8 codebooks used) with small channels, so tests and CPU runs are fast.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace


@dataclass(frozen=True)
class MimiConfig:
    sample_rate: int = 24000
    frame_rate: float = 12.5
    # SEANet (causal convolutions, ELU). `ratios` in decoder order; the encoder uses them reversed.
    n_filters: int = 64
    ratios: tuple[int, ...] = (8, 6, 5, 4)
    dimension: int = 512  # SEANet latent size; also the transformers' d_model
    n_residual_layers: int = 1
    kernel_size: int = 7
    residual_kernel_size: int = 3
    last_kernel_size: int = 3
    dilation_base: int = 2
    compress: int = 2
    # The two transformers (encoder side and decoder side) at the SEANet frame rate (25 Hz).
    num_heads: int = 8
    num_layers: int = 8
    dim_feedforward: int = 2048
    context: int = 250  # KV ring capacity and attention window, in 25 Hz positions
    max_period: float = 10000.0
    layer_scale: float = 0.01
    # Split residual vector quantizer: n_q_semantic codebooks on one projection, the rest on another.
    quantizer_dimension: int = 256
    n_q: int = 32
    n_q_semantic: int = 1
    bins: int = 2048
    num_codebooks: int = 8  # codebooks actually used for encode/decode

    def __post_init__(self) -> None:
        object.__setattr__(self, "ratios", tuple(int(r) for r in self.ratios))
        if self.sample_rate % self.hop_length:
            raise ValueError(f"sample_rate {self.sample_rate} is not a multiple of the SEANet hop {self.hop_length}")
        if abs(self.sample_rate / self.frame_rate - self.frame_size) > 1e-9 or self.frame_size % self.hop_length:
            raise ValueError(f"frame size {self.sample_rate / self.frame_rate} is not a multiple of the hop "
                             f"{self.hop_length}")
        if self.dimension % self.num_heads or (self.dimension // self.num_heads) % 2:
            raise ValueError(f"dimension {self.dimension} must split into {self.num_heads} heads of even size")
        if not self.n_q_semantic < self.num_codebooks <= self.n_q:
            raise ValueError(f"num_codebooks {self.num_codebooks} must be in ({self.n_q_semantic}, n_q={self.n_q}]")
        if self.context < self.downsample_stride:
            raise ValueError(f"context {self.context} is shorter than one frame ({self.downsample_stride} positions)")

    # Derived framing.
    @property
    def hop_length(self) -> int:
        """Samples per SEANet latent step (960 = 40 ms at 24 kHz)."""
        return math.prod(self.ratios)

    @property
    def frame_size(self) -> int:
        """Samples per code frame (1920 = 80 ms)."""
        return round(self.sample_rate / self.frame_rate)

    @property
    def downsample_stride(self) -> int:
        """SEANet steps per code frame (2): the transformers see this many positions per frame."""
        return self.frame_size // self.hop_length

    @classmethod
    def full(cls) -> "MimiConfig":
        return cls()

    @classmethod
    def tiny(cls) -> "MimiConfig":
        return cls(
            n_filters=4,
            dimension=32,
            num_heads=2,
            num_layers=2,
            dim_feedforward=64,
            quantizer_dimension=16,
            n_q=16,
        )

    def with_(self, **changes) -> "MimiConfig":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ratios"] = list(self.ratios)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "MimiConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown Mimi config keys: {', '.join(unknown)}")
        return cls(**d)
