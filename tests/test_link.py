"""The multiplexed link (common.proto): many sessions on one Link stream per stage.

Against real services on real sockets (the tiny checkpoint): a session on a link gets exactly what
its own stream would give it, token for token; one session's fault, a hostile entry or a broken
link touches no other session and leaks no slot; answers of one batched step leave as one message.
"""

from __future__ import annotations

import asyncio
import collections
import time

import grpc
import pytest

from duplex.v1 import common_pb2, encoder_pb2, encoder_pb2_grpc, talker_pb2
from services.encoder.config import EncoderConfig
from services.encoder.server import build as build_encoder
from tests.test_codec_services import audio, enc_frame, enc_open, encode_stream, served
from tests.test_talker_service import (
    OTHER_PERSONA, PERSONA, TICK_MS, Service, Session, config, first_voice, frame_msg, open_msg, user_frames,
)

pytestmark = pytest.mark.timeout(120)


class LinkClient:
    """One Link stream from the caller's side: entries out in one message, entries in by stream id."""

    def __init__(self, call, request_cls):
        self.call, self.request_cls = call, request_cls
        self.responses: dict[str, list] = collections.defaultdict(list)
        self.status: dict[str, common_pb2.LinkStatus] = {}
        self.messages_in = 0
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while (msg := await self.call.read()) is not grpc.aio.EOF:
            self.messages_in += 1
            for e in msg.entries:
                if e.WhichOneof("kind") == "status":
                    self.status[e.stream_id] = e.status
                else:
                    self.responses[e.stream_id].append(e.response)

    async def send(self, *entries: tuple) -> None:
        """Entries as (stream_id, request) or (stream_id, LinkEnd), all in one message."""
        out = []
        for sid, item in entries:
            kind = "end" if isinstance(item, common_pb2.LinkEnd) else "request"
            out.append(self.request_cls.Entry(stream_id=sid, **{kind: item}))
        await self.call.write(self.request_cls(entries=out))

    async def until(self, check, timeout: float = 30.0, what: str = "") -> None:
        deadline = time.monotonic() + timeout
        while not check():
            assert not self._reader.done() or check(), f"link ended while waiting for {what}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {dict(self.status)}"
            await asyncio.sleep(0.005)

    async def close(self) -> None:
        await self.call.done_writing()
        await asyncio.wait_for(self._reader, 30)
        assert await self.call.code() == grpc.StatusCode.OK, await self.call.details()


def outputs(responses) -> list[tuple[int, list[int]]]:
    return [(r.output.text_token, list(r.output.agent_codes)) for r in responses if r.WhichOneof("kind") == "output"]


async def test_sessions_on_a_talk_link_equal_their_own_streams_token_for_token(tiny_checkpoint):
    """Three greedy sessions share one TalkLink, opening and closing at different ticks; each one's
    outputs equal the same session's on its own Talk stream."""
    voice = first_voice(tiny_checkpoint)
    plan = {  # stream id -> (open kwargs, frames, the frame of "a" after which it opens)
        "a": (dict(persona=PERSONA, seed=11), user_frames(14, 1), 0),
        "b": (dict(persona=OTHER_PERSONA, seed=12), user_frames(6, 2), 3),
        "c": (dict(persona=PERSONA, voice=voice, seed=13), user_frames(4, 3), 6),
    }
    async with Service(config(tiny_checkpoint)) as svc:
        own = {}
        for sid, (kw, frames, _) in plan.items():  # each alone, on its own stream
            s = Session(svc.stub, f"own-{sid}", **kw)
            await s.open()
            await s.send_paced(frames, TICK_MS / 1000)
            own[sid] = [(o.text_token, list(o.agent_codes)) for o in await s.finish()]
            await svc.wait_free()
        link = LinkClient(svc.stub.TalkLink(), talker_pb2.TalkLinkRequest)
        sent = collections.Counter()
        for i in range(len(plan["a"][1])):
            opening = [sid for sid, (_, _, at) in plan.items() if at == i]
            for sid in opening:
                await link.send((sid, open_msg(sid, **plan[sid][0])))
                await link.until(lambda sid=sid: link.responses[sid], what=f"{sid} ready")
            batch = []
            for sid, (_, frames, at) in plan.items():
                if at <= i and sent[sid] < len(frames):
                    batch.append((sid, frame_msg(sent[sid], frames[sent[sid]])))
                    sent[sid] += 1
                    if sent[sid] == len(frames):
                        batch.append((sid, common_pb2.LinkEnd()))
            await link.send(*batch)  # the frames of one period, of every session, in one message
            await asyncio.sleep(TICK_MS / 1000)
        await link.until(lambda: len(link.status) == 3, what="three OK ends")
        for sid in plan:
            assert link.status[sid].code == 0, (sid, link.status[sid])
            assert link.responses[sid][0].WhichOneof("kind") == "ready"
            assert outputs(link.responses[sid]) == own[sid], sid
            assert len(own[sid]) == len(plan[sid][1]) - link.responses[sid][0].ready.output_delay_frames
        await link.close()
        await svc.wait_free()
        reg = svc.svc.runtime.metrics.registry
        assert reg.get_sample_value("duplex_stage_links_opened_total", {"stage": "talker"}) == 1


