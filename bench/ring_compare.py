"""Two KV rings' valid entries, compared in their storage's own units (bench.prefill_graph_check).

What is compared: one slot's ring indices 0..entries-1 (entries = min(its length, context): exactly the entries that
hold a position) in every layer, keys and values, in every store the ring keeps: the values of a plain ring; the
codes and fp16 scales of an fp8 ring; the codes, fp16 scales and fp16 minimums of a 4-bit ring. Not the padding a
graphed prefill chunk leaves past the slot's length (never read), nor any other slot.

Why units, not a float tolerance on the dequantized values: two paths that compute the same thing with different
fp32 summation orders (a CUDA graph's fixed chunk: 4 query rows where the chunk has 3, 8, 16 or all keys where the
slot has `start`) differ by about 1e-6 before the ring. A quantizer rounds that to the same stored value, or, where
the value lay on a rounding boundary, to its neighbour, and one neighbour is a large step as a float: a 4-bit
group's scale one fp16 ulp off moves its code 15 by 15 ulps (3.7e-3 at a scale of 0.3), a code one level off moves
by the whole scale. So each stored element is compared as a count of steps: a 4-bit code's level, an fp8 value's
place in e4m3's order, an fp16 scale's or minimum's ulps.

The verdict (Verdict):
- IDENTICAL: every compared element equal, bit for bit.
- ROUNDING: every element within one step (a plain ring: within PLAIN_TOLERANCE), at most MAX_SHARE of each quantized
  store's elements off, all finite: what rounding noise upstream of the ring does.
- DIFFERENT: anything else: an element two or more steps off (a wrong position or slot, another scale formula), many
  one-step ones (another rounding mode), or a non-finite value.
What ROUNDING cannot tell from noise: a writer that moves a few percent of elements by one step (e.g. codes divided by
the fp32 scale instead of the fp16 one it stores). prefill_graph_check's same-input write check demands IDENTICAL for
that.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from services.talker.kv_cache import Fp8KVCache, Int4KVCache, KVCache

PLAIN_TOLERANCE = 1e-4  # a plain (unquantized) ring: abs difference; fp32 rounding noise is about 1e-6
# Share of a quantized store's elements one step off that rounding noise can explain. The graph's chunk shapes against
# the eager ones (bench.prefill_graph_check --smoke, tiny model, CPU) move 3/4 of a plain ring's values by about one
# fp32 ulp; at fp16's ulp of 2^-11 that puts about one in 5000 scales or minimums over a rounding boundary, and
# measured, none of 15k quantized elements moved. Another rounding mode moves about half of all codes.
MAX_SHARE = 0.01


class Verdict(enum.Enum):
    IDENTICAL = "identical"
    ROUNDING = "rounding"
    DIFFERENT = "different"


class Unit(enum.Enum):
    """How a store's elements count steps."""

    PLAIN = "plain"  # floats of the compute dtype: compared by value
    NIBBLES = "nibbles"  # two 4-bit codes per byte: levels
    FP8 = "fp8"  # e4m3 codes: places in e4m3's order
    FP16 = "fp16"  # scales and minimums: ulps


@dataclass(frozen=True)
class StoreDiff:
    name: str  # e.g. "keys' scales"
    unit: Unit
    elements: int  # compared (a byte of 4-bit codes is two)
    differing: int
    max_steps: float  # the largest difference in steps (PLAIN: by value); 0 when identical
    finite: bool  # both rings' elements are finite

    @property
    def verdict(self) -> Verdict:
        if self.differing == 0 and self.finite:
            return Verdict.IDENTICAL
        if not self.finite:
            return Verdict.DIFFERENT
        if self.unit is Unit.PLAIN:
            return Verdict.ROUNDING if self.max_steps <= PLAIN_TOLERANCE else Verdict.DIFFERENT
        ok = self.max_steps <= 1 and self.differing <= MAX_SHARE * self.elements
        return Verdict.ROUNDING if ok else Verdict.DIFFERENT

    def __str__(self) -> str:
        if self.unit is Unit.PLAIN:
            return f"{self.name} {self.differing} of {self.elements} differ (max {self.max_steps:.2e})"
        step = {Unit.NIBBLES: "level", Unit.FP8: "e4m3 step", Unit.FP16: "ulp"}[self.unit]
        return (f"{self.name} {self.differing} of {self.elements} differ (max {self.max_steps:g} {step}"
                f"{'' if self.max_steps == 1 else 's'}{'' if self.finite else ', NON-FINITE'})")


