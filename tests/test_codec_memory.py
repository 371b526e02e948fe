"""Codec memory: each service keeps only its half of Mimi, warms up (graph capture) before serving
without touching any stream's state, and exports GPU memory gauges when it runs on CUDA."""

from __future__ import annotations

import copy
import math
import threading

import grpc
import numpy as np
import pytest
import torch
from prometheus_client import generate_latest
from safetensors.torch import save_file

from duplex.v1 import decoder_pb2_grpc, encoder_pb2_grpc
from services.common.checkpoint import CheckpointError, CheckpointPaths
from services.codec.stage import CodecBatcher
from services.common.metrics import StageMetrics
from services.codec.mimi import DroppedHalfError, MimiConfig, MimiModel, StreamingDecoder, StreamingEncoder
from services.common.stage_server import StageRuntime
from services.decoder.config import DecoderConfig
from services.decoder.server import build as build_decoder
from services.encoder.config import EncoderConfig
from services.encoder.server import build as build_encoder
from tests.test_codec_services import audio, decode_stream, encode_stream, reference_codes, reference_pcm

FRAME = 1920


@pytest.fixture(scope="module")
def full() -> MimiModel:
    return MimiModel.random(MimiConfig.tiny(), seed=3)


def numel(model: MimiModel) -> int:
    return sum(t.numel() for t in (*model.parameters(), *model.buffers()))


