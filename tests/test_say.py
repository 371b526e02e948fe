""""Say this" at the talker: text forced into the model's text stream (services/talker/say.py, engine.py).

- The say queue alone, with plain numbers: the model paces each word's start (EPAD kept, a word-starting
  piece replaced, PAD waited on up to the bound, then forced with EPAD after padding), a word's tokens on
  consecutive frames, cancels (mid-word, of a later say, while a step runs), bounds and typed refusals.
- The engine on the tiny checkpoint: the forced tokens appear in the text stream in order and the agent
  codes follow them; the full step and compact steps (engine.step_rows, the clock's catch-ups) give the
  same tokens and state with forcing, greedy and sampled, both alignments, stepping ahead.
- The talker service over a real gRPC Talk stream: a say is spoken (its tokens in the outputs, in
  order, N outputs for N inputs), equal to the in-process engine driven the same way; a cancel midway
  drops the rest; the bounds are typed refusals and the session goes on.
"""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
import torch

from duplex.v1 import talker_pb2
from services.common.checkpoint import CheckpointPaths
from services.talker.engine import NO_FORCE, NO_FRAME, SamplingParams, TalkerEngine, TextForcing
from services.talker.say import (
    EPAD_ID, PAD_ID, Force, Phase, SayDone, SayEnd, SayError, SayQueue, check_text, say_words)
from tests.test_compact_step import assert_same_state

pytestmark = pytest.mark.timeout(300)

WORDS = [[10, 11], [20], [30, 31, 32]]


# ---- the queue alone ------------------------------------------------------------------------------

def drive(q: SayQueue, written: list[int]) -> tuple[list[Force | None], list[SayDone]]:
    """Step the queue as the clock does, each step writing the next token of `written`."""
    offers, done = [], []
    for token in written:
        offers.append(q.next_force())
        done += q.stepped(token)
    return offers, done


def test_the_model_paces_word_starts_and_a_word_runs_on_consecutive_frames():
    q = SayQueue(max_wait_frames=3)
    q.add(7, WORDS)
    assert q.phase is Phase.WORD_START and q.queued_tokens == 6
    written = [PAD_ID, EPAD_ID, 10, 11,   # padding waited on, the model's EPAD kept, then the word
               20,                        # a word-starting piece of the model's: replaced by the word
               PAD_ID, PAD_ID, PAD_ID,    # three frames of padding: the bound
               EPAD_ID, 30, 31, 32]       # forced anyway, EPAD first (the last frame was padding)
    offers, done = drive(q, written)
    assert offers == [Force(10, True), Force(10, True), Force(10, False), Force(11, False),
                      Force(20, True),
                      Force(30, True), Force(30, True), Force(30, True),
                      Force(EPAD_ID, False), Force(30, False), Force(31, False), Force(32, False)]
    assert done == [SayDone(7, SayEnd.SAID, 6, 0)]
    assert q.phase is Phase.IDLE and q.queued_tokens == 0 and q.next_force() is None


def test_a_word_forced_after_a_spoken_piece_starts_without_epad():
    q = SayQueue(max_wait_frames=0)
    assert drive(q, [99]) == ([None], [])  # the model's own word (a piece without the word mark, 99)
    q.add(1, [[40, 41]])
    offers, done = drive(q, [40, 41])  # forced at once, right after the model's piece: no EPAD (the rule)
    assert offers == [Force(40, False), Force(41, False)]
    assert done == [SayDone(1, SayEnd.SAID, 2, 0)]


def test_says_follow_each_other_and_a_cancel_drops_only_what_is_not_said():
    q = SayQueue(max_wait_frames=0)  # every word forced at once
    q.add(1, WORDS)
    q.add(2, [[50, 51]])
    q.add(3, [[60]])
    offers, done = drive(q, [EPAD_ID, 10])  # say 1: EPAD, then the first token of its first word
    assert done == [] and q.queued_tokens == 6 - 1 + 2 + 1
    assert q.cancel(2) == [SayDone(2, SayEnd.CANCELLED, 0, 2)]  # a later say: the current one goes on
    assert q.next_force() == Force(11, False)
    assert q.stepped(11) == []
    assert q.cancel(1) == [SayDone(1, SayEnd.CANCELLED, 2, 4)]  # mid-say: its other words are dropped
    assert q.next_force() == Force(60, False)  # the next say starts at once (after the model's 11: no EPAD)
    assert q.stepped(60) == [SayDone(3, SayEnd.SAID, 1, 0)]
    assert q.cancel(3) == [] and q.cancel(0) == [] and q.queued_tokens == 0


