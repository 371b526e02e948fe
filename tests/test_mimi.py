"""Our Mimi on its own: streaming == one-shot, slot isolation, bad inputs, strict loading, key names."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from services.common.checkpoint import CheckpointError
from services.codec.mimi import InvalidFrame, MimiConfig, MimiModel, StreamingDecoder, StreamingEncoder

FRAME = 1920


@pytest.fixture(scope="module", params=["tiny", "tiny-short-context"])
def model(request) -> MimiModel:
    cfg = MimiConfig.tiny()
    if request.param == "tiny-short-context":
        cfg = cfg.with_(context=6)  # one-shot must reproduce the streamed ring window after it wraps
    return MimiModel(cfg).init_random_(seed=5).eval()


@pytest.fixture(scope="module")
def tiny() -> MimiModel:
    return MimiModel(MimiConfig.tiny()).init_random_(seed=0).eval()


def snapshot(streamer, slot: int) -> list[torch.Tensor]:
    return [t[slot].clone() for t in streamer._tensors]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# ---- streaming equals one-shot, per slot, with resets and idle steps ----------------------------

def test_streaming_equals_one_shot(model):
    """Slot s starts a stream at step start[s] and skips the steps in idle[s]; each stream's codes and
    audio must equal the one-shot encode/decode of that stream's own frames."""
    slots, steps = 4, 20
    start = [0, 0, 5, 11]
    idle = {0: set(), 1: {2, 3, 9}, 2: {8}, 3: {12, 13, 14}}
    g = torch.Generator().manual_seed(0)
    enc, dec = StreamingEncoder(model, slots), StreamingDecoder(model, slots)
    pcm_in = {s: [] for s in range(slots)}
    codes_out = {s: [] for s in range(slots)}
    codes_in = {s: [] for s in range(slots)}
    pcm_out = {s: [] for s in range(slots)}
    for t in range(steps):
        for s in range(slots):
            if t == start[s] and t > 0:
                enc.reset(s)
                dec.reset(s)
        active = torch.tensor([t >= start[s] and t not in idle[s] for s in range(slots)])
        pcm = 0.2 * torch.randn(slots, FRAME, generator=g)
        codes = torch.randint(0, 2048, (slots, 8), generator=g)
        c = enc.step(pcm, active)
        y = dec.step(codes, active)
        for s in range(slots):
            if active[s]:
                pcm_in[s].append(pcm[s])
                codes_out[s].append(c[s])
                codes_in[s].append(codes[s])
                pcm_out[s].append(y[s])
    for s in range(slots):
        want_codes = model.encode(torch.cat(pcm_in[s]).view(1, 1, -1))[0]
        assert torch.equal(torch.stack(codes_out[s], dim=1), want_codes), s
        want_pcm = model.decode(torch.stack(codes_in[s], dim=1)[None])[0, 0]
        got = torch.cat(pcm_out[s])
        assert (got - want_pcm).abs().max() < 1e-5, s
        assert want_pcm.abs().max() > 0.05


def test_codes_vary_with_input(tiny):
    g = torch.Generator().manual_seed(1)
    codes = tiny.encode(0.2 * torch.randn(2, 1, 10 * FRAME, generator=g))
    assert codes.shape == (2, 8, 10) and codes.dtype == torch.long
    for k in range(8):
        assert codes[:, k].unique().numel() >= 8, k  # every codebook is in use
    assert not torch.equal(codes[0], codes[1])


def test_init_random_is_deterministic():
    a = MimiModel(MimiConfig.tiny()).init_random_(seed=7).state_dict()
    b = MimiModel.random(MimiConfig.tiny(), seed=7).state_dict()  # from uninitialized memory: init covers all
    c = MimiModel(MimiConfig.tiny()).init_random_(seed=8).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["encoder.model.0.conv.conv.weight"], c["encoder.model.0.conv.conv.weight"])


def test_inactive_slot_state_is_untouched(tiny):
    enc, dec = StreamingEncoder(tiny, 3), StreamingDecoder(tiny, 3)
    g = torch.Generator().manual_seed(2)
    everyone = torch.ones(3, dtype=torch.bool)
    for _ in range(3):  # give every slot non-trivial state
        enc.step(0.2 * torch.randn(3, FRAME, generator=g), everyone)
        dec.step(torch.randint(0, 2048, (3, 8), generator=g), everyone)
    before_enc, before_dec = snapshot(enc, 1), snapshot(dec, 1)
    only_others = torch.tensor([True, False, True])
    enc.step(50 * torch.randn(3, FRAME, generator=g), only_others)
    dec.step(torch.randint(0, 2048, (3, 8), generator=g), only_others)
    assert same(before_enc, snapshot(enc, 1)) and same(before_dec, snapshot(dec, 1))
    assert not same(snapshot(enc, 0), before_enc)  # active slots did move