def states(streamer) -> list[torch.Tensor]:
    return [t.clone() for t in streamer._tensors]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def masks(slots: int, steps: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = [torch.ones(slots, dtype=torch.bool)]
    out += [torch.rand(slots, generator=g) < 0.7 for _ in range(steps - 1)]
    return out


# ---- keep_only --------------------------------------------------------------------------------------

def test_encode_half_streams_exactly_like_the_full_model(full):
    half = copy.deepcopy(full).keep_only("encode")
    assert half.kept == "encode" and full.kept == "both"
    assert numel(half) < numel(full) * 0.75
    keys = set(half.state_dict())
    assert not any(k.startswith(("decoder.", "decoder_transformer.", "upsample.")) or "output_proj" in k for k in keys)
    assert len(half.quantizer.rvq_first.vq.layers) + len(half.quantizer.rvq_rest.vq.layers) == full.cfg.num_codebooks
    assert {k for k in full.state_dict() if k.startswith(("encoder.", "encoder_transformer.", "downsample."))} <= keys

    slots, g = 3, torch.Generator().manual_seed(4)
    a, b = StreamingEncoder(full, slots), StreamingEncoder(half, slots)
    for active in masks(slots, 6, seed=5):
        pcm = 0.3 * torch.randn(slots, FRAME, generator=g)
        ca, cb = a.step(pcm, active), b.step(pcm, active)
        assert torch.equal(ca[active], cb[active])
    assert same(states(a), states(b))
    pcm = 0.3 * torch.randn(2, 1, 3 * FRAME, generator=g)
    assert torch.equal(half.encode(pcm), full.encode(pcm))


def test_decode_half_streams_exactly_like_the_full_model(full):
    half = copy.deepcopy(full).keep_only("decode")
    assert numel(half) < numel(full) * 0.75
    assert not any(k.startswith(("encoder.", "encoder_transformer.", "downsample.")) or "input_proj" in k
                   for k in half.state_dict())
    slots, g = 3, torch.Generator().manual_seed(6)
    a, b = StreamingDecoder(full, slots), StreamingDecoder(half, slots)
    for active in masks(slots, 6, seed=7):
        codes = torch.randint(0, full.cfg.bins, (slots, full.cfg.num_codebooks), generator=g)
        pa, pb = a.step(codes, active), b.step(codes, active)
        assert torch.equal(pa[active], pb[active])
    assert same(states(a), states(b))
    codes = torch.randint(0, full.cfg.bins, (1, full.cfg.num_codebooks, 3), generator=g)
    assert torch.equal(half.decode(codes), full.decode(codes))


def test_the_dropped_half_raises_a_clear_error(full):
    enc_only = copy.deepcopy(full).keep_only("encode")
    dec_only = copy.deepcopy(full).keep_only("decode")
    codes = torch.zeros(1, full.cfg.num_codebooks, 2, dtype=torch.long)
    pcm = torch.zeros(1, 1, 2 * FRAME)
    attempts = [
        (lambda: enc_only.decode(codes), "decode half"),
        (lambda: StreamingDecoder(enc_only, 2), "StreamingDecoder needs Mimi's decode half"),
        (lambda: enc_only.decoder, "decode half was dropped"),
        (lambda: enc_only.quantizer.decode(codes, torch.float32), "output_proj"),
        (lambda: dec_only.encode(pcm), "encode half"),
        (lambda: StreamingEncoder(dec_only, 2), "StreamingEncoder needs Mimi's encode half"),
        (lambda: dec_only.encoder_transformer(torch.zeros(1, full.cfg.dimension, 2)), "encode half was dropped"),
        (lambda: dec_only.quantizer.encode(torch.zeros(1, full.cfg.dimension, 1), 8), "input_proj"),
        (lambda: enc_only.keep_only("decode"), "keep_only\\('encode'\\) dropped"),
    ]
    for call, words in attempts:
        with pytest.raises(DroppedHalfError, match=words) as e:
            call()
        assert not isinstance(e.value, AttributeError)
    assert enc_only.keep_only("encode") is enc_only  # the same half again: nothing to do
    with pytest.raises(ValueError):
        copy.deepcopy(full).keep_only("both")
    with pytest.raises(AttributeError):  # other missing attributes stay AttributeErrors
        enc_only.no_such_thing


def test_load_keep_checks_the_whole_file_strictly(full, tmp_path):
    path = tmp_path / "mimi.safetensors"
    save_file(full.state_dict(), str(path))
    enc_only = MimiModel.load(path, full.cfg, keep="encode")
    assert enc_only.kept == "encode" and enc_only.device.type == "cpu" and enc_only.dtype == torch.float32
    pcm = 0.3 * torch.randn(1, 1, 2 * FRAME, generator=torch.Generator().manual_seed(8))
    assert torch.equal(enc_only.encode(pcm), full.encode(pcm))
    assert MimiModel.load(path, full.cfg, keep="decode").kept == "decode"

    state = dict(full.state_dict())
    missing = "decoder_transformer.transformer.layers.0.linear1.weight"  # a key of the half that is dropped
    del state[missing]
    save_file(state, str(path))
    with pytest.raises(CheckpointError, match=missing.replace(".", r"\.")):
        MimiModel.load(path, full.cfg, keep="encode")
    with pytest.raises(ValueError):
        MimiModel.load(path, full.cfg, keep="both")


# ---- an all-inactive step changes nothing ---------------------------------------------------------

@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_a_step_with_every_slot_inactive_leaves_all_state_bit_identical(full, kind):
    slots, g = 3, torch.Generator().manual_seed(9)
    cfg = full.cfg
    if kind == "encoder":
        streamer = StreamingEncoder(full, slots)
        inputs = lambda: 0.3 * torch.randn(slots, FRAME, generator=g)  # noqa: E731
    else:
        streamer = StreamingDecoder(full, slots)
        inputs = lambda: torch.randint(0, cfg.bins, (slots, cfg.num_codebooks), generator=g)  # noqa: E731
    fresh = states(streamer)
    none = torch.zeros(slots, dtype=torch.bool)
    streamer.step(torch.zeros_like(inputs()), none)  # what the service's warmup runs
    assert same(fresh, states(streamer))
    everyone = torch.ones(slots, dtype=torch.bool)
    for _ in range(4):  # slots with history (the transformer ring partly filled, offsets > 0)
        streamer.step(inputs(), everyone)
    before = states(streamer)
    assert not same(before, fresh)
    streamer.step(torch.zeros_like(inputs()), none)
    streamer.step(inputs() * (1000 if kind == "encoder" else 1), none)  # junk input, still inactive
    assert same(before, states(streamer))
    streamer.step(inputs(), everyone)  # the check has teeth: an active step moves state
    assert not same(before, states(streamer))


# ---- warmup in the services -----------------------------------------------------------------------

async def test_warmup_runs_on_the_worker_then_syncs_and_empties_the_cuda_cache(monkeypatch):
    """The CUDA branch of the warmup, with torch.cuda stubbed: step (all inactive), synchronize, empty_cache,
    all on the batcher's single worker thread."""
    events = []
    here = lambda: threading.current_thread().name  # noqa: E731
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(("sync", device, here())))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append(("empty", None, here())))

    def step(x, active):
        events.append(("step", (tuple(x.shape), bool(active.any())), here()))
        return torch.zeros(x.shape[0], 8, dtype=torch.long)

    batcher = CodecBatcher(StageRuntime("encoder", 4), step, lambda slot: None, (FRAME,), torch.float32)
    try:
        seconds = await batcher.warmup("cuda:1")
    finally:
        await batcher.stop()
    assert seconds >= 0
    assert [(e[0], e[1]) for e in events] == [("step", ((4, FRAME), False)), ("sync", torch.device("cuda:1")),
                                              ("empty", None)]
    assert all(e[2].startswith("encoder-step") for e in events)
    assert batcher.steps == 0  # not a served step


