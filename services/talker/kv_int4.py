"""4-bit storage of the KV ring (services/talker/kv_cache.Int4KVCache) and decode attention over it.

Why: memory. A full-context session keeps 3000 frames x 32 layers x a key and a value per head; in fp8 that is
0.80 GB, and 160 sessions fill an H200 beside the codecs. In this format a session takes 0.44 GB: about 300 fit.

The format, for each key or value vector of one (slot, head, position), D = head_dim values (128 at full size):

* A Hadamard rotation first. Keys and values are multiplied by the normalised Hadamard matrix R (D x D,
  orthogonal and symmetric), and so is the query; the attention output is multiplied by R on the way out.
  Attention is unchanged (Rq . Rk = q . k, and softmax(.) V R R = softmax(.) V). Why: an LLM's keys have a few
  outlier channels (KIVI, KVQuant). In a per-token group one outlier sets the scale and leaves the other
  channels a couple of levels; R spreads every channel over all D, so each vector looks Gaussian and a
  per-token scale fits it (QuaRot). QServe's SmoothAttention answers the same outliers with per-channel
  factors calibrated on real activations, which a server of random or unseen checkpoints does not have.
* Per-token groups of D/2 channels, asymmetric: each half of a rotated vector keeps an fp16 scale and an fp16
  minimum, and 16 levels, x ~= min + scale * code with code = round((x - min) / scale) in 0..15.
  - Per token for keys too (KIVI groups keys per channel): the ring is written one frame at a time, and a
    per-token group is final when it is written, as fp8's per-vector scale is. A per-channel group spans G
    frames, so it needs a full-precision window of the newest frames until G have arrived and a flush inside
    every step, a second kind of entry for the kernel, the prefill read, the voice prefix copy and the idle-row
    restore. After the rotation there are no outlier channels left for per-channel groups to isolate.
  - Two groups per vector, not one: on the tiny model (tests/test_kv4.py's guard: teacher-forced greedy agreement
    over 500 frames, a ring of 32), 93.6 % with halves and 92.5 % with whole vectors (fp8: 97.6 %). Halves cost 4
    more bytes per vector: about 300 full-context sessions beside the codecs instead of about 320 (estimated from
    the fp8 measurements, bench/RESULTS.md).
  - Asymmetric (a minimum, 16 levels) rather than symmetric (+-7 around 0, 15 levels): 93.6 % against 92.0 %.
* Packing: byte i of a vector holds channel i's code in its low nibble and channel i + D/2's in its high one, so
  the low nibbles are exactly group 0 and the high ones group 1: the kernel splits a tile with a mask and a
  shift, and each half meets its own contiguous half of the query.

Bytes per position at full size: 2 (K, V) x 32 layers x 32 heads x (64 code bytes + 4 fp16) = 147456, against
fp8's 266240 (0.55x).

No full-precision window of the newest frames (KIVI keeps one): its first job there is the unfinished
per-channel group, which per-token groups do not have, and at 4 bits (rather than KIVI's 2) it buys little;
it would cost every path above a second kind of entry.

Decode attention (Triton, `decode_attention_int4`): as the fp8 kernel (decode_attention.py), one program per
(row, head) reads its slot's ring in place and only the valid entries, and dequantization is fused. A group's
scale and minimum factor out of its products, so codes are used as plain numbers:
    q . k = s0 (q_lo . c_lo) + z0 sum(q_lo) + s1 (q_hi . c_hi) + z1 sum(q_hi)
    sum_t p_t v_t[half] = sum_t (p_t s_t) c_t[half] + sum_t p_t z_t
Three kernels compute this (`Kernel`; bench.attention_check checks and times them at every launch setting):
* tile, the first: a [BLOCK_N, D/2] byte tile per block, widened to int32, its nibbles split by mask and shift,
  and every block's value sums reduced across all the program's threads (shuffles and shared memory). Measured on
  the H200: 3.10 ms per layer at 288 full slots, 1285 GB/s, a third of the bandwidth.
* planes: the codes as 32-bit words (eight nibbles: four channels of each half). Nibble M of each half-word is a
  "plane" of D/8 channels, turned into a float without a shift or a conversion: masked in place into the
  mantissa of 2^23 and 2^23 taken off (one LOP3 and one FADD; the plane's weight 16^M, a power of two, comes
  off exactly: folded into the query for keys, out of the sum at the end for values), then one FMA with the
  query (keys) or with p * scale (values). A block is a
  [BLOCK_N / ROWS, ROWS, D/8] tile whose ROWS span the program's threads, so the value planes accumulate per
  thread and are summed across threads once, after the loop. The loop is software-pipelined (tl.range's
  num_stages: the loads of the next blocks are in flight while one is computed). About 4.2-4.6 instructions per
  code in the compiled loop (sm_90) against the tile kernel's 5.6-6.6.
* mma: the planes kernel with the keys' dot products on int8 tensor cores (wgmma on Hopper). Codes are exact
  int8 numbers, unpacked four to a register (an AND, or a shift and an AND, in inline PTX: Triton's own byte
  operations extract and re-pack every byte); the query, one vector per program, becomes three int8 limbs
  (q = unit * (l0 + l1 / 128 + l2 / 128^2), within 2.4e-7 of max |q|) in three columns of the B operand per half,
  and the products sum exactly in int32. The values stay on the planes' FMA path: their dot products run over
  positions, which the ring stores apart (a position's channels are contiguous), and int8 tensor cores want the
  summed dimension contiguous. About 2.9-3.6 instructions per code (tools/kernel_sass.py).
All take the same arguments; which runs and how is a `Launch`.
"""

