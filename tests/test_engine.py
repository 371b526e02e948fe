"""The Talker engine (services/talker/engine.py) and its sampler, on the tiny checkpoint.

Greedy parity with moshi 0.2.13's LMGen, prompt prefill (parallel == frame by frame == the
column rule written out independently here), slot independence, ring wrap, sampling
statistics, and typed refusals that leave other sessions alone.
"""

from __future__ import annotations

import os

os.environ.setdefault("NO_TORCH_COMPILE", "1")  # moshi would torch.compile its kernels on CPU

import math
import shutil

import pytest
import torch

from services.common.checkpoint import CheckpointPaths, InvalidVoice
from services.talker import prompt
from services.talker.engine import InvalidPersona, InvalidSampling, SamplingParams, TalkerEngine
from services.talker.model import LMConfig
from services.talker.sampling import RowParams, noise_key, sample, uniform_noise
from services.talker.voices import RING, load_voice
from tools.moshi_reference import moshi_lm_model

GREEDY = SamplingParams(greedy=True)
PERSONA = "You are kind."


@pytest.fixture(scope="module")
def paths(tiny_checkpoint) -> CheckpointPaths:
    return CheckpointPaths.open(tiny_checkpoint)


def engine(paths, slots=4, context=None, kv_fp8=False, alignment="moshi") -> TalkerEngine:
    """Upstream timing unless a test asks for another: these tests hold moshi 0.2.13's behaviour
    (tests/test_alignment.py holds the personaplex alignment's)."""
    return TalkerEngine.from_checkpoint(paths, slots=slots, context=context, kv_fp8=kv_fp8, alignment=alignment)


def user_frames(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 2048, (n, 8), generator=torch.Generator().manual_seed(seed))


def prefill(job, chunk=1000):
    while not job.run(chunk):
        pass


def run_session(eng: TalkerEngine, slot: int, frames: torch.Tensor):
    """Step one slot alone through `frames`; returns [(text, codes[8]) or None per frame]."""
    out = []
    for f in frames:
        codes = torch.zeros(eng.num_slots, 8, dtype=torch.long)
        codes[slot] = f
        active = torch.zeros(eng.num_slots, dtype=torch.bool)
        active[slot] = True
        r = eng.step(codes, active)
        out.append((int(r.text_tokens[slot]), r.agent_codes[slot].tolist()) if r.has_output[slot] else None)
    return out


# ---------------------------------------------------------------------------- parity with moshi


def moshi_lm(cfg: LMConfig, state: dict):
    return moshi_lm_model(cfg, state)


def test_greedy_parity_with_moshi_lmgen(paths):
    """Bare sessions (no prompt), 2 slots with different user audio, 104 frames (past the
    32-frame window): the same text and agent tokens as moshi's LMGen, frame for frame."""
    pytest.importorskip("moshi.models.lm", reason="the reference moshi==0.2.13 is a test dependency")
    from moshi.models.lm import LMGen

    eng = engine(paths, slots=2, context=32)
    # moshi with 8 depformer steps = the engine's resident model (agent codebooks only), same window
    ref = moshi_lm(eng.cfg.replace(dep_q=8, context=32), eng.model.state_dict())
    gen = LMGen(ref, use_sampling=False)
    T = 104
    users = torch.stack([user_frames(T, 1), user_frames(T, 2)], dim=1)  # [T, 2, 8]
    for s in range(2):
        assert eng.begin(s, None, None, GREEDY).done
    ours, theirs = [], []
    with gen.streaming(2):
        for t in range(T):
            r = eng.step(users[t], torch.ones(2, dtype=torch.bool))
            ours.append(torch.cat([r.text_tokens[:, None], r.agent_codes], 1) if bool(r.has_output.all()) else None)
            assert bool(r.has_output.any()) == bool(r.has_output.all())
            out = gen.step(users[t][:, :, None])
            theirs.append(None if out is None else out[:, :, 0])
    assert ours[0] is None and theirs[0] is None and eng.output_delay_frames == 1
    assert all(x is not None for x in ours[1:])
    for t in range(1, T):
        assert torch.equal(ours[t], theirs[t]), f"frame {t}: ours {ours[t].tolist()} moshi {theirs[t].tolist()}"
    # not a degenerate stream: the model produced varied tokens
    assert len({tuple(x[0].tolist()) for x in ours[1:]}) > 50


