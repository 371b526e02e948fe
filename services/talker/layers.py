"""Building blocks of the PersonaPlex LM, numerically matching moshi 0.2.13.

Parameter names follow the published checkpoint (`alpha`, `linear_in`, `linear_out`,
`in_proj_weight`, `out_proj.weight`) so a module tree of these blocks has exactly the
published state_dict keys.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from services.talker.fused import fused


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 (moshi's "rms_norm_f32"): eps inside the mean, learnt alpha [1, 1, dim]."""

    def __init__(self, dim: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.alpha = nn.Parameter(torch.ones(1, 1, dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.alpha, self.eps)


@fused
def rms_norm(x: torch.Tensor, alpha: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    var = eps + torch.mean(x32 * x32, dim=-1, keepdim=True)
    # Same operation order as moshi: x * (alpha * rsqrt(var)); alpha flattened so any rank works.
    return (x32 * (alpha.reshape(-1).float() * torch.rsqrt(var))).to(x.dtype)


class Gating(nn.Module):
    """SiLU-gated feed-forward. linear_in rows are [gate | up]."""

    def __init__(self, dim: int, hidden: int, device=None, dtype=None):
        super().__init__()
        self.linear_in = nn.Linear(dim, 2 * hidden, bias=False, device=device, dtype=dtype)
        self.linear_out = nn.Linear(hidden, dim, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_out(silu_gate(self.linear_in(x)))


@fused
def silu_gate(h: torch.Tensor) -> torch.Tensor:
    """[..., 2 * hidden] (gate | up) -> silu(gate) * up."""
    h = h.unflatten(-1, (2, -1))
    return F.silu(h[..., 0, :]) * h[..., 1, :]


class Weight(nn.Module):
    """A bare `weight` parameter, for packed per-step matrices stored as `<name>.weight`."""

    def __init__(self, rows: int, cols: int, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols, device=device, dtype=dtype))


@fused
def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, max_period: float):
    """Interleaved RoPE: pairs (x[2i], x[2i+1]) rotate by positions * max_period^(-2i/D).

    q, k: [B, H, T, D]; positions: LongTensor[B, T] (absolute). Computed in fp32, like moshi.
    """
    D = q.shape[-1]
    ds = torch.arange(D // 2, device=q.device, dtype=torch.float32)
    freqs = torch.exp(ds * (-math.log(max_period) * 2 / D))
    ts = positions.float()[:, None, :, None]  # [B, 1, T, 1]
    rotr, roti = torch.cos(freqs * ts), torch.sin(freqs * ts)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x = x.unflatten(-1, (D // 2, 2))
        xr, xi = x[..., 0].float(), x[..., 1].float()
        out = torch.stack([(xr * rotr - xi * roti).to(x.dtype), (xr * roti + xi * rotr).to(x.dtype)], dim=-1)
        return out.flatten(-2)

    return rotate(q), rotate(k)


def embed_or_zero(emb: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """Embedding lookup where the id -1 means "no input" and embeds to exactly zero."""
    y = emb(ids.clamp(min=0))
    return torch.where((ids == -1)[..., None], torch.zeros((), dtype=y.dtype, device=y.device), y)