@dataclass(frozen=True)
class RingDiff:
    entries: int  # ring indices 0..entries-1 compared
    layers: int
    stores: tuple[StoreDiff, ...]
    dequantized_max_abs: float  # what `read` gives, for scale: not part of the verdict

    @property
    def verdict(self) -> Verdict:
        verdicts = {s.verdict for s in self.stores}
        return next(v for v in (Verdict.DIFFERENT, Verdict.ROUNDING, Verdict.IDENTICAL) if v in verdicts)

    def __str__(self) -> str:
        # Stores of keys and values are reported together: "codes 0 of 3584 differ", not one line each.
        return (f"ring indices 0..{self.entries - 1} of {self.layers} layers: "
                f"{'; '.join(str(s) for s in self.stores)}; dequantized max abs diff "
                f"{self.dequantized_max_abs:.2e}: {self.verdict.value.upper()}")


def stores(kv: KVCache) -> list[tuple[str, Unit, torch.Tensor, torch.Tensor]]:
    """(name, unit, keys' store, values' store) of every store the ring keeps, each indexed [layer, slot, head,
    ring index, ...]."""
    if isinstance(kv, Int4KVCache):
        return [("codes", Unit.NIBBLES, kv.k, kv.v), ("scales", Unit.FP16, kv.k_scale, kv.v_scale),
                ("minimums", Unit.FP16, kv.k_zero, kv.v_zero)]
    if isinstance(kv, Fp8KVCache):
        return [("codes", Unit.FP8, kv.k, kv.v), ("scales", Unit.FP16, kv.k_scale, kv.v_scale)]
    return [("values", Unit.PLAIN, kv.k, kv.v)]


def _ordered(t: torch.Tensor, unit: Unit) -> tuple[torch.Tensor, torch.Tensor]:
    """Elements as integers one apart for neighbouring stored values, and whether each is finite."""
    if unit is Unit.NIBBLES:
        codes = torch.stack([t & 15, t >> 4]).to(torch.int32)
        return codes, torch.ones_like(codes, dtype=torch.bool)
    # Sign and magnitude bits -> a signed integer in the values' order (+0 and -0 both 0).
    bits, mag_mask, inf = ((t.view(torch.uint8).to(torch.int32), 0x7F, 0x7F) if unit is Unit.FP8
                           else (t.view(torch.int16).to(torch.int32) & 0xFFFF, 0x7FFF, 0x7C00))
    mag = bits & mag_mask
    return torch.where(bits > mag_mask, -mag, mag), mag < inf  # e4m3fn: only 0x7F is NaN; fp16: 0x7C00 up


def _store_diff(name: str, unit: Unit, a: torch.Tensor, b: torch.Tensor) -> StoreDiff:
    if unit is Unit.PLAIN:
        a, b = a.float(), b.float()
        d = (a - b).abs()
        finite = bool(torch.isfinite(a).all() and torch.isfinite(b).all())
        return StoreDiff(name, unit, a.numel(), int((a != b).sum()), float(d.max()) if d.numel() else 0.0, finite)
    (oa, fa), (ob, fb) = _ordered(a, unit), _ordered(b, unit)
    d = (oa - ob).abs()
    return StoreDiff(name, unit, oa.numel(), int((d > 0).sum()), float(d.max()) if d.numel() else 0.0,
                     bool(fa.all() and fb.all()))


def compare_rings(a: KVCache, b: KVCache, slot: int, entries: int | None = None) -> RingDiff:
    """Slot `slot`'s valid entries in rings a and b (same class and shape). entries: ring indices 0..entries-1,
    by default min(a's length of the slot, context); the slot's lengths are the caller's to compare."""
    if type(a) is not type(b) or a.k.shape != b.k.shape or a.k.dtype != b.k.dtype:
        raise ValueError(f"cannot compare a {type(a).__name__} {tuple(a.k.shape)} {a.k.dtype} ring with a "
                         f"{type(b).__name__} {tuple(b.k.shape)} {b.k.dtype} one")
    n = min(int(a.length[slot]), a.context) if entries is None else entries
    if not 0 < n <= a.context:
        raise ValueError(f"entries must be in [1, {a.context}], got {n}")
    diffs = []
    for name, unit, ka, va in stores(a):
        _, _, kb, vb = next(s for s in stores(b) if s[0] == name)
        pick = lambda t: t[:, slot, :, :n].cpu()  # noqa: E731  - [layer, head, entry, ...]
        diffs.append(_store_diff(name, unit, torch.stack([pick(ka), pick(va)]), torch.stack([pick(kb), pick(vb)])))
    idx_a, idx_b = a.slot_index(slot), b.slot_index(slot)
    deq = max(float((x.float() - y.float()).abs().max())
              for layer in range(a.num_layers)
              for x, y in zip(a.read(layer, idx_a, torch.float32, n), b.read(layer, idx_b, torch.float32, n),
                              strict=True))
    return RingDiff(n, a.num_layers, tuple(diffs), deq)