from __future__ import annotations

import enum
import math
import os
from typing import NamedTuple

import torch

from services.talker.decode_attention import SCALE_DTYPE, attend_valid
from services.talker.fused import fused

LEVELS = 15  # the largest code: 4 bits
CODE_DTYPE = torch.uint8
# The smallest scale: fp16's smallest subnormal. A constant half gets it instead of 0 (and 0 / 0); a tiny vector
# keeps its 16 levels down to ranges of about 1e-5 (fp16's smallest normal would coarsen them below 1e-3).
MIN_SCALE = 2.0 ** -24
# A scale or minimum beyond fp16's range is clamped into it (such a vector saturates instead of becoming inf).
SCALE_MAX = torch.finfo(SCALE_DTYPE).max


def hadamard(n: int, device=None) -> torch.Tensor:
    """The normalised Sylvester Hadamard matrix of size n (a power of two), fp32: orthogonal and symmetric.

    Built on `device` itself: a copy from the host would synchronise the stream, and a recorded voice's prefix ring
    is made on the talker's compute thread while other sessions' steps are queued."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two size, got {n}")
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


@fused
def rotate(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """x [..., D] @ r in fp32, back in x's dtype (r is its own inverse: rotate(rotate(x)) ~= x)."""
    return (x.float() @ r).to(x.dtype)


