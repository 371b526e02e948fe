"""Causal convolutions that run either one-shot or streaming with per-slot state.

Streaming state lives outside the modules (in a list of preallocated tensors owned by
a StreamingEncoder/Decoder), so several streamers can share one model. Every state
tensor has the slot as its first dimension and resets to zeros. A streaming call
takes `active` (bool [B]): inactive rows compute garbage and leave their state
bit-for-bit untouched.

Module nesting mirrors moshi's (`StreamingConv1d.conv.conv` is the nn.Conv1d, an extra
level left from its weight-norm wrapper), so state_dict keys are the published ones.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def masked_update_(state: Tensor, new: Tensor, active: Tensor) -> None:
    """state[b] = new[b] where active[b]; other rows keep their exact bits."""
    mask = active.view(-1, *([1] * (state.dim() - 1)))
    state.copy_(torch.where(mask, new, state))


class _Conv1dHolder(nn.Module):
    def __init__(self, *args, **kwargs):
        super().__init__()
        self.conv = nn.Conv1d(*args, **kwargs)


class _ConvTr1dHolder(nn.Module):
    def __init__(self, *args, **kwargs):
        super().__init__()
        self.convtr = nn.ConvTranspose1d(*args, **kwargs)


class StreamingConv1d(nn.Module):
    """Causal Conv1d: left context of (effective kernel - stride) samples, nothing on the right.

    `replicate=True` pads the very first window of a stream with its first sample instead of
    zeros (moshi's pad_mode="replicate", used by the learnt downsample).
    State: [previous input tail [B, C_in, K_eff - S]] (+ [started flag [B]] when replicating).
    """

    def __init__(self, cin: int, cout: int, kernel_size: int, stride: int = 1, dilation: int = 1,
                 groups: int = 1, bias: bool = True, replicate: bool = False):
        super().__init__()
        self.conv = _Conv1dHolder(cin, cout, kernel_size, stride, dilation=dilation, groups=groups, bias=bias)
        self.stride = stride
        self.context = (kernel_size - 1) * dilation + 1 - stride
        self.replicate = replicate

    def init_state(self, batch: int, device, dtype) -> list[Tensor]:
        state = [torch.zeros(batch, self.conv.conv.in_channels, self.context, device=device, dtype=dtype)]
        if self.replicate:
            state.append(torch.zeros(batch, dtype=torch.bool, device=device))
        return state

    def forward(self, x: Tensor, state: list[Tensor] | None = None, active: Tensor | None = None) -> Tensor:
        if x.shape[-1] % self.stride:
            raise ValueError(f"conv input length {x.shape[-1]} is not a multiple of its stride {self.stride}")
        if self.context == 0:
            return self.conv.conv(x)
        if state is None:  # one-shot: a fresh stream
            if self.replicate:
                pad = x[..., :1].expand(-1, -1, self.context)
            else:
                pad = x.new_zeros(x.shape[0], x.shape[1], self.context)
            return self.conv.conv(torch.cat([pad, x], dim=-1))
        previous = state[0]
        if self.replicate:
            started = state[1]
            fresh = (~started & active).view(-1, 1, 1)
            previous = torch.where(fresh, x[..., :1].expand_as(previous), previous)
        full = torch.cat([previous, x], dim=-1)
        y = self.conv.conv(full)
        masked_update_(state[0], full[..., -self.context:], active)
        if self.replicate:
            state[1].copy_(state[1] | active)
        return y


class StreamingConvTranspose1d(nn.Module):
    """Causal ConvTranspose1d: the right overlap (K - S samples) of a chunk is carried
    into the next chunk instead of being output. State: [overlap tail [B, C_out, K - S]]
    (kept without the bias, which the next chunk's output already carries)."""

    def __init__(self, cin: int, cout: int, kernel_size: int, stride: int = 1, groups: int = 1, bias: bool = True):
        super().__init__()
        self.convtr = _ConvTr1dHolder(cin, cout, kernel_size, stride, groups=groups, bias=bias)
        self.stride = stride
        self.overlap = kernel_size - stride

    def init_state(self, batch: int, device, dtype) -> list[Tensor]:
        return [torch.zeros(batch, self.convtr.convtr.out_channels, self.overlap, device=device, dtype=dtype)]

    def forward(self, x: Tensor, state: list[Tensor] | None = None, active: Tensor | None = None) -> Tensor:
        y = self.convtr.convtr(x)
        if self.overlap == 0:
            return y
        if state is None:  # one-shot: drop the tail that belongs to the future
            return y[..., : -self.overlap]
        partial = state[0]
        head = y[..., : self.overlap] + partial
        tail = y[..., -self.overlap:]
        bias = self.convtr.convtr.bias
        if bias is not None:
            tail = tail - bias[:, None]
        masked_update_(partial, tail, active)
        return torch.cat([head, y[..., self.overlap: -self.overlap]], dim=-1)
