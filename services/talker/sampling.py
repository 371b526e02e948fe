"""Per-row token sampling with counter-based noise: greedy, or temperature + top-k.

Every row (slot) has its own parameters. Randomness is a pure function of
(session seed, frame index, codebook, vocabulary index), hashed with 32-bit integer
mixing in torch, then turned into Gumbel noise; the token is the argmax of
top-k-masked, temperature-scaled logits plus that noise (Gumbel-max = a draw from
softmax(logits / T) restricted to the top k). So:
  - a session's draws do not depend on which other sessions share the batch,
  - replaying a session with the same seed gives the same tokens,
  - there is no generator state to carry, reset, or capture (CUDA-graph friendly).

    key = noise_key(seed=LongTensor[B], frame=LongTensor[B])   # once per frame
    tokens = sample(logits[B, V], params, key, codebook=0)      # text; audio codebooks 1..8
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF
_U24 = float(1 << 24)


class InvalidSampling(ValueError):
    """Sampling parameters that cannot be used (negative or non-finite temperature, bad top-k or seed)."""


@dataclass(frozen=True)
class SamplingParams:
    greedy: bool = False
    text_temperature: float = 0.7
    text_top_k: int = 25
    audio_temperature: float = 0.8
    audio_top_k: int = 250
    seed: int = 0

    def validate(self, text_card: int, card: int) -> "SamplingParams":
        if not isinstance(self.greedy, bool):
            raise InvalidSampling(f"greedy must be a bool, got {self.greedy!r}")
        for name in ("text_temperature", "audio_temperature"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise InvalidSampling(f"{name} must be a finite number >= 0, got {v!r}")
        for name, vocab in (("text_top_k", text_card), ("audio_top_k", card)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= vocab:
                raise InvalidSampling(f"{name} must be an int in [0, {vocab}] (0 = no top-k), got {v!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise InvalidSampling(f"seed must be an int in [0, 2**63), got {self.seed!r}")
        return self


@dataclass
class RowParams:
    """One set of per-row sampling parameters as tensors [B] (text or audio)."""

    greedy: torch.Tensor  # bool: argmax (also where temperature == 0)
    temperature: torch.Tensor  # float32
    top_k: torch.Tensor  # long, already resolved: 0 -> vocabulary size
    max_k: int  # Python max of top_k over the rows (bounds the topk call without a device sync)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer (lowbias32) on int64 tensors holding values in [0, 2**32).
    Multipliers stay below 2**31, so products fit in int64 without overflow."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def noise_key(seed: torch.Tensor, frame: torch.Tensor) -> torch.Tensor:
    """The per-row key of one frame, LongTensor[B] in [0, 2**32), from seed [B] (63 bits) and frame [B]."""
    lo, hi = seed & _M32, (seed >> 32) & _M32
    return _mix32(_mix32(_mix32(lo ^ 0x9E3779B9) ^ hi) ^ (frame & _M32))


def uniform_noise(key: torch.Tensor, codebook: int, index: torch.Tensor) -> torch.Tensor:
    """U(0, 1) float32 shaped like index [B, n]: a pure function of (key[b], codebook, index[b, j])."""
    h = key ^ ((codebook + 1) * 0x85EBCA6B & _M32)  # [B]
    h = _mix32(h[:, None] ^ (index & _M32))  # [B, n]
    return ((h >> 8).to(torch.float32) + 0.5) / _U24  # 24 bits: exact in float32, never 0 or 1


def sample(logits: torch.Tensor, p: RowParams, key: torch.Tensor, codebook: int) -> torch.Tensor:
    """logits [B, V] -> tokens LongTensor[B]; key = noise_key(seed, frame) of each row.

    Only the max_k best candidates of each row get noise (a token outside a row's top-k can never
    win), and the noise is keyed by vocabulary index, not rank, so it does not depend on max_k."""
    logits = logits.float()
    V = logits.shape[-1]
    k = min(max(p.max_k, 1), V)
    vals, idx = logits.topk(k, dim=-1)  # [B, k], best first
    keep = torch.arange(k, device=logits.device)[None, :] < p.top_k[:, None]  # exactly top_k[b] candidates
    temp = torch.where(p.temperature > 0, p.temperature, torch.ones_like(p.temperature))
    gumbel = -torch.log(-torch.log(uniform_noise(key, codebook, idx)))
    scores = torch.where(keep, vals / temp[:, None] + gumbel, torch.full_like(vals, -math.inf))
    drawn = idx.gather(1, scores.argmax(dim=-1, keepdim=True))[:, 0]
    # greedy rows: torch's argmax over the raw logits, as the reference does (same tie-breaking)
    return torch.where(p.greedy | (p.temperature <= 0), logits.argmax(dim=-1), drawn)
