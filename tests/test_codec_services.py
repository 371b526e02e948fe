"""The Mimi encoder and decoder services on the tiny checkpoint, over real gRPC sockets.

Served results are compared with the in-process StreamingEncoder/StreamingDecoder run
one stream at a time from a fresh state: this proves batching, slot isolation and slot
reset at once. One test runs both services as real processes via tools/procs.py.
"""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from duplex.v1 import common_pb2, decoder_pb2, decoder_pb2_grpc, encoder_pb2, encoder_pb2_grpc
from services.common.checkpoint import CheckpointPaths
from services.codec.mimi import MimiConfig, MimiModel, StreamingDecoder, StreamingEncoder
from services.decoder.config import DecoderConfig
from services.decoder.server import build as build_decoder
from services.encoder.config import EncoderConfig
from services.encoder.server import build as build_encoder
from tools.procs import ServiceProcess, health_status

FRAME = 1920


@pytest.fixture(scope="module")
def mimi(tiny_checkpoint) -> MimiModel:
    paths = CheckpointPaths.open(tiny_checkpoint, require=("mimi",))
    return MimiModel.load(paths.mimi, MimiConfig.from_dict(paths.serve_config()["mimi"]))


def audio(n: int, seed: int) -> list[np.ndarray]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(FRAME, generator=g) * 0.3).numpy() for _ in range(n)]


def reference_codes(mimi: MimiModel, frames: list[np.ndarray], enc: StreamingEncoder | None = None) -> list[list[int]]:
    enc = enc or StreamingEncoder(mimi, 1)
    one = torch.ones(1, dtype=torch.bool)
    return [enc.step(torch.from_numpy(f)[None], one)[0].tolist() for f in frames]


def reference_pcm(mimi: MimiModel, codes: list[list[int]]) -> np.ndarray:
    dec, one = StreamingDecoder(mimi, 1), torch.ones(1, dtype=torch.bool)
    return np.stack([dec.step(torch.tensor([c]), one)[0].numpy() for c in codes])


def enc_open(sid: str):
    return encoder_pb2.EncodeRequest(open=common_pb2.StreamOpen(stream_id=sid))


def enc_frame(seq: int, pcm: np.ndarray):
    return encoder_pb2.EncodeRequest(frame=common_pb2.PcmFrame(seq=seq, pcm_f32le=pcm.astype("<f4").tobytes()))


def dec_open(sid: str):
    return decoder_pb2.DecodeRequest(open=common_pb2.StreamOpen(stream_id=sid))


def dec_frame(seq: int, codes):
    return decoder_pb2.DecodeRequest(frame=common_pb2.CodesFrame(seq=seq, codes=list(codes)))


async def encode_stream(stub, sid: str, frames, pause: float = 0.0, expect_slot: int | None = None) -> list[list[int]]:
    call = stub.Encode()
    await call.write(enc_open(sid))
    opened = await call.read()
    if expect_slot is not None:
        assert opened.opened.slot == expect_slot
    got = []
    for seq, f in enumerate(frames):
        await call.write(enc_frame(seq, f))
        r = await call.read()
        assert r.codes.seq == seq
        got.append(list(r.codes.codes))
        if pause:
            await asyncio.sleep(pause)
    await call.done_writing()
    assert await call.code() == grpc.StatusCode.OK
    return got


async def decode_stream(stub, sid: str, codes) -> np.ndarray:
    call = stub.Decode()
    await call.write(dec_open(sid))
    assert (await call.read()).WhichOneof("kind") == "opened"
    out = []
    for seq, c in enumerate(codes):
        await call.write(dec_frame(seq, c))
        r = await call.read()
        assert r.pcm.seq == seq and len(r.pcm.pcm_f32le) == 4 * FRAME
        out.append(np.frombuffer(r.pcm.pcm_f32le, dtype="<f4"))
    await call.done_writing()
    assert await call.code() == grpc.StatusCode.OK
    return np.stack(out)


async def served(build, cfg):
    service = build(cfg)
    await service.start()
    return service


@pytest.fixture
async def encoder(tiny_checkpoint):
    service = await served(build_encoder,
                           EncoderConfig(checkpoint=str(tiny_checkpoint), host="127.0.0.1", port=0, metrics_port=0,
                                         slots=4))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{service.port}")
    yield service, encoder_pb2_grpc.EncoderStub(channel)
    await channel.close()
    await service.stop()


@pytest.fixture
async def decoder(tiny_checkpoint):
    service = await served(build_decoder,
                           DecoderConfig(checkpoint=str(tiny_checkpoint), host="127.0.0.1", port=0, metrics_port=0,
                                         slots=4))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{service.port}")
    yield service, decoder_pb2_grpc.DecoderStub(channel)
    await channel.close()
    await service.stop()


async def test_encoder_many_streams_interleaved_match_reference(encoder, mimi):
    service, stub = encoder
    # 8 streams through 4 slots: staggered opens, different lengths, so opens and closes interleave
    # and freed slots are reused while other streams are mid-flight.
    inputs = {f"user-{i}": audio(2 + i % 4, seed=i) for i in range(8)}

    async def one(i: int, sid: str):
        await asyncio.sleep(0.02 * i)
        while True:
            try:
                return await encode_stream(stub, sid, inputs[sid], pause=0.005)
            except grpc.aio.AioRpcError as e:  # all 4 slots busy: retry, as the gateway would elsewhere
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                await asyncio.sleep(0.02)

    results = await asyncio.gather(*(one(i, sid) for i, sid in enumerate(inputs)))
    for (sid, frames), got in zip(inputs.items(), results):
        assert got == reference_codes(mimi, frames), sid
    assert service.batcher.steps < sum(len(f) for f in inputs.values())  # streams shared steps
    assert service.runtime.pool.free_count == 4


