"""The Talker LM (services/talker/model.py) against the reference implementation, moshi 0.2.13.

moshi is a test-only numerical reference: both models get the same random weights through
the published (fused) key names, then are run frame by frame and compared.
"""

from __future__ import annotations

import os

os.environ.setdefault("NO_TORCH_COMPILE", "1")  # moshi would torch.compile its kernels on CPU

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from services.common.checkpoint import CheckpointError
from services.talker.model import LMConfig, LMModel

# moshi is the test-only reference; `make test` installs it, so a missing one fails here rather than skipping parity.
from moshi.utils.compile import no_compile

from tools.moshi_reference import moshi_lm_model

TINY = LMConfig.tiny()


@pytest.fixture(autouse=True)
def _moshi_eager():
    """Keep moshi eager even if another module imported it before NO_TORCH_COMPILE was set."""
    with no_compile():
        yield


def moshi_model(cfg: LMConfig, state: dict, dtype: torch.dtype):
    return moshi_lm_model(cfg, state, dtype)


def random_tokens(cfg: LMConfig, B: int, T: int, seed: int) -> torch.Tensor:
    """[B, T, 17] ids over the whole input range: -1 (no input), normal ids and the initial ids."""
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(-1, cfg.text_card + 1, (B, T, 1), generator=g)
    audio = torch.randint(-1, cfg.card + 1, (B, T, cfg.n_q), generator=g)
    return torch.cat([text, audio], dim=-1)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def step_all(model: LMModel, kv, tokens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Run tokens [B, T, 17] one frame at a time; returns h [B, T, dim]."""
    return torch.cat([model.temporal(model.embed(tokens[:, t : t + 1]), kv, slots) for t in range(tokens.shape[1])], 1)


# ----------------------------------------------------------------------------- 1. parity with moshi


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_matches_moshi_frame_by_frame(dtype, tol):
    ours = LMModel(TINY, dep_steps=16).init_random_(0).to(dtype)
    ref = moshi_model(TINY, ours.state_dict(), dtype)
    B, N = 2, 6
    tokens = random_tokens(TINY, B, N, seed=1)
    kv = ours.new_kv_cache(B)
    slots = torch.arange(B)
    worst = {"h": 0.0, "text": 0.0, "dep": 0.0}
    with torch.no_grad(), ref.streaming(B):
        for t in range(N):
            ref_h, ref_text = ref.forward_text(tokens[:, t : t + 1].transpose(1, 2))
            h = ours.temporal(ours.embed(tokens[:, t : t + 1]), kv, slots)
            text = ours.text_logits(h)
            worst["h"] = max(worst["h"], rel_err(h, ref_h))
            worst["text"] = max(worst["text"], rel_err(text, ref_text[:, 0]))
            # depformer, teacher-forced with the reference's greedy tokens so both see the same inputs
            prev = ref_text[:, 0, 0].float().argmax(-1)
            dep_kv = ours.new_depformer_cache(B)
            with ref.depformer.streaming(B):
                for cb in range(TINY.dep_q):
                    ref_logits = ref.forward_depformer(cb, prev[:, None, None], ref_h)[:, 0, 0]
                    logits = ours.depformer_step_logits(cb, h[:, 0], prev, dep_kv)
                    worst["dep"] = max(worst["dep"], rel_err(logits, ref_logits))
                    prev = ref_logits.float().argmax(-1)
    assert all(v < tol for v in worst.values()), worst
    assert h.dtype == dtype and kv.k.dtype == dtype


def test_rms_norm_matches_moshi_where_eps_matters():
    from moshi.modules.transformer import create_norm_fn

    from services.talker.layers import RMSNorm

    ref = create_norm_fn("rms_norm_f32", 16)
    ours = RMSNorm(16, TINY.norm_eps)
    with torch.no_grad():
        ref.alpha.copy_(torch.linspace(0.5, 1.5, 16).view(1, 1, 16))
        ours.alpha.copy_(ref.alpha)
        x = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(0)) * 1e-4  # variance ~ eps
        assert torch.equal(ours(x), ref(x))
        assert torch.equal(ours(x.bfloat16()), ref(x.bfloat16()))


def test_greedy_generation_matches_moshi_lmgen():
    """End to end through moshi's own LMGen (greedy, its own delays and token cache): given the
    inputs LMGen feeds its transformer each frame, we pick the same text and audio tokens."""
    from moshi.models.lm import LMGen

    ours = LMModel(TINY, dep_steps=16).init_random_(3)
    ref = moshi_model(TINY, ours.state_dict(), torch.float32)
    gen = LMGen(ref, use_sampling=False)
    seen: list[torch.Tensor] = []
    forward_text = ref.forward_text  # record what LMGen feeds (it binds forward_text when streaming starts)
    ref.forward_text = lambda seq, *a, **k: (seen.append(seq.clone()), forward_text(seq, *a, **k))[1]
    B, N = 2, 5
    greedy = lambda cb, logits: logits.argmax(-1)  # noqa: E731
    kv = ours.new_kv_cache(B)
    no_user_input = torch.zeros(B, 0, 1, dtype=torch.long)  # with dep_q 16, moshi generates all 16 streams
    with torch.no_grad(), gen.streaming(B):
        for _ in range(N):
            gen.step(no_user_input)
            h = ours.temporal(ours.embed(seen[-1].transpose(1, 2)), kv, torch.arange(B))[:, 0]
            text = ours.text_logits(h).argmax(-1)
            audio = ours.depformer(h, text, greedy)
            state = gen._streaming_state  # LMGen wrote this frame's tokens at offsets % cache length
            pos = int(state.offsets[0]) % state.cache.shape[2]
            assert torch.equal(state.cache[:, 0, pos], text)
            assert torch.equal(state.cache[:, 1 : TINY.dep_q + 1, pos], audio)
    assert len(seen) == N


# ----------------------------------------------------------------------------- 2. 8 vs 16 depformer steps


def test_eight_step_depformer_gives_the_same_agent_tokens(tmp_path):
    full = LMModel(TINY, dep_steps=16).init_random_(5)
    save_file(full.state_dict(), str(tmp_path / "model.safetensors"))
    m16 = LMModel.load(tmp_path, TINY, dep_steps=16)
    m8 = LMModel.load(tmp_path, TINY, dep_steps=8)
    assert m8.depformer_in[7].weight.equal(full.depformer_in[7].weight) and len(m8.linears) == 8
    inited8 = LMModel(TINY, dep_steps=8).init_random_(5).state_dict()  # a prefix of the full init
    assert inited8.keys() == m8.state_dict().keys()
    assert all(torch.equal(v, m8.state_dict()[k]) for k, v in inited8.items())
    B, N = 4, 4
    tokens = random_tokens(TINY, B, N, seed=6)
    kv16, kv8 = m16.new_kv_cache(B), m8.new_kv_cache(B)
    greedy = lambda cb, logits: logits.argmax(-1)  # noqa: E731
    for t in range(N):
        h16 = m16.temporal(m16.embed(tokens[:, t : t + 1]), kv16, torch.arange(B))[:, 0]
        h8 = m8.temporal(m8.embed(tokens[:, t : t + 1]), kv8, torch.arange(B))[:, 0]
        assert torch.equal(h16, h8)
        text = m16.text_logits(h16).argmax(-1)
        a16 = m16.depformer(h16, text, greedy)
        a8 = m8.depformer(h8, text, greedy)
        assert a16.shape == (B, 16) and a8.shape == (B, 8)
        assert torch.equal(a16[:, :8], a8)


# ----------------------------------------------------------------------------- 3. ring wrap / sliding window


def test_ring_wraps_like_moshi_sliding_window():
    cfg = TINY.replace(context=8)
    ours = LMModel(cfg).init_random_(7)
    ref = moshi_model(cfg, ours.state_dict(), torch.float32)
    B, N = 2, 27  # more than three times around the ring
    tokens = random_tokens(cfg, B, N, seed=8)
    kv = ours.new_kv_cache(B)
    h = step_all(ours, kv, tokens, torch.arange(B))
    assert kv.length.tolist() == [N, N]
    with torch.no_grad():
        with ref.streaming(B):  # moshi streaming: its own ring of `context` entries
            ref_stream = torch.cat([ref.forward_text(tokens[:, t : t + 1].transpose(1, 2))[0] for t in range(N)], 1)
        ref_full, _ = ref.forward_text(tokens.transpose(1, 2))  # from scratch: whole sequence, banded mask
    assert rel_err(h, ref_stream) < 1e-5
    assert rel_err(h, ref_full) < 1e-5
    prefilled = ours.temporal(ours.embed(tokens), ours.new_kv_cache(B), torch.arange(B))  # one T=27 chunk
    assert rel_err(prefilled, ref_full) < 1e-5


def test_window_is_exactly_the_last_context_positions():
    """One layer: the output at p depends on inputs p-C+1..p only, and equals a from-scratch
    recomputation over just those C frames (RoPE is relative, so positions can restart at 0)."""
    C = 8
    cfg = TINY.replace(context=C, num_layers=1)
    model = LMModel(cfg).init_random_(9)
    N = 20
    base = random_tokens(cfg, 1, N, seed=10)
    h = step_all(model, model.new_kv_cache(1), base, torch.tensor([0]))
    for p in (C - 1, C, 13, N - 1):
        window = base[:, p - C + 1 : p + 1]
        scratch = model.temporal(model.embed(window), model.new_kv_cache(1), torch.tensor([0]))
        assert rel_err(h[:, p], scratch[:, -1]) < 1e-5, p
    p = 15
    outside, inside = base.clone(), base.clone()
    outside[:, p - C] = (outside[:, p - C] + 1) % cfg.card  # just left of the window
    inside[:, p - C + 1] = (inside[:, p - C + 1] + 1) % cfg.card  # its oldest frame
    h_out = step_all(model, model.new_kv_cache(1), outside, torch.tensor([0]))
    h_in = step_all(model, model.new_kv_cache(1), inside, torch.tensor([0]))
    assert torch.equal(h_out[:, p], h[:, p])
    assert not torch.allclose(h_in[:, p], h[:, p], atol=1e-4)


# ----------------------------------------------------------------------------- 4. prefill and slots


def test_parallel_prefill_equals_single_steps():
    cfg = TINY.replace(context=8)
    model = LMModel(cfg).init_random_(11)
    chunks = [3, 5, 11, 1, 4, 8]  # crosses the ring boundary, one chunk longer than the ring
    tokens = random_tokens(cfg, 1, sum(chunks), seed=12)
    kv_step, kv_par = model.new_kv_cache(2), model.new_kv_cache(2)
    slot = torch.tensor([1])
    h_step = step_all(model, kv_step, tokens, slot)
    outs, t = [], 0
    for n in chunks:
        outs.append(model.temporal(model.embed(tokens[:, t : t + n]), kv_par, slot))
        t += n
    h_par = torch.cat(outs, 1)
    assert rel_err(h_par, h_step) < 1e-5
    assert kv_par.length.tolist() == kv_step.length.tolist() == [0, sum(chunks)]
    torch.testing.assert_close(kv_par.k, kv_step.k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv_par.v, kv_step.v, rtol=1e-5, atol=1e-5)
    assert not kv_par.k[:, 0].any()  # the other slot was never touched


@pytest.mark.parametrize("fp8", [False, True])
def test_a_prefill_reading_only_its_window_equals_one_reading_the_whole_ring(fp8):
    """A young slot's history lies in ring indices 0..start-1: a chunk that reads only a window
    holding them (exactly start, or more) gives what reading all of the ring gives, and so does the
    ring it leaves. A window the cache cannot have is refused."""
    cfg = TINY.replace(context=16)
    model = LMModel(cfg).init_random_(21)
    chunks = [5, 3, 4]
    tokens = random_tokens(cfg, 1, sum(chunks), seed=22)
    slot = torch.tensor([1])
    results = {}
    for how in ("all", "exact", "wider"):
        kv = model.new_kv_cache(2, fp8=fp8)
        outs, t = [], 0
        for n in chunks:
            window = {"all": None, "exact": t, "wider": min(t + 6, cfg.context)}[how]
            outs.append(model.temporal(model.embed(tokens[:, t : t + n]), kv, slot, window))
            t += n
        results[how] = (torch.cat(outs, 1), kv)
    h_all, kv_all = results["all"]
    for how in ("exact", "wider"):
        h, kv = results[how]
        assert rel_err(h, h_all) < 1e-5, how
        assert torch.equal(kv.length, kv_all.length)
        torch.testing.assert_close(kv.k.float(), kv_all.k.float(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kv.v.float(), kv_all.v.float(), rtol=1e-5, atol=1e-5)
    assert rel_err(h_all, step_all(model, model.new_kv_cache(2, fp8=fp8), tokens, slot)) < (0.1 if fp8 else 1e-5)
    kv = model.new_kv_cache(2, fp8=fp8)
    for bad in (-1, cfg.context + 1):
        with pytest.raises(ValueError, match="window"):
            model.temporal(model.embed(tokens[:, :4]), kv, slot, bad)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(context=st.sampled_from([1, 3, 8]), chunks=st.lists(st.integers(1, 10), min_size=1, max_size=3),
       start=st.integers(0, 9))
def test_any_chunking_equals_single_steps(context, chunks, start):
    """Property: after `start` single steps, any split of the next frames into chunks gives the
    same outputs and ring as stepping them one at a time."""
    cfg = TINY.replace(context=context, num_layers=1)
    model = _small_model(cfg)
    tokens = random_tokens(cfg, 1, start + sum(chunks), seed=context * 100 + start)
    kv_step, kv_par = model.new_kv_cache(1), model.new_kv_cache(1)
    h_step = step_all(model, kv_step, tokens, kv_step.all_slots)
    if start:
        step_all(model, kv_par, tokens[:, :start], kv_par.all_slots)
    outs, t = [], start
    for n in chunks:
        outs.append(model.temporal(model.embed(tokens[:, t : t + n]), kv_par, torch.tensor([0])))
        t += n
    assert rel_err(torch.cat(outs, 1), h_step[:, start:]) < 1e-5
    assert torch.equal(kv_par.length, kv_step.length)
    torch.testing.assert_close(kv_par.k, kv_step.k, rtol=1e-5, atol=1e-5)


_models: dict = {}


def _small_model(cfg: LMConfig) -> LMModel:
    if cfg not in _models:
        _models[cfg] = LMModel(cfg).init_random_(17)
    return _models[cfg]


def test_slots_are_independent():
    cfg = TINY.replace(context=8)
    model = LMModel(cfg).init_random_(13)
    lengths = [2, 7, 13]
    hist = [random_tokens(cfg, 1, n, seed=20 + i) for i, n in enumerate(lengths)]
    new = random_tokens(cfg, 2, 3, seed=30)
    kv = model.new_kv_cache(3)
    for i, tok in enumerate(hist):
        model.temporal(model.embed(tok), kv, torch.tensor([i]))
    untouched = kv.k[:, 1].clone(), kv.v[:, 1].clone()
    batched = model.temporal(model.embed(new), kv, torch.tensor([2, 0]))  # a subset, out of order
    assert kv.length.tolist() == [5, 7, 16]
    assert torch.equal(kv.k[:, 1], untouched[0]) and torch.equal(kv.v[:, 1], untouched[1])
    for row, slot in enumerate([2, 0]):
        alone = model.new_kv_cache(1)
        model.temporal(model.embed(hist[slot]), alone, torch.tensor([0]))
        expect = model.temporal(model.embed(new[row : row + 1]), alone, torch.tensor([0]))
        assert rel_err(batched[row : row + 1], expect) < 1e-5
        torch.testing.assert_close(kv.k[:, slot], alone.k[:, 0], rtol=1e-5, atol=1e-5)
    # the all-slots fast path (no host-side check) is the same computation
    twin = model.new_kv_cache(3)
    for i, tok in enumerate(hist):
        model.temporal(model.embed(tok), twin, torch.tensor([i]))
    three = random_tokens(cfg, 3, 1, seed=31)
    fast = model.temporal(model.embed(three, check=False), twin, twin.all_slots)
    alone = model.new_kv_cache(1)
    model.temporal(model.embed(hist[2]), alone, torch.tensor([0]))
    assert rel_err(fast[2:], model.temporal(model.embed(three[2:]), alone, torch.tensor([0]))) < 1e-5
    # a reset slot behaves like a fresh one
    kv.reset(2)
    assert kv.length.tolist() == [5, 7, 0] and not kv.k[:, 2].any()
    again = model.temporal(model.embed(new[:1]), kv, torch.tensor([2]))
    fresh = model.temporal(model.embed(new[:1]), model.new_kv_cache(1), torch.tensor([0]))
    assert rel_err(again, fresh) < 1e-6


def test_bad_inputs_are_refused_and_leave_the_cache_alone():
    model = LMModel(TINY).init_random_(0)
    kv = model.new_kv_cache(2)
    model.temporal(model.embed(random_tokens(TINY, 1, 2, seed=0)), kv, torch.tensor([0]))
    before = kv.k.clone(), kv.length.clone()
    x = model.embed(random_tokens(TINY, 2, 1, seed=1))
    with pytest.raises(ValueError, match="distinct"):
        model.temporal(x, kv, torch.tensor([1, 1]))
    with pytest.raises(IndexError):
        model.temporal(x, kv, torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="rows"):
        model.temporal(x, kv, torch.tensor([0]))
    with pytest.raises(ValueError):
        model.temporal(x[..., :10], kv, torch.tensor([0, 1]))
    bad = random_tokens(TINY, 1, 1, seed=2)
    bad[0, 0, 3] = TINY.card + 1
    with pytest.raises(ValueError, match="token ids"):
        model.embed(bad)
    with pytest.raises(ValueError):
        model.embed(bad[..., :5])
    with pytest.raises(IndexError):
        kv.reset(2)
    assert torch.equal(kv.k, before[0]) and torch.equal(kv.length, before[1])
    with pytest.raises(ValueError):
        model.depformer_step_logits(16, torch.zeros(1, TINY.dim), torch.zeros(1, dtype=torch.long),
                                    model.new_depformer_cache(1))
    with pytest.raises(ValueError, match="batch"):
        model.depformer_step_logits(0, torch.zeros(2, TINY.dim), torch.zeros(2, dtype=torch.long),
                                    model.new_depformer_cache(1))
    with pytest.raises(ValueError, match="not made for this model"):
        model.temporal(x, LMModel(TINY.replace(num_layers=1)).new_kv_cache(2), torch.tensor([0, 1]))
    with pytest.raises(ValueError):
        LMModel(TINY, dep_steps=17)


def test_embedding_of_minus_one_is_zero():
    model = LMModel(TINY).init_random_(0)
    tokens = torch.full((1, 2, 17), -1)
    assert not model.embed(tokens).any()
    tokens[0, 1, 5] = 7
    torch.testing.assert_close(model.embed(tokens)[0, 1], model.emb[4].weight[7])


# ----------------------------------------------------------------------------- 5. strict loading


def _published_list() -> dict[str, tuple[int, ...]]:
    """The key list of the published model.safetensors (reference doc), expanded."""
    keys = {}
    for i in range(32):
        p = f"transformer.layers.{i}."
        keys[p + "self_attn.in_proj_weight"] = (12288, 4096)
        keys[p + "self_attn.out_proj.weight"] = (4096, 4096)
        keys[p + "norm1.alpha"] = keys[p + "norm2.alpha"] = (1, 1, 4096)
        keys[p + "gating.linear_in.weight"] = (22528, 4096)
        keys[p + "gating.linear_out.weight"] = (4096, 11264)
    for i in range(6):
        p = f"depformer.layers.{i}."
        keys[p + "self_attn.in_proj_weight"] = (49152, 1024)
        keys[p + "self_attn.out_proj.weight"] = (16384, 1024)
        keys[p + "norm1.alpha"] = keys[p + "norm2.alpha"] = (1, 1, 1024)
        for s in range(16):
            keys[p + f"gating.{s}.linear_in.weight"] = (5632, 1024)
            keys[p + f"gating.{s}.linear_out.weight"] = (1024, 2816)
    for k in range(16):
        keys[f"emb.{k}.weight"] = (2049, 4096)
        keys[f"depformer_in.{k}.weight"] = (1024, 4096)
        keys[f"linears.{k}.weight"] = (2048, 1024)
    for k in range(15):
        keys[f"depformer_emb.{k}.weight"] = (2049, 1024)
    keys["text_emb.weight"] = (32001, 4096)
    keys["text_linear.weight"] = (32000, 4096)
    keys["out_norm.alpha"] = (1, 1, 4096)
    keys["depformer_text_emb.weight"] = (32001, 1024)
    return keys


def test_full_config_has_exactly_the_published_keys():
    meta = LMModel(LMConfig.full(), dep_steps=16, device="meta")
    assert {k: tuple(v.shape) for k, v in meta.state_dict().items()} == _published_list()
    assert sum(v.numel() for v in meta.state_dict().values()) == pytest.approx(8.37e9, rel=0.01)


@pytest.mark.parametrize("damage,key", [
    ("missing", "transformer.layers.1.gating.linear_out.weight"),
    ("missing", "depformer.layers.0.gating.15.linear_in.weight"),  # not resident at 8 steps, still required
    ("unexpected", "transformer.layers.2.norm1.alpha"),
    ("shape", "depformer.layers.1.self_attn.in_proj_weight"),
    ("shape", "emb.3.weight"),
])
def test_strict_loading_names_the_bad_key(tmp_path, damage, key):
    state = LMModel(TINY, dep_steps=16).init_random_(0).state_dict()
    if damage == "missing":
        del state[key]
    elif damage == "unexpected":
        state[key] = torch.ones(1, 1, TINY.dim)  # a third layer the config does not have
    else:
        state[key] = state[key][:-1].contiguous()
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")):
        LMModel.load(tmp_path, TINY, dep_steps=8)


def test_load_refuses_missing_or_corrupt_files(tmp_path):
    with pytest.raises(CheckpointError):
        LMModel.load(tmp_path, TINY)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError):
        LMModel.load(tmp_path, TINY)


def test_load_roundtrip_and_dtype(tmp_path):
    src = LMModel(TINY, dep_steps=16).init_random_(2)
    save_file({k: v.to(torch.bfloat16) for k, v in src.state_dict().items()}, str(tmp_path / "model.safetensors"))
    model = LMModel.load(tmp_path / "model.safetensors", TINY, dtype=torch.float32, dep_steps=16)
    assert model.dtype == torch.float32 and not any(p.requires_grad for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, src.state_dict()[k].to(torch.bfloat16).float()), k


def test_config_roundtrip_and_validation():
    full = LMConfig.full()
    assert LMConfig.from_dict(full.to_dict()) == full
    assert full.num_streams == 17 and full.max_delay == 1 and full.head_dim == 128
    assert full.replace(context=8).context == 8
    with pytest.raises(ValueError, match="bogus"):
        LMConfig.from_dict({**full.to_dict(), "bogus": 1})
    with pytest.raises(ValueError):
        LMConfig.from_dict({"dim": 8})
    with pytest.raises(ValueError):
        full.replace(delays=(0, 1))
    with pytest.raises(ValueError):
        full.replace(num_heads=3)
    with pytest.raises(ValueError, match="delays"):
        LMConfig.from_dict({**full.to_dict(), "delays": 5})
    with pytest.raises(ValueError, match="norm_eps"):
        full.replace(norm_eps=0.0)


def test_loads_the_embedded_tiny_checkpoint(tiny_checkpoint):
    """The generated checkpoint (tools.make_checkpoint) loads strictly with the config it records."""
    from services.common.checkpoint import CheckpointPaths

    paths = CheckpointPaths.open(tiny_checkpoint, require=("lm",))
    cfg = LMConfig.from_dict(paths.serve_config()["lm"])
    model = LMModel.load(paths.lm, cfg, dep_steps=8)
    kv = model.new_kv_cache(1)
    h = model.temporal(model.embed(random_tokens(cfg, 1, 2, seed=0)), kv, kv.all_slots)[:, -1]
    audio = model.depformer(h, model.text_logits(h).argmax(-1), lambda cb, logits: logits.argmax(-1))
    assert audio.shape == (1, 8) and bool(((audio >= 0) & (audio < cfg.card)).all())


def test_a_poisoned_slot_touches_no_other_and_reset_clears_it():
    """Non-finite state in one slot (a diverged session) stays in that slot, and reset() leaves
    nothing of it for the next session: masked ring entries are zeroed, not just hidden."""
    model = LMModel(TINY).init_random_(1)
    kv = model.new_kv_cache(2)
    x = model.embed(random_tokens(TINY, 2, 3, seed=40))
    model.temporal(x, kv, kv.all_slots)
    kv.k[:, 0].fill_(float("nan"))
    h = model.temporal(x[:, :1], kv, kv.all_slots)
    assert h[0].isnan().all() and h[1].isfinite().all()
    alone = model.new_kv_cache(1)
    model.temporal(x[1:], alone, alone.all_slots)
    assert rel_err(h[1:], model.temporal(x[1:, :1], alone, alone.all_slots)) < 1e-6
    kv.reset(0)
    fresh = model.temporal(x[:1], model.new_kv_cache(1), torch.tensor([0]))
    assert rel_err(model.temporal(x[:1], kv, torch.tensor([0])), fresh) < 1e-6
