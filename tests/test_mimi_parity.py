"""Our Mimi against the reference implementation, moshi 0.2.13 (test-only import).

Both load the same random weights. Several slots stream in one batch, with slots reset at
different steps and some slots inactive (fed garbage) at some steps; the reference is one
independent moshi streaming instance per stream, restarted when its slot is reset.
"""

from __future__ import annotations

import copy

import pytest
import torch
from moshi.models import loaders

from services.codec.mimi import MimiConfig, MimiModel, StreamingDecoder, StreamingEncoder

STEPS = 24
SLOTS = 3
RESET_AT = {1: 9, 2: 15}  # slot -> step at which a new stream starts in it (slot 0 never resets)
INACTIVE = {(1, 3), (1, 4), (2, 7), (2, 20), (0, 12)}  # (slot, step) pairs with no frame


def moshi_mimi_config(cfg: MimiConfig) -> dict:
    """The published moshi config dict with `cfg`'s shapes written in."""
    c = copy.deepcopy(loaders._mimi_config)
    c["seanet"].update(
        dimension=cfg.dimension, n_filters=cfg.n_filters, ratios=list(cfg.ratios),
        n_residual_layers=cfg.n_residual_layers, kernel_size=cfg.kernel_size,
        residual_kernel_size=cfg.residual_kernel_size, last_kernel_size=cfg.last_kernel_size,
        dilation_base=cfg.dilation_base, compress=cfg.compress,
    )
    c["transformer"].update(
        d_model=cfg.dimension, num_heads=cfg.num_heads, num_layers=cfg.num_layers,
        dim_feedforward=cfg.dim_feedforward, context=cfg.context, max_period=cfg.max_period,
        layer_scale=cfg.layer_scale, input_dimension=cfg.dimension, output_dimensions=[cfg.dimension],
    )
    c["quantizer"].update(
        dimension=cfg.quantizer_dimension, n_q=cfg.n_q, bins=cfg.bins,
        input_dimension=cfg.dimension, output_dimension=cfg.dimension,
    )
    return c


def test_full_config_is_the_published_config():
    assert moshi_mimi_config(MimiConfig.full()) == loaders._mimi_config


def moshi_instance(cfg: MimiConfig, state: dict) -> torch.nn.Module:
    m = loaders.get_mimi(None, mimi_config=moshi_mimi_config(cfg), num_codebooks=cfg.num_codebooks)
    m.load_state_dict(state)  # moshi's load hook maps the published fused attention names
    m.streaming_forever(1)
    return m


def restart(m: torch.nn.Module) -> None:
    m._stop_streaming()
    m.streaming_forever(1)


def schedule():
    """(step, active mask, slots that start a new stream before this step)."""
    for t in range(STEPS):
        starts = [s for s, r in RESET_AT.items() if r == t]
        active = torch.tensor([(s, t) not in INACTIVE for s in range(SLOTS)])
        yield t, active, starts


@pytest.fixture(scope="module", params=["tiny", "tiny-short-context"])
def models(request):
    cfg = MimiConfig.tiny()
    if request.param == "tiny-short-context":
        cfg = cfg.with_(context=6)  # the KV ring wraps many times within the test
    ours = MimiModel(cfg).init_random_(seed=3).eval()
    return cfg, ours, ours.state_dict()


def _audio(g: torch.Generator, n: int) -> torch.Tensor:
    t = torch.arange(n) / 24000
    f = 100 + 900 * torch.rand(1, generator=g)
    return 0.3 * torch.sin(2 * torch.pi * f * t) + 0.05 * torch.randn(n, generator=g)


def test_streaming_encoder_matches_moshi(models):
    cfg, ours, state = models
    refs = [moshi_instance(cfg, state) for _ in range(SLOTS)]
    enc = StreamingEncoder(ours, SLOTS)
    g = torch.Generator().manual_seed(1)
    compared = 0
    with torch.no_grad():
        for t, active, starts in schedule():
            for s in starts:
                enc.reset(s)
                restart(refs[s])
            pcm = torch.stack([_audio(g, cfg.frame_size) for _ in range(SLOTS)])
            pcm[~active] = 100 * torch.randn(int((~active).sum()), cfg.frame_size, generator=g)  # garbage
            codes = enc.step(pcm, active)
            for s in range(SLOTS):
                if active[s]:
                    want = refs[s].encode(pcm[s].view(1, 1, -1))[0, :, 0]
                    assert torch.equal(codes[s], want), (t, s, codes[s], want)
                    compared += 1
    assert compared == SLOTS * STEPS - len(INACTIVE)


def test_streaming_decoder_matches_moshi(models):
    cfg, ours, state = models
    refs = [moshi_instance(cfg, state) for _ in range(SLOTS)]
    dec = StreamingDecoder(ours, SLOTS)
    g = torch.Generator().manual_seed(2)
    worst = 0.0
    level = []
    with torch.no_grad():
        for t, active, starts in schedule():
            for s in starts:
                dec.reset(s)
                restart(refs[s])
            codes = torch.randint(0, cfg.bins, (SLOTS, cfg.num_codebooks), generator=g)
            codes[~active] = -7  # garbage in inactive rows must be ignored
            pcm = dec.step(codes, active)
            for s in range(SLOTS):
                if active[s]:
                    want = refs[s].decode(codes[s].view(1, -1, 1))[0, 0]
                    worst = max(worst, (pcm[s] - want).abs().max().item())
                    level.append(want.abs().max().item())
    assert max(level) > 0.05  # the comparison is over real signal, not silence
    assert worst < 1e-4, worst


def test_full_size_matches_moshi():
    """The published shapes (SEANet 64 filters, 8 layers of d512 / 8 heads, 32 codebooks), a few frames:
    catches anything the tiny shapes cannot (head split, real strides and widths)."""
    cfg = MimiConfig.full()
    ours = MimiModel.random(cfg, seed=0)
    ref = loaders.get_mimi(None)
    ref.load_state_dict(ours.state_dict())
    ref.streaming_forever(1)
    enc, dec = StreamingEncoder(ours, 2), StreamingDecoder(ours, 2)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for t in range(3):
            active = torch.tensor([True, t != 1])  # slot 1 idles once; slot 0 is compared
            pcm = torch.stack([_audio(g, cfg.frame_size) for _ in range(2)])
            codes = enc.step(pcm, active)
            want = ref.encode(pcm[:1].view(1, 1, -1))[0, :, 0]
            assert torch.equal(codes[0], want), t
            out = dec.step(codes, active)
            want_pcm = ref.decode(want.view(1, -1, 1))[0, 0]
            assert (out[0] - want_pcm).abs().max() < 1e-4
            assert want_pcm.abs().max() > 0.05