async def test_reused_slot_starts_fresh(encoder, mimi):
    service, stub = encoder
    old, new = audio(3, seed=10), audio(3, seed=11)
    assert await encode_stream(stub, "old", old, expect_slot=0) == reference_codes(mimi, old)
    await asyncio.sleep(0)  # let the old stream's close run
    got = await encode_stream(stub, "new", new, expect_slot=0)
    fresh = reference_codes(mimi, new)
    assert got == fresh
    # The check has teeth: continuing the old stream's state gives other codes.
    continued = StreamingEncoder(mimi, 1)
    reference_codes(mimi, old, continued)
    assert reference_codes(mimi, new, continued) != fresh


async def test_decoder_parity_and_bad_codes(decoder, mimi):
    service, stub = decoder
    codes = reference_codes(mimi, audio(4, seed=3))
    other_codes = reference_codes(mimi, audio(4, seed=4))
    pcm, other_pcm = await asyncio.gather(decode_stream(stub, "a", codes), decode_stream(stub, "b", other_codes))
    np.testing.assert_allclose(pcm, reference_pcm(mimi, codes), atol=1e-5)
    np.testing.assert_allclose(other_pcm, reference_pcm(mimi, other_codes), atol=1e-5)

    bystander = stub.Decode()
    await bystander.write(dec_open("bystander"))
    await bystander.read()
    for bad, words in [([1] * 7, "7 codes, expected 8"), ([1] * 9, "9 codes"), ([0] * 7 + [2048], "outside [0, 2048)")]:
        call = stub.Decode()
        await call.write(dec_open("bad"))
        await call.read()
        await call.write(dec_frame(0, bad))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call.read()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details()
    ref = reference_pcm(mimi, codes[:2])
    for seq in range(2):  # the bystander is untouched and starts from a fresh state
        await bystander.write(dec_frame(seq, codes[seq]))
        r = await bystander.read()
        np.testing.assert_allclose(np.frombuffer(r.pcm.pcm_f32le, dtype="<f4"), ref[seq], atol=1e-5)
    await bystander.done_writing()


async def test_encoder_bad_pcm_and_repeated_seq(encoder, mimi):
    service, stub = encoder
    frames = audio(2, seed=5)
    call = stub.Encode()
    await call.write(enc_open("s"))
    await call.read()
    await call.write(enc_frame(0, frames[0]))
    await call.read()
    steps = service.batcher.steps
    await call.write(enc_frame(0, frames[1]))  # a retried send
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call.read()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "already received" in e.value.details()
    assert service.batcher.steps == steps
    call = stub.Encode()
    await call.write(enc_open("short"))
    await call.read()
    await call.write(enc_frame(0, frames[0][:1000]))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call.read()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "4000 bytes, expected 7680" in e.value.details()


def test_real_processes_round_trip_metrics_and_sigterm_drain(tiny_checkpoint, mimi):
    common = ["--checkpoint", str(tiny_checkpoint), "--slots", "2", "--threads", "1", "--host", "127.0.0.1"]
    enc = ServiceProcess("services.encoder", common, env={"ENCODER_DRAIN_DEADLINE_S": "20"}).spawn()
    dec = ServiceProcess("services.decoder", common).spawn()
    with enc, dec:
        enc.wait_ready()
        dec.wait_ready()
        frames = audio(3, seed=7)

        async def client():
            async with grpc.aio.insecure_channel(enc.address) as ec, grpc.aio.insecure_channel(dec.address) as dc:
                codes = await encode_stream(encoder_pb2_grpc.EncoderStub(ec), "proc", frames)
                pcm = await decode_stream(decoder_pb2_grpc.DecoderStub(dc), "proc", codes)
                cap = await decoder_pb2_grpc.DecoderStub(dc).GetCapacity(common_pb2.CapacityRequest())
                # SIGTERM drains: the live stream keeps working, a new one is refused, then the process exits.
                stub = encoder_pb2_grpc.EncoderStub(ec)
                live = stub.Encode()
                await live.write(enc_open("live"))
                await live.read()
                enc.terminate()
                health = health_pb2_grpc.HealthStub(ec)
                for _ in range(100):  # until the process has handled SIGTERM
                    reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
                    if reply.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                        break
                    await asyncio.sleep(0.05)
                late = stub.Encode()
                await late.write(enc_open("late"))
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await late.read()
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                await live.write(enc_frame(0, frames[0]))
                assert list((await live.read()).codes.codes) == reference_codes(mimi, frames[:1])[0]
                await live.done_writing()
                assert await live.code() == grpc.StatusCode.OK
                return codes, pcm, cap

        codes, pcm, cap = asyncio.run(client())
        assert codes == reference_codes(mimi, frames)
        np.testing.assert_allclose(pcm, reference_pcm(mimi, codes), atol=1e-5)
        assert (cap.stage, cap.total_slots, cap.free_slots) == ("decoder", 2, 2)
        metrics = urllib.request.urlopen(dec.metrics_url, timeout=5).read().decode()
        assert 'duplex_stage_frames_out_total{stage="decoder"} 3.0' in metrics
        assert 'duplex_stage_step_seconds_count{stage="decoder"} 3.0' in metrics
        assert enc.proc.wait(15) == 0  # drained and exited by itself once the live stream ended
        assert "draining" in enc.stderr_tail() and "close stream=live" in enc.stderr_tail()
        assert health_status(dec.address) == health_pb2.HealthCheckResponse.SERVING
        assert dec.stop() == 0