def test_reset_restores_fresh_state(tiny):
    enc = StreamingEncoder(tiny, 2)
    fresh = snapshot(enc, 0)
    enc.step(0.2 * torch.randn(2, FRAME), torch.ones(2, dtype=torch.bool))
    other = snapshot(enc, 1)
    enc.reset(0)
    assert same(fresh, snapshot(enc, 0)) and same(other, snapshot(enc, 1))
    enc.reset_all()
    assert same(fresh, snapshot(enc, 1))


# ---- bad input: typed errors, nothing changed, other slots keep working ----------------------------

def test_bad_encoder_input(tiny):
    enc = StreamingEncoder(tiny, 2)
    active = torch.ones(2, dtype=torch.bool)
    enc.step(0.1 * torch.randn(2, FRAME), active)
    before = [t.clone() for t in enc._tensors]
    for pcm, act in [
        (torch.zeros(2, FRAME - 1), active),                       # wrong frame length
        (torch.zeros(3, FRAME), active),                           # wrong slot count
        (torch.zeros(2, FRAME, dtype=torch.int16), active),        # not float
        ("audio", active),
        (torch.zeros(2, FRAME), torch.ones(2)),                    # mask not bool
        (torch.zeros(2, FRAME), torch.ones(3, dtype=torch.bool)),  # mask wrong size
    ]:
        with pytest.raises(InvalidFrame):
            enc.step(pcm, act)
    nan = torch.zeros(2, FRAME)
    nan[1, 7] = float("nan")
    with pytest.raises(InvalidFrame) as e:
        enc.step(nan, active)
    assert e.value.slots == [1]
    assert all(torch.equal(a, b) for a, b in zip(before, enc._tensors))
    enc.step(nan, torch.tensor([True, False]))  # the healthy slot alone still steps
    with pytest.raises(IndexError):
        enc.reset(2)


def test_bad_decoder_input(tiny):
    dec = StreamingDecoder(tiny, 2)
    active = torch.ones(2, dtype=torch.bool)
    before = [t.clone() for t in dec._tensors]
    for codes in [torch.zeros(2, 7, dtype=torch.long), torch.zeros(2, 8), torch.zeros(2, 8, dtype=torch.bool)]:
        with pytest.raises(InvalidFrame):
            dec.step(codes, active)
    codes = torch.zeros(2, 8, dtype=torch.long)
    codes[0, 3] = 2048
    with pytest.raises(InvalidFrame) as e:
        dec.step(codes, active)
    assert e.value.slots == [0]
    assert all(torch.equal(a, b) for a, b in zip(before, dec._tensors))
    out = dec.step(codes, torch.tensor([False, True]))
    assert torch.isfinite(out[1]).all()


def test_bad_one_shot_input(tiny):
    for pcm in [torch.zeros(1, 1, FRAME + 1), torch.zeros(1, 2, FRAME), torch.zeros(1, 1, 0), torch.zeros(1, FRAME)]:
        with pytest.raises(InvalidFrame):
            tiny.encode(pcm)
    for codes in [torch.zeros(1, 8, 2), torch.full((1, 8, 2), -1), torch.zeros(1, 4, 2, dtype=torch.long)]:
        with pytest.raises(InvalidFrame):
            tiny.decode(codes)


# ---- loading ---------------------------------------------------------------------------------------

def test_load_roundtrip(tiny, tmp_path):
    path = tmp_path / "mimi.safetensors"
    save_file(tiny.state_dict(), str(path))
    loaded = MimiModel.load(path, MimiConfig.tiny())
    pcm = 0.2 * torch.randn(1, 1, 3 * FRAME)
    assert torch.equal(loaded.encode(pcm), tiny.encode(pcm))


@pytest.mark.parametrize("change, key", [
    ("missing", "decoder_transformer.transformer.layers.1.self_attn.in_proj_weight"),
    ("unexpected", "encoder.model.99.conv.conv.weight"),
    ("misshaped", "quantizer.rvq_rest.vq.layers.3._codebook.embedding_sum"),
])
def test_load_is_strict(tiny, tmp_path, change, key):
    state = dict(tiny.state_dict())
    if change == "missing":
        del state[key]
    elif change == "unexpected":
        state[key] = torch.zeros(1)
    else:
        state[key] = torch.zeros(3, 3)
    path = tmp_path / "mimi.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")):
        MimiModel.load(path, MimiConfig.tiny())


