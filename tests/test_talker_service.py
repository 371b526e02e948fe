"""The Talker service over real gRPC sockets: sessions on the 80 ms conversation clock.

Most tests run the service in-process (a real grpc.aio server on a real port, the real
engine on the tiny checkpoint) with a short tick so the suite stays fast; the last one
starts `python -m services.talker` as a real subprocess. "Reference" outputs come from
running the same engine in-process, one session alone, with the same inputs (greedy).
"""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from dataclasses import replace

import grpc
import pytest
import torch

from duplex.v1 import common_pb2, talker_pb2, talker_pb2_grpc
from services.common.checkpoint import CheckpointPaths
from services.common.stage_server import ADMIN_TOKEN_ENV
from services.talker.config import TalkerConfig
from services.talker.server import TalkerService
from services.talker.session import SessionStatus

LIVE = SessionStatus.LIVE

pytestmark = pytest.mark.timeout(120)

# Short: the tiny model's attention window (32 frames) must hold voice + silence + persona + silence.
PERSONA = "You are a friendly assistant."
OTHER_PERSONA = "Be kind."
TICK_MS = 40.0
# One slot count for every in-process test: engines are loaded once per module (see `engine`).
SLOTS = 3
# ... but one: the catch-up test's cell is wide enough for a compact step (engine.CATCH_UP_BUCKETS)
# below it, and its reference engine as wide (the CPU's GEMMs give a row the same bits from 8 rows on).
WIDE_SLOTS = 12


def user_frames(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2048, (n, 8), generator=g).tolist()


def first_voice(ckpt) -> str:
    names = CheckpointPaths(ckpt).voice_names()
    assert names, "the tiny checkpoint bundles at least one voice"
    return names[0]


# ---- in-process reference ----------------------------------------------------------------------

_ENGINES: dict = {}


def engine(ckpt, role: str):
    """One engine per role for the whole module (loading takes seconds): "served" steps ahead as
    TalkerService builds it; "reference" and "classic" (the clock's tick tests) take frame j at step j;
    "wide-served" and "wide-reference" are the same with WIDE_SLOTS slots.
    An engine passes from test to test; engine.begin must reset a slot completely (tested)."""
    from services.talker.engine import TalkerEngine

    if role not in _ENGINES:
        paths = CheckpointPaths.open(ckpt, require=("lm", "tokenizer"))
        # served as TalkerService builds it (stepping ahead); the reference steps the classic way
        _ENGINES[role] = TalkerEngine.from_checkpoint(paths, slots=WIDE_SLOTS if role.startswith("wide") else SLOTS,
                                                      step_ahead=role.endswith("served"))
    return _ENGINES[role]


def reference_outputs(ckpt, slot: int, voice, persona: str, frames, seed: int = 1, role: str = "reference"):
    """(text_token, agent_codes) per output of one session run alone in an engine slot."""
    from services.talker.engine import SamplingParams

    eng = engine(ckpt, role)
    slots = eng.num_slots
    job = eng.begin(slot, voice, persona, SamplingParams(greedy=True, seed=seed))
    while not job.run(64):
        pass
    out = []
    for f in frames:
        codes = torch.zeros(slots, 8, dtype=torch.long)
        codes[slot] = torch.tensor(f)
        active = torch.zeros(slots, dtype=torch.bool)
        active[slot] = True
        r = eng.step(codes, active)
        if bool(r.has_output[slot]):
            out.append((int(r.text_tokens[slot]), r.agent_codes[slot].tolist()))
    eng.release(slot)
    return out


# ---- service and client helpers ----------------------------------------------------------------

def config(ckpt, **kw) -> TalkerConfig:
    base = TalkerConfig(checkpoint=str(ckpt), port=0, metrics_port=0, slots=SLOTS, tick_ms=TICK_MS,
                        drain_deadline_s=2.0)
    return replace(base, **kw)