@pytest.fixture(scope="module")
def mimi(tiny_checkpoint) -> MimiModel:
    paths = CheckpointPaths.open(tiny_checkpoint, require=("mimi",))
    return MimiModel.load(paths.mimi, MimiConfig.from_dict(paths.serve_config()["mimi"]))


@pytest.mark.parametrize("stage", ["encoder", "decoder"])
async def test_service_warms_up_before_serving_and_keeps_state_fresh(tiny_checkpoint, mimi, stage):
    build, cfg_cls, streamer_cls = {
        "encoder": (build_encoder, EncoderConfig, StreamingEncoder),
        "decoder": (build_decoder, DecoderConfig, StreamingDecoder),
    }[stage]
    service = build(cfg_cls(checkpoint=str(tiny_checkpoint), host="127.0.0.1", port=0, metrics_port=-1, slots=3))
    assert service.codec.model.kept == ("encode" if stage == "encoder" else "decode")
    steps = []
    inner = service.batcher._step
    service.batcher._step = lambda x, active: (steps.append(active.clone()), inner(x, active))[1]
    await service.start()
    try:
        assert len(steps) == 1 and not steps[0].any() and service.warmup_s is not None
        assert same(states(service.codec), states(streamer_cls(mimi, 3)))
        assert service.batcher.steps == 0
        # Generated metrics on CPU: no GPU gauges at all.
        assert b"gpu_memory" not in generate_latest(service.runtime.metrics.registry)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{service.port}") as channel:
            codes = reference_codes(mimi, audio(3, seed=21))
            if stage == "encoder":
                got = await encode_stream(encoder_pb2_grpc.EncoderStub(channel), "s", audio(3, seed=21))
                assert got == codes
            else:
                pcm = await decode_stream(decoder_pb2_grpc.DecoderStub(channel), "s", codes)
                np.testing.assert_allclose(pcm, reference_pcm(mimi, codes), atol=1e-5)
    finally:
        await service.stop()


# ---- GPU memory gauges ----------------------------------------------------------------------------

def gauge_values(metrics: StageMetrics) -> dict[str, float]:
    return {s.name: s.value for fam in metrics.registry.collect() for s in fam.samples if "gpu_memory" in s.name}


def test_track_gpu_on_cpu_registers_nothing():
    metrics = StageMetrics("encoder")
    assert metrics.track_gpu("cpu") is False
    assert metrics.track_gpu(torch.device("cpu")) is False
    assert gauge_values(metrics) == {}
    assert b"gpu_memory" not in generate_latest(metrics.registry)


def test_gpu_gauges_read_lazily_never_init_cuda_and_never_raise(monkeypatch):
    calls = []
    initialized = [False]

    def reading(name, value):
        def read(device=None):
            calls.append((name, device))
            if isinstance(value, Exception):
                raise value
            return value
        return read

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized[0])
    monkeypatch.setattr(torch.cuda, "memory_allocated", reading("allocated", 1234))
    monkeypatch.setattr(torch.cuda, "memory_reserved", reading("reserved", 5678))
    monkeypatch.setattr(torch.cuda, "mem_get_info", reading("free", (91011, 10**9)))
    metrics = StageMetrics("talker")
    assert metrics.track_gpu("cuda:1") is True
    assert metrics.track_gpu("cuda:1") is True  # again: no duplicate-registration error
    assert calls == []  # nothing is read until a scrape

    names = ["duplex_stage_gpu_memory_allocated_bytes", "duplex_stage_gpu_memory_reserved_bytes",
             "duplex_stage_gpu_memory_free_bytes"]
    values = gauge_values(metrics)  # CUDA not initialized yet: NaN, and no torch.cuda call
    assert sorted(values) == sorted(names) and all(math.isnan(v) for v in values.values())
    assert calls == []

    initialized[0] = True
    assert gauge_values(metrics) == dict(zip(names, [1234.0, 5678.0, 91011.0]))
    assert {device for _, device in calls} == {torch.device("cuda:1")}
    text = generate_latest(metrics.registry).decode()
    assert 'duplex_stage_gpu_memory_free_bytes{stage="talker"} 91011.0' in text

    monkeypatch.setattr(torch.cuda, "memory_allocated", reading("allocated", RuntimeError("CUDA error: device lost")))
    values = gauge_values(metrics)
    assert math.isnan(values[names[0]]) and values[names[1]] == 5678.0
    assert "duplex_stage_gpu_memory_allocated_bytes" in generate_latest(metrics.registry).decode()