# ---------------------------------------------------------------------------- prompt prefill


def reference_columns(eng: TalkerEngine, voice: str | None, persona: str) -> tuple[int, torch.Tensor, int]:
    """The prompt's token columns written out from the spec, independently of prompt.py:
    frames = [voice frames] + silence x6 + "<system> persona <system>" + silence x6;
    column c, stream k = frame c - delay[k]; the initial token for frames <= 0; with a voice the
    columns before N-1 are its embeddings and its ring supplies the entries of voice frames."""
    cfg = eng.cfg
    sil = [3, *prompt.SILENCE_TOKENS, *prompt.SINE_TOKENS]
    tail = [sil] * 6 + [[t, *prompt.SILENCE_TOKENS, *prompt.SINE_TOKENS]
                        for t in eng.tokenizer.encode_persona(persona)] + [sil] * 6
    n = 0
    cache = None
    if voice:
        v = load_voice(eng.paths.resolve_voice(voice), cfg.dim, cfg.delays, cfg.text_card, cfg.card)
        n, cache = v.frames, v.cache
    F = n + len(tail)
    initial = [cfg.text_card] + [cfg.card] * cfg.n_q
    first = n - 1 if voice else 0
    cols = []
    for c in range(first, F - 1):
        col = []
        for k, d in enumerate(cfg.delays):
            f = c - d
            if f <= 0:
                col.append(initial[k])
            elif f < n:
                col.append(int(cache[k, c % RING]))
            else:
                col.append(tail[f - n][k])
        cols.append(col)
    return first, torch.tensor(cols), F


@pytest.mark.parametrize("voice,alignment", [(None, "moshi"), ("NATF2.pt", "moshi"), ("NATF2.pt", "personaplex")])
def test_parallel_prefill_equals_frame_by_frame(paths, voice, alignment):
    chunked, single = engine(paths, slots=2, alignment=alignment), engine(paths, slots=2, alignment=alignment)
    job_a = chunked.begin(1, voice, PERSONA, GREEDY)
    job_b = single.begin(1, voice, PERSONA, GREEDY)
    assert job_a.total_frames == job_b.total_frames == job_a.prompt_frames - 1
    runs = 0
    while not job_a.run(7):  # a few parallel chunks of 7 frames
        runs += 1
    assert runs >= 2
    while not job_b.run(1):  # strictly one frame per forward
        pass
    assert job_a.frames_done == job_b.frames_done == job_a.total_frames

    # an independent frame-by-frame reference: the spec's columns, one temporal step at a time
    model = chunked.model
    kv = model.new_kv_cache(1, context=chunked.context)
    slot0 = torch.zeros(1, dtype=torch.long)
    first, cols, F = reference_columns(chunked, voice, PERSONA)
    assert F == job_a.prompt_frames
    if voice:
        v = load_voice(paths.resolve_voice(voice), model.cfg.dim, model.cfg.delays, model.cfg.text_card, model.cfg.card)
        for e in v.embeddings:
            model.temporal(e[None, None], kv, slot0)
    for c in cols:
        model.temporal(model.embed(c[None, None]), kv, slot0)

    for eng in (chunked, single):
        assert int(eng.kv.length[1]) == int(kv.length[0]) == F - 1
        assert torch.allclose(eng.kv.k[:, 1], kv.k[:, 0], atol=1e-5, rtol=1e-4)
        assert torch.allclose(eng.kv.v[:, 1], kv.v[:, 0], atol=1e-5, rtol=1e-4)
        assert int(eng.offset[1]) == F - 1 and int(eng.start[1]) == F
    assert torch.equal(chunked.hist[1], single.hist[1])
    # the next frames come out the same
    frames = user_frames(12, 3)
    a, b = run_session(chunked, 1, frames), run_session(single, 1, frames)
    assert a == b
    if alignment == "moshi":
        assert a[0] is None and all(x is not None for x in a[1:])  # the first live step closes the prompt
    else:
        assert a[0] == (prompt.PAD_ID, prompt.SILENCE_TOKENS) and all(x is not None for x in a)