def test_load_bad_files(tmp_path):
    with pytest.raises(CheckpointError):
        MimiModel.load(tmp_path / "absent.safetensors", MimiConfig.tiny())
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError):
        MimiModel.load(junk, MimiConfig.tiny())


def test_load_moshi_memory_names(tiny, tmp_path):
    """A file saved from moshi's in-memory state_dict (`in_projs.0.weight`) loads too."""
    from moshi.models import loaders

    from tests.test_mimi_parity import moshi_mimi_config

    ref = loaders.get_mimi(None, mimi_config=moshi_mimi_config(tiny.cfg))
    ref.load_state_dict(tiny.state_dict())
    assert any(".in_projs.0." in k for k in ref.state_dict())
    path = tmp_path / "moshi.safetensors"
    save_file(ref.state_dict(), str(path))
    loaded = MimiModel.load(path, MimiConfig.tiny())
    assert all(torch.equal(v, tiny.state_dict()[k]) for k, v in loaded.state_dict().items())


# ---- key names -------------------------------------------------------------------------------------

def test_full_keys_and_shapes_match_moshi():
    """The full config's state_dict has exactly the published Mimi names and shapes (all 32 codebooks)."""
    from moshi.models import loaders

    from services.codec.mimi.model import published_names

    with torch.device("meta"):
        ref = loaders.get_mimi(None, device="meta")
        ours = MimiModel(MimiConfig.full())
    want = {k: tuple(v.shape) for k, v in published_names(ref.state_dict()).items()}
    got = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert got == want
    assert "encoder_transformer.transformer.layers.7.self_attn.in_proj_weight" in got
    assert "quantizer.rvq_rest.vq.layers.30._codebook.embedding_sum" in got
    assert sum(v.numel() for v in ours.parameters()) > 70_000_000


def test_config_roundtrip():
    for cfg in (MimiConfig.tiny(), MimiConfig.full()):
        assert MimiConfig.from_dict(cfg.to_dict()) == cfg
    assert MimiConfig.tiny().frame_size == FRAME and MimiConfig.tiny().hop_length == 960
    with pytest.raises(ValueError):
        MimiConfig.from_dict({"n_filters": 4, "bogus": 1})
    with pytest.raises(ValueError):
        MimiConfig(num_codebooks=33)


def test_weights_loaded_after_use_take_effect():
    """The quantizer caches centroids; a later load_state_dict must invalidate that cache."""
    a = MimiModel(MimiConfig.tiny()).init_random_(seed=11)
    b = MimiModel(MimiConfig.tiny()).init_random_(seed=12)
    pcm = 0.2 * torch.randn(1, 1, 4 * FRAME)
    a.encode(pcm)
    a.load_state_dict(b.state_dict())
    assert torch.equal(a.encode(pcm), b.encode(pcm))


def test_bf16_load_streams(tiny, tmp_path):
    """A bf16 model (quantizer kept in fp32) streams, gives float32 audio and mostly the fp32 codes."""
    path = tmp_path / "mimi.safetensors"
    save_file(tiny.state_dict(), str(path))
    half = MimiModel.load(path, MimiConfig.tiny(), dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16 and half.quantizer.rvq_first.input_proj.weight.dtype == torch.float32
    enc, dec = StreamingEncoder(half, 2), StreamingDecoder(half, 2)
    active = torch.ones(2, dtype=torch.bool)
    pcm = 0.2 * torch.randn(2, 1, 4 * FRAME, generator=torch.Generator().manual_seed(3))
    codes = torch.stack([enc.step(pcm[:, 0, i * FRAME:(i + 1) * FRAME], active) for i in range(4)], dim=-1)
    assert (codes == tiny.encode(pcm)).float().mean() > 0.75
    out = dec.step(codes[..., 0], active)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_loads_the_embedded_tiny_checkpoint(tiny_checkpoint):
    from services.common.checkpoint import CheckpointPaths

    paths = CheckpointPaths.open(tiny_checkpoint, require=("mimi",))
    cfg = MimiConfig.from_dict(paths.serve_config()["mimi"])
    model = MimiModel.load(paths.mimi, cfg)
    pcm = 0.2 * torch.randn(1, 1, 2 * FRAME, generator=torch.Generator().manual_seed(9))
    codes = model.encode(pcm)
    assert codes.shape == (1, cfg.num_codebooks, 2)
    assert model.decode(codes).shape == (1, 1, 2 * FRAME)
