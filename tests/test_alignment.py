"""How the talker matches NVIDIA's reference server, on the tiny checkpoint, greedy. The two live-step
timings of the engine (services/talker/engine.py module doc):

- "personaplex" (NVIDIA's fork, the default): user frame j is written to column F+j and read at
  step j+1; step 0 returns the prompt's last frame; N inputs give N outputs; attention over C-1.
- "moshi" (upstream 0.2.13): read in the same step, N-1 outputs, attention over C
  (its parity with moshi's LMGen is tests/test_engine.py's).
And the persona edge cases: `<system>` alone, and the empty persona (which the reference crashes on).
"""

from __future__ import annotations

import os

os.environ.setdefault("NO_TORCH_COMPILE", "1")  # moshi would torch.compile its kernels on CPU

import pytest
import torch

from services.common.checkpoint import CheckpointPaths
from services.talker import prompt
from services.talker.engine import NO_FRAME, SamplingParams, TalkerEngine
from services.talker.voices import RING
from tools.moshi_reference import moshi_lm_model

GREEDY = SamplingParams(greedy=True)
USER_Q0 = 1 + 8  # stream index of the user's first codebook
SINE = torch.tensor(prompt.SINE_TOKENS)


@pytest.fixture(scope="module")
def paths(tiny_checkpoint) -> CheckpointPaths:
    return CheckpointPaths.open(tiny_checkpoint)


def engine(paths, alignment: str, slots: int = 2, context: int | None = None) -> TalkerEngine:
    return TalkerEngine.from_checkpoint(paths, slots=slots, context=context, alignment=alignment)


def user_frames(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 2048, (n, 8), generator=torch.Generator().manual_seed(seed))


def start(eng: TalkerEngine, slot: int, voice, persona):
    job = eng.begin(slot, voice, persona, GREEDY)
    while not job.run(16):
        pass
    return job


def one_step(eng: TalkerEngine, slot: int, frame: torch.Tensor):
    codes = torch.zeros(eng.num_slots, 8, dtype=torch.long)
    codes[slot] = frame
    active = torch.zeros(eng.num_slots, dtype=torch.bool)
    active[slot] = True
    r = eng.step(codes, active)
    return (int(r.text_tokens[slot]), r.agent_codes[slot].tolist()) if r.has_output[slot] else None


def run(eng: TalkerEngine, slot: int, frames: torch.Tensor) -> list:
    return [one_step(eng, slot, f) for f in frames]


@pytest.mark.parametrize("voice", [None, "NATF2.pt"])
def test_personaplex_gives_n_outputs_for_n_inputs_the_first_being_the_prompts_last_frame(paths, voice):
    frames = user_frames(10, 1)
    fork = engine(paths, "personaplex")
    job = start(fork, 0, voice, "You are kind.")
    out = run(fork, 0, frames)
    assert job.output_delay_frames == 0 == fork.output_delay_frames
    assert all(o is not None for o in out) and len(out) == 10
    assert out[0] == (prompt.PAD_ID, prompt.SILENCE_TOKENS)  # text PAD, agent SILENCE: prompt frame F-1
    assert out[1] != out[0]  # from step 1 on the model speaks

    upstream = engine(paths, "moshi")
    job = start(upstream, 0, voice, "You are kind.")
    out = run(upstream, 0, frames)
    assert job.output_delay_frames == 1 == upstream.output_delay_frames
    assert out[0] is None and all(o is not None for o in out[1:])