def test_a_cancel_while_the_step_runs_drops_the_step_s_offer_and_all_the_rest():
    q = SayQueue(max_wait_frames=0)
    q.add(1, WORDS)
    drive(q, [EPAD_ID])
    assert q.next_force() == Force(10, False)  # the step is submitted with this ...
    assert q.cancel(0) == [SayDone(1, SayEnd.CANCELLED, 0, 6)]  # ... and the client cancels meanwhile
    assert q.stepped(10) == [] and q.next_force() is None and q.queued_tokens == 0
    q.add(2, [[70]])  # the queue serves the next say as a fresh one (after the model's 10: no EPAD)
    assert q.next_force() == Force(70, False)


def test_bounds_and_bad_says_are_typed_refusals_that_change_nothing():
    q = SayQueue(max_tokens=5, max_wait_frames=2)
    q.add(1, [[1, 2], [3]])
    for say_id, words, kind in [(1, [[4]], "bad_say"), (0, [[4]], "bad_say"),
                                (2, [[1] * 6], "say_too_long"), (3, [[4, 5], [6]], "say_queue_full")]:
        with pytest.raises(SayError) as e:
            q.add(say_id, words)
        assert e.value.kind == kind, (say_id, words)
    assert q.queued_tokens == 3
    q.add(4, [[4, 5]])  # exactly at the bound
    assert q.queued_tokens == 5
    for text, kind in [("", "bad_say"), ("   \n", "bad_say"), (None, "bad_say"), ("x" * 11, "say_too_long"),
                       ("bell\x07", "bad_say"), ("<system>", "bad_say")]:
        with pytest.raises(SayError) as e:
            check_text(text, max_chars=10)
        assert e.value.kind == kind, text
    assert check_text("two\nlines", 10) == "two\nlines"


def test_say_words_are_the_model_tokenizer_s_words(tiny_checkpoint):
    from services.talker.text import TextTokenizer

    tok = TextTokenizer.load(CheckpointPaths.open(tiny_checkpoint).tokenizer)
    words = say_words(tok, "Hello there, friend.", 100)
    assert len(words) == 3 and [tok.encode(w) for w in ("Hello", "there,", "friend.")] == words
    starts = tok.word_starts()
    assert all(starts[w[0]] for w in words) and starts[EPAD_ID] and not starts[PAD_ID]
    assert "".join(tok.piece(t) for w in words for t in w) == " Hello there, friend."
    with pytest.raises(SayError) as e:
        say_words(tok, "22", 100)  # the tiny tokenizer has no digits: nothing to say
    assert e.value.kind == "bad_say"


# ---- the engine -----------------------------------------------------------------------------------

SLOTS = 12
CONTEXT = 48  # short: rings wrap within the test
FRAMES = 48
TEXTS = ["Hello there.", "Thank you.", "How are you?"]
MAX_WAIT = 4


@pytest.fixture(scope="module")
def paths(tiny_checkpoint) -> CheckpointPaths:
    return CheckpointPaths.open(tiny_checkpoint)


def new_engine(paths, **kw) -> TalkerEngine:
    return TalkerEngine.from_checkpoint(paths, slots=SLOTS, context=CONTEXT, catch_up_buckets=(8,), **kw)


def begin(eng: TalkerEngine, slots: range) -> None:
    for slot in slots:
        sampling = SamplingParams(greedy=True) if slot % 2 else SamplingParams(seed=slot + 1)
        job = eng.begin(slot, None, "You are kind." if slot % 3 else "", sampling)
        while not job.run(64):
            pass


