"""Recording a new voice stays off the tick path (issue 31): its work on the compute thread comes in
bounded pieces between the ticks of the sessions already talking, and the recording is what it was.

On the tiny checkpoint, on the CPU (CUDA graphs, which run these pieces on the GPU, are checked by
bench/prefill_graph_check.py):
- a voice recorded by the talker's recorder, then a session with it on the conversation clock: its KV
  prefix is computed by the session's prefill pieces, at most prefill_chunk_frames positions each, one
  riding each main step, while a bystander gets its output at every tick; each piece's cost on the
  compute thread is in duplex_talker_voice_compute_seconds and the engine's log;
- the recording equals voice_recorder.record (the reference's steps, as the offline tool runs them) bit
  for bit;
- a voice's prefix computed by pieces of several sessions (one closed half-way) is the prefix computed
  by one session, and a later session copies it (every KV storage format).
"""

from __future__ import annotations

import asyncio
import logging
import math

import pytest
import torch

from services.common import voice_audio
from services.common.checkpoint import CheckpointPaths
from services.common.slots import SlotPool
from services.codec.mimi import MimiConfig, MimiModel
from services.talker import prompt
from services.talker.clock import ConversationClock
from services.talker.engine import SamplingParams, TalkerEngine
from services.talker.session import Output, SessionStatus
from services.talker.voice_recorder import VoiceRecorder, record
from tests.test_talker_service import talker_metrics, user_frames, value
from tests.test_voices_from_audio import speech_like

pytestmark = pytest.mark.timeout(300)

GREEDY = SamplingParams(greedy=True, seed=1)
CHUNK = 8  # prefill_chunk_frames: a 3 s voice (37 prefix positions) takes 5 pieces


@pytest.fixture(scope="module")
def paths(tiny_checkpoint) -> CheckpointPaths:
    return CheckpointPaths.open(tiny_checkpoint)


def compute_s(metrics, part: str) -> tuple[int, float]:
    return (int(value(metrics, "duplex_talker_voice_compute_seconds_count", part=part)),
            value(metrics, "duplex_talker_voice_compute_seconds_sum", part=part))


async def test_a_new_voices_work_comes_in_bounded_pieces_between_a_bystanders_ticks(paths, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="talker.engine")
    metrics = talker_metrics()
    eng = TalkerEngine.from_checkpoint(paths, slots=3)
    clock = ConversationClock(eng, SlotPool(3), tick_s=0.08, max_backlog_frames=25, prefill_chunk_frames=CHUNK,
                              metrics=metrics)
    recorder = VoiceRecorder(paths, eng, clock.compute, tmp_path / "voices", metrics=metrics)
    loop = asyncio.get_running_loop()
    try:
        bystander = clock.open("bystander", clock.pool.acquire(), None, "", GREEDY, 1)
        await clock.prefill_in_slack(loop.time() + 10)
        assert bystander.status is SessionStatus.LIVE

        pcm = speech_like(3.0, voice_audio.SAMPLE_RATE, seed=21)[0]
        lease = await recorder.resolve("newcomer", pcm)
        voice = eng._voice_files[lease.key]
        positions = voice.frames - 1
        assert compute_s(metrics, "lookup")[0] == 1  # one call on the compute thread, measured
        assert compute_s(metrics, "prefix_step") == (0, 0.0)  # nothing of the prefix yet: it waits for a session

        newcomer = clock.open("newcomer", clock.pool.acquire(), lease.key, "Hi.", GREEDY, 1)
        frames = user_frames(40, 5)
        per_tick, outputs, t = [], 0, 0
        while newcomer.status is not SessionStatus.LIVE:
            clock.push(bystander, t, frames[t])
            assert await clock.tick(loop.time() + 10) == 1  # the main step, a piece of the newcomer riding it
            while not bystander.outbox.empty():
                outputs += isinstance(bystander.outbox.get_nowait(), Output)
            t += 1
            assert outputs == t  # the bystander's output at every tick, the newcomer's pieces between them
            per_tick.append(newcomer.job.voice_frames_run if newcomer.job is not None else 0)
        lease.release()

        # The voice's prefix: at most CHUNK positions a piece, one piece a tick, all of it computed once.
        voice_ticks = [n for n in per_tick if n]
        assert max(voice_ticks) <= CHUNK and sum(voice_ticks) == positions
        assert len(voice_ticks) == math.ceil(positions / CHUNK) == 5
        assert per_tick[: len(voice_ticks)] == voice_ticks  # the first pieces, back to back: no tick without one
        # Each piece's cost on the compute thread, as the next GPU run reads it (bench/voice_recording.py).
        count, seconds = compute_s(metrics, "prefix_step")
        assert count == len(voice_ticks) and seconds > 0
        assert compute_s(metrics, "prefix_alone") == (0, 0.0)
        line = next(r.getMessage() for r in caplog.records if "KV prefix of" in r.getMessage())
        assert f"voice {lease.key}: KV prefix of {positions} frames computed in 5 piece(s)" in line

        # The prefix copied by a second session is the one the first computed in its slot, bit for bit.
        prefix = eng._voice_kv[lease.key]
        job = eng.begin(2, lease.key, "Hi.", GREEDY)
        assert job.run(job.total_frames - positions) and job.voice_frames_run == 0  # copied: costs no piece
        for slot in (newcomer.slot, 2):
            assert torch.equal(eng.kv.k[:, slot, :, :positions], prefix.kv.k[:, 0])
            assert torch.equal(eng.kv.v[:, slot, :, :positions], prefix.kv.v[:, 0])
        eng.release(2)
    finally:
        recorder.close()
        for s in list(clock.sessions.values()):
            clock.close(s)
        await clock.stop()