@pytest.mark.parametrize("alignment", ["personaplex", "moshi"])
def test_live_step_j_reads_user_frame_j_minus_1_in_personaplex_and_j_in_moshi(paths, alignment):
    """The history column each live step reads (offset F-1+j): its user q0 entry is frame j-1's
    (personaplex; the prompt's SINE at j=0) or frame j's (moshi); the delay-1 user streams lag one more."""
    eng = engine(paths, alignment)
    job = start(eng, 1, "NATF2.pt", "Hi.")
    F = job.prompt_frames
    frames = user_frames(6, 2)
    lag = 1 if alignment == "personaplex" else 0

    def frame_codes(i):  # user frame i; before the first live frame, the prompt's SINE
        return SINE if i < 0 else frames[i]

    for j, f in enumerate(frames):
        read = (F - 1 + j) % RING
        one_step(eng, 1, f)
        col = eng.hist[1, USER_Q0:, read]
        assert int(col[0]) == int(frame_codes(j - lag)[0]), f"step {j} read user q0 of the wrong frame"
        assert col[1:].tolist() == frame_codes(j - lag - 1)[1:].tolist(), f"step {j}: delay-1 streams"
        if lag:  # the frame just given waits in the next column
            assert int(eng.hist[1, USER_Q0, (F + j) % RING]) == int(f[0])


def test_personaplex_equals_moshi_timing_fed_sine_first_with_a_window_of_c_minus_1(paths):
    """What the fork does, said another way (the issue's measurement): an upstream-timed engine fed
    [SINE] + user frames, with an attention window one frame shorter, gives the same frames, far past the
    ring filling. With the full window C the two part once the ring is full: exactly C-1 keys count."""
    C, T = 24, 80
    frames = user_frames(T, 3)
    fork = engine(paths, "personaplex", context=C)
    assert fork.context == C - 1  # the attention window
    job = start(fork, 0, None, "Hi.")
    ours = run(fork, 0, frames)
    assert job.prompt_frames + T > 3 * C

    def upstream(context):
        eng = engine(paths, "moshi", context=context)
        start(eng, 0, None, "Hi.")
        return run(eng, 0, torch.cat([SINE[None], frames]))

    short = upstream(C - 1)
    assert short[0] is None and ours[1:] == short[1:T]
    full = upstream(C)
    fill = C - job.prompt_frames  # live steps before the ring of C wraps
    assert ours[1:fill] == full[1:fill]
    assert ours[1:] != full[1:T]


@pytest.mark.parametrize("voice", [None, "NATF2.pt"])
def test_stepping_ahead_gives_the_forks_frames_one_user_frame_earlier(paths, voice):
    """The talker's default: step j is given user frame j-1 (step 0 none), so it can run before frame j
    arrives. Token for token the fork's outputs, far past the ring filling, with other slots live."""
    C, T = 24, 80
    frames, other = user_frames(T, 4), user_frames(T, 5)
    fork = engine(paths, "personaplex", context=C)
    ahead = TalkerEngine.from_checkpoint(paths, slots=2, context=C, step_ahead=True)
    jobs = [start(e, s, voice, "Hi.") for e in (fork, ahead) for s in (0, 1)]
    assert jobs[0].prompt_frames + T > 3 * C
    want, got = [], []
    for j in range(T):
        want.append(one_step(fork, 0, frames[j]))
        one_step(fork, 1, other[j])
        codes = torch.stack([frames[j - 1] if j else torch.full((8,), NO_FRAME), other[j]])
        r = ahead.step(codes, torch.ones(2, dtype=torch.bool))
        got.append((int(r.text_tokens[0]), r.agent_codes[0].tolist()) if r.has_output[0] else None)
    assert got == want and want[1] is not None


def test_only_a_step_ahead_engine_takes_a_row_without_a_user_frame(paths):
    with pytest.raises(ValueError, match="step_ahead needs alignment 'personaplex'"):
        TalkerEngine.from_checkpoint(paths, slots=1, alignment="moshi", step_ahead=True)
    eng = engine(paths, "personaplex", slots=1)
    start(eng, 0, None, "Hi.")
    with pytest.raises(ValueError, match="user codes must be in"):
        one_step(eng, 0, torch.full((8,), NO_FRAME))