def forcing(queues: dict, slots: list[int]) -> tuple[TextForcing, dict]:
    offers = {s: queues[s].next_force() if s in queues else None for s in slots}
    tokens = torch.tensor([NO_FORCE if offers[s] is None else offers[s].token for s in slots])
    gated = torch.tensor([offers[s] is not None and offers[s].gated for s in slots])
    return TextForcing(tokens, gated), offers


def assert_said_in_order(text_stream: list[int], words: list[list[int]], max_gap: int) -> int:
    """Each word's tokens on consecutive frames, the words in order, each within max_gap frames after the
    last one; returns where the first word starts."""
    i, last_end, first = 0, -1, None
    for word in words:
        start = next((j for j in range(i, len(text_stream)) if text_stream[j:j + len(word)] == word), None)
        assert start is not None, f"word {word} not in the text stream after frame {i}: {text_stream}"
        if last_end >= 0:
            assert start - last_end <= max_gap, (word, start, last_end, text_stream)
        first = start if first is None else first
        i = last_end = start + len(word)
    return first



@pytest.mark.parametrize("alignment,step_ahead", [("personaplex", True), ("moshi", False), ("personaplex", False)])
def test_forced_text_is_spoken_in_order_and_compact_steps_equal_the_full_step(paths, alignment, step_ahead):
    full, compact, plain = (new_engine(paths, alignment=alignment, step_ahead=step_ahead) for _ in range(3))
    live = range(SLOTS)
    for e in (full, compact, plain):
        begin(e, live)
    said = [0, 3, 5, 6]  # greedy and sampled sessions say something; the others talk on their own
    words = {s: say_words(full.tokenizer, TEXTS[i % len(TEXTS)], 200) for i, s in enumerate(said)}
    queues = {e: {s: SayQueue(max_wait_frames=MAX_WAIT) for s in said} for e in ("full", "compact")}
    for qs in queues.values():
        for s in said:
            qs[s].add(1, words[s])
    rng, g = random.Random(1), torch.Generator().manual_seed(1)
    stepped = [0] * SLOTS
    texts = {s: [] for s in live}  # each slot's output text stream
    written = {s: [] for s in live}  # and the tokens its steps wrote
    ends: dict[int, list[SayDone]] = {s: [] for s in said}
    plain_codes = {s: [] for s in said}
    forced_codes = {s: [] for s in said}
    for t in range(FRAMES):
        n = rng.randint(1, 8) if rng.random() < 0.75 else SLOTS
        slots = sorted(rng.sample(list(live), n), key=lambda _: rng.random())
        rows = rng.choice([b for b in compact.row_buckets if b >= n])
        codes = torch.randint(0, 2048, (n, 8), generator=g)
        for i, s in enumerate(slots):
            if step_ahead and stepped[s] == 0:
                codes[i] = NO_FRAME
            stepped[s] += 1
        f_full, _ = forcing(queues["full"], slots)
        f_compact, _ = forcing(queues["compact"], slots)
        assert torch.equal(f_full.tokens, f_compact.tokens) and torch.equal(f_full.gated, f_compact.gated)
        codes_full, active = torch.zeros(SLOTS, 8, dtype=torch.long), torch.zeros(SLOTS, dtype=torch.bool)
        codes_full[slots], active[slots] = codes, True
        by_slot = TextForcing.none(SLOTS)
        by_slot.tokens[slots], by_slot.gated[slots] = f_full.tokens, f_full.gated
        want = full.step(codes_full, active, by_slot)
        got = compact.step_rows(slots, codes, rows, f_compact)
        base = plain.step(codes_full, active)  # the same sessions without any say
        where = f"frame {t}, slots {slots} in {rows} rows"
        for name in ("text_tokens", "agent_codes", "has_output", "next_text"):
            assert torch.equal(getattr(want, name), getattr(got, name)), f"{where}: {name}"
        assert_same_state(full, compact, where)
        for s in slots:
            if s in said:
                ends[s] += queues["full"][s].stepped(int(want.next_text[s]))
                queues["compact"][s].stepped(int(got.next_text[s]))
            written[s].append(int(want.next_text[s]))
            if bool(want.has_output[s]):
                texts[s].append(int(want.text_tokens[s]))
                if s in said:
                    forced_codes[s].append(want.agent_codes[s].tolist())
                    plain_codes[s].append(base.agent_codes[s].tolist())
    for s in said:
        # what a step writes is the text of the next step's output (both alignments)
        assert texts[s][-(len(written[s]) - 1):] == written[s][:-1], s
        # in order, a word's tokens on consecutive frames, each word started within the wait bound
        # (and an EPAD): from the first step for the first word, after the last word for the others
        first = assert_said_in_order(written[s], words[s], max_gap=MAX_WAIT + 1)
        assert first <= MAX_WAIT + 1
        # and between its words only padding: the say's transcript is exactly its text
        tokens = [t for w in words[s] for t in w]
        span = [t for t in written[s][first:] if t not in (PAD_ID, EPAD_ID)][:len(tokens)]
        assert span == tokens, (span, tokens)
        assert ends[s] == [SayDone(1, SayEnd.SAID, sum(map(len, words[s])), 0)], s
        assert queues["full"][s].next_force() is None  # then the model talks on its own
    # the agent codes follow the forced text: the said sessions' speech differs from their own
    assert all(forced_codes[s] != plain_codes[s] for s in said)
    # a session that says nothing is untouched by its neighbours' says
    quiet = [s for s in live if s not in said]
    assert all(torch.equal(full.hist[s], plain.hist[s]) for s in quiet)


