"""Compact steps (TalkerEngine.step_rows, the clock's catch-up steps) on the tiny checkpoint: a subset
of slots stepped as a batch of a few rows, padded with idle slots, gives those slots the tokens and the
state the full step gives them, bit for bit, and leaves every other slot as it was.

Two engines with the same sessions step the same random subsets, frame after frame: one with the full
step (an active mask over every slot), one with compact steps of a random bucket that holds the subset
(the slots in a random row order). Greedy and sampled sessions, voice and persona prompts, rings that
wrap, a slot still prefilling while the others step, both alignments, stepping ahead, fp8 and 4-bit KV.
"""

from __future__ import annotations

import random

import pytest
import torch

from services.common.checkpoint import CheckpointPaths
from services.talker.engine import NO_FRAME, SamplingParams, TalkerEngine

SLOTS = 12
BUCKETS = (8,)  # row_buckets (8, 12): the CPU's GEMMs give a row the same bits from 8 rows on
CONTEXT = 32  # short: rings wrap within the test
FRAMES = 40


@pytest.fixture(scope="module")
def paths(tiny_checkpoint) -> CheckpointPaths:
    return CheckpointPaths.open(tiny_checkpoint)


def engine(paths, **kw) -> TalkerEngine:
    return TalkerEngine.from_checkpoint(paths, slots=SLOTS, context=CONTEXT, **{"catch_up_buckets": BUCKETS} | kw)


def begin_all(eng: TalkerEngine, voice: str) -> object:
    """Slots 0..S-2 live (prompts and sampling varied); the last slot's prompt begun, 3 frames in."""
    for slot in range(SLOTS - 1):
        prompt = [(None, None), (None, ""), (voice, "Hi.")][slot % 3]
        sampling = SamplingParams(greedy=True) if slot % 2 else SamplingParams(seed=slot + 1)
        job = eng.begin(slot, *prompt, sampling)
        while not job.run(64):
            pass
    job = eng.begin(SLOTS - 1, voice, "You are kind.", SamplingParams(seed=99))
    assert not job.run(3)
    return job


def state(eng: TalkerEngine) -> dict[str, torch.Tensor]:
    """Everything a step can change or read, per slot; KV stores as raw bytes (fp8 compares exactly)."""
    kv = eng.kv
    stores = {name: getattr(kv, name) for name in ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero")
              if hasattr(kv, name)}
    return {"hist": eng.hist, "offset": eng.offset, "start": eng.start, "first_output": eng.first_output,
            "seed": eng.seed, "length": kv.length,
            **{f"kv.{name}": t.contiguous().view(torch.uint8) for name, t in stores.items()}}


def assert_same_state(a: TalkerEngine, b: TalkerEngine, where: str) -> None:
    sa, sb = state(a), state(b)
    for name in sa:
        assert torch.equal(sa[name], sb[name]), f"{where}: {name} differs"


@pytest.mark.parametrize("alignment,step_ahead,kv_bits", [("personaplex", True, None), ("moshi", False, None),
                                                          ("personaplex", False, 8), ("personaplex", True, 4)])
def test_a_compact_step_gives_the_full_steps_tokens_and_state(paths, alignment, step_ahead, kv_bits):
    voice = CheckpointPaths(paths.root).voice_names()[0]
    full, compact = (engine(paths, alignment=alignment, step_ahead=step_ahead, kv_bits=kv_bits) for _ in range(2))
    assert compact.row_buckets == (8, SLOTS)
    jobs = [begin_all(e, voice) for e in (full, compact)]
    assert_same_state(full, compact, "after the prompts")
    rng, g = random.Random(0), torch.Generator().manual_seed(0)
    stepped = [0] * SLOTS
    rows_run = []
    for t in range(FRAMES):
        live = [s for s in range(SLOTS) if full.is_live(s)]
        n = rng.randint(1, min(8, len(live)) if rng.random() < 0.75 else len(live))  # mostly a bucket's worth
        slots = rng.sample(live, n)  # a random subset, in a random row order
        rows = rng.choice([b for b in compact.row_buckets if b >= len(slots)])
        codes = torch.randint(0, 2048, (len(slots), 8), generator=g)
        for i, s in enumerate(slots):
            if step_ahead and stepped[s] == 0:
                codes[i] = NO_FRAME  # a step-ahead session's step 0 has no user frame
            stepped[s] += 1
        codes_full, active = torch.zeros(SLOTS, 8, dtype=torch.long), torch.zeros(SLOTS, dtype=torch.bool)
        codes_full[slots], active[slots] = codes, True
        want = full.step(codes_full, active)
        got = compact.step_rows(slots, codes, rows)
        where = f"frame {t}, slots {slots} in {rows} rows"
        for name in ("text_tokens", "agent_codes", "has_output"):
            assert torch.equal(getattr(want, name), getattr(got, name)), f"{where}: {name}"
        assert_same_state(full, compact, where)
        rows_run.append(rows)
        if t % 3 == 0 and not jobs[0].done:  # the last slot's prompt runs on between steps, then it talks
            assert jobs[0].run(4) == jobs[1].run(4)
    assert full.is_live(SLOTS - 1) and stepped[SLOTS - 1] > 0
    assert rows_run.count(8) >= FRAMES // 3 and bool(want.has_output.any())
    # not a degenerate stream: the sessions' tokens vary
    assert len({tuple(want.agent_codes[s].tolist()) for s in range(SLOTS) if want.has_output[s]}) > 1


def test_step_rows_refuses_bad_requests_with_typed_errors_and_changes_nothing(paths):
    eng = engine(paths)
    for slot in range(3):
        assert eng.begin(slot, None, None, SamplingParams(greedy=True)).done
    before = {name: t.clone() for name, t in state(eng).items()}
    codes = torch.zeros(2, 8, dtype=torch.long)
    bad = [(([0, 1], codes, 4), "rows must be one of"),
           (([0, 0], codes, 8), "distinct"),
           (([0, 1, 2], codes, 8), "user_codes must be a LongTensor\\[3, 8\\]"),
           (([0, 5], codes, 8), "not live"),
           (([0, 1], codes.float(), 8), "user_codes must be"),
           (([0, 1], torch.full((2, 8), 2048), 8), "user codes must be in"),
           (([0, 99], codes, 8), "distinct ints in"),
           (([], codes[:0], 8), "1 to 8")]
    for (slots, c, rows), match in bad:
        with pytest.raises(ValueError, match=match):
            eng.step_rows(slots, c, rows)
    for name, t in state(eng).items():
        assert torch.equal(t, before[name]), name
    eng.step_rows([2, 0], codes, 8)  # then a good one steps exactly its slots
    assert (eng.offset - before["offset"]).tolist() == [1, 0, 1] + [0] * (SLOTS - 3)
    with pytest.raises(ValueError, match="catch_up_buckets"):
        engine(paths, catch_up_buckets=(0,))


def test_warmup_times_an_idle_step_of_each_row_count_and_changes_nothing(paths):
    eng = engine(paths)
    eng.warmup()
    assert set(eng.warm_step_s) == {8, SLOTS} and all(0 < s < 10 for s in eng.warm_step_s.values())
    fresh = engine(paths)  # warmup's prompt in slot 0, without the timed steps
    job = fresh.begin(0, None, "", SamplingParams(greedy=True))
    while not job.run(64):
        pass
    fresh.release(0)
    assert_same_state(eng, fresh, "after warmup")
