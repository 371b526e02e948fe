"""fp8 (e4m3) weights for the temporal transformer's matrices.

Why: memory. At 160 full-context sessions the fp8 KV ring takes 128 GB of an H200's 150; the
bf16 weights take 15.4 GB more, and the encoder and decoder processes beside the talker did not
fit in what was left. The 32 temporal layers' four matrices are 13.2 GB of those weights; in fp8
they are 6.6 GB. They are also what a frame reads most besides the ring, so steps read less.

What: each matrix W [out, in] is stored as fp8 with one fp32 scale per output row (amax / 448:
rows differ in range, and a per-row scale is exact to apply after the product). The activation
x [M, in] is quantized per row on the fly the same way (dynamic, no calibration). The product
runs as an fp8 GEMM with fp32 accumulation (torch._scaled_mm with row-wise scales, Hopper and
later) and comes out in the model's dtype:

    y[m, n] = (sum_k xq[m, k] * wq[n, k]) * sx[m] * sw[n]

On the CPU (tests, CPU runs) the same quantization is applied and the product computed in fp32:
the same arithmetic up to summation order. The depformer, the text head and the embeddings stay
in the model's dtype: small, and the logits' last projection is the most sensitive one.

Quality against the bf16 weights: bench/quality.py (full size, random weights) and
tests/test_fp8_weights.py (tiny model, greedy agreement over 500 frames).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from services.talker.decode_attention import FP8, FP8_MAX
from services.talker.fused import fused


@fused
def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], fp32 scale [M, 1]) with x ~= q * scale, one scale per row."""
    amax = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


class Fp8Linear(nn.Module):
    """A bias-free linear layer whose weight is fp8 with per-output-row scales (see module doc)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        q, scale = quantize_rows.eager(weight.detach())  # once, at load: not worth a compile
        self.register_buffer("weight", q)  # [out, in] fp8, row-major: its .t() is the column-major operand
        self.register_buffer("scale", scale.reshape(1, -1).contiguous())  # [1, out] fp32
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        xq, sx = quantize_rows(x.reshape(-1, x.shape[-1]))
        if x.is_cuda:
            y = torch._scaled_mm(xq, self.weight.t(), scale_a=sx, scale_b=self.scale, out_dtype=x.dtype)
        else:
            y = ((xq.float() @ self.weight.float().t()) * sx * self.scale).to(x.dtype)
        return y.reshape(*lead, self.out_features)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.weight.float() * self.scale.t()).to(dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3, per-row scales"


def linear(x: torch.Tensor, weight: torch.Tensor | Fp8Linear) -> torch.Tensor:
    """F.linear for a plain weight tensor, the fp8 product for an Fp8Linear."""
    return weight(x) if isinstance(weight, Fp8Linear) else F.linear(x, weight)


@torch.no_grad()
def quantize_temporal_weights(layers: nn.ModuleList) -> int:
    """Swap every temporal layer's four matrices (in_proj, out_proj, gating in/out) for Fp8Linear,
    in place, freeing the originals as it goes. Returns the bytes saved."""
    saved = 0
    for layer in layers:
        for owner, name in ((layer.self_attn, "in_proj_weight"), (layer.self_attn, "out_proj"),
                            (layer.gating, "linear_in"), (layer.gating, "linear_out")):
            current = getattr(owner, name)  # a Parameter (in_proj_weight), an nn.Linear, or done already
            if isinstance(current, Fp8Linear):
                continue
            w = current if isinstance(current, torch.Tensor) else current.weight
            q = Fp8Linear(w)
            saved += w.numel() * w.element_size() - q.weight.numel() - q.scale.numel() * 4
            delattr(owner, name)  # the bf16 matrix goes with its last reference
            setattr(owner, name, q)
            del current, w
    return saved