async def test_one_sessions_fault_on_a_link_ends_that_session_only(tiny_checkpoint):
    """On one EncodeLink: a bad frame, a repeated seq, a duplicate open, entries for unknown stream
    ids and a session over its inbox bound each end (or are dropped for) that session alone, with a
    typed status; the healthy session keeps its codes equal to its own stream's, and every slot
    comes back."""
    encoder = await served(build_encoder, EncoderConfig(checkpoint=str(tiny_checkpoint), host="127.0.0.1", port=0,
                                                        metrics_port=0, slots=4))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{encoder.port}")
    stub = encoder_pb2_grpc.EncoderStub(channel)
    try:
        frames = audio(12, 5)
        expected = await encode_stream(stub, "own", frames)
        link = LinkClient(stub.EncodeLink(), encoder_pb2.EncodeLinkRequest)
        await link.send(("ok", enc_open("ok")), ("bad", enc_open("bad")), ("rep", enc_open("rep")),
                        ("dup", enc_open("dup")))
        await link.until(lambda: all(link.responses[s] for s in ("ok", "bad", "rep", "dup")), what="opens")
        await link.send(("bad", encoder_pb2.EncodeRequest(frame=common_pb2.PcmFrame(seq=0, pcm_f32le=b"\0" * 12))),
                        ("rep", enc_frame(0, frames[0])), ("rep", enc_frame(0, frames[0])),
                        ("dup", enc_open("dup")),
                        ("ghost", enc_frame(0, frames[0])), ("ghost-end", common_pb2.LinkEnd()))
        for seq, f in enumerate(frames):
            await link.send(("ok", enc_frame(seq, f)))
            await link.until(lambda seq=seq: len(link.responses["ok"]) == seq + 2, what=f"ok frame {seq}")
        await link.send(("ok", common_pb2.LinkEnd()))
        await link.until(lambda: {"ok", "bad", "rep", "dup", "ghost"} <= set(link.status), what="ends")
        codes = {s: grpc.StatusCode(next(c for c in grpc.StatusCode if c.value[0] == link.status[s].code))
                 for s in link.status}
        assert codes["ok"] == grpc.StatusCode.OK
        assert [list(r.codes.codes) for r in link.responses["ok"][1:]] == expected
        assert (codes["bad"], link.status["bad"].kind) == (grpc.StatusCode.INVALID_ARGUMENT, "bad_frame")
        assert (codes["rep"], link.status["rep"].kind) == (grpc.StatusCode.INVALID_ARGUMENT, "seq_repeated")
        assert codes["dup"] == grpc.StatusCode.INVALID_ARGUMENT
        assert (codes["ghost"], link.status["ghost"].kind) == (grpc.StatusCode.INVALID_ARGUMENT, "not_open")
        assert "ghost-end" not in link.status  # an end for no session is dropped
        # A session far over its inbox bound (5 s of frames at once) is refused, typed, alone.
        await link.send(("flood", enc_open("flood")), *[("flood", enc_frame(seq, frames[0])) for seq in range(200)])
        await link.until(lambda: "flood" in link.status, what="flood refused")
        assert link.status["flood"].kind == "backlog_full"
        await link.close()
        deadline = time.monotonic() + 10
        while encoder.runtime.pool.free_count != 4:
            assert time.monotonic() < deadline, "slots did not come back"
            await asyncio.sleep(0.01)
    finally:
        await channel.close()
        await encoder.stop()