def test_personaplex_bare_session_matches_moshi_lmgen_with_a_window_of_c_minus_1(paths):
    """No prompt: moshi 0.2.13's LMGen discards its first user frame (column 0 is the initial token),
    so LMGen fed [anything] + user frames reads each one a step later, as the fork does; with moshi's
    context C-1 it attends over what the fork's ring of C does. Equal frame for frame, 3 windows long."""
    pytest.importorskip("moshi.models.lm", reason="the reference moshi==0.2.13 is a test dependency")
    from moshi.models.lm import LMGen

    C, T = 32, 104
    eng = engine(paths, "personaplex", context=C)
    ref = moshi_lm_model(eng.cfg.replace(dep_q=8, context=C - 1), eng.model.state_dict())
    gen = LMGen(ref, use_sampling=False)
    users = torch.stack([user_frames(T, 4), user_frames(T, 5)], dim=1)  # [T, 2, 8]
    jobs = [eng.begin(s, None, None, GREEDY) for s in range(2)]
    assert all(j.done and j.output_delay_frames == 1 for j in jobs)
    fed = torch.cat([torch.zeros_like(users[:1]), users[:-1]])  # LMGen's first frame is never read
    with gen.streaming(2):
        for t in range(T):
            r = eng.step(users[t], torch.ones(2, dtype=torch.bool))
            theirs = gen.step(fed[t][:, :, None])
            if t == 0:
                assert theirs is None and not bool(r.has_output.any())
                continue
            assert bool(r.has_output.all())
            ours = torch.cat([r.text_tokens[:, None], r.agent_codes], 1)
            assert torch.equal(ours, theirs[:, :, 0]), f"frame {t}"
    assert int(eng.kv.valid_entries(eng.kv.length[:, None] - 1).max()) == C - 1


def test_alignment_is_a_flag_and_an_env_var_and_is_checked(paths):
    from services.talker.config import TalkerConfig

    assert TalkerConfig.load(["--checkpoint", "/x"], env={}).alignment == "personaplex"
    assert TalkerConfig.load(["--checkpoint", "/x"], env={"TALKER_ALIGNMENT": "moshi"}).alignment == "moshi"
    flag = TalkerConfig.load(["--checkpoint", "/x", "--alignment", "personaplex"], env={"TALKER_ALIGNMENT": "moshi"})
    assert flag.alignment == "personaplex"
    with pytest.raises(SystemExit, match="alignment"):
        TalkerConfig.load(["--checkpoint", "/x"], env={"TALKER_ALIGNMENT": "fork"})
    with pytest.raises(ValueError, match="alignment"):
        engine(paths, "upstream")
    with pytest.raises(ValueError, match="context"):
        engine(paths, "personaplex", context=1)  # a window of C-1 = 0 frames


# ---------------------------------------------------------------------------- persona edge cases


def test_a_persona_that_is_exactly_the_system_tag_is_used_as_it_stands(paths):
    """The reference keeps a stripped text that starts and ends with `<system>`: the tag alone stays one tag."""
    eng = engine(paths, "personaplex")
    tag = eng.tokenizer.encode("<system>")
    assert eng.tokenizer.encode_persona("<system>") == tag == eng.tokenizer.encode_persona("  <system>\n")
    assert eng.tokenizer.encode_persona("hi") == eng.tokenizer.encode("<system> hi <system>") != tag
    job = start(eng, 0, None, "<system>")
    assert job.prompt_frames == 6 + len(tag) + 6


@pytest.mark.parametrize("persona", ["", "  \n\t"])
def test_an_empty_persona_is_the_voice_and_the_two_silences_alone(paths, persona):
    """Defined here (the reference crashes): no persona frames at all, not an empty `<system>  <system>` pair."""
    eng = engine(paths, "personaplex")
    assert eng.tokenizer.encode_persona(persona) == []
    with_voice = start(eng, 0, "NATF2.pt", persona)
    tag = len(eng.tokenizer.encode("<system>"))
    assert with_voice.prompt_frames == start(eng, 1, "NATF2.pt", "<system>").prompt_frames - tag
    no_voice = start(eng, 1, None, persona)
    assert no_voice.prompt_frames == 12 and no_voice.output_delay_frames == 0
    out = run(eng, 1, user_frames(4, 6))
    assert out[0] == (prompt.PAD_ID, prompt.SILENCE_TOKENS) and all(o is not None for o in out)