async def test_the_recorders_recording_is_the_reference_recording_bit_for_bit(paths, tmp_path):
    """What the recorder hands the engine (Mimi in its child process, the columns on a worker thread, the
    embedding lookup launched on the compute thread and copied to the host off it) is what
    voice_recorder.record gives: the steps as they ran before the lookup left the tick path."""
    eng = TalkerEngine.from_checkpoint(paths, slots=2)

    async def inline(fn):
        return fn()

    recorder = VoiceRecorder(paths, eng, inline, tmp_path / "voices")
    pcm = speech_like(2.0, voice_audio.SAMPLE_RATE, seed=22)[0]
    try:
        key = (await recorder.resolve("v", pcm)).key
    finally:
        recorder.close()
    ours = eng._voice_files[key]
    section = paths.serve_config()
    mimi = MimiModel.load(paths.mimi, MimiConfig.from_dict(section["mimi"]))
    theirs = record(pcm, mimi, eng.model.embed, torch.tensor(eng.cfg.delays),
                    prompt.initial_tokens(eng.text_card, eng.card, eng.cfg.num_streams))
    assert ours.embeddings.dtype == theirs.embeddings.dtype == torch.bfloat16
    assert torch.equal(ours.embeddings, theirs.embeddings) and torch.equal(ours.cache, theirs.cache)


@pytest.mark.parametrize("kv_bits", [None, 8, 4], ids=["float", "fp8", "int4"])
def test_a_prefix_computed_by_several_sessions_pieces_is_the_one_sessions_prefix(paths, kv_bits):
    """A session closed half-way through a new voice's prefix leaves what it computed; the next session
    continues from there, in its own slot, and the prefix is the one a session computing it alone gets,
    bit for bit (the same chunks)."""
    lm = TalkerEngine.from_checkpoint(paths, slots=1)
    codes = torch.randint(0, lm.card, (30, 8), generator=torch.Generator().manual_seed(4))
    voice = prompt.make_voice(lm.model.embed, codes, torch.tensor(lm.cfg.delays),
                              prompt.initial_tokens(lm.text_card, lm.card, lm.cfg.num_streams))
    positions = voice.frames - 1
    assert positions > 2 * CHUNK

    alone = TalkerEngine.from_checkpoint(paths, slots=3, kv_bits=kv_bits)
    alone.add_voice("v", voice)
    job = alone.begin(0, "v", "Hi.", GREEDY)
    while not job.run(CHUNK):
        pass
    reference = alone._voice_kv["v"].kv

    eng = TalkerEngine.from_checkpoint(paths, slots=3, kv_bits=kv_bits)
    eng.add_voice("v", voice)
    first = eng.begin(0, "v", "Hi.", GREEDY)
    assert not first.run(CHUNK) and first.voice_frames_run == CHUNK
    eng.release(0)  # closed: its piece stays in the voice's prefix
    second = eng.begin(1, "v", "Hi.", GREEDY)
    computed = []
    while not second.run(CHUNK):
        computed.append(second.voice_frames_run)
    assert sum(computed) == positions - CHUNK and max(computed) <= CHUNK
    prefix = eng._voice_kv["v"]
    assert prefix.complete and int(prefix.kv.length[0]) == positions
    for ours, theirs in zip(prefix.kv._stores(), reference._stores(), strict=True):
        assert torch.equal(ours, theirs)
    third = eng.begin(2, "v", "Hi.", GREEDY)
    assert third.run(third.total_frames - positions) and third.voice_frames_run == 0
    for slot in (1, 2):
        for store, theirs in zip(eng.kv._stores(), prefix.kv._stores(), strict=True):
            assert torch.equal(store[:, slot, :, :positions], theirs[:, 0])