@fused
def quantize_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes uint8 [..., D/2], scale fp16 [..., 2], zero fp16 [..., 2]) with
    x[..., g*D/2 + i] ~= zero[g] + scale[g] * code, code = codes[i] & 15 for g = 0 and codes[i] >> 4 for g = 1."""
    halves = x.detach().float().unflatten(-1, (2, -1))  # [..., 2, D/2]
    lo, hi = halves.amin(dim=-1), halves.amax(dim=-1)
    scale = ((hi - lo) / LEVELS).clamp(MIN_SCALE, SCALE_MAX).to(SCALE_DTYPE)
    zero = lo.clamp(-SCALE_MAX, SCALE_MAX).to(SCALE_DTYPE)
    codes = ((halves - zero.float()[..., None]) / scale.float()[..., None]).round().clamp(0, LEVELS).to(CODE_DTYPE)
    return codes[..., 0, :] | (codes[..., 1, :] << 4), scale, zero


def dequantize_int4(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    halves = torch.stack([codes & 15, codes >> 4], dim=-2).float()  # [..., 2, D/2]
    return (zero.float()[..., None] + scale.float()[..., None] * halves).flatten(-2).to(dtype)


def decode_attention_int4_reference(q, ring_k, ring_v, k_scale, k_zero, v_scale, v_zero, slots, n_valid, sm_scale):
    """Plain torch, the kernel's contract: q [B, H, D] (rotated); rings [S, H, C, D/2] uint8 with scales and zeros
    [S, H, C, 2]; slots, n_valid [B] -> [B, H, D] (rotated)."""
    keys = dequantize_int4(ring_k[slots], k_scale[slots], k_zero[slots], torch.float32)
    values = dequantize_int4(ring_v[slots], v_scale[slots], v_zero[slots], torch.float32)
    return attend_valid(q, keys, values, n_valid, sm_scale)


try:  # Triton exists on the GPU image, not on CPU-only machines.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None


MAGIC = 0x4B000000  # the bits of 2^23 as fp32: with a nibble c OR'ed into its mantissa it reads 2^23 + c


class Kernel(str, enum.Enum):
    """Which Triton decode kernel (all take the same arguments and compute the same attention; the notes above)."""

    TILE = "tile"  # the first: a [BLOCK_N, D/2] byte tile, its nibbles split by mask and shift, reduced every block
    PLANES = "planes"  # 32-bit words, eight nibble planes, per-thread partial sums reduced once (see the notes)
    MMA = "mma"  # the planes kernel with the keys' dot products on int8 tensor cores


class Launch(NamedTuple):
    """The kernel's launch: which kernel, positions per block, warps, pipeline stages, and how codes become floats.

    exact_bits (the tile kernel's choice, _as_float): through the bits of 2^23 + c, or an integer-to-float
    conversion. Both give the code exactly; they differ in speed. The planes and mma kernels always go through the
    bits (their nibbles are masked in place), so they take exact_bits True only."""

    kernel: Kernel
    block_n: int
    num_warps: int
    num_stages: int
    exact_bits: bool

    @classmethod
    def parse(cls, text: str) -> "Launch":
        """'KERNEL,BLOCK_N,WARPS,STAGES,EXACT_BITS' (str(launch)), e.g. 'planes,128,4,3,1'."""
        parts = text.split(",")
        try:
            kernel, bn, warps, stages, exact = Kernel(parts[0]), *(int(x) for x in parts[1:])
        except ValueError as e:  # a bad kernel name, a non-integer, or the wrong count of fields
            raise ValueError(f"a 4-bit launch is KERNEL,BLOCK_N,WARPS,STAGES,EXACT_BITS with KERNEL one of "
                             f"{', '.join(k.value for k in Kernel)}, got {text!r}") from e
        return cls(kernel, bn, warps, stages, bool(exact)).checked()

    def checked(self) -> "Launch":
        """Itself, if Triton can launch it; a ValueError says why not."""
        pow2 = lambda x: x >= 1 and not x & (x - 1)  # noqa: E731
        if not (pow2(self.block_n) and self.block_n >= 16 and pow2(self.num_warps) and self.num_stages >= 1):
            raise ValueError(f"a 4-bit launch needs block_n a power of two >= 16, num_warps a power of two and "
                             f"num_stages >= 1, got {self}")
        if self.kernel is not Kernel.TILE and not self.exact_bits:
            raise ValueError(f"the {self.kernel.value} kernel always converts codes through their bits: exact_bits "
                             f"must be True")
        return self

    def __str__(self) -> str:
        return f"{self.kernel.value},{self.block_n},{self.num_warps},{self.num_stages},{int(self.exact_bits)}"


# The served launch is the one measured on the GPU: the tile kernel at its best setting (3.17 ms per layer at
# 288 full-context slots, bench/RESULTS.md). The planes and mma kernels agree with the reference in Triton's
# interpreter but are not yet timed or run on a GPU: bench/kv4.sh sweeps all three kernels' launch settings
# (bench.attention_check) and runs bench.talker with the fastest that agrees (--kv4-launch sets this for a run);
# make the winner the default once it is measured.
LAUNCH = Launch(Kernel.TILE, block_n=256, num_warps=4, num_stages=2, exact_bits=True)


if triton is not None:

    @triton.jit
    def _as_float(c, EXACT_BITS: tl.constexpr):
        """Codes 0..15 (int32) as fp32. EXACT_BITS: through the bits of 2^23 + c (an OR and a subtraction, no
        integer-to-float conversion). Both are exact; in this kernel the conversion (sm_90's I2FP) measured the
        faster, 3.10 ms per layer against 3.17."""
        if EXACT_BITS:
            return (c | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        return c.to(tl.float32)

    @triton.jit
    def _decode_int4_tile_kernel(Q, K, V, KS, KZ, VS, VZ, SLOTS, NVALID, OUT, sm_scale,
                            s_qb, s_qh, s_ks, s_kh, s_kc, s_ms, s_mh, s_mc, s_ob, s_oh,
                            HALF: tl.constexpr, BLOCK_N: tl.constexpr, EXACT_BITS: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        slot = tl.load(SLOTS + b).to(tl.int64)
        n = tl.load(NVALID + b)
        d = tl.arange(0, HALF)
        q_base = Q + b * s_qb + h * s_qh
        q_lo = tl.load(q_base + d).to(tl.float32) * sm_scale
        q_hi = tl.load(q_base + HALF + d).to(tl.float32) * sm_scale
        sum_q_lo = tl.sum(q_lo, axis=0)
        sum_q_hi = tl.sum(q_hi, axis=0)
        k_base = K + slot * s_ks + h * s_kh
        v_base = V + slot * s_ks + h * s_kh
        m_base = slot * s_ms + h * s_mh  # scales and zeros share one layout
        m_i = -float("inf")
        l_i = 0.0
        acc_lo = tl.zeros([HALF], dtype=tl.float32)
        acc_hi = tl.zeros([HALF], dtype=tl.float32)
        zero_lo = 0.0  # sum_t p_t * zero_t of each half, added to every channel of it at the end
        zero_hi = 0.0
        for start in range(0, n, BLOCK_N):
            idx = start + tl.arange(0, BLOCK_N)
            valid = idx < n
            offs = idx[:, None] * s_kc + d[None, :]
            m0 = m_base + idx * s_mc
            kc = tl.load(k_base + offs, mask=valid[:, None], other=0).to(tl.int32)
            s = (tl.load(KS + m0, mask=valid, other=0.0).to(tl.float32)
                 * tl.sum(_as_float(kc & 15, EXACT_BITS) * q_lo[None, :], axis=1)
                 + tl.load(KS + m0 + 1, mask=valid, other=0.0).to(tl.float32)
                 * tl.sum(_as_float(kc >> 4, EXACT_BITS) * q_hi[None, :], axis=1)
                 + tl.load(KZ + m0, mask=valid, other=0.0).to(tl.float32) * sum_q_lo
                 + tl.load(KZ + m0 + 1, mask=valid, other=0.0).to(tl.float32) * sum_q_hi)
            s = tl.where(valid, s, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            vc = tl.load(v_base + offs, mask=valid[:, None], other=0).to(tl.int32)
            p_lo = p * tl.load(VS + m0, mask=valid, other=0.0).to(tl.float32)
            p_hi = p * tl.load(VS + m0 + 1, mask=valid, other=0.0).to(tl.float32)
            acc_lo = acc_lo * alpha + tl.sum(p_lo[:, None] * _as_float(vc & 15, EXACT_BITS), axis=0)
            acc_hi = acc_hi * alpha + tl.sum(p_hi[:, None] * _as_float(vc >> 4, EXACT_BITS), axis=0)
            zero_lo = zero_lo * alpha + tl.sum(p * tl.load(VZ + m0, mask=valid, other=0.0).to(tl.float32), axis=0)
            zero_hi = zero_hi * alpha + tl.sum(p * tl.load(VZ + m0 + 1, mask=valid, other=0.0).to(tl.float32), axis=0)
            m_i = m_new
        o_base = OUT + b * s_ob + h * s_oh
        tl.store(o_base + d, ((acc_lo + zero_lo) / l_i).to(OUT.dtype.element_ty))
        tl.store(o_base + HALF + d, ((acc_hi + zero_hi) / l_i).to(OUT.dtype.element_ty))


    @triton.jit
    def _plane(w, nibble, magic, M: tl.constexpr):
        """Nibble M (0..3) of the low 16 bits of the words w, times 16^M, as fp32 and exactly: the nibble masked in
        place into the mantissa of 2^23, less 2^23. No shift and no integer-to-float conversion. The mask (`nibble`,
        15) and `magic` (the bits of 2^23) come as kernel arguments: as constants, the AND and the OR compile to two
        instructions (a LOP3 takes one immediate; a mask of the low bits becomes a bit-field extract); as
        registers, to one LOP3."""
        return ((w & (nibble << (4 * M))) | magic).to(tl.float32, bitcast=True) - 8388608.0

    @triton.jit
    def _fp16_pair(x, G: tl.constexpr):
        """Half G of 32-bit words that each hold two fp16 (a half vector's scale or minimum, G = 0 or 1), as fp32."""
        return ((x >> (16 * G)) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _channels(i, HALF: tl.constexpr, P: tl.constexpr, M: tl.constexpr):
        """The channels that plane (P, M) holds: nibble M of half-word P of word i is byte 4i + 2P + M // 2's low
        (M even, group 0) or high (M odd, group 1) nibble."""
        return (M % 2) * HALF + 4 * i + 2 * P + M // 2

    @triton.jit
    def _q_plane(q_base, i, sm_scale, HALF: tl.constexpr, P: tl.constexpr, M: tl.constexpr):
        """The query at plane (P, M)'s channels, times sm_scale and 16^-M (a power of two: exact, so the products
        with the plane's 16^M-weighted codes round as q * code would)."""
        return tl.load(q_base + _channels(i, HALF, P, M)).to(tl.float32) * sm_scale * (1.0 / (1 << (4 * M)))

    @triton.jit
    def _v_plane(acc, pv, vw, nibble, magic, alpha, M: tl.constexpr):
        """acc [ROWS, WORDS] rescaled, plus the block's p * scale-weighted codes of one value plane, summed over the
        positions each thread holds (axis 0 is in-thread: no shuffle, no shared memory)."""
        return acc * alpha + tl.sum(pv[:, :, None] * _plane(vw, nibble, magic, M), axis=0)

    @triton.jit
    def _store_plane(o_base, i, acc, denom, z, HALF: tl.constexpr, P: tl.constexpr, M: tl.constexpr):
        """Plane (P, M) of the output: its per-thread sums summed, the weight 16^M off, the half's p * minimum sum
        added, over the softmax denominator."""
        out = (tl.sum(acc, axis=0) * (1.0 / (1 << (4 * M))) + z) / denom
        tl.store(o_base + _channels(i, HALF, P, M), out.to(o_base.dtype.element_ty))

    @triton.jit
    def _v_planes(a00, a01, a02, a03, a10, a11, a12, a13, p, vs, vw, nibble, magic, alpha):
        """The eight value planes' accumulators after one block (both kernels): the words' low and high halves, each
        half vector's scale weighting p."""
        pv_lo = p * _fp16_pair(vs, 0)
        pv_hi = p * _fp16_pair(vs, 1)
        vw_hi = vw >> 16
        return (_v_plane(a00, pv_lo, vw, nibble, magic, alpha, 0), _v_plane(a01, pv_hi, vw, nibble, magic, alpha, 1),
                _v_plane(a02, pv_lo, vw, nibble, magic, alpha, 2), _v_plane(a03, pv_hi, vw, nibble, magic, alpha, 3),
                _v_plane(a10, pv_lo, vw_hi, nibble, magic, alpha, 0),
                _v_plane(a11, pv_hi, vw_hi, nibble, magic, alpha, 1),
                _v_plane(a12, pv_lo, vw_hi, nibble, magic, alpha, 2),
                _v_plane(a13, pv_hi, vw_hi, nibble, magic, alpha, 3))

    @triton.jit
    def _store_planes(o_base, i, a00, a01, a02, a03, a10, a11, a12, a13, denom, z_lo, z_hi, HALF: tl.constexpr):
        """The eight planes of the output (both kernels)."""
        _store_plane(o_base, i, a00, denom, z_lo, HALF, 0, 0)
        _store_plane(o_base, i, a01, denom, z_hi, HALF, 0, 1)
        _store_plane(o_base, i, a02, denom, z_lo, HALF, 0, 2)
        _store_plane(o_base, i, a03, denom, z_hi, HALF, 0, 3)
        _store_plane(o_base, i, a10, denom, z_lo, HALF, 1, 0)
        _store_plane(o_base, i, a11, denom, z_hi, HALF, 1, 1)
        _store_plane(o_base, i, a12, denom, z_lo, HALF, 1, 2)
        _store_plane(o_base, i, a13, denom, z_hi, HALF, 1, 3)

    @triton.jit
    def _decode_int4_planes_kernel(Q, K, V, KS, KZ, VS, VZ, SLOTS, NVALID, OUT, sm_scale, nibble, magic,
                                   s_qb, s_qh, s_ks, s_kh, s_ms, s_mh, s_ob, s_oh,
                                   HALF: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                                   NUM_STAGES: tl.constexpr):
        """K, V: the rings as int32 words (WORDS = HALF / 4 per vector); KS..VZ: the scales and minimums as int32
        words of two fp16 (one per position). A block of BLOCK_N positions is a [BLOCK_N / ROWS, ROWS, WORDS] tile;
        ROWS spans the program's threads, so sums over axis 0 stay in each thread."""
        WORDS: tl.constexpr = HALF // 4
        b = tl.program_id(0)
        h = tl.program_id(1)
        slot = tl.load(SLOTS + b).to(tl.int64)
        n = tl.load(NVALID + b)
        i = tl.arange(0, WORDS)
        q_base = Q + b * s_qb + h * s_qh
        d = tl.arange(0, HALF)
        sum_q_lo = tl.sum(tl.load(q_base + d).to(tl.float32) * sm_scale, axis=0)
        sum_q_hi = tl.sum(tl.load(q_base + HALF + d).to(tl.float32) * sm_scale, axis=0)
        q00 = _q_plane(q_base, i, sm_scale, HALF, 0, 0)[None, None, :]
        q01 = _q_plane(q_base, i, sm_scale, HALF, 0, 1)[None, None, :]
        q02 = _q_plane(q_base, i, sm_scale, HALF, 0, 2)[None, None, :]
        q03 = _q_plane(q_base, i, sm_scale, HALF, 0, 3)[None, None, :]
        q10 = _q_plane(q_base, i, sm_scale, HALF, 1, 0)[None, None, :]
        q11 = _q_plane(q_base, i, sm_scale, HALF, 1, 1)[None, None, :]
        q12 = _q_plane(q_base, i, sm_scale, HALF, 1, 2)[None, None, :]
        q13 = _q_plane(q_base, i, sm_scale, HALF, 1, 3)[None, None, :]
        rows = tl.arange(0, BLOCK_N // ROWS)[:, None] * ROWS + tl.arange(0, ROWS)[None, :]  # [BLOCK_N / ROWS, ROWS]
        k_base = K + slot * s_ks + h * s_kh
        v_base = V + slot * s_ks + h * s_kh
        m_base = slot * s_ms + h * s_mh  # scales and minimums share one layout
        m_i = -float("inf")
        # Per thread-row partial sums (softmax denominator, p * minimum of each half, and the eight value planes),
        # summed across threads once after the loop.
        l_i = tl.zeros([ROWS], dtype=tl.float32)
        z_lo = tl.zeros([ROWS], dtype=tl.float32)
        z_hi = tl.zeros([ROWS], dtype=tl.float32)
        a00 = tl.zeros([ROWS, WORDS], dtype=tl.float32)
        a01 = tl.zeros([ROWS, WORDS], dtype=tl.float32)
        a02 = tl.zeros([ROWS, WORDS], dtype=tl.float32)
        a03 = tl.zeros([ROWS, WORDS], dtype=tl.float32)
        a10 = tl.zeros([ROWS, WORDS], dtype=tl.float32)
        a11 = tl.zeros([ROWS, WORDS], dtype=tl.float32)
        a12 = tl.zeros([ROWS, WORDS], dtype=tl.float32)
        a13 = tl.zeros([ROWS, WORDS], dtype=tl.float32)
        for start in tl.range(0, n, BLOCK_N, num_stages=NUM_STAGES):
            idx = start + rows
            valid = idx < n
            offs = idx[:, :, None] * WORDS + i[None, None, :]
            # Unsigned words: their shifts are logical (an arithmetic one would cost a sign extension per use).
            kw = tl.load(k_base + offs, mask=valid[:, :, None], other=0).to(tl.uint32, bitcast=True)
            vw = tl.load(v_base + offs, mask=valid[:, :, None], other=0).to(tl.uint32, bitcast=True)
            ks = tl.load(KS + m_base + idx, mask=valid, other=0).to(tl.uint32, bitcast=True)
            kz = tl.load(KZ + m_base + idx, mask=valid, other=0).to(tl.uint32, bitcast=True)
            vs = tl.load(VS + m_base + idx, mask=valid, other=0).to(tl.uint32, bitcast=True)
            vz = tl.load(VZ + m_base + idx, mask=valid, other=0).to(tl.uint32, bitcast=True)
            kw_hi = kw >> 16  # half-word 1 (bytes 2, 3) down to half-word 0's place: one shift per eight codes
            dot_lo = (_plane(kw, nibble, magic, 0) * q00 + _plane(kw, nibble, magic, 2) * q02
                      + _plane(kw_hi, nibble, magic, 0) * q10 + _plane(kw_hi, nibble, magic, 2) * q12)
            dot_hi = (_plane(kw, nibble, magic, 1) * q01 + _plane(kw, nibble, magic, 3) * q03
                      + _plane(kw_hi, nibble, magic, 1) * q11 + _plane(kw_hi, nibble, magic, 3) * q13)
            # Each half's scale enters before the sum over the words: one sum per position, not one per half.
            s = (tl.sum(dot_lo * _fp16_pair(ks, 0)[:, :, None] + dot_hi * _fp16_pair(ks, 1)[:, :, None], axis=2)
                 + _fp16_pair(kz, 0) * sum_q_lo + _fp16_pair(kz, 1) * sum_q_hi)
            s = tl.where(valid, s, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(tl.max(s, axis=1), axis=0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            z_lo = z_lo * alpha + tl.sum(p * _fp16_pair(vz, 0), axis=0)
            z_hi = z_hi * alpha + tl.sum(p * _fp16_pair(vz, 1), axis=0)
            a00, a01, a02, a03, a10, a11, a12, a13 = _v_planes(a00, a01, a02, a03, a10, a11, a12, a13, p, vs, vw,
                                                               nibble, magic, alpha)
            m_i = m_new
        l_sum = tl.sum(l_i, axis=0)
        zl = tl.sum(z_lo, axis=0)
        zh = tl.sum(z_hi, axis=0)
        o_base = OUT + b * s_ob + h * s_oh
        _store_planes(o_base, i, a00, a01, a02, a03, a10, a11, a12, a13, l_sum, zl, zh, HALF)


    @triton.jit
    def _nibbles(x, HIGH: tl.constexpr, INTERPRET: tl.constexpr):
        """Code bytes (uint8) -> their low (or HIGH) nibbles as int8, four per instruction: an AND (after a shift for
        the high ones) on the 32-bit register that holds four bytes. Triton's own `x & 15` on bytes extracts and
        re-packs each one. The interpreter runs no PTX: there, the same in Triton."""
        if INTERPRET:
            return ((x >> 4) if HIGH else (x & 15)).to(tl.int8, bitcast=True)
        if HIGH:
            return tl.inline_asm_elementwise("shr.b32 $0, $1, 4;\n\tand.b32 $0, $0, 0x0F0F0F0F;", "=r,r", [x],
                                             dtype=tl.int8, is_pure=True, pack=4)
        return tl.inline_asm_elementwise("and.b32 $0, $1, 0x0F0F0F0F;", "=r,r", [x], dtype=tl.int8, is_pure=True,
                                         pack=4)

    @triton.jit
    def _limbs(q):
        """q [HALF] fp32 -> (unit, l0, l1, l2), q = unit * (l0 + l1 / 128 + l2 / 128^2) to within unit / 2^15
        (2.4e-7 of max |q|), each l an integer of at most 127 in magnitude (held in fp32): three int8 limbs."""
        unit = tl.maximum(tl.max(tl.abs(q), axis=0), 1e-30) / 127.0
        x = q / unit
        l0 = tl.floor(x + 0.5)
        x = (x - l0) * 128.0  # exact: x - l0 is within 0.5 of 0
        l1 = tl.floor(x + 0.5)
        x = (x - l1) * 128.0
        return unit, l0, l1, tl.floor(x + 0.5)

    @triton.jit
    def _limb_columns(l0, l1, l2, cols, FIRST: tl.constexpr):
        """[HALF, 16] int8 with the limbs in columns FIRST..FIRST+2, zero elsewhere: a tensor-core B operand."""
        c = tl.where(cols == FIRST, l0[:, None], tl.where(cols == FIRST + 1, l1[:, None],
                                                          tl.where(cols == FIRST + 2, l2[:, None], 0.0)))
        return c.to(tl.int8)

    @triton.jit
    def _decode_int4_mma_kernel(Q, K, V, KS, KZ, VS, VZ, SLOTS, NVALID, OUT, sm_scale, nibble, magic,
                                s_qb, s_qh, s_ks, s_kh, s_ms, s_mh, s_ob, s_oh,
                                HALF: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                                NUM_STAGES: tl.constexpr, INTERPRET: tl.constexpr):
        """The planes kernel with the keys' dot products on int8 tensor cores: codes (exact in int8) times the
        query's three int8 limbs, summed exactly in int32 (at most 127 * 15 * HALF), one column per limb and half.
        K: the keys' ring as bytes; V..VZ and the strides (in 32-bit words) as the planes kernel's."""
        WORDS: tl.constexpr = HALF // 4
        b = tl.program_id(0)
        h = tl.program_id(1)
        slot = tl.load(SLOTS + b).to(tl.int64)
        n = tl.load(NVALID + b)
        i = tl.arange(0, WORDS)
        d = tl.arange(0, HALF)
        q_base = Q + b * s_qb + h * s_qh
        q_lo = tl.load(q_base + d).to(tl.float32) * sm_scale
        q_hi = tl.load(q_base + HALF + d).to(tl.float32) * sm_scale
        sum_q_lo = tl.sum(q_lo, axis=0)
        sum_q_hi = tl.sum(q_hi, axis=0)
        cols = tl.arange(0, 16)[None, :]
        u_lo, l0, l1, l2 = _limbs(q_lo)
        b_lo = _limb_columns(l0, l1, l2, cols, 0)
        u_hi, l0, l1, l2 = _limbs(q_hi)
        b_hi = _limb_columns(l0, l1, l2, cols, 3)
        # Column c of the product, as a score: its limb's weight, and which half's scale it takes.
        weight = tl.where(cols % 3 == 0, 1.0, tl.where(cols % 3 == 1, 1.0 / 128, 1.0 / 16384))
        weight = tl.where(cols < 3, u_lo * weight, tl.where(cols < 6, u_hi * weight, 0.0))
        rows = tl.arange(0, BLOCK_N // ROWS)[:, None] * ROWS + tl.arange(0, ROWS)[None, :]  # [BLOCK_N / ROWS, ROWS]
        k_base = K + (slot * s_ks + h * s_kh) * 4  # bytes
        v_base = V + slot * s_ks + h * s_kh
        m_base = slot * s_ms + h * s_mh
        m_i = -float("inf")
        l_i = tl.zeros([ROWS], dtype=tl.float32)
        z_lo = tl.zeros([ROWS], dtype=tl.float32)
        z_hi = tl.zeros([ROWS], dtype=tl.float32)
        a00 = tl.zeros([ROWS, WORDS], dtype=tl.float32)
        a01 = tl.zeros([ROWS, WORDS], dtype=tl.float32)
        a02 = tl.zeros([ROWS, WORDS], dtype=tl.float32)
        a03 = tl.zeros([ROWS, WORDS], dtype=tl.float32)
        a10 = tl.zeros([ROWS, WORDS], dtype=tl.float32)
        a11 = tl.zeros([ROWS, WORDS], dtype=tl.float32)
        a12 = tl.zeros([ROWS, WORDS], dtype=tl.float32)
        a13 = tl.zeros([ROWS, WORDS], dtype=tl.float32)
        for start in tl.range(0, n, BLOCK_N, num_stages=NUM_STAGES):
            idx_k = start + tl.arange(0, BLOCK_N)
            valid_k = idx_k < n
            kc = tl.load(k_base + idx_k[:, None] * HALF + d[None, :], mask=valid_k[:, None], other=0)
            prod = tl.dot(_nibbles(kc, False, INTERPRET), b_lo, out_dtype=tl.int32)
            prod = tl.dot(_nibbles(kc, True, INTERPRET), b_hi, prod, out_dtype=tl.int32)  # [BLOCK_N, 16]
            ks = tl.load(KS + m_base + idx_k, mask=valid_k, other=0).to(tl.uint32, bitcast=True)
            kz = tl.load(KZ + m_base + idx_k, mask=valid_k, other=0).to(tl.uint32, bitcast=True)
            scale = tl.where(cols < 3, _fp16_pair(ks, 0)[:, None], _fp16_pair(ks, 1)[:, None])
            s = (tl.sum(prod.to(tl.float32) * weight * scale, axis=1)
                 + _fp16_pair(kz, 0) * sum_q_lo + _fp16_pair(kz, 1) * sum_q_hi)
            s = tl.where(valid_k, s, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.exp(m_i - m_new)
            p = tl.reshape(tl.exp(s - m_new), (BLOCK_N // ROWS, ROWS))  # [BLOCK_N / ROWS, ROWS], as `rows`
            idx = start + rows
            valid = idx < n
            vw = tl.load(v_base + idx[:, :, None] * WORDS + i[None, None, :], mask=valid[:, :, None],
                         other=0).to(tl.uint32, bitcast=True)
            vs = tl.load(VS + m_base + idx, mask=valid, other=0).to(tl.uint32, bitcast=True)
            vz = tl.load(VZ + m_base + idx, mask=valid, other=0).to(tl.uint32, bitcast=True)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            z_lo = z_lo * alpha + tl.sum(p * _fp16_pair(vz, 0), axis=0)
            z_hi = z_hi * alpha + tl.sum(p * _fp16_pair(vz, 1), axis=0)
            a00, a01, a02, a03, a10, a11, a12, a13 = _v_planes(a00, a01, a02, a03, a10, a11, a12, a13, p, vs, vw,
                                                               nibble, magic, alpha)
            m_i = m_new
        l_sum = tl.sum(l_i, axis=0)
        zl = tl.sum(z_lo, axis=0)
        zh = tl.sum(z_hi, axis=0)
        o_base = OUT + b * s_ob + h * s_oh
        _store_planes(o_base, i, a00, a01, a02, a03, a10, a11, a12, a13, l_sum, zl, zh, HALF)


def decode_attention_int4(q, ring_k, ring_v, k_scale, k_zero, v_scale, v_zero, slots, n_valid, sm_scale,
                          launch: Launch | None = None):
    """One query per row against its slot's 4-bit ring, in place. Triton on CUDA, torch elsewhere.

    q [B, H, D] (in the rotated basis); ring_k/ring_v [S, H, C, D/2] uint8 (contiguous in the last two dims);
    k_scale/k_zero/v_scale/v_zero [S, H, C, 2] fp16; slots [B]; n_valid [B] (entries 0..n_valid-1 are valid,
    n_valid >= 1). Returns [B, H, D] in the rotated basis. No host synchronisation: safe inside a CUDA graph."""
    if triton is None or not q.is_cuda:
        return decode_attention_int4_reference(q, ring_k, ring_v, k_scale, k_zero, v_scale, v_zero, slots, n_valid,
                                               sm_scale)
    return launch_int4(q, ring_k, ring_v, k_scale, k_zero, v_scale, v_zero, slots, n_valid, sm_scale,
                       launch or LAUNCH)


def launch_int4(q, ring_k, ring_v, k_scale, k_zero, v_scale, v_zero, slots, n_valid, sm_scale, launch: Launch,
                out: torch.Tensor | None = None):
    """The Triton kernel `launch` names, on any device Triton runs on (CUDA, or the CPU under TRITON_INTERPRET=1),
    into `out` (like q) if given."""
    launch = launch.checked()
    B, H, D = q.shape
    out = torch.empty_like(q) if out is None else out
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1
    assert ring_k.stride() == ring_v.stride() and ring_k.stride(3) == 1 and ring_k.shape[3] * 2 == D
    assert ring_k.stride(2) == D // 2  # one vector's codes right after the previous one's
    assert k_scale.stride() == k_zero.stride() == v_scale.stride() == v_zero.stride() and k_scale.stride(3) == 1
    assert k_scale.stride(2) == 2  # a position's two halves' scales (or minimums) are one 32-bit word
    if launch.kernel is Kernel.TILE:
        _decode_int4_tile_kernel[(B, H)](
            q, ring_k, ring_v, k_scale, k_zero, v_scale, v_zero, slots, n_valid, out, sm_scale,
            q.stride(0), q.stride(1), ring_k.stride(0), ring_k.stride(1), ring_k.stride(2),
            k_scale.stride(0), k_scale.stride(1), k_scale.stride(2), out.stride(0), out.stride(1),
            HALF=D // 2, BLOCK_N=launch.block_n, EXACT_BITS=launch.exact_bits, num_warps=launch.num_warps,
            num_stages=launch.num_stages,
        )
        return out
    if D % 8 or (D // 8) & (D // 8 - 1) or (launch.kernel is Kernel.MMA and D < 32):
        raise ValueError(f"the {launch.kernel.value} kernel needs head_dim a power of two of at least "
                         f"{32 if launch.kernel is Kernel.MMA else 8}, got {D}")
    # 16-byte loads: a vector's WORDS words take WORDS / 4 threads, so a warp spans 32 * 4 / WORDS positions.
    rows = min(launch.block_n, launch.num_warps * 128 // max(4, D // 8))
    words = lambda t: t.view(torch.int32)  # noqa: E731  - 4 code bytes, or a half vector's fp16 pair, per word
    kw, vw, ks, kz, vs, vz = (words(t) for t in (ring_k, ring_v, k_scale, k_zero, v_scale, v_zero))
    args = (q, kw, vw, ks, kz, vs, vz, slots, n_valid, out, sm_scale, 15, MAGIC, q.stride(0), q.stride(1),
            kw.stride(0), kw.stride(1), ks.stride(0), ks.stride(1), out.stride(0), out.stride(1))
    meta = dict(HALF=D // 2, BLOCK_N=launch.block_n, ROWS=rows, NUM_STAGES=launch.num_stages,
                num_warps=launch.num_warps)
    if launch.kernel is Kernel.PLANES:
        _decode_int4_planes_kernel[(B, H)](*args, **meta)
    else:  # the keys as bytes (the tensor cores take their codes four to a register)
        interpret = os.environ.get("TRITON_INTERPRET") == "1"
        _decode_int4_mma_kernel[(B, H)](*args[:1], ring_k, *args[2:], INTERPRET=interpret, **meta)
    return out