def test_forcing_refuses_bad_tokens_with_a_typed_error_and_changes_nothing(paths):
    eng = new_engine(paths)
    begin(eng, range(2))
    before = eng.hist.clone(), eng.offset.clone()
    codes = torch.zeros(2, 8, dtype=torch.long)
    for forced in [TextForcing(torch.tensor([5, eng.text_card]), torch.zeros(2, dtype=torch.bool)),
                   TextForcing(torch.tensor([5, -2]), torch.zeros(2, dtype=torch.bool)),
                   TextForcing(torch.tensor([5]), torch.zeros(1, dtype=torch.bool)),
                   (torch.tensor([5, 5]), torch.zeros(2, dtype=torch.bool))]:
        with pytest.raises(ValueError, match="forced"):
            eng.step_rows([0, 1], codes, 8, forced)
    assert torch.equal(eng.hist, before[0]) and torch.equal(eng.offset, before[1])
    r = eng.step_rows([0, 1], codes, 8, TextForcing(torch.tensor([NO_FORCE, 42]), torch.zeros(2, dtype=torch.bool)))
    assert int(r.next_text[1]) == 42 and int(r.next_text[2]) == -1


# ---- the talker service ---------------------------------------------------------------------------

from tests.test_talker_service import (  # noqa: E402
    TICK_MS, WIDE_SLOTS, Service, config, engine, frame_msg, open_msg, user_frames)


class SayStream:
    """A Talk stream that also says things: outputs and say answers collected by a reader."""

    def __init__(self, stub, stream_id: str):
        self.call = stub.Talk()
        self.stream_id = stream_id
        self.outputs: list[talker_pb2.TalkOutput] = []
        self.answers: list[talker_pb2.TalkResponse] = []
        self.sent = 0
        self.ready = None
        self._reader = None

    async def open(self, *first: talker_pb2.TalkRequest) -> None:
        """Open, with `first` sent right behind the open (read before the prompt is live)."""
        await self.call.write(open_msg(self.stream_id))
        for req in first:
            await self.call.write(req)
        self._reader = asyncio.create_task(self._read())
        while self.ready is None:
            assert not self._reader.done(), await self.call.details()
            await asyncio.sleep(0.005)

    async def _read(self):
        while (resp := await self.call.read()) is not grpc.aio.EOF:
            kind = resp.WhichOneof("kind")
            if kind == "ready":
                self.ready = resp.ready
            elif kind == "output":
                self.outputs.append(resp.output)
            else:
                self.answers.append(resp)

    async def send_paced(self, frames, period_s: float) -> None:
        for f in frames:
            await self.call.write(frame_msg(self.sent, f))
            self.sent += 1
            await asyncio.sleep(period_s)

    async def wait_outputs(self, n: int, timeout: float = 30.0) -> None:
        async def enough():
            while len(self.outputs) < n:
                assert not self._reader.done(), await self.call.details()
                await asyncio.sleep(0.005)
        await asyncio.wait_for(enough(), timeout)

    async def write(self, req: talker_pb2.TalkRequest) -> None:
        await self.call.write(req)

    async def wait_answers(self, n: int, timeout: float = 30.0) -> None:
        async def enough():
            while len(self.answers) < n:
                assert not self._reader.done(), await self.call.details()
                await asyncio.sleep(0.005)
        await asyncio.wait_for(enough(), timeout)

    async def finish(self) -> None:
        await self.call.done_writing()
        await asyncio.wait_for(self._reader, 30)
        assert await self.call.code() == grpc.StatusCode.OK, await self.call.details()


