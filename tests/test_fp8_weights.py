"""fp8 temporal weights (services/talker/fp8_weights.py): the arithmetic, the swap, quality on the
tiny model, and that a session's output still depends on nothing but its own inputs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional as F

from services.talker.fp8_weights import Fp8Linear, quantize_rows
from services.talker.model import LMConfig, LMModel
from tests.test_fp8_kv import greedy_frame  # the same greedy frame as the fp8 KV guard

TINY = LMConfig.tiny()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_fp8_linear_is_the_scaled_product_of_the_quantized_operands():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g) * torch.linspace(0.01, 3.0, 48)[:, None]  # rows of different range
    x = torch.randn(5, 7, 64, generator=g)
    lin = Fp8Linear(w)
    assert lin.weight.dtype == torch.float8_e4m3fn and lin.scale.shape == (1, 48)
    xq, sx = quantize_rows(x.reshape(-1, 64))
    expected = (xq.float() * sx) @ lin.dequantized().t()
    y = lin(x)
    assert y.shape == (5, 7, 48)
    assert torch.allclose(y.reshape(-1, 48), expected, rtol=1e-5, atol=1e-5)
    # and close to the full-precision product: e4m3 has a 3-bit mantissa, a few % per element
    assert rel(y, F.linear(x, w)) < 0.06
    # per-row scales: every row of the weight keeps its relative precision, small rows included
    assert rel(lin.dequantized()[0], w[0]) < 0.05 and rel(lin.dequantized()[-1], w[-1]) < 0.05


def test_a_row_of_zeros_stays_zero_and_rows_are_independent():
    lin = Fp8Linear(torch.randn(16, 32, generator=torch.Generator().manual_seed(1)))
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(2))
    x[1] = 0
    y = lin(x)
    assert not y[1].any() and torch.isfinite(y).all()
    # a row's result does not depend on the other rows (per-row activation scales): batch-independent
    x2 = x.clone()
    x2[2] *= 1000
    assert torch.equal(lin(x2)[0], y[0])


def test_quantize_swaps_the_temporal_matrices_only_and_is_idempotent():
    model = LMModel(TINY, dep_steps=8).init_random_(0)
    before = {n: p.clone() for n, p in model.named_parameters()}
    saved = model.quantize_weights_fp8_()
    layer = model.transformer.layers[0]
    assert isinstance(layer.self_attn.in_proj_weight, Fp8Linear) and isinstance(layer.self_attn.out_proj, Fp8Linear)
    assert isinstance(layer.gating.linear_in, Fp8Linear) and isinstance(layer.gating.linear_out, Fp8Linear)
    d, h = TINY.dim, TINY.hidden
    per_layer = 3 * d * d + d * d + 2 * h * d + h * d
    assert saved == TINY.num_layers * (per_layer * 3 - (3 * d + d + 2 * h + d) * 4)  # fp32: 4 bytes -> 1 + scales
    assert model.quantize_weights_fp8_() == 0
    left = dict(model.named_parameters())
    assert not any(".self_attn." in n or ".gating." in n for n in left if n.startswith("transformer."))
    for n, p in left.items():  # everything else is untouched
        assert torch.equal(p, before[n]), n


def test_fp8_weights_greedy_agreement_over_500_frames():
    """Teacher-forced on the reference's own tokens, like the fp8 KV guard in test_fp8_kv.py."""
    ref_model = LMModel(TINY, dep_steps=8).init_random_(2)
    fp8_model = copy.deepcopy(ref_model)
    fp8_model.quantize_weights_fp8_()
    frames, B = 500, 2
    ref_kv, fp8_kv = ref_model.new_kv_cache(B), fp8_model.new_kv_cache(B, fp8=True)  # both shortcuts together
    user = torch.randint(0, TINY.card, (frames, B, 8), generator=torch.Generator().manual_seed(3))
    prev = torch.full((B, 9), TINY.card)
    prev[:, 0] = TINY.text_card
    agree = total = text_agree = 0
    logit_errs = []
    with torch.no_grad():
        for t in range(frames):
            tokens = torch.cat([prev, user[t]], dim=1)[:, None]
            h_ref = ref_model.temporal(ref_model.embed(tokens), ref_kv, ref_kv.all_slots)[:, 0]
            h_fp8 = fp8_model.temporal(fp8_model.embed(tokens), fp8_kv, fp8_kv.all_slots)[:, 0]
            logit_errs.append(rel(fp8_model.text_logits(h_fp8), ref_model.text_logits(h_ref)))
            ref, got = greedy_frame(ref_model, h_ref), greedy_frame(fp8_model, h_fp8)
            agree += int((ref == got).sum())
            text_agree += int((ref[:, 0] == got[:, 0]).sum())
            total += ref.numel()
            prev = ref
    rate, text_rate = agree / total, text_agree / (frames * B)
    print(f"fp8 weights + fp8 KV vs fp32, tiny model, greedy agreement over {frames} frames: {rate:.4f} "
          f"(text {text_rate:.4f}), text logits rel err mean {sum(logit_errs) / len(logit_errs):.4f}")
    # Random tiny weights give flat logits, where argmax flips on small errors: measured 0.906 overall
    # (text 0.978; the audio codes, 2048-way argmaxes of the depformer, flip most), 1.3% logits error.
    assert text_rate > 0.95 and rate > 0.85, (text_rate, rate)
    assert sum(logit_errs) / len(logit_errs) < 0.05


@pytest.fixture(scope="module")
def paths(tiny_checkpoint):
    from services.common.checkpoint import CheckpointPaths

    return CheckpointPaths.open(tiny_checkpoint)


def test_engine_with_fp8_weights_serves_a_session_independent_of_others(paths):
    from services.talker.engine import SamplingParams, TalkerEngine

    def session(eng, slot, frames):
        job = eng.begin(slot, "NATF2.pt", "You are kind.", SamplingParams(seed=7))
        while not job.run(8):
            pass
        out = []
        g = torch.Generator().manual_seed(5)
        for f in frames:
            codes = torch.randint(0, 2048, (eng.num_slots, 8), generator=g)  # other slots: noise
            codes[slot] = f
            active = torch.ones(eng.num_slots, dtype=torch.bool) if eng.num_slots > 1 else torch.tensor([True])
            for s in range(eng.num_slots):
                active[s] = s == slot or eng.is_live(s)
            r = eng.step(codes, active)
            out.append((int(r.text_tokens[slot]), r.agent_codes[slot].tolist()) if r.has_output[slot] else None)
        return out

    frames = torch.randint(0, 2048, (12, 8), generator=torch.Generator().manual_seed(4))
    alone = TalkerEngine.from_checkpoint(paths, slots=1, weights_fp8=True)
    assert isinstance(alone.model.transformer.layers[0].gating.linear_in, Fp8Linear)
    busy = TalkerEngine.from_checkpoint(paths, slots=3, weights_fp8=True)
    for s in (0, 2):  # two other live sessions with their own prompts and inputs
        job = busy.begin(s, "VARF0.pt", "Be brief.", SamplingParams(seed=s + 1))
        while not job.run(8):
            pass
    expected = session(alone, 0, frames)
    assert any(o is not None for o in expected)
    assert session(busy, 1, frames) == expected
