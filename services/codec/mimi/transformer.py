"""The Mimi transformers: pre-norm LayerNorm, RoPE (interleaved pairs), GELU FF, layer scale,
causal attention over a window of `context` positions.

Streaming keeps, per slot, a KV ring of `context` positions per layer and one position
offset. Each step writes its T new keys into the ring before attending, exactly like
moshi's RingKVCache, so the first query of a step sees one key fewer than the window
once the ring has wrapped. The one-shot path reproduces that same window (the model is
served streaming, so this is the behaviour that counts), which keeps one-shot == streaming.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .config import MimiConfig
from .conv import masked_update_


def apply_rope(q: Tensor, k: Tensor, positions: Tensor, max_period: float) -> tuple[Tensor, Tensor]:
    """Rotate interleaved (real, imag) pairs of q, k [B, H, T, D] by their positions [B, T] (in fp32)."""
    D = q.shape[-1]
    ds = torch.arange(D // 2, device=q.device, dtype=torch.float32)
    freqs = torch.exp(ds * (-math.log(max_period) * 2 / D))
    angles = positions.float()[:, None, :, None] * freqs  # [B, 1, T, D/2]
    cos, sin = torch.cos(angles), torch.sin(angles)

    def rotate(x: Tensor) -> Tensor:
        pairs = x.view(*x.shape[:-1], D // 2, 2)
        re, im = pairs[..., 0].float(), pairs[..., 1].float()
        out = torch.stack([re * cos - im * sin, re * sin + im * cos], dim=-1)
        return out.view(x.shape).to(x.dtype)

    return rotate(q), rotate(k)


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int, max_period: float):
        super().__init__()
        self.num_heads = num_heads
        self.max_period = max_period
        # Published files keep q|k|v fused in one matrix (rows q, then k, then v; heads inside each).
        self.in_proj_weight = nn.Parameter(torch.empty(3 * dim, dim))
        self.out_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: Tensor, pos_q: Tensor, low: Tensor, cache: tuple[Tensor, Tensor] | None,
                active: Tensor | None) -> Tensor:
        """x [B, T, D]; pos_q [B, T] absolute positions; keys below `low` [B, T] are out of the window.

        cache = (k_ring, v_ring) [B, H, C, D/H] for streaming (written for active rows only),
        None for one-shot (the keys are x's own)."""
        B, T, dim = x.shape
        q, k, v = F.linear(x, self.in_proj_weight).view(B, T, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, k, pos_q, self.max_period)
        if cache is None:
            keys, values, pos_k = k, v, pos_q
        else:
            keys, values = cache
            C = keys.shape[2]
            slot = (pos_q % C)[:, None, :, None].expand_as(k)  # ring index of each new position
            keep = active.view(B, 1, 1, 1)
            keys.scatter_(2, slot, torch.where(keep, k, keys.gather(2, slot)))
            values.scatter_(2, slot, torch.where(keep, v, values.gather(2, slot)))
            # Absolute position held by each ring index after this write (negative: never written).
            last = pos_q[:, -1:]
            pos_k = last - torch.remainder(last - torch.arange(C, device=x.device), C)
        visible = (pos_k[:, None, :] <= pos_q[:, :, None]) & (pos_k[:, None, :] >= low[:, :, None])
        visible &= (pos_k >= 0)[:, None, :]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible[:, None])
        return self.out_proj(out.transpose(1, 2).reshape(B, T, dim))


class LayerScale(nn.Module):
    def __init__(self, dim: int, init: float):
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: Tensor) -> Tensor:
        return self.scale * x


class TransformerLayer(nn.Module):
    def __init__(self, cfg: MimiConfig):
        super().__init__()
        d = cfg.dimension
        self.self_attn = Attention(d, cfg.num_heads, cfg.max_period)
        self.norm1 = nn.LayerNorm(d, eps=1e-5)
        self.norm2 = nn.LayerNorm(d, eps=1e-5)
        self.linear1 = nn.Linear(d, cfg.dim_feedforward, bias=False)
        self.linear2 = nn.Linear(cfg.dim_feedforward, d, bias=False)
        self.layer_scale_1 = LayerScale(d, cfg.layer_scale)
        self.layer_scale_2 = LayerScale(d, cfg.layer_scale)

    def forward(self, x: Tensor, pos_q: Tensor, low: Tensor, cache, active) -> Tensor:
        x = x + self.layer_scale_1(self.self_attn(self.norm1(x), pos_q, low, cache, active))
        return x + self.layer_scale_2(self.linear2(F.gelu(self.linear1(self.norm2(x)))))


class Transformer(nn.Module):
    def __init__(self, cfg: MimiConfig):
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(cfg.num_layers))


class MimiTransformer(nn.Module):
    """[B, D, T] (conv layout) -> [B, D, T]. `.transformer.layers` mirrors moshi's ProjectedTransformer
    (d_model equals the SEANet dimension in Mimi, so there are no projections)."""

    def __init__(self, cfg: MimiConfig):
        super().__init__()
        self.transformer = Transformer(cfg)
        self.context = cfg.context
        self.chunk = cfg.downsample_stride  # positions per streaming step
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.dimension // cfg.num_heads

    def init_state(self, batch: int, device, dtype) -> list[Tensor]:
        """[offset [B] (long), then k_ring, v_ring [B, H, context, D/H] per layer]."""
        state = [torch.zeros(batch, dtype=torch.long, device=device)]
        for _ in self.transformer.layers:
            for _kv in range(2):
                state.append(torch.zeros(batch, self.num_heads, self.context, self.head_dim, device=device,
                                         dtype=dtype))
        return state

    def forward(self, x: Tensor, state: list[Tensor] | None = None, active: Tensor | None = None) -> Tensor:
        x = x.transpose(1, 2)
        B, T, _ = x.shape
        steps = torch.arange(T, device=x.device)
        if state is None:
            if T % self.chunk:
                raise ValueError(f"transformer input of {T} positions is not whole frames of {self.chunk}")
            pos_q = steps.expand(B, T)
            # The window a streamed step would have: its ring holds the last `context` positions up to its end.
            low = (pos_q // self.chunk + 1) * self.chunk - self.context
        else:
            if T > self.context:
                raise ValueError(f"a streaming step of {T} positions exceeds the KV ring of {self.context}")
            offset = state[0]
            pos_q = offset[:, None] + steps
            low = pos_q - self.context + 1
        for i, layer in enumerate(self.transformer.layers):
            cache = None if state is None else (state[1 + 2 * i], state[2 + 2 * i])
            x = layer(x, pos_q, low, cache, active)
        if state is not None:
            masked_update_(state[0], state[0] + T, active)
        return x.transpose(1, 2)