def say_msg(say_id: int, text: str) -> talker_pb2.TalkRequest:
    return talker_pb2.TalkRequest(say=talker_pb2.TalkSay(id=say_id, text=text))


def cancel_msg(say_id: int = 0) -> talker_pb2.TalkRequest:
    return talker_pb2.TalkRequest(say_cancel=talker_pb2.TalkSayCancel(id=say_id))


def reference_with_say(ckpt, slot: int, frames, text: str, max_wait: int,
                       role: str = "reference") -> list[tuple[int, list[int]]]:
    """One session alone in the in-process engine, saying `text` from its first step (greedy)."""
    eng = engine(ckpt, role)
    job = eng.begin(slot, None, "You are a friendly assistant.", SamplingParams(greedy=True, seed=1))
    while not job.run(64):
        pass
    q = SayQueue(max_wait_frames=max_wait)
    q.add(1, say_words(eng.tokenizer, text, 2000))
    out = []
    for f in frames:
        codes = torch.zeros(eng.num_slots, 8, dtype=torch.long)
        codes[slot] = torch.tensor(f)
        active = torch.zeros(eng.num_slots, dtype=torch.bool)
        active[slot] = True
        offer = q.next_force()
        forced = TextForcing.none(eng.num_slots)
        if offer is not None:
            forced.tokens[slot], forced.gated[slot] = offer.token, offer.gated
        r = eng.step(codes, active, forced)
        q.stepped(int(r.next_text[slot]))
        if bool(r.has_output[slot]):
            out.append((int(r.text_tokens[slot]), r.agent_codes[slot].tolist()))
    eng.release(slot)
    return out


async def test_a_say_is_spoken_in_order_with_n_outputs_for_n_inputs_as_the_engine_says_it(tiny_checkpoint):
    text = "Hello there, how are you?"
    frames = user_frames(40, 5)
    async with Service(config(tiny_checkpoint, say_max_wait_frames=3)) as s:
        words = say_words(s.svc.engine.tokenizer, text, 2000)
        sess = SayStream(s.stub, "say")
        await sess.open(say_msg(1, text))  # queued before the prompt is live: said from the first step
        await sess.send_paced(frames, TICK_MS / 1000)
        await sess.wait_answers(1)
        await sess.finish()
        await s.wait_free()
    done = sess.answers[0].say_done
    assert (done.id, done.end, done.tokens_said, done.tokens_dropped) == (1, talker_pb2.SAY_END_SAID,
                                                                        sum(map(len, words)), 0)
    assert len(sess.outputs) == len(frames) - sess.ready.output_delay_frames
    assert [o.input_seq for o in sess.outputs] == list(range(sess.ready.output_delay_frames, len(frames)))
    tokens = [o.text_token for o in sess.outputs]
    assert_said_in_order(tokens, words, max_gap=3 + 2)
    # the transcript carries it as the model's own words
    assert text in "".join(o.text_piece for o in sess.outputs)
    want = reference_with_say(tiny_checkpoint, sess.ready.slot, frames, text, max_wait=3)
    assert [(o.text_token, list(o.agent_codes)) for o in sess.outputs] == want