def test_voice_kv_is_computed_once_and_shared(paths):
    eng = engine(paths, slots=3)
    first = eng.begin(0, "NATM1.pt", PERSONA, GREEDY)
    voice_frames = first.prompt_frames - 1 - first._cols.inputs.shape[0]
    assert voice_frames == load_voice(paths.resolve_voice("NATM1.pt"), eng.cfg.dim, eng.cfg.delays,
                                      eng.text_card, eng.card).frames - 1
    # uncached, the voice costs its frames: this budget is not enough
    assert not first.run(first.total_frames - voice_frames)
    prefill(first)
    second = eng.begin(2, "NATM1.pt", PERSONA, GREEDY)
    # cached: the voice is copied for free, the rest fits in total - voice frames
    assert second.run(second.total_frames - voice_frames)
    assert torch.equal(eng.kv.k[:, 0, :, :voice_frames], eng.kv.k[:, 2, :, :voice_frames])
    assert torch.equal(eng.kv.v[:, 0, :, :voice_frames], eng.kv.v[:, 2, :, :voice_frames])
    assert torch.allclose(eng.kv.k[:, 0], eng.kv.k[:, 2], atol=1e-5) and torch.equal(eng.hist[0], eng.hist[2])
    assert list(eng._voice_kv) == ["NATM1.pt"]
    # the cached prefix holds the voice's positions only, not a session's whole ring
    assert eng._voice_kv["NATM1.pt"].kv.context == voice_frames < eng.context


# ---------------------------------------------------------------------------- slot independence


@pytest.mark.parametrize("sampling,kv_fp8", [(GREEDY, False), (SamplingParams(seed=1234), False), (GREEDY, True)],
                         ids=["greedy", "sampled", "greedy-fp8-kv"])
def test_session_output_does_not_depend_on_other_sessions(paths, sampling, kv_fp8):
    T = 30
    mine = user_frames(T, 10)
    alone = engine(paths, slots=4, kv_fp8=kv_fp8)
    assert alone.kv.k.dtype == (torch.float8_e4m3fn if kv_fp8 else torch.float32)
    job = alone.begin(0, "NATF2.pt", PERSONA, sampling)
    prefill(job, 8)
    expected = run_session(alone, 0, mine)

    eng = engine(paths, slots=4, kv_fp8=kv_fp8)
    S = eng.num_slots
    others = {1: user_frames(200, 11), 3: user_frames(200, 12), 0: user_frames(200, 13)}
    # slot 1: a live bare session before mine starts; slot 3 prefilling at the same time as mine
    eng.begin(1, None, None, SamplingParams(seed=9))
    job3 = eng.begin(3, "VARF0.pt", "Be brief.", SamplingParams(seed=5, text_temperature=1.3))
    job3.run(2)
    job = eng.begin(2, "NATF2.pt", PERSONA, sampling)
    got, t, k = [], 0, {1: 0, 3: 0, 0: 0}
    while len(got) < T:
        t += 1
        codes = torch.zeros(S, 8, dtype=torch.long)
        active = torch.zeros(S, dtype=torch.bool)
        for s in (0, 1, 3):
            if eng.is_live(s) and (t + s) % 3:  # others skip some ticks
                codes[s] = others[s][k[s]]
                k[s] += 1
                active[s] = True
        if job.done and t % 4:  # mine also skips some ticks
            codes[2] = mine[len(got)]
            active[2] = True
        r = eng.step(codes, active)
        if active[2]:
            got.append((int(r.text_tokens[2]), r.agent_codes[2].tolist()) if r.has_output[2] else None)
        if not job.done:
            job.run(8)
        if not job3.done:
            job3.run(3)
        if t == 12:
            eng.release(1)  # slot 1 stops ...
        if t == 20:
            eng.begin(0, None, "Talk about the weather.", SamplingParams(seed=77))  # ... slot 0 starts ...
        if t == 22:
            prefill(eng._jobs[0], 64)
        if t == 25:
            eng.begin(3, "NATF2.pt", PERSONA, GREEDY).run(1000)  # ... slot 3 restarts mid-conversation
    assert got == expected


# ---------------------------------------------------------------------------- ring wrap


