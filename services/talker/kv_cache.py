"""Static, preallocated attention state for the LM.

KVCache: the temporal transformer's per-slot ring. Every slot owns a ring of `context`
positions per layer; position p lives at ring index p % context. Shapes never change after
allocation (the step can be CUDA-graphed; the dtype can be fp8 for storage). The only
per-slot bookkeeping is `length`: how many positions the slot has written (absolute, it keeps
growing past `context`), from which the position held at every ring index is derived.

The cache also owns attention over its ring (`attend`): the model computes q/k/v and RoPE, the
cache stores k/v and attends. A subclass with another storage (fp8 with scales, 4-bit codes) or a
fused decode kernel overrides `attend` / `write` / `read` / `decode` without touching the model.
`kv_cache_type(bits)` names the storage: None (the compute dtype), 8 (fp8) or 4 (int4).

`attend`, `write`, `read` and `decode` take any trusted slot-index tensor of B rows (`all_slots`, a
`slot_index`, or a subset of distinct slots, e.g. a catch-up step's): row b is slot slots[b].

DepformerCache: the depformer's keys/values for the steps of one frame.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from services.talker.decode_attention import FP8, SCALE_DTYPE, decode_attention, dequantize_fp8, quantize_fp8
from services.talker.kv_int4 import (CODE_DTYPE, decode_attention_int4, dequantize_int4, hadamard, quantize_int4,
                                     rotate)


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
        # Passing this very tensor as `slots` skips the (host-syncing) validity check: use it for
        # a step over every slot, e.g. under a CUDA graph.
        self.all_slots = torch.arange(slots, device=device)
        self._slot_index: dict[int, torch.Tensor] = {}  # slot -> LongTensor [slot] (see slot_index)
        self._trusted: list[torch.Tensor] = []  # see trust()
        # BoolTensor[B] or None, set by the caller around a live step over every slot: rows whose
        # attention output is used. The others (idle slots, stepped only because the step's shape is
        # fixed) attend over one entry instead of their whole ring: an idle slot costs no bandwidth.
        self.live_rows: torch.Tensor | None = None

    @property
    def slots(self) -> int:
        return self.k.shape[1]

    @property
    def context(self) -> int:
        return self.k.shape[3]

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def heads(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        """Values per key or value vector (what the model computes; the storage may pack them)."""
        return self.k.shape[4]

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def bytes_per_position(self) -> int:
        """Device bytes one slot's position holds, values and scales (a voice prefix of n frames: n times this)."""
        return sum(t.numel() * t.element_size() for t in self._stores()) // (self.slots * self.context)

    def reset(self, slot: int) -> None:
        """Forget a slot's history. Its keys/values are zeroed too, so nothing a previous session
        left there (even a non-finite value) can leak into the next one through masked attention."""
        if isinstance(slot, torch.Tensor):
            slot = int(slot)
        if not isinstance(slot, int) or not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot!r} is out of range for a cache of {self.slots} slots")
        self.length[slot].fill_(0)  # not `= 0`: that copies from pageable memory, waiting for the GPU
        for t in self._stores():
            t[:, slot].zero_()

    def _stores(self) -> list[torch.Tensor]:
        """Every tensor indexed [layer, slot, head, ring index, ...] (a subclass adds its scales)."""
        return [self.k, self.v]

    def copy_slot(self, src: "KVCache", src_slot: int, dst_slot: int, src_length: int | None = None) -> None:
        """Copy slot `src_slot` of `src` (same format) into our `dst_slot`, which must be reset.

        `src` may have a shorter ring than ours if its slot never wrapped (a voice prefix sized to
        the voice): its positions 0..n-1 then sit at ring indices 0..n-1 in both, and the rest of
        our (reset, zeroed) ring stays empty. `src_length`, the positions the source slot has
        written if the caller knows it, spares the check a host sync."""
        n = src.context
        layout = lambda c: (type(c), c.k.dtype, c.num_layers, c.heads, c.head_dim)  # noqa: E731
        if layout(src) != layout(self) or n > self.context:
            raise ValueError(f"cannot copy a {type(src).__name__} {tuple(src.k.shape)} {src.k.dtype} slot into a "
                             f"{type(self).__name__} {tuple(self.k.shape)} {self.k.dtype}")
        written = int(src.length[src_slot]) if src_length is None else src_length
        if n < self.context and written > n:
            raise ValueError(f"the source slot wrapped its ring of {n} ({written} positions written); "
                             f"only an unwrapped slot copies into a longer ring")
        for ours, theirs in zip(self._stores(), src._stores(), strict=True):
            ours[:, dst_slot, :, :n].copy_(theirs[:, src_slot])
        self.length[dst_slot].copy_(src.length[src_slot])

    def copy_positions(self, src: "KVCache", src_slot: int, dst_slot: int, lo: int, hi: int) -> None:
        """Copy positions lo..hi-1 of slot `src_slot` of `src` (same format) into our `dst_slot`, which then
        counts hi positions written. Both slots hold them unwrapped, at ring indices lo..hi-1 (hi within
        both rings): a voice prefix computed chunk by chunk in a session's slot and kept in its own ring
        (engine._VoicePrefix). A few copies, no host sync."""
        layout = lambda c: (type(c), c.k.dtype, c.num_layers, c.heads, c.head_dim)  # noqa: E731
        if layout(src) != layout(self) or not 0 <= lo <= hi <= min(src.context, self.context):
            raise ValueError(f"cannot copy positions {lo}..{hi - 1} of a {type(src).__name__} {tuple(src.k.shape)} "
                             f"{src.k.dtype} slot into a {type(self).__name__} {tuple(self.k.shape)} {self.k.dtype}")
        for ours, theirs in zip(self._stores(), src._stores(), strict=True):
            ours[:, dst_slot, :, lo:hi].copy_(theirs[:, src_slot, :, lo:hi])
        self.length[dst_slot].fill_(hi)  # fill_: no wait for the GPU (reset)

    def save_entries(self, idx: torch.Tensor, rows: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The entry at ring index idx[b] of slot rows[b] (rows None: every slot, b = s), in every
        layer (for `restore_entries`)."""
        rows = self.all_slots if rows is None else rows
        return [t[:, rows, :, idx] for t in self._stores()]

    def restore_entries(self, idx: torch.Tensor, saved: list[torch.Tensor], keep: torch.Tensor,
                        rows: torch.Tensor | None = None) -> None:
        """Put back the saved entries of the rows where keep[b] holds (static shapes, no sync)."""
        rows = self.all_slots if rows is None else rows
        for t, old in zip(self._stores(), saved, strict=True):
            mask = keep.view(-1, *([1] * (old.dim() - 1)))
            t[:, rows, :, idx] = torch.where(mask, old, t[:, rows, :, idx])

    def ring_positions(self, last: torch.Tensor) -> torch.Tensor:
        """Absolute position held at each ring index when `last` (LongTensor[B]) was the latest
        position written; -1 where nothing was written yet. Returns LongTensor[B, context]."""
        C = self.context
        j = torch.arange(C, device=last.device)
        pos = last[:, None] - torch.remainder(last[:, None] - j, C)
        return torch.where(pos >= 0, pos, torch.full_like(pos, -1))

    def slot_index(self, slot: int) -> torch.Tensor:
        """A device LongTensor [slot] for a call on one slot, checked here on the host once: passing
        it as `slots` skips check_slots' host syncs (a prefill then queues behind a step's GPU
        work instead of waiting for it)."""
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot!r} is out of range for a cache of {self.slots} slots")
        if slot not in self._slot_index:
            self._slot_index[slot] = self.all_slots[slot : slot + 1]  # a view: no host-to-device copy
        return self._slot_index[slot]

    def trust(self, slots: torch.Tensor) -> None:
        """Let check_slots pass this very tensor without its host syncs (e.g. a CUDA graph's static
        slot input); the caller guarantees it only ever holds valid, distinct slots."""
        self._trusted.append(slots)

    def check_slots(self, slots: torch.Tensor) -> None:
        """Rows of one call must name distinct, existing slots (a duplicate would race its own writes)."""
        if slots is self.all_slots or any(slots is t for t in (*self._slot_index.values(), *self._trusted)):
            return  # identity: made or vouched for here
        if slots.dim() != 1 or slots.dtype != torch.long:
            raise ValueError(f"slots must be a 1-D LongTensor, got {tuple(slots.shape)} {slots.dtype}")
        if slots.numel() == 0:
            return
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= self.slots:
            raise IndexError(f"slot ids must be in [0, {self.slots}), got range [{lo}, {hi}]")
        if torch.unique(slots).numel() != slots.numel():
            raise ValueError(f"slot ids in one call must be distinct, got {slots.tolist()}")

    # ---- storage and attention (override for other storage formats or kernels)

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Store k/v [B, H, T, Dh] of positions [B, T] at ring index pos % context. Only the last
        `context` positions of a chunk can survive in the ring, so only they are written (this also
        keeps the indices of one scatter distinct)."""
        n = min(positions.shape[1], self.context)
        idx = positions[:, -n:] % self.context  # [B, n]
        rows = slots[:, None].expand_as(idx)
        # advanced indices around a slice put their dims first: the target is [B, n, H, Dh]
        self.k[layer][rows, :, idx] = k[:, :, -n:].transpose(1, 2).to(self.k.dtype)
        self.v[layer][rows, :, idx] = v[:, :, -n:].transpose(1, 2).to(self.v.dtype)

    def _ring(self, t: torch.Tensor, layer: int, slots: torch.Tensor, entries: int | None) -> torch.Tensor:
        """Ring indices 0..entries-1 (all: None) of `slots` in store t, sliced before gathering. For
        a call over every slot it is a view: gathering would copy the whole cache each step."""
        t = t[layer] if entries is None else t[layer][:, :, :entries]
        return t if slots is self.all_slots else t[slots]

    def read(self, layer: int, slots: torch.Tensor, dtype: torch.dtype,
             entries: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The rings of `slots` as [B, H, entries or context, Dh] in the compute dtype."""
        return self._ring(self.k, layer, slots, entries).to(dtype), self._ring(self.v, layer, slots, entries).to(dtype)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
               positions: torch.Tensor, window: int | None = None, prompt: bool = False) -> torch.Tensor:
        """Causal sliding-window attention of the T new positions [B, H, T, Dh] (already RoPE'd)
        of each row's slot, storing their k/v. Query p sees keys p-context+1..p (moshi's window).

        `prompt`: the positions are a prompt chunk, of any length (one included): they attend the
        ring as it was and each other's k/v as computed, then are written. Otherwise T == 1 is a live
        step (written first, then read back from the ring with the rest) and T > 1 a prompt chunk.
        Why a chunk of one is not a step: a quantized ring rounds what it stores, so as a step the
        frame would see its own key and value rounded, and inside a longer chunk (or a CUDA graph's
        chunk, padded) exact; the eager and graphed 4-bit prompts differed by that (bench/RESULTS.md).

        `window` (prefill only): the caller's promise that every row's slot has written at most
        `window` positions and never wrapped, so its history lies in ring indices 0..window-1 and
        only those are read. A new session's prompt sits at the start of a 3000-entry ring: reading
        all of it (gather, dequantize, concatenate, a masked attention over 3000+ keys, per layer)
        would be most of a prompt chunk's time."""
        if q.shape[2] == 1 and not prompt:
            # Live step: write first, then attend over the ring. The entry overwritten was the
            # position just outside the window, so the ring now holds exactly the window.
            self.write(layer, slots, positions, k, v)
            return self.decode(layer, q, slots, positions)
        # Prefill: attend over [ring as it was] + [the T new positions], then write. Writing
        # first could overwrite positions still inside the window of the chunk's early queries
        # (moshi's own multi-position streaming call does write first, so once its ring wraps it
        # differs from stepping; this equals stepping, and moshi's T=1 and full-sequence forward).
        if window is not None and not 0 <= window <= self.context:
            raise ValueError(f"window must be in [0, {self.context}], got {window}")
        old_k, old_v = self.read(layer, slots, q.dtype, window)
        keys, values = torch.cat([old_k, k], dim=2), torch.cat([old_v, v], dim=2)
        old_pos = self.ring_positions(positions[:, 0] - 1)[:, :window]  # [B, window or C]
        k_pos = torch.cat([old_pos, positions], dim=1)  # [B, (window or C) + T]
        delta = positions[:, :, None] - k_pos[:, None, :]  # [B, T, (window or C) + T]
        mask = ((k_pos >= 0)[:, None, :] & (delta >= 0) & (delta < self.context))[:, None]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        self.write(layer, slots, positions, k, v)
        return out


    def valid_entries(self, positions: torch.Tensor) -> torch.Tensor:
        """How many ring entries each row's live query reads (positions [B, 1]): all the valid
        ones, min(p + 1, context), or 1 for a row that live_rows marks idle."""
        n = (positions[:, 0] + 1).clamp(max=self.context)
        if self.live_rows is not None:
            n = torch.where(self.live_rows, n, torch.ones_like(n))
        return n

    def scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Per-vector dequantization scales of a layer's ring (None: the ring holds plain floats)."""
        return None, None

    def decode(self, layer: int, q: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One query per row [B, H, 1, Dh] over its slot's ring, which already holds the new entry.

        On CUDA a Triton kernel reads the ring in place and only its valid entries (indices
        0..min(p+1, context)-1 hold positions p-context+1..p). Elsewhere: plain torch."""
        if q.is_cuda:
            n_valid = self.valid_entries(positions)
            k_scale, v_scale = self.scales(layer)
            out = decode_attention(q[:, :, 0], self.k[layer], self.v[layer], k_scale, v_scale, slots, n_valid,
                                   q.shape[-1] ** -0.5)
            return out[:, :, None]
        keys, values = self.read(layer, slots, q.dtype)
        mask = (self.ring_positions(positions[:, 0]) >= 0)[:, None, None, :]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


class Fp8KVCache(KVCache):
    """The ring stored as fp8 (e4m3) with one fp16 scale per (slot, head, position) key or value
    vector: half the bytes of bf16, which is what lets ~160 full-context sessions fit one H200.
    Why per-vector scales: see services/talker/decode_attention.py."""

    def __init__(self, num_layers: int, slots: int, heads: int, context: int, head_dim: int, device=None,
                 dtype=None):
        super().__init__(num_layers, slots, heads, context, head_dim, device=device, dtype=FP8)
        shape = (num_layers, slots, heads, context)
        self.k_scale = torch.zeros(shape, device=device, dtype=SCALE_DTYPE)
        self.v_scale = torch.zeros(shape, device=device, dtype=SCALE_DTYPE)

    def _stores(self) -> list[torch.Tensor]:
        return [self.k, self.v, self.k_scale, self.v_scale]

    def scales(self, layer: int):
        return self.k_scale[layer], self.v_scale[layer]

    def write(self, layer, slots, positions, k, v) -> None:
        n = min(positions.shape[1], self.context)
        idx = positions[:, -n:] % self.context
        rows = slots[:, None].expand_as(idx)
        for ring, scale, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            xq, xs = quantize_fp8(x[:, :, -n:].transpose(1, 2))  # [B, n, H, Dh], [B, n, H]
            ring[layer][rows, :, idx] = xq
            scale[layer][rows, :, idx] = xs

    def read(self, layer, slots, dtype, entries=None):
        k, v, ks, vs = (self._ring(t, layer, slots, entries) for t in self._stores())
        return dequantize_fp8(k, ks, dtype), dequantize_fp8(v, vs, dtype)


class Int4KVCache(KVCache):
    """The ring as 4-bit codes, two per byte, with an fp16 scale and minimum per half vector, in a Hadamard-rotated
    basis: 0.55x fp8's bytes, what lets about 300 full-context sessions fit one H200 beside the codecs. The format
    and why: services/talker/kv_int4.py.

    `attend` rotates q, k and v on the way in and the output on the way out; `write`, `read` and `decode` work in
    the rotated basis (what `read` returns is the rotated keys and values)."""

    def __init__(self, num_layers: int, slots: int, heads: int, context: int, head_dim: int, device=None,
                 dtype=None):
        if head_dim < 2 or head_dim & (head_dim - 1):
            raise ValueError(f"a 4-bit KV ring needs a power-of-two head_dim (its Hadamard rotation), got {head_dim}")
        super().__init__(num_layers, slots, heads, context, head_dim // 2, device=device, dtype=CODE_DTYPE)
        shape = (num_layers, slots, heads, context, 2)  # one scale and one minimum per half vector
        self.k_scale, self.k_zero, self.v_scale, self.v_zero = (
            torch.zeros(shape, device=device, dtype=SCALE_DTYPE) for _ in range(4))
        self.rotation = hadamard(head_dim, device=device)

    @property
    def head_dim(self) -> int:
        return 2 * self.k.shape[4]

    def _stores(self) -> list[torch.Tensor]:
        return [self.k, self.v, self.k_scale, self.k_zero, self.v_scale, self.v_zero]

    def attend(self, layer, q, k, v, slots, positions, window=None, prompt=False):
        r = self.rotation
        out = super().attend(layer, rotate(q, r), rotate(k, r), rotate(v, r), slots, positions, window, prompt)
        return rotate(out, r)

    def write(self, layer, slots, positions, k, v) -> None:
        n = min(positions.shape[1], self.context)
        idx = positions[:, -n:] % self.context
        rows = slots[:, None].expand_as(idx)
        for ring, scale, zero, x in ((self.k, self.k_scale, self.k_zero, k), (self.v, self.v_scale, self.v_zero, v)):
            codes, xs, xz = quantize_int4(x[:, :, -n:].transpose(1, 2))  # [B, n, H, Dh/2], [B, n, H, 2] twice
            ring[layer][rows, :, idx] = codes
            scale[layer][rows, :, idx] = xs
            zero[layer][rows, :, idx] = xz

    def read(self, layer, slots, dtype, entries=None):
        k, v, ks, kz, vs, vz = (self._ring(t, layer, slots, entries) for t in self._stores())
        return dequantize_int4(k, ks, kz, dtype), dequantize_int4(v, vs, vz, dtype)

    def decode(self, layer, q, slots, positions):
        if not q.is_cuda:
            return super().decode(layer, q, slots, positions)  # plain torch over `read`
        out = decode_attention_int4(q[:, :, 0], self.k[layer], self.v[layer], self.k_scale[layer],
                                    self.k_zero[layer], self.v_scale[layer], self.v_zero[layer], slots,
                                    self.valid_entries(positions), q.shape[-1] ** -0.5)
        return out[:, :, None]


KV_BITS = (None, 8, 4)  # the storages kv_cache_type knows: the compute dtype, fp8, int4


def kv_cache_type(bits: int | None) -> type[KVCache]:
    """The KV ring class storing `bits` per value: None the compute dtype, 8 fp8 (e4m3), 4 int4."""
    types = dict(zip(KV_BITS, (KVCache, Fp8KVCache, Int4KVCache), strict=True))
    if isinstance(bits, bool) or bits not in types:
        raise ValueError(f"KV bits must be one of {', '.join(map(str, KV_BITS))}, got {bits!r}")
    return types[bits]


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
