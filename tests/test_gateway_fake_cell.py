"""The gateway in-process against a fake cell: three in-process gRPC stages that answer capacity polls
and their Link streams as a test scripts them (no model, no checkpoint).

The case here: a stage that errors just after it accepted an open. Its error can come before the
client session holds the relay (in the same link message as the talker's ready, or while the
/api/chat upgrade's handshake runs), when nobody listens yet. The session must still report it and
end (error, close 1011), not sit open and silent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import grpc
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from duplex.v1 import (
    common_pb2, decoder_pb2, decoder_pb2_grpc, encoder_pb2, encoder_pb2_grpc, talker_pb2, talker_pb2_grpc,
)
from services.gateway.cells import _make_cell
from services.gateway.config import CellAddress, GatewayConfig
from services.gateway.relay import OpenParams, Relay, RelayStatus
from services.gateway.server import Gateway
from tests.relay_listener import RelayRecorder

pytestmark = pytest.mark.timeout(60)

_INTERNAL = grpc.StatusCode.INTERNAL.value[0]


def _capacity(stage: str) -> common_pb2.Capacity:
    return common_pb2.Capacity(total_slots=4, free_slots=4, stage=stage, frame_ms=80)


async def _answer_link(request_iterator, response_cls, answer_open):
    """A stage's Link: each open gets `answer_open(stream_id)`'s entries, each end an OK status."""
    async for msg in request_iterator:
        out = []
        for e in msg.entries:
            if e.WhichOneof("kind") == "end":
                out.append(response_cls.Entry(stream_id=e.stream_id, status=common_pb2.LinkStatus(code=0)))
            elif e.request.WhichOneof("kind") == "open":
                out += answer_open(e.stream_id)
        if out:
            yield response_cls(entries=out)


class Encoder(encoder_pb2_grpc.EncoderServicer):
    async def GetCapacity(self, request, context):
        return _capacity("encoder")

    async def EncodeLink(self, request_iterator, context):
        cls, opened = encoder_pb2.EncodeLinkResponse, encoder_pb2.EncodeResponse.Opened()
        async for msg in _answer_link(request_iterator, cls, lambda sid: [
                cls.Entry(stream_id=sid, response=encoder_pb2.EncodeResponse(opened=opened))]):
            yield msg


class Decoder(decoder_pb2_grpc.DecoderServicer):
    async def GetCapacity(self, request, context):
        return _capacity("decoder")

    async def DecodeLink(self, request_iterator, context):
        cls, opened = decoder_pb2.DecodeLinkResponse, decoder_pb2.DecodeResponse.Opened()
        async for msg in _answer_link(request_iterator, cls, lambda sid: [
                cls.Entry(stream_id=sid, response=decoder_pb2.DecodeResponse(opened=opened))]):
            yield msg


class Talker(talker_pb2_grpc.TalkerServicer):
    """Accepts every open (ready, its prompt live); `fail_after_open`: fails the stream in the same
    link message."""

    def __init__(self, fail_after_open: bool):
        self.fail_after_open = fail_after_open

    async def GetCapacity(self, request, context):
        return _capacity("talker")

    async def TalkLink(self, request_iterator, context):
        cls = talker_pb2.TalkLinkResponse
        failure = common_pb2.LinkStatus(code=_INTERNAL, kind="internal", details="the step failed")
        async for msg in _answer_link(request_iterator, cls, lambda sid: [
                cls.Entry(stream_id=sid, response=talker_pb2.TalkResponse(ready=talker_pb2.TalkReady(prime=0))),
                *([cls.Entry(stream_id=sid, status=failure)] if self.fail_after_open else [])]):
            yield msg


@contextlib.asynccontextmanager
async def fake_cell(fail_after_open: bool):
    """The cell's address while its three stages serve."""
    servers, ports = [], []
    for servicer, add in ((Encoder(), encoder_pb2_grpc.add_EncoderServicer_to_server),
                          (Talker(fail_after_open), talker_pb2_grpc.add_TalkerServicer_to_server),
                          (Decoder(), decoder_pb2_grpc.add_DecoderServicer_to_server)):
        server = grpc.aio.server()
        add(servicer, server)
        ports.append(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        servers.append(server)
    try:
        yield CellAddress(*(f"127.0.0.1:{p}" for p in ports))
    finally:
        for server in servers:
            await server.stop(0)


@pytest.fixture
async def gateway():
    async with fake_cell(fail_after_open=True) as cell:
        gw = Gateway(GatewayConfig(host="127.0.0.1", port=0, cells=(cell,), cleanup_timeout_s=2.0))
        await gw.start()
        try:
            yield gw
        finally:
            await gw.stop()


@pytest.mark.parametrize("fail_after_open", [False, True])
async def test_a_relays_status_from_open_to_end(fail_after_open):
    """Open -> OPEN (counted on the cell) -> close -> ENDED (off the count). A stage that fails right
    after accepting: the open still succeeds, FAILED, the failure told to the listener once and kept
    in `failed`; abort -> ENDED, off the count."""
    async with fake_cell(fail_after_open) as address:
        cell = _make_cell(address)
        heard = RelayRecorder()
        try:
            p = await Relay.open_on(cell, OpenParams("s-1", "", "Hi.", talker_pb2.Sampling()), heard,
                                    open_timeout_s=5, stall_timeout_s=5, cleanup_timeout_s=2)
            assert cell.live_sessions == 1
            if fail_after_open:
                assert p.status is RelayStatus.FAILED and p.failed is not None and heard.errors == [p.failed]
                assert (p.failed.code, p.failed.stage) == ("runtime_stream_failed", "talker")
                confirmed = await p.abort()
            else:
                assert p.status is RelayStatus.OPEN and p.live and p.failed is None
                confirmed = await p.close()
                assert heard.errors == []
            assert confirmed and p.status is RelayStatus.ENDED and cell.live_sessions == 0
            assert await p.abort() is confirmed  # one cleanup, however many callers
        finally:
            await cell.close()


async def _until_closed(ws, timeout: float = 10.0) -> list:
    """Every message until the server closes the socket (TimeoutError: it stays open and silent)."""
    got = []

    async def read():
        try:
            async for message in ws:
                got.append(message)
        except ConnectionClosed:
            pass

    await asyncio.wait_for(read(), timeout)
    return got


async def test_a_stage_failing_right_after_the_open_ends_a_realtime_session_with_its_error(gateway):
    async with connect(f"ws://127.0.0.1:{gateway.port}/v1/realtime") as ws:
        await ws.send(json.dumps({"type": "session.update", "session": {"instructions": "Be brief."}}))
        events = [json.loads(m) for m in await _until_closed(ws)]
        assert ws.close_code == 1011
    types = [e["type"] for e in events]
    assert types[0] == "session.created", types
    errors = [e["error"] for e in events if e["type"] == "error"]
    assert [(e["type"], e["code"]) for e in errors] == [("server_error", "runtime_stream_failed")], events
    assert "talker" in errors[0]["message"] and "the step failed" in errors[0]["message"]
    assert types[-1] == "session.closed", types


async def test_a_stage_failing_right_after_the_open_ends_a_native_session_with_its_error(gateway):
    async with connect(f"ws://127.0.0.1:{gateway.port}/api/chat?text_prompt=hi") as ws:
        messages = await _until_closed(ws)
        assert ws.close_code == 1011
    assert messages[0] == b"\x00", messages  # the handshake: the session was admitted
    errors = [m[1:].decode() for m in messages if m[:1] == b"\x05"]
    assert len(errors) == 1 and errors[0].startswith("runtime_stream_failed: talker"), messages