def test_sessions_run_far_past_the_window(paths):
    eng = engine(paths, slots=2, context=24)
    assert eng.context == 24
    prefill(eng.begin(0, "NATF2.pt", "Hi.", SamplingParams(seed=3)), 5)
    eng.begin(1, None, None, GREEDY)
    frames = user_frames(80, 4)  # more than 3 windows
    texts = []
    for f in frames:
        r = eng.step(torch.stack([f, f]), torch.ones(2, dtype=torch.bool))
        if bool(r.has_output[0]):
            assert 0 <= int(r.text_tokens[0]) < eng.text_card
            assert bool(((r.agent_codes >= 0) & (r.agent_codes < eng.card)).all())
            texts.append(int(r.text_tokens[0]))
    assert len(texts) == 79 and int(eng.kv.length[1]) == 80
    assert torch.isfinite(eng.kv.k).all()
    assert len(set(texts)) > 5


# ---------------------------------------------------------------------------- sampling


def params(B, greedy=False, temp=1.0, k=0, V=64):
    top = torch.full((B,), V if k <= 0 else k, dtype=torch.long)
    return RowParams(torch.full((B,), greedy), torch.full((B,), float(temp)), top, int(top.max()))


def draw(logits, p, seed, frames, cb=0):
    """One draw per frame index 0..frames-1 for each row: LongTensor[frames, B] (all in one batch:
    row (t, b) is row b at frame t, which is also what shows the draws are batch-independent)."""
    B = logits.shape[0]
    rep = RowParams(p.greedy.repeat(frames), p.temperature.repeat(frames), p.top_k.repeat(frames), p.max_k)
    seeds = torch.full((frames * B,), seed, dtype=torch.long)
    t = torch.arange(frames).repeat_interleave(B)
    return sample(logits.repeat(frames, 1), rep, noise_key(seeds, t), cb).view(frames, B)


def test_top_k_is_respected():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 64, generator=g)
    p = RowParams(torch.zeros(3, dtype=torch.bool), torch.tensor([1.0, 5.0, 50.0]), torch.tensor([1, 5, 20]), 20)
    toks = draw(logits, p, seed=1, frames=400)
    for b, k in enumerate([1, 5, 20]):
        allowed = set(logits[b].topk(k).indices.tolist())
        assert set(toks[:, b].tolist()) <= allowed
        if k > 1:
            assert len(set(toks[:, b].tolist())) == k  # high temperature: every allowed token shows up


def test_draws_follow_the_tempered_softmax():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    n = 6000
    for temp in (1.0, 2.0):
        toks = draw(logits, params(1, temp=temp, V=4), seed=42, frames=n)[:, 0]
        freq = torch.bincount(toks, minlength=4).float() / n
        want = torch.softmax(logits[0] / temp, -1)
        assert (freq - want).abs().max() < 0.025, (temp, freq, want)
    # low temperature concentrates on the argmax, greedy and temperature 0 are the argmax
    cold = draw(logits, params(1, temp=0.05, V=4), seed=1, frames=200)[:, 0]
    assert (cold == 3).float().mean() > 0.99
    assert set(draw(logits, params(1, greedy=True, V=4), seed=1, frames=20)[:, 0].tolist()) == {3}
    assert set(draw(logits, params(1, temp=0.0, V=4), seed=1, frames=20)[:, 0].tolist()) == {3}


def test_noise_is_reproducible_and_batch_independent():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 256, generator=g)
    p = params(4, temp=1.0, k=100, V=256)
    a, b = draw(logits, p, seed=7, frames=50), draw(logits, p, seed=7, frames=50)
    assert torch.equal(a, b)
    c = draw(logits, p, seed=8, frames=50)
    assert (a != c).float().mean() > 0.5
    # a row's draw depends only on its own (seed, frame, codebook): alone == inside a batch
    alone = draw(logits[2:3], params(1, temp=1.0, k=100, V=256), seed=7, frames=50)
    assert torch.equal(alone[:, 0], a[:, 2])
    # codebooks get different noise
    assert (draw(logits, p, seed=7, frames=50, cb=3) != a).float().mean() > 0.5
    u = uniform_noise(noise_key(torch.tensor([0, 2**62 + 5]), torch.tensor([0, 10**9])), 17,
                      torch.arange(10000).expand(2, -1))
    assert float(u.min()) > 0 and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.01
    # the high half of the seed matters too
    idx = torch.arange(64)[None]
    assert not torch.equal(uniform_noise(noise_key(torch.tensor([1]), torch.tensor([0])), 0, idx),
                           uniform_noise(noise_key(torch.tensor([1 + 2**40]), torch.tensor([0])), 0, idx))