async def test_a_broken_link_frees_its_sessions_and_a_batched_step_answers_in_one_message(tiny_checkpoint):
    """Four sessions' frames in one message come back as one message (one batched step); cancelling
    the link (the caller died) frees every slot it held, and a new link works at once."""
    encoder = await served(build_encoder, EncoderConfig(checkpoint=str(tiny_checkpoint), host="127.0.0.1", port=0,
                                                        metrics_port=0, slots=4, batch_wait_ms=50))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{encoder.port}")
    stub = encoder_pb2_grpc.EncoderStub(channel)
    try:
        link = LinkClient(stub.EncodeLink(), encoder_pb2.EncodeLinkRequest)
        sids = [f"s{i}" for i in range(4)]
        await link.send(*[(s, enc_open(s)) for s in sids])
        await link.until(lambda: all(link.responses[s] for s in sids), what="opens")
        before = link.messages_in
        frames = audio(1, 9)
        await link.send(*[(s, enc_frame(0, frames[0])) for s in sids])
        await link.until(lambda: all(len(link.responses[s]) == 2 for s in sids), what="codes")
        assert link.messages_in - before == 1, "one batched step's answers should leave in one message"
        assert encoder.runtime.pool.free_count == 0
        link.call.cancel()
        deadline = time.monotonic() + 10
        while encoder.runtime.pool.free_count != 4:
            assert time.monotonic() < deadline, "a broken link's sessions kept their slots"
            await asyncio.sleep(0.01)
        again = LinkClient(stub.EncodeLink(), encoder_pb2.EncodeLinkRequest)
        await again.send(("s0", enc_open("s0")), ("s0", enc_frame(0, frames[0])), ("s0", common_pb2.LinkEnd()))
        await again.until(lambda: "s0" in again.status, what="s0 on a new link")
        assert again.status["s0"].code == 0 and len(again.responses["s0"]) == 2
        # An ended stream id opens again on the same link (a caller retrying after a refusal does).
        del again.status["s0"]
        await again.send(("s0", enc_open("s0")), ("s0", enc_frame(0, frames[0])), ("s0", common_pb2.LinkEnd()))
        await again.until(lambda: "s0" in again.status, what="s0 reopened")
        assert again.status["s0"].code == 0 and len(again.responses["s0"]) == 4
        await again.close()
        reg = encoder.runtime.metrics.registry
        assert reg.get_sample_value("duplex_stage_links_opened_total", {"stage": "encoder"}) == 2
        assert reg.get_sample_value("duplex_stage_link_entries_total", {"stage": "encoder", "direction": "in"}) >= 14
    finally:
        await channel.close()
        await encoder.stop()


async def test_a_stage_that_does_not_read_its_link_is_given_up_within_the_outbox_bound(monkeypatch):
    """The gateway's relays cannot wait for room on a link, so a stage that stops reading would grow
    the link's unsent entries without end: past the bound the link is lost (its sessions fail typed)
    and its entries are dropped."""
    from duplex.v1 import encoder_pb2_grpc as stubs
    from services.gateway import links
    from services.gateway.cells import _make_cell
    from services.gateway.config import CellAddress

    class Deaf(stubs.EncoderServicer):
        async def EncodeLink(self, request_iterator, context):
            await asyncio.sleep(3600)  # never reads: HTTP/2 flow control stops the caller's writes

    server = grpc.aio.server()
    stubs.add_EncoderServicer_to_server(Deaf(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    monkeypatch.setattr(links, "OUTBOX_BYTES", 256 * 1024)
    monkeypatch.setattr(links, "OUTBOX_LIMIT_BYTES", 512 * 1024)
    cell = _make_cell(CellAddress(f"127.0.0.1:{port}", "127.0.0.1:1", "127.0.0.1:1"))
    lost = []
    link = links.StageLink(cell, "encoder", lambda stage, entry: None, lambda stage, why: lost.append(why))
    try:
        frame = encoder_pb2.EncodeRequest(frame=common_pb2.PcmFrame(seq=0, pcm_f32le=b"\0" * 7680))
        for i in range(2000):  # 15 MB offered
            link.send(f"s{i % 50}", request=frame)
            if i % 20 == 0:
                await asyncio.sleep(0.001)  # let the writer run (and block on the deaf stage)
            if lost:
                break
        assert lost and "does not read its link" in lost[0], lost
        assert link.lost is not None
    finally:
        await link.close()
        await cell.close()
        await server.stop(0)
