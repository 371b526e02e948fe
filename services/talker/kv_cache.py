"""Static, preallocated attention state for the LM.

KVCache: the temporal transformer's per-slot ring. Every slot owns a ring of `context`
positions per layer; position p lives at ring index p % context. Shapes never change after
allocation (the step can be CUDA-graphed; the dtype can be fp8 for storage). The only
per-slot bookkeeping is `length`: how many positions the slot has written (absolute, it keeps
growing past `context`), from which the position held at every ring index is derived.

DepformerCache: the depformer's keys/values for the steps of one frame.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, slots: int, heads: int, context: int, head_dim: int,
                 device=None, dtype=None):
        if slots < 1:
            raise ValueError(f"a KV cache needs at least one slot, got {slots}")
        if context < 1:
            raise ValueError(f"context must be >= 1, got {context}")
        shape = (num_layers, slots, heads, context, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = torch.zeros(slots, device=device, dtype=torch.long)

    @property
    def slots(self) -> int:
        return self.k.shape[1]

    @property
    def context(self) -> int:
        return self.k.shape[3]

    @property
    def device(self) -> torch.device:
        return self.k.device

    def reset(self, slot: int) -> None:
        """Forget a slot's history. Its keys/values are zeroed too, so nothing a previous session
        left there (even a non-finite value) can leak into the next one through masked attention."""
        if isinstance(slot, torch.Tensor):
            slot = int(slot)
        if not isinstance(slot, int) or not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot!r} is out of range for a cache of {self.slots} slots")
        self.length[slot] = 0
        self.k[:, slot].zero_()
        self.v[:, slot].zero_()

    def ring_positions(self, last: torch.Tensor) -> torch.Tensor:
        """Absolute position held at each ring index when `last` (LongTensor[B]) was the latest
        position written; -1 where nothing was written yet. Returns LongTensor[B, context]."""
        C = self.context
        j = torch.arange(C, device=last.device)
        pos = last[:, None] - torch.remainder(last[:, None] - j, C)
        return torch.where(pos >= 0, pos, torch.full_like(pos, -1))

    def check_slots(self, slots: torch.Tensor) -> None:
        """Rows of one call must name distinct, existing slots (a duplicate would race its own writes)."""
        if slots.dim() != 1 or slots.dtype != torch.long:
            raise ValueError(f"slots must be a 1-D LongTensor, got {tuple(slots.shape)} {slots.dtype}")
        if slots.numel() == 0:
            return
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= self.slots:
            raise IndexError(f"slot ids must be in [0, {self.slots}), got range [{lo}, {hi}]")
        if torch.unique(slots).numel() != slots.numel():
            raise ValueError(f"slot ids in one call must be distinct, got {slots.tolist()}")


class DepformerCache:
    """Keys/values of the depformer for the steps of one frame: [layers, B, heads, steps, head_dim].

    Step cb writes index cb and reads 0..cb, so a cache can be reused frame after frame
    without clearing it: everything a step reads was written earlier in the same frame.
    """

    def __init__(self, num_layers: int, batch: int, heads: int, steps: int, head_dim: int,
                 device=None, dtype=None):
        shape = (num_layers, batch, heads, steps, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def steps(self) -> int:
        return self.k.shape[3]
