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
"""

from __future__ import annotations

import math
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
    """The normalised Sylvester Hadamard matrix of size n (a power of two), fp32: orthogonal and symmetric."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two size, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).to(device)


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

if triton is not None:

    @triton.jit
    def _as_float(c, EXACT_BITS: tl.constexpr):
        """Codes 0..15 (int32) as fp32. EXACT_BITS: through the bits of 2^23 + c (an OR and a subtraction, no
        integer-to-float conversion, which Hopper issues at a fraction of the FMA rate)."""
        if EXACT_BITS:
            return (c | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        return c.to(tl.float32)

    @triton.jit
    def _decode_int4_kernel(Q, K, V, KS, KZ, VS, VZ, SLOTS, NVALID, OUT, sm_scale,
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


class Launch(NamedTuple):
    """The kernel's launch: positions per block, warps, pipeline stages, and how codes become floats (_as_float)."""

    block_n: int
    num_warps: int
    num_stages: int
    exact_bits: bool


# A first choice, not yet timed on the GPU: bench/kv4.sh sweeps the launch settings at 288 full-context slots
# (bench.attention_check) and runs bench.talker with the fastest (--kv4-launch sets this for a run).
LAUNCH = Launch(block_n=128, num_warps=4, num_stages=2, exact_bits=True)


def decode_attention_int4(q, ring_k, ring_v, k_scale, k_zero, v_scale, v_zero, slots, n_valid, sm_scale,
                          launch: Launch | None = None):
    """One query per row against its slot's 4-bit ring, in place. Triton on CUDA, torch elsewhere.

    q [B, H, D] (in the rotated basis); ring_k/ring_v [S, H, C, D/2] uint8 (contiguous in the last two dims);
    k_scale/k_zero/v_scale/v_zero [S, H, C, 2] fp16; slots [B]; n_valid [B] (entries 0..n_valid-1 are valid,
    n_valid >= 1). Returns [B, H, D] in the rotated basis. No host synchronisation: safe inside a CUDA graph."""
    if triton is None or not q.is_cuda:
        return decode_attention_int4_reference(q, ring_k, ring_v, k_scale, k_zero, v_scale, v_zero, slots, n_valid,
                                               sm_scale)
    return _launch(q, ring_k, ring_v, k_scale, k_zero, v_scale, v_zero, slots, n_valid, sm_scale, launch or LAUNCH)


def _launch(q, ring_k, ring_v, k_scale, k_zero, v_scale, v_zero, slots, n_valid, sm_scale, launch: Launch):
    B, H, D = q.shape
    out = torch.empty_like(q)
    assert ring_k.stride() == ring_v.stride() and ring_k.stride(3) == 1 and ring_k.shape[3] * 2 == D
    assert k_scale.stride() == k_zero.stride() == v_scale.stride() == v_zero.stride() and k_scale.stride(3) == 1
    _decode_int4_kernel[(B, H)](
        q, ring_k, ring_v, k_scale, k_zero, v_scale, v_zero, slots, n_valid, out, sm_scale,
        q.stride(0), q.stride(1), ring_k.stride(0), ring_k.stride(1), ring_k.stride(2),
        k_scale.stride(0), k_scale.stride(1), k_scale.stride(2), out.stride(0), out.stride(1),
        HALF=D // 2, BLOCK_N=launch.block_n, EXACT_BITS=launch.exact_bits, num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    return out
