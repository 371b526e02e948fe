"""Decode attention over the per-slot KV ring, and fp8 storage of that ring.

The live step has one query per slot and reads every valid entry of that slot's ring. At 160
sessions of 3000 frames this is ~126 GB of keys/values per frame in fp8 — the step is bound
by memory bandwidth, so two things matter:

* Read the ring in place. Gathering `ring[slots]` first (what the plain torch path does)
  copies it, doubling the traffic. The kernel below takes the slot index per row instead.
* Read only the valid part. A slot that has written `n` positions holds min(n, context)
  valid entries at ring indices 0..min(n, context)-1 (position p lives at p % context), so the
  kernel loops over exactly those: a young session costs less than a full one.

Order inside the ring does not matter to attention (keys carry RoPE already), so no
un-rotation of the ring is needed.

fp8 storage (e4m3) keeps one scale per (slot, head, position), i.e. per 128-value key or value
vector. Why this granularity: a new position is written every frame, one vector at a time, so
a per-vector scale is final when written (a per-tensor or per-channel scale would have to grow
as new vectors arrive and re-quantize old ones); the scale costs 2 bytes (fp16) per 128 bytes
of payload; and outlier vectors (which RoPE'd keys have) do not crush the resolution of others.
"""

from __future__ import annotations

import torch

from services.talker.fused import fused

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
SCALE_DTYPE = torch.float16


# The smallest scale: fp16's smallest normal. A smaller one would round to 0 in fp16 (an all-zero
# vector's would), and 0 / 0 is a NaN in the ring. e4m3 is floating point, so a scale larger than
# a tiny vector needs costs it no relative precision down to e4m3's subnormals.
MIN_SCALE = torch.finfo(SCALE_DTYPE).tiny


@fused
def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (fp8 [..., D], scale [...]) with x ~= fp8 * scale, one scale per vector."""
    amax = x.detach().abs().amax(dim=-1).float()
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE).to(SCALE_DTYPE)
    q = (x.float() / scale.float()[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.float()[..., None]).to(dtype)


def decode_attention_reference(q, ring_k, ring_v, k_scale, v_scale, slots, n_valid, sm_scale):
    """Plain torch: q [B, H, D]; ring [S, H, C, D] (fp8 with scales [S, H, C], or any float with
    scales None); slots, n_valid [B] -> [B, H, D]. Same contract as the Triton kernel."""
    keys, values = ring_k[slots], ring_v[slots]
    if k_scale is not None:
        keys = dequantize_fp8(keys, k_scale[slots], torch.float32)
        values = dequantize_fp8(values, v_scale[slots], torch.float32)
    return attend_valid(q, keys, values, n_valid, sm_scale)


def attend_valid(q, keys, values, n_valid, sm_scale):
    """q [B, H, D] over entries 0..n_valid[b]-1 of keys/values [B, H, C, D] (the rest never read), in fp32."""
    keys, values = keys.float(), values.float()
    C = keys.shape[2]
    valid = torch.arange(C, device=q.device)[None, :] < n_valid[:, None]  # [B, C]
    scores = torch.einsum("bhd,bhcd->bhc", q.float(), keys) * sm_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    values = values.masked_fill(~valid[:, None, :, None], 0.0)  # never read past the valid entries
    return torch.einsum("bhc,bhcd->bhd", scores.softmax(-1), values).to(q.dtype)


try:  # Triton exists on the GPU image, not on CPU-only machines.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

if triton is not None:

    @triton.jit
    def _decode_kernel(Q, K, V, KS, VS, SLOTS, NVALID, OUT, sm_scale,
                       s_qb, s_qh, s_ks, s_kh, s_kc, s_ss, s_sh, s_ob, s_oh,
                       HAS_SCALE: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        slot = tl.load(SLOTS + b).to(tl.int64)
        n = tl.load(NVALID + b)
        d = tl.arange(0, D)
        q = tl.load(Q + b * s_qb + h * s_qh + d).to(tl.float32) * sm_scale
        k_base = K + slot * s_ks + h * s_kh
        v_base = V + slot * s_ks + h * s_kh
        m_i = -float("inf")
        l_i = 0.0
        acc = tl.zeros([D], dtype=tl.float32)
        for start in range(0, n, BLOCK_N):
            idx = start + tl.arange(0, BLOCK_N)
            valid = idx < n
            offs = idx[:, None] * s_kc + d[None, :]
            k = tl.load(k_base + offs, mask=valid[:, None], other=0.0).to(tl.float32)
            v = tl.load(v_base + offs, mask=valid[:, None], other=0.0).to(tl.float32)
            # A vector's scale factors out of its dot product: the key's scales the score, the
            # value's its probability, one product per position instead of one per element.
            s = tl.sum(k * q[None, :], axis=1)
            if HAS_SCALE:
                s = s * tl.load(KS + slot * s_ss + h * s_sh + idx, mask=valid, other=0.0).to(tl.float32)
            s = tl.where(valid, s, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            if HAS_SCALE:
                p = p * tl.load(VS + slot * s_ss + h * s_sh + idx, mask=valid, other=0.0).to(tl.float32)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            m_i = m_new
        out = acc / l_i
        tl.store(OUT + b * s_ob + h * s_oh + d, out.to(OUT.dtype.element_ty))


# Launch parameters of the kernel: the fastest in bench/attention_check.py's sweep at the serving
# shape (160 slots x 3000 positions, fp8). Plain FMA: a tensor-core variant (the query broadcast to
# a 16-row MMA tile) measured slower (bench/RESULTS.md).
BLOCK_N, NUM_WARPS, NUM_STAGES = 256, 4, 2


def decode_attention(q, ring_k, ring_v, k_scale, v_scale, slots, n_valid, sm_scale, block_n: int = BLOCK_N,
                     num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES):
    """One query per row against its slot's ring, in place. Triton on CUDA, torch elsewhere.

    q [B, H, D]; ring_k/ring_v [S, H, C, D] (contiguous in the last two dims); k_scale/v_scale
    [S, H, C] for fp8 rings, else None; slots [B] (ring row of each query); n_valid [B] (entries
    0..n_valid-1 are valid, n_valid >= 1). No host synchronisation: safe inside a CUDA graph.
    """
    if triton is None or not q.is_cuda:
        return decode_attention_reference(q, ring_k, ring_v, k_scale, v_scale, slots, n_valid, sm_scale)
    B, H, D = q.shape
    out = torch.empty_like(q)
    has_scale = k_scale is not None
    ks = k_scale if has_scale else q  # unused pointer when there are no scales
    vs = v_scale if has_scale else q
    s_ss, s_sh = (k_scale.stride(0), k_scale.stride(1)) if has_scale else (0, 0)
    assert ring_k.stride() == ring_v.stride() and ring_k.stride(3) == 1
    _decode_kernel[(B, H)](
        q, ring_k, ring_v, ks, vs, slots, n_valid, out, sm_scale,
        q.stride(0), q.stride(1), ring_k.stride(0), ring_k.stride(1), ring_k.stride(2), s_ss, s_sh,
        out.stride(0), out.stride(1),
        HAS_SCALE=has_scale, D=D, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages,
    )
    return out