class Service:
    def __init__(self, cfg: TalkerConfig, eng=None):
        self.cfg, self.eng = cfg, eng

    async def __aenter__(self):
        self.svc = await TalkerService(self.cfg, self.eng or engine(self.cfg.checkpoint, "served")).start()
        self.channel = grpc.aio.insecure_channel(self.svc.address)
        self.stub = talker_pb2_grpc.TalkerStub(self.channel)
        return self

    async def __aexit__(self, *exc):
        await self.channel.close()
        await self.svc.stop()

    def metric(self, name: str, **labels) -> float:
        v = self.svc.runtime.metrics.registry.get_sample_value(name, labels)
        return 0.0 if v is None else v

    async def capacity(self) -> common_pb2.Capacity:
        return await self.stub.GetCapacity(common_pb2.CapacityRequest())

    async def wait_free(self, n: int = SLOTS, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while (await self.capacity()).free_slots != n:
            assert time.monotonic() < deadline, f"free slots never reached {n}: {await self.capacity()}"
            await asyncio.sleep(0.01)


def open_msg(stream_id: str, voice: str = "", persona: str = PERSONA, greedy: bool = True, seed: int = 1, **sampling):
    return talker_pb2.TalkRequest(open=talker_pb2.TalkOpen(
        stream=common_pb2.StreamOpen(stream_id=stream_id), voice=voice, persona=persona,
        sampling=talker_pb2.Sampling(greedy=greedy, seed=seed, **sampling)))


def frame_msg(seq: int, codes) -> talker_pb2.TalkRequest:
    return talker_pb2.TalkRequest(frame=common_pb2.CodesFrame(seq=seq, codes=codes))


class Session:
    """One Talk stream from the client side; outputs are collected by a background reader."""

    def __init__(self, stub, stream_id: str, **open_kw):
        self.call = stub.Talk()
        self.stream_id = stream_id
        self.open_kw = open_kw
        self.outputs: list[talker_pb2.TalkOutput] = []
        self.output_times: list[float] = []
        self.sent_times: list[float] = []
        self.sent = 0
        self.ready: talker_pb2.TalkReady | None = None
        self._reader: asyncio.Task | None = None

    async def open(self) -> talker_pb2.TalkReady:
        await self.call.write(open_msg(self.stream_id, **self.open_kw))
        resp = await self.call.read()
        assert resp is not grpc.aio.EOF and resp.WhichOneof("kind") == "ready", resp
        self.ready = resp.ready
        self._reader = asyncio.create_task(self._read())
        return self.ready

    async def _read(self):
        while True:
            resp = await self.call.read()
            if resp is grpc.aio.EOF:
                return
            assert resp.WhichOneof("kind") == "output"
            self.outputs.append(resp.output)
            self.output_times.append(time.monotonic())

    async def send(self, codes) -> None:
        self.sent_times.append(time.monotonic())
        await self.call.write(frame_msg(self.sent, codes))
        self.sent += 1

    async def send_paced(self, frames, period_s: float) -> None:
        t0 = time.monotonic()
        for i, f in enumerate(frames):
            await asyncio.sleep(max(0.0, t0 + i * period_s - time.monotonic()))
            await self.send(f)

    async def finish(self) -> list[talker_pb2.TalkOutput]:
        """Half-close and wait for the stream's OK end."""
        await self.call.done_writing()
        await asyncio.wait_for(self._reader, 30)
        assert await self.call.code() == grpc.StatusCode.OK, await self.call.details()
        return self.outputs

    async def wait_outputs(self, n: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.outputs) < n:
            assert time.monotonic() < deadline, f"{self.stream_id}: {len(self.outputs)} outputs, expected {n}"
            assert not self._reader.done() or len(self.outputs) >= n, f"stream ended: {await self.call.code()}"
            await asyncio.sleep(0.005)

    async def error(self, timeout: float = 30.0) -> tuple[grpc.StatusCode, str]:
        """The status the stream ended with (waits for it)."""
        if self._reader is not None:
            try:
                await asyncio.wait_for(self._reader, timeout)
            except grpc.aio.AioRpcError:
                pass
        return await asyncio.wait_for(self.call.code(), timeout), await self.call.details()

    def as_pairs(self):
        return [(o.text_token, list(o.agent_codes)) for o in self.outputs]


async def open_error(stub, *requests) -> tuple[grpc.StatusCode, str]:
    """Send `requests` on a new stream; return the status it ends with (must not be OK)."""
    call = stub.Talk()
    for r in requests:
        await call.write(r)

    async def read_to_end():
        while (await call.read()) is not grpc.aio.EOF:
            pass

    with pytest.raises(grpc.aio.AioRpcError) as e:
        await asyncio.wait_for(read_to_end(), 30)  # a TimeoutError here means: not refused
    return e.value.code(), e.value.details()


# ---- tests ----------------------------------------------------------------------------------

async def test_open_ready_then_paced_outputs(tiny_checkpoint):
    voice = first_voice(tiny_checkpoint)
    async with Service(config(tiny_checkpoint)) as s:
        sess = Session(s.stub, "a", voice=voice, seed=1234)
        ready = await sess.open()
        assert ready.slot == 0 and ready.seed == 1234
        assert ready.prefill_frames > 12  # voice + 6 silence + persona tokens + 6 silence
        assert ready.prefill_ms > 0
        delay = ready.output_delay_frames
        assert delay == s.svc.engine.output_delay_frames
        n = 12
        await sess.send_paced(user_frames(n, 0), TICK_MS / 1000)
        outs = await sess.finish()
        assert len(outs) == n - delay
        for i, o in enumerate(outs):
            assert o.seq == i and o.input_seq == i + delay
            assert len(o.agent_codes) == 8 and all(0 <= c < 2048 for c in o.agent_codes)
            assert o.text_piece == s.svc.engine.text_piece(o.text_token)
        # steps 0..n-1, and the step that took the last input if it ran before the input ended (step ahead)
        assert n <= s.metric("duplex_talker_frames_advanced_total") <= n + 1
        assert 1 <= s.metric("duplex_talker_tick_seconds_count") <= n + 1  # ticks that stepped
        await s.wait_free()


async def test_greedy_output_equals_in_process_engine(tiny_checkpoint):
    voice = first_voice(tiny_checkpoint)
    frames = user_frames(16, 1)
    async with Service(config(tiny_checkpoint)) as s:
        sess = Session(s.stub, "g", voice=voice)
        ready = await sess.open()
        await sess.send_paced(frames, TICK_MS / 1000)
        await sess.finish()
    assert sess.as_pairs() == reference_outputs(tiny_checkpoint, ready.slot, voice, PERSONA, frames)


async def test_concurrent_sessions_with_different_starts(tiny_checkpoint):
    """Three sessions in one batch, opened at different times, each equals its solo run."""
    period = TICK_MS / 1000
    plans = [("s0", PERSONA, 0.0, 14), ("s1", OTHER_PERSONA, 3.3 * period, 10), ("s2", PERSONA, 6.7 * period, 9)]
    async with Service(config(tiny_checkpoint)) as s:

        async def run(name, persona, start, n):
            await asyncio.sleep(start)
            sess = Session(s.stub, name, persona=persona)
            ready = await sess.open()
            frames = user_frames(n, 100 + int(name[1:]))
            await sess.send_paced(frames, period)
            await sess.finish()
            return sess, ready, persona, frames

        results = await asyncio.gather(*(run(*p) for p in plans))
    assert len({r.slot for _, r, _, _ in results}) == 3
    for sess, ready, persona, frames in results:
        assert sess.as_pairs() == reference_outputs(tiny_checkpoint, ready.slot, None, persona, frames), sess.stream_id


async def test_stalled_session_is_not_advanced_and_does_not_delay_others(tiny_checkpoint):
    period = TICK_MS / 1000
    async with Service(config(tiny_checkpoint)) as s:
        quiet, busy = Session(s.stub, "quiet"), Session(s.stub, "busy")
        await quiet.open()
        await busy.open()
        delay = quiet.ready.output_delay_frames
        qframes = user_frames(10, 5)
        await quiet.send_paced(qframes[:4], period)
        await quiet.wait_outputs(4 - delay)
        skipped0 = s.metric("duplex_talker_frames_skipped_total")
        # quiet says nothing for 20 ticks while busy talks at the frame rate: busy gets every
        # output while quiet is still silent (nothing waits for quiet's input) ...
        await busy.send_paced(user_frames(20, 6), period)
        await busy.wait_outputs(20 - delay)
        assert len(quiet.outputs) == 4 - delay  # ... and quiet gets no invented steps
        assert s.metric("duplex_talker_frames_skipped_total") - skipped0 >= 10
        # quiet resumes exactly where it stopped: its whole output is a solo run of its inputs.
        await quiet.send_paced(qframes[4:], period)
        await quiet.finish()
        await busy.finish()
        assert quiet.as_pairs() == reference_outputs(tiny_checkpoint, quiet.ready.slot, None, PERSONA, qframes)


async def test_backlog_over_bound_is_refused_on_that_stream_only(tiny_checkpoint):
    # A 1 s tick and a 4-frame bound: 5 frames sent between two ticks are one too many.
    async with Service(config(tiny_checkpoint, tick_ms=1000.0, max_backlog_s=4.0)) as s:
        flood, calm = Session(s.stub, "flood"), Session(s.stub, "calm")
        await flood.open()
        await calm.open()
        # A write racing the server's end of the stream makes grpc's client report its own
        # INTERNAL instead of the server's status, so pause briefly after each write.
        for f in user_frames(200, 7):
            await flood.send(f)
            await asyncio.sleep(0.02)
            if flood._reader.done():
                break
        code, details = await flood.error()
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "backlog" in details, details
        assert s.metric("duplex_talker_backlog_refusals_total") == 1
        await calm.send_paced(user_frames(3, 8), 0.0)
        await calm.wait_outputs(3 - calm.ready.output_delay_frames, timeout=10)
        await calm.finish()


async def test_burst_is_caught_up_with_extra_steps(tiny_checkpoint):
    tick = 0.4  # long enough for several tiny steps per period even on a loaded machine
    async with Service(config(tiny_checkpoint, tick_ms=tick * 1000, max_backlog_s=20.0)) as s:
        sess = Session(s.stub, "late")
        await sess.open()
        delay = sess.ready.output_delay_frames
        frames = user_frames(12, 9)
        t0 = time.monotonic()
        for f in frames:  # a late client delivers 12 frames at once
            await sess.send(f)
        await sess.wait_outputs(12 - delay)
        elapsed = time.monotonic() - t0
        # One step per tick would take 12 ticks; catch-up steps use the rest of each period.
        assert elapsed < 0.6 * 12 * tick, elapsed
        assert s.metric("duplex_talker_catch_up_steps_total", rows=str(SLOTS)) >= 1
        await sess.finish()
        assert sess.as_pairs() == reference_outputs(tiny_checkpoint, sess.ready.slot, None, PERSONA, frames)


class GpuShapedEngine:
    """The served engine with a GPU's cost shape, where a step costs what its rows cost whoever is
    active: a step of every slot takes full_s more, a compact one compact_s more, and its warm-up
    times (the clock's prior for catch-up sizes not yet measured) say the same."""

    def __init__(self, eng, full_s: float, compact_s: float):
        self._eng, self.full_s, self.compact_s = eng, full_s, compact_s

    def step(self, codes, active):
        time.sleep(self.full_s)
        return self._eng.step(codes, active)

    def step_rows(self, slots, codes, rows):
        time.sleep(self.full_s if rows == self._eng.num_slots else self.compact_s)
        return self._eng.step_rows(slots, codes, rows)

    @property
    def warm_step_s(self) -> dict[int, float]:
        return {rows: self.full_s if rows == self._eng.num_slots else self.compact_s for rows in self.row_buckets}

    def __getattr__(self, name):
        return getattr(self._eng, name)


async def test_a_session_that_falls_behind_catches_up_while_others_stream(tiny_checkpoint):
    """A cell whose main step takes half the period, where a catch-up step of every slot never fits
    beside it: one session's frames stall for three periods and then come at once while three others
    stream. Compact catch-up steps bring it back to lag 0 in the tick they arrive (no forced step,
    no step of every slot), its later outputs leave as soon as their inputs arrive, like the others',
    and every session's outputs are token for token its run alone."""
    period, n = 0.4, 14  # long: the CPU's own step time (10-60 ms, loaded) stays small beside the shaped costs
    served = GpuShapedEngine(engine(tiny_checkpoint, "wide-served"), full_s=0.5 * period, compact_s=0.05 * period)
    assert served.row_buckets == (8, WIDE_SLOTS)
    cfg = config(tiny_checkpoint, slots=WIDE_SLOTS, tick_ms=period * 1000)
    async with Service(cfg, served) as s:
        names = ("late", "a", "b", "c")
        sessions = {name: Session(s.stub, name) for name in names}
        for sess in sessions.values():
            await sess.open()
        frames = {name: user_frames(n, 200 + i) for i, name in enumerate(names)}

        async def stall_then_burst(sess, fs):
            await sess.send_paced(fs[:5], period)
            await asyncio.sleep(3 * period)  # frames 5..7 held back by the network ...
            for f in fs[5:8]:
                await sess.send(f)  # ... then delivered together
            await sess.send_paced(fs[8:], period)

        await asyncio.gather(stall_then_burst(sessions["late"], frames["late"]),
                             *(sessions[x].send_paced(frames[x], period) for x in names[1:]))
        for sess in sessions.values():
            await sess.finish()
        compact = s.metric("duplex_talker_catch_up_steps_total", rows="8")
        full = s.metric("duplex_talker_catch_up_steps_total", rows=str(WIDE_SLOTS))
        forced = s.metric("duplex_talker_catch_up_steps_forced_total")
        behind = s.metric("duplex_talker_sessions_behind_sum")
    assert compact >= 1 and full == 0, (compact, full, forced)
    assert behind <= 3, behind  # session-ticks a frame behind: the burst's tick (and jitter), not every tick after
    late = sessions["late"]
    delay = late.ready.output_delay_frames
    waits = [late.output_times[i] - late.sent_times[o.input_seq] for i, o in enumerate(late.outputs)]
    # the outputs answering the last frames leave as their inputs arrive (one frame behind, each
    # would wait for the next tick)
    assert sorted(waits[-5:])[2] < 0.25 * period, waits
    assert len(late.outputs) == n - delay
    for i, name in enumerate(names):
        want = reference_outputs(tiny_checkpoint, sessions[name].ready.slot, None, PERSONA, frames[name],
                                 role="wide-reference")
        assert sessions[name].as_pairs() == want, name


async def test_full_talker_answers_resource_exhausted(tiny_checkpoint):
    async with Service(config(tiny_checkpoint)) as s:
        sessions = [Session(s.stub, f"s{i}") for i in range(SLOTS)]
        for sess in sessions:
            await sess.open()
        cap = await s.capacity()
        assert (cap.total_slots, cap.free_slots, cap.active_streams, cap.stage) == (SLOTS, 0, SLOTS, "talker")
        t0 = time.monotonic()
        code, details = await open_error(s.stub, open_msg("one-too-many"))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "slot" in details
        assert time.monotonic() - t0 < 2.0  # at once: no waiting for a slot
        await sessions[0].finish()
        await s.wait_free(1)
        late = Session(s.stub, "one-too-many")
        await late.open()
        for sess in [*sessions[1:], late]:
            await sess.finish()


async def test_slot_reuse_after_cancel_and_disconnect_carries_nothing(tiny_checkpoint):
    frames = user_frames(10, 11)
    """After cancel or a dropped connection the slot is reused (lowest free slot first) and the new
    session's greedy output equals a solo run in the reference engine, whose slot had other
    predecessors: any state left behind would make them differ."""
    async with Service(config(tiny_checkpoint)) as s:
        # 1) cancel mid-conversation
        old = Session(s.stub, "old", persona=OTHER_PERSONA, greedy=False, seed=99)
        await old.open()
        await old.send_paced(user_frames(8, 12), TICK_MS / 1000)
        await old.wait_outputs(4)
        old.call.cancel()
        await s.wait_free()
        new = Session(s.stub, "new")
        assert (await new.open()).slot == 0
        await new.send_paced(frames, TICK_MS / 1000)
        await new.finish()
        expected = reference_outputs(tiny_checkpoint, 0, None, PERSONA, frames)
        assert new.as_pairs() == expected
        # 2) a client that drops its connection mid-stream (a separate channel, closed hard)
        await s.wait_free()
        channel = grpc.aio.insecure_channel(s.svc.address)
        dropped = Session(talker_pb2_grpc.TalkerStub(channel), "dropped", persona=OTHER_PERSONA)
        await dropped.open()
        await dropped.send_paced(user_frames(6, 13), TICK_MS / 1000)
        await channel.close(grace=None)
        await s.wait_free()
        again = Session(s.stub, "again")
        assert (await again.open()).slot == 0
        await again.send_paced(frames, TICK_MS / 1000)
        await again.finish()
        assert again.as_pairs() == expected


BAD_OPENS = [
    (open_msg("v", voice="../model.safetensors"), grpc.StatusCode.INVALID_ARGUMENT, "voice"),
    (open_msg("v", voice="NOPE.pt"), grpc.StatusCode.INVALID_ARGUMENT, "voice"),
    (open_msg("p", persona="x" * 100_001), grpc.StatusCode.INVALID_ARGUMENT, "persona"),  # over max_persona_chars
    (open_msg("p", persona="bad\x00byte"), grpc.StatusCode.INVALID_ARGUMENT, "persona"),
    (open_msg("t", greedy=False, text_temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (open_msg("t", greedy=False, audio_temperature=float("nan")), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (open_msg("k", greedy=False, audio_top_k=5000), grpc.StatusCode.INVALID_ARGUMENT, "top_k"),
    (open_msg(""), grpc.StatusCode.INVALID_ARGUMENT, "stream id"),
    (frame_msg(0, [1] * 8), grpc.StatusCode.INVALID_ARGUMENT, "open"),
]


async def test_bad_open_and_bad_frames_get_typed_errors_and_change_nothing(tiny_checkpoint):
    # A persona within the character bound whose prompt is longer than the model's attention
    # window (every copy is several tokens): only engine.begin can refuse it, after a slot was taken.
    too_long = "You are a friendly assistant. " * (engine(tiny_checkpoint, "served").context // 4 + 1)
    async with Service(config(tiny_checkpoint, max_persona_chars=100_000)) as s:
        bad_opens = [*BAD_OPENS, (open_msg("w", persona=too_long), grpc.StatusCode.INVALID_ARGUMENT, "persona")]
        for req, code, word in bad_opens:
            got, details = await open_error(s.stub, req)
            assert got == code and word in details.lower(), (req, got, details)
        await s.wait_free(SLOTS)  # every refused session left its slot (if it took one) free
        live = Session(s.stub, "live")
        await live.open()
        got, _ = await open_error(s.stub, open_msg("live"))
        assert got == grpc.StatusCode.ALREADY_EXISTS
        bad_frames = [
            ([frame_msg(0, [1] * 7)], grpc.StatusCode.INVALID_ARGUMENT, "8"),
            ([frame_msg(0, [1] * 7 + [2048])], grpc.StatusCode.INVALID_ARGUMENT, "2048"),
            ([frame_msg(0, [1] * 8), frame_msg(0, [1] * 8)], grpc.StatusCode.INVALID_ARGUMENT, "already"),
            ([frame_msg(0, [1] * 8), frame_msg(2, [1] * 8)], grpc.StatusCode.FAILED_PRECONDITION, "skips"),
            ([open_msg("again")], grpc.StatusCode.INVALID_ARGUMENT, "frame"),
        ]
        for frames, code, word in bad_frames:
            got, details = await open_error(s.stub, open_msg("victim"), *frames)
            assert got == code and word in details, (frames, got, details)
            await s.wait_free(SLOTS - 1)
        # the live session was never touched: it still answers and equals a solo run
        frames = user_frames(8, 14)
        await live.send_paced(frames, TICK_MS / 1000)
        await live.finish()
        assert live.as_pairs() == reference_outputs(tiny_checkpoint, live.ready.slot, None, PERSONA, frames)


async def test_drain_refuses_new_sessions_and_ends_live_ones_at_the_deadline(tiny_checkpoint, monkeypatch):
    monkeypatch.setenv(ADMIN_TOKEN_ENV, "talker-admin")
    async with Service(config(tiny_checkpoint)) as s:
        sess = Session(s.stub, "d")
        await sess.open()
        admin = (("authorization", "Bearer talker-admin"),)
        resp = await s.stub.Drain(common_pb2.DrainRequest(deadline_s=2.0), metadata=admin)
        assert resp.active_streams == 1
        cap = await s.capacity()
        assert cap.draining and cap.free_slots == 0
        code, _ = await open_error(s.stub, open_msg("late"))
        assert code == grpc.StatusCode.UNAVAILABLE
        # the live session is still served until the deadline
        await sess.send_paced(user_frames(4, 15), TICK_MS / 1000)
        await sess.wait_outputs(4 - sess.ready.output_delay_frames)
        code, details = await sess.error()
        assert code == grpc.StatusCode.UNAVAILABLE and "drain" in details


def test_subprocess_serves_and_drains_on_sigterm(tiny_checkpoint):
    """python -m services.talker as a real process: serve, export metrics, and on SIGTERM refuse new
    sessions while the live one runs to its end, then exit 0."""
    from tools.procs import ServiceProcess

    args = ["--checkpoint", str(tiny_checkpoint), "--slots", "2", "--tick-ms", "40", "--threads", "1"]
    with ServiceProcess("services.talker", args) as proc:
        async def talk():
            async with grpc.aio.insecure_channel(proc.address) as ch:
                stub = talker_pb2_grpc.TalkerStub(ch)
                first = Session(stub, "sub")
                ready = await first.open()
                await first.send_paced(user_frames(8, 16), 0.04)
                outs = await first.finish()
                text = await asyncio.to_thread(
                    lambda: urllib.request.urlopen(proc.metrics_url, timeout=5).read().decode())
                # SIGTERM with a session live: it keeps being served, a new one is refused.
                live = Session(stub, "live")
                await live.open()
                proc.terminate()
                await live.send_paced(user_frames(4, 17), 0.04)
                await live.wait_outputs(4 - ready.output_delay_frames)
                code, _ = await open_error(stub, open_msg("new"))
                await live.finish()
                return ready, outs, text, code

        ready, outs, text, refused = asyncio.run(talk())
        assert len(outs) == 8 - ready.output_delay_frames
        # 8 steps, and the one that took the last input if it ran before the input ended (step ahead)
        assert re.search(r"^duplex_talker_frames_advanced_total [89]\.0$", text, re.M), text
        assert "duplex_talker_tick_lateness_seconds_bucket" in text
        assert refused == grpc.StatusCode.UNAVAILABLE
        assert proc.proc.wait(timeout=20) == 0  # exits by itself once the live session ended


def test_config_env_then_flags_and_bad_values():
    cfg = TalkerConfig.load(["--checkpoint", "/x", "--slots", "4"], env={"TALKER_SLOTS": "9", "TALKER_TICK_MS": "40"})
    assert (cfg.slots, cfg.tick_ms, cfg.port) == (4, 40.0, 50052)  # flag over env over default
    assert cfg.max_backlog_frames == 50  # 2 s of 40 ms frames
    assert cfg.torch_dtype == torch.float32 and replace(cfg, device="cuda").torch_dtype == torch.bfloat16
    for bad in ({"slots": 0}, {"tick_ms": 0.0}, {"max_backlog_s": 0.0}, {"dtype": "int8"}, {"context": -1},
                {"input_wait_ms": 40.0}, {"catch_up_lag_frames": 0}):
        with pytest.raises(ValueError):
            replace(cfg, **bad)
    with pytest.raises(SystemExit):
        TalkerConfig.load([], env={})  # no checkpoint
    with pytest.raises(SystemExit):
        TalkerConfig.load(["--checkpoint", "/x"], env={"TALKER_SLOTS": "many"})


# ---- the conversation clock, driven tick by tick (decisions alone: test_talker_tick_policy.py) ----

class SlowEngine:
    """The served engine, each step `delay_s(active rows)` slower: a step as long as a big batch's."""

    def __init__(self, eng, delay_s):
        self._eng, self.delay_s = eng, delay_s

    def step(self, codes, active):
        time.sleep(self.delay_s(int(active.sum())))
        return self._eng.step(codes, active)

    def step_rows(self, slots, codes, rows):
        time.sleep(self.delay_s(len(slots)))
        return self._eng.step_rows(slots, codes, rows)

    def __getattr__(self, name):
        return getattr(self._eng, name)


class RecordingEngine(SlowEngine):
    """The served engine, recording the monotonic time of each step."""

    def __init__(self, eng):
        super().__init__(eng, lambda rows: 0.0)
        self.steps_at: list[float] = []

    def step(self, codes, active):
        self.steps_at.append(time.monotonic())
        return super().step(codes, active)

    def step_rows(self, slots, codes, rows):  # a compact catch-up step
        self.steps_at.append(time.monotonic())
        return super().step_rows(slots, codes, rows)


def new_clock(eng, **kw):
    """A clock on its own slot pool, driven by the test (tick, prefill_in_slack) or started."""
    from services.common.slots import SlotPool
    from services.talker.clock import ConversationClock

    kw = {"tick_s": 0.08, "max_backlog_frames": 25, "prefill_chunk_frames": 64} | kw
    return ConversationClock(eng, SlotPool(SLOTS), **kw)


async def live_sessions(clock, *names: str, voice=None, persona: str = "", early_outputs: bool = False) -> list:
    """Sessions opened on the clock and prefilled (pieces alone, in a roomy slack)."""
    from services.talker.engine import SamplingParams

    sessions = [clock.open(n, clock.pool.acquire(), voice, persona, SamplingParams(greedy=True, seed=1), 1,
                           early_outputs) for n in names]
    await clock.prefill_in_slack(asyncio.get_running_loop().time() + 10)
    assert all(s.status is LIVE for s in sessions)
    return sessions


def value(metrics, name: str, **labels) -> float:
    return metrics.stage.registry.get_sample_value(name, labels) or 0.0


def talker_metrics():
    from services.common.metrics import StageMetrics
    from services.talker.metrics import TalkerMetrics

    return TalkerMetrics(StageMetrics("talker"))


async def close_all(clock) -> None:
    """Take every session off the clock, then stop it (each test's teardown)."""
    for sess in list(clock.sessions.values()):
        clock.close(sess)
    await clock.stop()


async def test_a_lagging_session_gets_one_catch_up_step_past_the_deadline(tiny_checkpoint):
    """With no time left in the period (a step longer than half of it), a session 2+ frames behind
    still gets one catch-up step per tick, so its backlog shrinks instead of staying for good;
    one frame behind, it waits for the next tick."""
    clock = new_clock(engine(tiny_checkpoint, "classic"))
    loop = asyncio.get_running_loop()
    try:
        sess, = await live_sessions(clock, "late")
        for i, f in enumerate(user_frames(4, 5)):
            clock.push(sess, i, f)
        assert await clock.tick(loop.time()) == 2 and len(sess.inputs) == 2  # 3 behind: main + one catch-up
        assert await clock.tick(loop.time()) == 1 and len(sess.inputs) == 1  # 1 behind: the next tick's
        assert await clock.tick(loop.time()) == 1 and len(sess.inputs) == 0
        assert await clock.tick(loop.time() + 10) == 0  # nothing queued: no step at all
    finally:
        await close_all(clock)


async def test_a_frame_that_arrives_during_the_main_step_does_not_force_a_catch_up(tiny_checkpoint):
    """A session one frame behind whose next frame comes in while the main step runs is not two
    behind: that frame is the next tick's. No catch-up step past the deadline for it (one that
    fits still runs); with two frames behind before the main step, one does."""
    clock = new_clock(SlowEngine(engine(tiny_checkpoint, "classic"), lambda rows: 0.06))  # a frame comes in meanwhile
    loop = asyncio.get_running_loop()
    try:
        sess, = await live_sessions(clock, "jitter")
        frames = user_frames(8, 8)
        for seq, extra_before in ((0, 1), (3, 2)):
            for i in range(extra_before + 1):
                clock.push(sess, seq + i, frames[seq + i])
            mid_step = seq + extra_before + 1
            loop.call_later(0.02, clock.push, sess, mid_step, frames[mid_step])
            steps = await clock.tick(loop.time())  # no time left in the period: only a forced catch-up runs
            assert steps == extra_before, extra_before  # 1 behind: none; 2 behind: one
            assert len(sess.inputs) == extra_before + 1 - steps + 1  # the mid-step frame waits for the next tick
            while sess.inputs:
                await clock.tick(loop.time() + 10)  # room for catch-ups: drain before the next case
    finally:
        await close_all(clock)


async def test_forced_catch_ups_and_lagging_sessions_are_counted_and_the_lag_is_configurable(tiny_checkpoint):
    """A catch-up step run past the deadline counts as forced, and each tick observes how many
    sessions are still behind after its main step. With catch_up_lag_frames 3, two frames behind
    waits."""
    from services.talker.clock import ConversationClock
    from services.talker.metrics import STEP_PARTS

    loop = asyncio.get_running_loop()
    for lag, steps_at_2_behind in ((2, 2), (3, 1)):
        metrics = talker_metrics()
        clock = new_clock(engine(tiny_checkpoint, "classic"), catch_up_lag_frames=lag, metrics=metrics)
        try:
            sess, = await live_sessions(clock, "lag")
            for i, f in enumerate(user_frames(3, 7)):
                clock.push(sess, i, f)
            # No time left in the period: only a forced catch-up runs.
            assert await clock.tick(loop.time()) == steps_at_2_behind, lag
            assert value(metrics, "duplex_talker_catch_up_steps_forced_total") == steps_at_2_behind - 1
            assert value(metrics, "duplex_talker_sessions_behind_count") == 1
            assert value(metrics, "duplex_talker_sessions_behind_sum") == 1  # one session, behind after the main step
            # Each step's wall time, split into its parts (metrics.STEP_PARTS), all of it accounted for.
            parts = {p: value(metrics, "duplex_talker_step_part_seconds_sum", part=p) for p in STEP_PARTS}
            counts = [value(metrics, "duplex_talker_step_part_seconds_count", part=p) for p in parts]
            assert counts == [steps_at_2_behind] * len(parts)
            wall = value(metrics, "duplex_stage_step_seconds_sum", stage="talker")
            assert parts["launch"] > 0 and sum(parts.values()) == pytest.approx(wall, abs=0.005)
        finally:
            await close_all(clock)
    with pytest.raises(ValueError, match="catch_up_lag_frames"):
        ConversationClock(clock.engine, clock.pool, tick_s=0.08, max_backlog_frames=25, prefill_chunk_frames=64,
                          catch_up_lag_frames=0)


async def test_slow_ticks_and_the_periods_the_clock_drops_are_counted(tiny_checkpoint):
    """A tick over the period is counted by what it held; one that ends more than a period past its
    deadline makes the clock skip to the latest grid time, and the periods it skipped are counted,
    not just logged."""
    from services.talker.engine import SamplingParams

    metrics = talker_metrics()
    stall = 0.07  # a step that takes 3.5 periods
    clock = new_clock(SlowEngine(engine(tiny_checkpoint, "classic"), lambda rows: stall), tick_s=0.02, metrics=metrics)
    clock.start()
    try:
        sess = clock.open("slow", clock.pool.acquire(), None, "", SamplingParams(greedy=True, seed=1), 1)
        while sess.status is not LIVE:  # prefilled while the clock sleeps
            await asyncio.sleep(0.01)
        assert value(metrics, "duplex_talker_ticks_dropped_total") == 0
        for i, f in enumerate(user_frames(3, 2)):
            clock.push(sess, i, f)
            await asyncio.sleep(0.1)
        assert value(metrics, "duplex_talker_ticks_dropped_total") >= 2  # each 70 ms tick ends >= 2 periods late
        slow = {c: value(metrics, "duplex_talker_slow_ticks_total", cause=c) for c in ("catch_up", "late_start",
                                                                                      "wait_and_step")}
        assert sum(slow.values()) >= 2 and slow["catch_up"] == 0, slow  # one frame per tick: no catch-up
    finally:
        await close_all(clock)


async def test_a_catch_up_step_is_judged_by_what_catch_up_steps_cost(tiny_checkpoint):
    """A catch-up step runs only the sessions still behind (idle rows attend over one KV entry), so
    whether one fits before the deadline is decided by the measured catch-up time, not by the main
    step's: a main step of many sessions fills most of the period, a catch-up of a few does not."""
    main_s = 0.25  # a step of two or more rows; one row is fast (its own 10-50 ms on a loaded CPU)
    clock = new_clock(SlowEngine(engine(tiny_checkpoint, "classic"), lambda rows: main_s if rows > 1 else 0.0))
    loop = asyncio.get_running_loop()
    try:
        a, b = await live_sessions(clock, "a", "b")
        frames = user_frames(5, 6)
        for seq, f in enumerate(frames[:2]):
            clock.push(a, seq, f)
        clock.push(b, 0, frames[0])
        assert await clock.tick(loop.time() + 10) == 2  # plenty of room: both steps measured
        assert clock.policy.step_s >= main_s > clock.policy.catch_up_s[SLOTS]  # (3 slots: no compact bucket)
        for seq, f in enumerate(frames[2:4], start=2):
            clock.push(a, seq, f)
        clock.push(b, 1, frames[1])
        # 400 ms: a second main step would not fit after the first, the measured catch-up does.
        assert await clock.tick(loop.time() + 0.4) == 2 and not a.inputs
    finally:
        await close_all(clock)


async def talk_beside(clock, mine, other, frames, first_seq: int) -> list:
    """One tick per frame: `mine` sends frames[i] and `other` keeps talking beside it (seq numbers
    from first_seq). Returns mine's outputs as (text token, agent codes)."""
    loop, got = asyncio.get_running_loop(), []
    for i, f in enumerate(frames):
        clock.push(mine, i, f)
        clock.push(other, first_seq + i, frames[(first_seq + i) % len(frames)])
        await clock.tick(loop.time() + 10)
        while not mine.outbox.empty():
            out = mine.outbox.get_nowait()
            got.append((out.text_token, out.agent_codes))
    return got


async def test_prefill_pieces_run_alone_in_the_slack_while_they_fit_and_only_fail_their_own_session(tiny_checkpoint):
    """With a session live and no tick, a new session's prompt runs in the period's slack (begin +
    a whole chunk, oldest first) while a piece fits before the deadline, never one that does not;
    it then talks exactly like a session run alone. A begin() that refuses (a voice the engine
    lacks) fails that session only."""
    from services.common.checkpoint import InvalidVoice
    from services.talker.engine import SamplingParams
    from services.talker.session import Ready

    clock = new_clock(engine(tiny_checkpoint, "classic"))
    loop = asyncio.get_running_loop()
    voice, greedy = first_voice(tiny_checkpoint), SamplingParams(greedy=True, seed=1)
    try:
        first, = await live_sessions(clock, "first")  # nobody live: pieces alone
        mine_slot = clock.pool.acquire()
        mine = clock.open("mine", mine_slot, voice, PERSONA, greedy, 1)
        bad = clock.open("bad", clock.pool.acquire(), "NOT-A-VOICE.pt", PERSONA, greedy, 1)
        await clock.prefill_in_slack(loop.time() + 0.005)  # less than the headroom: no piece fits
        assert mine.job is None and not mine.pieces_ms and not bad.pieces_ms
        await clock.prefill_in_slack(loop.time() + 10)  # plenty of slack: every waiting prompt
        assert mine.status is LIVE and len(mine.pieces_ms) == 1  # its whole prompt: one chunk
        assert isinstance(mine.outbox.get_nowait(), Ready)
        assert isinstance(bad.outbox.get_nowait(), InvalidVoice) and bad.status is SessionStatus.FAILED
        assert first.status is LIVE
        frames = user_frames(14, 3)
        got = await talk_beside(clock, mine, first, frames, first_seq=0)  # mine beside first, as if alone
        assert got == reference_outputs(tiny_checkpoint, mine_slot, voice, PERSONA, frames)
    finally:
        await close_all(clock)


async def test_a_prefill_piece_rides_the_main_step_and_only_fails_its_own_session(tiny_checkpoint):
    """Each main step carries one piece of the oldest waiting prompt (its host work while the step
    runs, its chunk queued behind it), a catch-up step none. The session then talks exactly like
    one run alone; a begin() that refuses, riding a step, fails that session only and the step's
    outputs still come."""
    from services.common.checkpoint import InvalidVoice
    from services.talker.engine import SamplingParams
    from services.talker.session import Ready

    metrics = talker_metrics()
    clock = new_clock(engine(tiny_checkpoint, "classic"), metrics=metrics)
    loop = asyncio.get_running_loop()
    voice, greedy = first_voice(tiny_checkpoint), SamplingParams(greedy=True, seed=1)
    try:
        first, = await live_sessions(clock, "first")  # nobody live: a piece alone
        bad = clock.open("bad", clock.pool.acquire(), "NOT-A-VOICE.pt", PERSONA, greedy, 1)
        mine_slot = clock.pool.acquire()
        mine = clock.open("mine", mine_slot, voice, PERSONA, greedy, 1)
        frames = user_frames(14, 3)
        clock.push(first, 0, frames[0])
        clock.push(first, 1, frames[1])  # a frame behind: a catch-up step follows the main step
        assert await clock.tick(loop.time() + 10) == 2
        # The main step carried bad's piece (the oldest waiting): refused, bad alone fails.
        assert isinstance(bad.outbox.get_nowait(), InvalidVoice) and bad.status is SessionStatus.FAILED
        assert not first.inputs and clock.steps == 2  # both of first's frames stepped
        assert mine.job is None and not mine.pieces_ms  # the catch-up step carried none
        await clock.prefill_in_slack(loop.time() + 0.001)  # a slack that holds no piece runs none
        assert mine.job is None and not mine.pieces_ms
        clock.push(first, 2, frames[2])
        assert await clock.tick(loop.time() + 10) == 1
        assert mine.status is LIVE and len(mine.pieces_ms) == 1  # its whole prompt: one chunk, riding the step
        assert isinstance(mine.outbox.get_nowait(), Ready) and clock.steps == 3
        assert value(metrics, "duplex_talker_prefill_pieces_total", where="step") == 2
        assert value(metrics, "duplex_talker_prefill_pieces_total", where="alone") == 1
        assert value(metrics, "duplex_talker_step_part_seconds_sum", part="prefill") > 0
        got = await talk_beside(clock, mine, first, frames, first_seq=3)  # mine beside first, as if alone
        assert got == reference_outputs(tiny_checkpoint, mine_slot, voice, PERSONA, frames)
    finally:
        await close_all(clock)


async def test_a_session_that_ended_gets_no_more_prefill(tiny_checkpoint):
    """Between a session's END and the servicer closing it, a tick's piece goes to a prompt still
    waiting, not to the ended session's slot."""
    from services.talker.engine import SamplingParams
    from services.talker.session import END, Ready

    clock = new_clock(engine(tiny_checkpoint, "classic"))
    loop = asyncio.get_running_loop()
    try:
        a, b = await live_sessions(clock, "a", "b")
        clock.push(a, 0, user_frames(1, 4)[0])
        clock.input_done(a)
        await clock.tick(loop.time() + 10)  # a's last frame: END
        items = [a.outbox.get_nowait() for _ in range(a.outbox.qsize())]
        assert items[-1] is END and a.status is SessionStatus.ENDED
        waiting = clock.open("c", clock.pool.acquire(), None, "", SamplingParams(greedy=True, seed=1), 1)
        clock.push(b, 0, user_frames(1, 4)[0])
        assert await clock.tick(loop.time() + 10) == 1
        assert waiting.status is LIVE and isinstance(waiting.outbox.get_nowait(), Ready)
        assert a.outbox.empty() and not a.pieces_ms[1:]  # its one piece: the prompt before it talked
    finally:
        await close_all(clock)


async def test_the_clock_ticks_on_the_cells_frame_grid(tiny_checkpoint):
    """Deadlines are k * tick_s + tick_phase_s of the monotonic clock (services/common/frame_grid.py),
    whenever the clock started, so every process of the cell knows them."""
    period = 0.08
    for phase in (0.03, 0.065):  # two phases: a clock off the grid cannot pass both by chance
        eng = RecordingEngine(engine(tiny_checkpoint, "classic"))
        clock = new_clock(eng, tick_s=period, tick_phase_s=phase)
        sess, = await live_sessions(clock, "a")
        await asyncio.sleep(0.017)  # start the clock off the grid
        clock.start()
        try:
            for i, f in enumerate(user_frames(6, 2)):
                clock.push(sess, i, f)
                await asyncio.sleep(period)
            offsets = [(t - phase) % period for t in eng.steps_at]
            # On the grid, a little late at most: the median within 15 ms (a clock off the grid by a
            # constant cannot be within 15 ms of both phases) and none past half a period (one tick may be
            # late on a loaded machine).
            assert len(offsets) >= 4 and sorted(offsets)[len(offsets) // 2] < 0.015, offsets
            assert all(o < period / 2 for o in offsets), offsets
        finally:
            await close_all(clock)


async def test_a_frame_just_after_the_deadline_rides_the_tick_and_silence_costs_no_wait(tiny_checkpoint):
    """input_wait: a talking session whose frame arrives a few ms after the deadline is stepped in
    that tick's one step (without the wait it is skipped or needs a catch-up step). A session that
    is not talking (no frame yet, or none for over 1.5 periods) never makes the clock wait."""
    loop = asyncio.get_running_loop()
    frames = user_frames(8, 9)
    for wait_s in (0.04, 0.0):
        clock = new_clock(engine(tiny_checkpoint, "classic"), input_wait_s=wait_s)
        try:
            a, b, _silent = await live_sessions(clock, "a", "b", "silent")
            clock.push(a, 0, frames[0])
            clock.push(b, 0, frames[0])
            assert await clock.tick(loop.time() + 10) == 1
            steps = clock.steps
            clock.push(a, 1, frames[1])
            loop.call_later(0.01, clock.push, b, 1, frames[1])  # b's frame: 10 ms after the deadline
            await clock.tick(loop.time() + 0.2)
            await asyncio.sleep(0.02)  # b's frame has arrived by now, whatever the tick did
            on_time = clock.steps == steps + 1 and not a.inputs and not b.inputs
            assert on_time if wait_s else not on_time
            if b.inputs:  # (no wait) step b's frame before the next checks
                await clock.tick(loop.time() + 10)
        finally:
            await close_all(clock)
    # The silent session alone lacks a frame: no wait; nor for one quiet for 1.5 periods; a talking
    # one whose frame is due: a wait of input_wait.
    metrics = talker_metrics()
    clock = new_clock(engine(tiny_checkpoint, "classic"), input_wait_s=0.04, metrics=metrics)
    try:
        a, _silent = await live_sessions(clock, "a", "silent")
        clock.push(a, 0, frames[0])
        assert await clock.tick(loop.time() + 10) == 1
        await asyncio.sleep(0.13)  # a has been quiet for over 1.5 periods
        assert await clock.tick(loop.time() + 10) == 0
        assert value(metrics, "duplex_talker_input_wait_seconds_count") == 0
        clock.push(a, 1, frames[1])
        assert await clock.tick(loop.time() + 10) == 1
        assert await clock.tick(loop.time() + 10) == 0  # a is talking and its next frame is due
        assert value(metrics, "duplex_talker_input_wait_seconds_count") == 1
        assert 0.035 < value(metrics, "duplex_talker_input_wait_seconds_sum") < 0.2
    finally:
        await close_all(clock)


async def test_stepping_ahead_runs_step_k_before_input_k_and_answers_it_when_input_k_arrives(tiny_checkpoint):
    """Step 0 runs at go-live with no input; output k waits for input k; the step that took the last
    input is dropped at the end: N inputs, N outputs, the classic engine's tokens."""
    from services.talker.session import END

    frames = user_frames(5, 9)
    clock = new_clock(engine(tiny_checkpoint, "served"))
    loop = asyncio.get_running_loop()
    try:
        sess, = await live_sessions(clock, "ahead", persona="Hi.")
        sess.outbox.get_nowait()  # Ready
        assert await clock.tick(loop.time() + 10) == 1  # step 0, before any input
        assert sess.outbox.empty() and sess.pairing.held is not None and sess.pairing.held.input_seq == 0
        outs = []
        for i, f in enumerate(frames):
            clock.push(sess, i, f)
            outs.append(sess.outbox.get_nowait())  # output i leaves as input i arrives
            assert sess.outbox.empty()
            assert await clock.tick(loop.time() + 10) == 1  # step i + 1, with input i
        clock.input_done(sess)
        assert sess.outbox.get_nowait() is END and sess.pairing.held is None
        assert [o.input_seq for o in outs] == list(range(5))
        want = reference_outputs(tiny_checkpoint, sess.slot, None, "Hi.", frames)
        assert [(o.text_token, o.agent_codes) for o in outs] == want
    finally:
        await close_all(clock)


async def test_stepping_ahead_drops_the_queued_step_of_the_last_input(tiny_checkpoint):
    from services.talker.session import END

    clock = new_clock(engine(tiny_checkpoint, "served"))
    loop = asyncio.get_running_loop()
    try:
        sess, = await live_sessions(clock, "short", persona="Hi.")
        sess.outbox.get_nowait()  # Ready
        for i, f in enumerate(user_frames(2, 10)):
            clock.push(sess, i, f)
        clock.input_done(sess)  # steps 0, 1 answer inputs 0, 1; step 2 (input 1's) is not needed
        assert [k for k, _ in sess.inputs] == [0, 1]
        assert await clock.tick(loop.time()) >= 1
        while sess.inputs:
            assert await clock.tick(loop.time() + 10) == 1
        got = [sess.outbox.get_nowait() for _ in range(3)]
        assert [o.input_seq for o in got[:2]] == [0, 1] and got[2] is END
    finally:
        await close_all(clock)


async def test_early_outputs_leave_at_their_steps_end_and_the_surplus_only_if_it_ran(tiny_checkpoint):
    """With early_outputs, output k leaves when step k ends, before input k arrives, with the tokens
    held outputs have. The last input's step: dropped if still queued at the half-close; sent (its
    input_seq is the input count, for the caller to drop) if it already ran."""
    from services.talker.session import END

    frames = user_frames(4, 9)
    clock = new_clock(engine(tiny_checkpoint, "served"))
    loop = asyncio.get_running_loop()
    try:
        early, late = await live_sessions(clock, "early", "late", persona="Hi.", early_outputs=True)
        for sess in (early, late):
            sess.outbox.get_nowait()  # Ready
        assert await clock.tick(loop.time() + 10) == 1  # step 0 of both, before any input
        # Output 0 waits for the session's first frame: until then its prompt may still be re-primed.
        assert all(s.outbox.empty() and s.pairing.held is not None for s in (early, late))
        got = {s.stream_id: [] for s in (early, late)}
        for i, f in enumerate(frames):
            for sess in (early, late):
                clock.push(sess, i, f)
                if i == 0:
                    got[sess.stream_id].append(sess.outbox.get_nowait())  # output 0, released by frame 0
                    assert got[sess.stream_id][0].input_seq == 0
                assert sess.outbox.empty()  # output i left at step i's end
            if i < len(frames) - 1:
                assert await clock.tick(loop.time() + 10) == 1
                for sess in (early, late):
                    got[sess.stream_id].append(sess.outbox.get_nowait())
        clock.input_done(early)  # step 4 (input 3's) still queued: dropped
        assert early.outbox.get_nowait() is END
        assert await clock.tick(loop.time() + 10) == 1  # late's step 4 runs, then it half-closes
        surplus = late.outbox.get_nowait()
        clock.input_done(late)
        assert late.outbox.get_nowait() is END
        assert surplus.input_seq == len(frames)
        want = reference_outputs(tiny_checkpoint, early.slot, None, "Hi.", frames)
        for sess in (early, late):
            assert [o.input_seq for o in got[sess.stream_id]] == list(range(len(frames)))
        assert [(o.text_token, o.agent_codes) for o in got["early"]] == want
        assert [(o.text_token, o.agent_codes) for o in got["late"]] == reference_outputs(
            tiny_checkpoint, late.slot, None, "Hi.", frames)
    finally:
        await close_all(clock)