def test_engine_sessions_with_same_seed_repeat_and_other_seeds_differ(paths):
    eng = engine(paths, slots=3)
    frames = user_frames(15, 5)
    runs = []
    for seed in (5, 5, 6):
        eng.begin(1, None, PERSONA, SamplingParams(seed=seed))
        prefill(eng._jobs[1])
        runs.append(run_session(eng, 1, frames))
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    greedy = []
    for seed in (5, 6):
        eng.begin(1, None, PERSONA, SamplingParams(seed=seed, greedy=True))
        prefill(eng._jobs[1])
        greedy.append(run_session(eng, 1, frames))
    assert greedy[0] == greedy[1]  # greedy ignores the seed


# ---------------------------------------------------------------------------- refusals


def test_bad_requests_are_typed_and_leave_other_sessions_alone(paths, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(paths.root, ck)
    torch.save({"embeddings": torch.zeros(2, 1, 1, 3), "cache": torch.zeros(1, 17, 4, dtype=torch.long)},
               ck / "voices" / "BAD.pt")
    eng = engine(CheckpointPaths.open(ck), slots=2)
    ref = engine(paths, slots=2)
    frames = user_frames(20, 6)
    for e in (eng, ref):
        prefill(e.begin(0, "NATF2.pt", PERSONA, SamplingParams(seed=3)))
    before = run_session(eng, 0, frames[:10])
    assert before == run_session(ref, 0, frames[:10])

    bad = [
        (InvalidVoice, dict(voice="../NATF2.pt")),
        (InvalidVoice, dict(voice="NOPE.pt")),
        (InvalidVoice, dict(voice="NATF2")),
        (InvalidVoice, dict(voice="BAD.pt")),
        (InvalidPersona, dict(persona="word " * 200)),
        (InvalidPersona, dict(persona=b"bytes")),
        (InvalidPersona, dict(persona="nul\x00byte")),
        (InvalidPersona, dict(persona="\ud800 unpaired")),
        (InvalidSampling, dict(sampling=SamplingParams(text_temperature=-1.0))),
        (InvalidSampling, dict(sampling=SamplingParams(audio_temperature=math.nan))),
        (InvalidSampling, dict(sampling=SamplingParams(text_top_k=eng.text_card + 1))),
        (InvalidSampling, dict(sampling=SamplingParams(seed=-1))),
        (InvalidSampling, dict(sampling={"greedy": True})),
    ]
    for slot in (0, 1):  # on the live slot itself, and on a free one
        for exc, kw in bad:
            args = dict(voice=None, persona=PERSONA, sampling=GREEDY) | kw
            with pytest.raises(exc):
                eng.begin(slot, args["voice"], args["persona"], args["sampling"])
    assert eng.is_live(0) and not eng.is_live(1)
    with pytest.raises(IndexError):
        eng.begin(2, None, PERSONA, GREEDY)
    with pytest.raises(ValueError, match="cuda_graph needs"):
        TalkerEngine(eng.model, eng.tokenizer, 2, cuda_graph=True)  # the model is on the CPU
    # bad steps change nothing
    offset = eng.offset.clone()
    with pytest.raises(ValueError, match="user codes"):
        eng.step(torch.full((2, 8), 2048), torch.tensor([True, False]))
    with pytest.raises(ValueError, match="not live"):
        eng.step(torch.zeros(2, 8, dtype=torch.long), torch.tensor([True, True]))
    with pytest.raises(ValueError, match="BoolTensor"):
        eng.step(torch.zeros(2, 8, dtype=torch.long), torch.tensor([1, 0]))
    idle = eng.step(torch.zeros(2, 8, dtype=torch.long), torch.tensor([False, False]))  # a tick with no input
    assert not idle.has_output.any() and bool((idle.text_tokens == -1).all())
    assert torch.equal(eng.offset, offset)
    # the live session carries on exactly as if nothing had happened
    assert run_session(eng, 0, frames[10:]) == run_session(ref, 0, frames[10:])
    # a released slot is not steppable, and its pending prefill job is dead
    job = eng.begin(1, None, PERSONA, GREEDY)
    eng.release(1)
    with pytest.raises(RuntimeError, match="cancelled"):
        job.run(10)
    with pytest.raises(ValueError, match="not live"):
        eng.step(torch.zeros(2, 8, dtype=torch.long), torch.tensor([False, True]))


def test_text_pieces(paths):
    eng = engine(paths, slots=1)
    ids = eng.tokenizer.encode("hello teacher")
    assert "".join(eng.text_piece(i) for i in ids) == " hello teacher"
    assert [eng.text_piece(i) for i in range(4)] == [""] * 4


def test_warmup_leaves_no_trace_in_slot_0(paths):
    """warmup() prefills a prompt in slot 0 and releases it: a session there afterwards produces
    exactly what it produces on a fresh engine."""
    frames = torch.randint(0, 2048, (20, 8), generator=torch.Generator().manual_seed(11))
    outs = []
    for warm in (False, True):
        eng = engine(paths, slots=2)
        if warm:
            eng.warmup(("NATF2.pt",))
            assert not eng.is_live(0) and eng._voice_kv["NATF2.pt"].complete
        job = eng.begin(0, "NATF2.pt", "You are calm.", SamplingParams(greedy=True))
        voice_frames = job.prompt_frames - 1 - job._cols.inputs.shape[0]
        if warm:  # preloaded: the voice is copied, only the rest of the prompt runs
            assert job.run(job.total_frames - voice_frames)
        while not job.run(64):
            pass
        outs.append(run_session(eng, 0, frames))
    assert outs[0] == outs[1] and any(o is not None for o in outs[0])


def test_warmup_refuses_a_voice_the_checkpoint_lacks(paths):
    with pytest.raises(InvalidVoice, match="NOPE"):
        engine(paths, slots=1).warmup(("NOPE.pt",))


def test_bench_full_context_makes_every_ring_entry_valid_from_the_first_frame(paths):
    """The benchmark mode (TalkerConfig.bench_full_context): a session goes live with its length a
    whole ring further on, so the first live step already attends over `context` entries, the
    steady state's cost. Ring indices are unchanged, and the slot still steps and stays finite."""
    eng = engine(paths, slots=2, context=32, kv_fp8=True)
    eng.bench_full_context = True
    job = eng.begin(0, None, PERSONA, GREEDY)
    prefill(job)
    assert int(eng.kv.length[0]) == job.total_frames + 32 and int(eng.kv.length[1]) == 0
    assert bool((eng.kv.ring_positions(eng.kv.length[:1] - 1) >= 0).all())  # every index holds a position
    out = run_session(eng, 0, user_frames(40, seed=3))  # wraps the ring once more
    assert all(o is not None for o in out[1:])
    assert int(eng.kv.length[0]) == job.total_frames + 32 + 40
    assert all(0 <= c < 2048 for _, codes in out[1:] for c in codes)


def test_fused_functions_stay_eager_on_the_cpu():
    """fused.enable() compiles only for CUDA tensors: on the CPU the very eager function runs, and
    nothing is handed to torch.compile (which would compile C++ on a CI machine)."""
    from torch._dynamo.utils import counters

    from services.talker import fused
    from services.talker.layers import rms_norm

    x, alpha = torch.randn(3, 1, 16), torch.rand(1, 1, 16)
    before = sum(counters["stats"].values())
    fused.enable()
    try:
        assert fused.enabled()
        got = rms_norm(x, alpha, 1e-8)
    finally:
        fused.enable(False)
    assert torch.equal(got, rms_norm.eager(x, alpha, 1e-8))
    assert sum(counters["stats"].values()) == before


def test_talker_config_refuses_compile_off_cuda():
    from services.talker.config import TalkerConfig

    with pytest.raises(ValueError, match="compile needs a CUDA device"):
        TalkerConfig(checkpoint="x", compile=True)
    assert TalkerConfig(checkpoint="x", compile=True, device="cuda").compile