async def test_a_cancel_midway_drops_the_rest_and_bounds_are_typed_refusals(tiny_checkpoint):
    long_text = " ".join(["hello there friend"] * 20)
    async with Service(config(tiny_checkpoint, say_max_wait_frames=0, max_say_chars=400,
                              max_say_tokens=200)) as s:
        tok = s.svc.engine.tokenizer
        total = sum(map(len, say_words(tok, long_text, 400)))
        assert 100 < total < 200  # one fits the session's queue, two do not
        sess = SayStream(s.stub, "cancel")
        await sess.open()
        frames = user_frames(40, 6)
        await sess.write(say_msg(1, long_text))
        await sess.write(say_msg(2, "x" * 401))  # over the characters
        await sess.write(say_msg(3, long_text))  # over the queued tokens, with say 1 queued
        await sess.write(say_msg(4, "\x07"))
        await sess.write(say_msg(1, "again"))  # say 1 is still pending
        await sess.wait_answers(4)
        refused = {a.say_refused.id: a.say_refused.kind for a in sess.answers}
        assert refused == {2: "say_too_long", 3: "say_queue_full", 4: "bad_say", 1: "bad_say"}, sess.answers
        await sess.send_paced(frames[:12], TICK_MS / 1000)
        await sess.write(cancel_msg(0))
        await sess.wait_answers(5)
        done = sess.answers[4].say_done
        assert done.id == 1 and done.end == talker_pb2.SAY_END_CANCELLED
        assert 0 < done.tokens_said < total and done.tokens_said + done.tokens_dropped == total
        await sess.write(say_msg(5, "Thank you."))  # the queue has room again; the session goes on
        await sess.send_paced(frames[12:], TICK_MS / 1000)
        await sess.wait_answers(6)
        await sess.finish()
        await s.wait_free()
    assert sess.answers[5].say_done.id == 5 and sess.answers[5].say_done.end == talker_pb2.SAY_END_SAID
    assert len(sess.outputs) == len(frames) - sess.ready.output_delay_frames
    # every frame was forced (no wait) until the cancel: the outputs carry exactly the said prefix
    said = [t for w in say_words(tok, long_text, 400) for t in w][:done.tokens_said]
    stream = [o.text_token for o in sess.outputs]
    run = [t for t in stream if t != EPAD_ID]
    assert any(run[i:i + len(said)] == said for i in range(len(run))), (said, stream)


async def test_a_say_goes_on_through_compact_catch_up_steps(tiny_checkpoint):
    """A session saying something falls behind (its frames held back, then delivered at once): compact
    catch-up steps (engine.step_rows) carry its forcing, and its outputs are token for token the
    in-process engine's, one step per frame."""
    text = "Thank you for your order, how are you today?"
    period, frames = 0.2, user_frames(36, 8)
    cfg = config(tiny_checkpoint, slots=WIDE_SLOTS, tick_ms=period * 1000, say_max_wait_frames=2,
                 max_backlog_s=20.0)
    async with Service(cfg, engine(tiny_checkpoint, "wide-served")) as s:
        sess = SayStream(s.stub, "behind")
        await sess.open(say_msg(1, text))
        await sess.send_paced(frames[:4], period)
        await sess.send_paced(frames[4:20], 0.0)  # 16 frames at once: caught up in compact steps
        await sess.wait_outputs(20 - sess.ready.output_delay_frames)
        await sess.send_paced(frames[20:], period / 4)
        await sess.wait_answers(1, timeout=60)
        await sess.finish()
        compact = s.metric("duplex_talker_catch_up_steps_total", rows="8")
    assert compact >= 1
    assert sess.answers[0].say_done.end == talker_pb2.SAY_END_SAID
    assert text in "".join(o.text_piece for o in sess.outputs)
    want = reference_with_say(tiny_checkpoint, sess.ready.slot, frames, text, max_wait=2, role="wide-reference")
    assert [(o.text_token, list(o.agent_codes)) for o in sess.outputs] == want
