"""fp8 KV ring (services/talker/kv_cache.Fp8KVCache): storage, isolation and the quality guard.

The quality guard on the tiny model: the same 500-frame token history is fed teacher-forced
through the model once with the plain (fp32) ring and once with the fp8 ring, and the greedy
text and agent tokens each ring would pick are compared frame by frame. Teacher forcing keeps
one early disagreement from changing every later input, so the number measures the ring's
precision, not the chaos of a random model.
"""

from __future__ import annotations

import pytest
import torch

from services.talker.decode_attention import decode_attention_reference, dequantize_fp8, quantize_fp8
from services.talker.kv_cache import KVCache
from services.talker.model import LMConfig, LMModel

TINY = LMConfig.tiny().replace(context=32)  # small: 500 frames wrap the ring many times


def test_quantize_round_trip_is_close_and_scales_are_per_vector():
    x = torch.randn(3, 4, 5, 64) * torch.logspace(-3, 3, 5)[None, None, :, None]  # very different magnitudes
    q, scale = quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, 4, 5)
    err = (dequantize_fp8(q, scale, torch.float32) - x).norm(dim=-1) / x.norm(dim=-1)
    assert float(err.max()) < 0.05  # e4m3 has a 3-bit mantissa: a few percent per vector at worst


def test_decode_reference_only_reads_valid_entries():
    S, H, C, D = 3, 2, 8, 16
    k, v = torch.randn(S, H, C, D), torch.randn(S, H, C, D)
    q = torch.randn(2, H, D)
    slots, n_valid = torch.tensor([2, 0]), torch.tensor([3, 8])
    out = decode_attention_reference(q, k, v, None, None, slots, n_valid, D ** -0.5)
    k2, v2 = k.clone(), v.clone()
    k2[2, :, 3:], v2[2, :, 3:] = float("nan"), float("nan")  # beyond slot 2's valid entries
    assert torch.equal(decode_attention_reference(q, k2, v2, None, None, slots, n_valid, D ** -0.5), out)


def test_fp8_ring_reset_copy_and_isolation():
    model = LMModel(TINY, dep_steps=8).init_random_(1)
    kv = model.new_kv_cache(3, fp8=True)
    tokens = torch.randint(0, 100, (3, 5, 17), generator=torch.Generator().manual_seed(0))
    model.temporal(model.embed(tokens), kv, kv.all_slots)
    assert kv.k.dtype == torch.float8_e4m3fn and float(kv.k_scale[:, 1].float().abs().sum()) > 0
    other = model.new_kv_cache(3, fp8=True)
    other.copy_slot(kv, 1, 2)
    assert torch.equal(other.k_scale[:, 2], kv.k_scale[:, 1]) and int(other.length[2]) == 5
    kv.reset(1)
    assert int(kv.length[1]) == 0 and float(kv.k_scale[:, 1].float().abs().sum()) == 0
    assert float(kv.k_scale[:, 0].float().abs().sum()) > 0  # other slots untouched


def test_zero_and_tiny_vectors_quantize_to_finite_values():
    """An all-zero key (a padded prefill frame's, in layer 0) must not get a scale that underflows
    fp16 to 0: 0 / 0 would put NaN in the ring, which masked attention then spreads."""
    x = torch.zeros(3, 4, 128)
    x[1] = 1e-7
    x[2] = torch.randn(4, 128, generator=torch.Generator().manual_seed(0)) * 1e-3
    q, scale = quantize_fp8(x)
    back = dequantize_fp8(q, scale, torch.float32)
    assert torch.isfinite(back).all() and not back[0].any()
    assert float((back[2] - x[2]).norm() / x[2].norm()) < 0.05  # small vectors keep their precision


@pytest.mark.parametrize("fp8", [False, True])
def test_a_short_unwrapped_ring_copies_into_a_longer_one(fp8):
    model = LMModel(TINY, dep_steps=8).init_random_(1)
    tokens = torch.randint(0, 100, (1, 5, 17), generator=torch.Generator().manual_seed(0))
    short = model.new_kv_cache(1, context=5, fp8=fp8)
    model.temporal(model.embed(tokens), short, short.all_slots)
    full = model.new_kv_cache(2, fp8=fp8)
    model.temporal(model.embed(tokens), full, full.all_slots[:1])  # the same positions, computed in place
    full.copy_slot(short, 0, 1)
    assert int(full.length[1]) == 5
    for ours, theirs in zip(full._stores(), short._stores()):
        assert torch.equal(ours[:, 1, :, :5], theirs[:, 0]) and not ours[:, 1, :, 5:].float().any()
    # and it is what the slot would hold had it run the positions itself (up to summation order)
    k_copied, k_computed = full.read(full.k.shape[0] - 1, torch.tensor([1, 0]), torch.float32)[0]  # last layer
    assert torch.allclose(k_copied, k_computed, atol=0.05 if fp8 else 1e-5)
    with pytest.raises(ValueError, match="cannot copy"):
        short.copy_slot(full, 0, 0)  # longer into shorter
    with pytest.raises(ValueError, match="cannot copy"):
        model.new_kv_cache(1, fp8=not fp8).copy_slot(short, 0, 0)  # another storage format
    model.temporal(model.embed(tokens[:, :1]), short, short.all_slots)  # 6 positions in a ring of 5: wrapped
    with pytest.raises(ValueError, match="wrapped"):
        full.copy_slot(short, 0, 1)


def greedy_frame(model: LMModel, h: torch.Tensor) -> torch.Tensor:
    text = model.text_logits(h).argmax(-1)
    audio = model.depformer(h, text, lambda cb, logits: logits.argmax(-1), steps=8)
    return torch.cat([text[:, None], audio], dim=1)


def test_fp8_greedy_agreement_over_500_frames():
    model = LMModel(TINY, dep_steps=8).init_random_(2)
    frames, B = 500, 2
    ref_kv, fp8_kv = model.new_kv_cache(B), model.new_kv_cache(B, fp8=True)
    g = torch.Generator().manual_seed(3)
    user = torch.randint(0, TINY.card, (frames, B, 8), generator=g)
    prev = torch.full((B, 9), TINY.card)  # the reference run's own tokens, fed back to both
    prev[:, 0] = TINY.text_card
    agree = total = 0
    with torch.no_grad():
        for t in range(frames):
            tokens = torch.cat([prev, user[t]], dim=1)[:, None]  # [B, 1, 17]
            x = model.embed(tokens)
            ref = greedy_frame(model, model.temporal(x, ref_kv, ref_kv.all_slots)[:, 0])
            got = greedy_frame(model, model.temporal(x, fp8_kv, fp8_kv.all_slots)[:, 0])
            agree += int((ref == got).sum())
            total += ref.numel()
            prev = ref
    rate = agree / total
    print(f"fp8 vs fp32 KV, tiny model, teacher-forced greedy token agreement over {frames} frames: {rate:.4f}")
    assert int(fp8_kv.length[0]) == frames > 10 * TINY.context  # the ring wrapped many times
    assert rate > 0.9, rate


def test_idle_rows_read_one_entry_live_rows_their_valid_part():
    """What the decode kernel is told to read per row: min(p + 1, context) entries, or a single
    one for a row the step marks idle (its output is discarded, its ring costs no bandwidth)."""
    cache = KVCache(1, 3, 1, 8, 4)
    positions = torch.tensor([[0], [5], [20]])
    assert cache.valid_entries(positions).tolist() == [1, 6, 8]
    cache.live_rows = torch.tensor([True, False, True])
    assert cache.valid_entries(positions).tolist() == [1, 1, 8]
