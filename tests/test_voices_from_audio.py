"""Voices from audio, recorded as NVIDIA's reference server records them (services/common/voice_audio.py,
services/talker/voice_recorder.py, tools/make_voice.py), on the tiny checkpoint.

WAV -> .pt equals the same steps done by hand (wave + pyloudnorm + Mimi + prompt.make_voice); the
normalised audio measures -24 LUFS with pyloudnorm's own meter; a 48 kHz stereo file works (its first
channel); bad audio is refused with a typed kind; the talker records a voice once (memory, then
disk) and serves it by name and shipped with an open, over gRPC.
"""

from __future__ import annotations

import shutil
import wave
from pathlib import Path

import grpc
import numpy as np
import pyloudnorm
import pytest
import torch

from duplex.v1 import common_pb2, talker_pb2, talker_pb2_grpc
from services.common import voice_audio
from services.common.checkpoint import CheckpointPaths
from services.codec.mimi import MimiConfig, MimiModel, StreamingEncoder
from services.talker import prompt
from services.talker.config import TalkerConfig
from services.talker.engine import SamplingParams, TalkerEngine
from services.talker.model import LMConfig, LMModel
from services.talker.server import TalkerService
from services.talker.voice_recorder import VoiceRecorder
from services.talker.voices import load_voice, save_voice
from tools import make_voice

GREEDY = SamplingParams(greedy=True)


def speech_like(seconds: float, rate: int, seed: int, channels: int = 1) -> np.ndarray:
    """[channels, T]: voiced harmonics under a syllable-rate envelope, plus a little noise."""
    g = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    out = []
    for c in range(channels):
        f0 = 110.0 * (1 + c) + 20 * np.sin(2 * np.pi * 0.7 * t)
        phase = 2 * np.pi * np.cumsum(f0) / rate
        voiced = sum(np.sin(k * phase) / k for k in range(1, 8))
        envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4.0 * t + c)
        out.append(0.05 * (1 + 3 * c) * envelope * voiced + 0.002 * g.standard_normal(t.size))
    return np.clip(np.stack(out), -1, 1).astype(np.float32)


def write_wav(path: Path, pcm: np.ndarray, rate: int) -> Path:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(pcm.shape[0])
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((pcm.T * 32767).round().astype("<i2").tobytes())
    return path


@pytest.fixture(scope="module")
def paths(tiny_checkpoint) -> CheckpointPaths:
    return CheckpointPaths.open(tiny_checkpoint)


@pytest.fixture(scope="module")
def models(paths):
    section = paths.serve_config()
    mimi = MimiModel.load(paths.mimi, MimiConfig.from_dict(section["mimi"]))
    lm = LMModel.load(paths.lm, LMConfig.from_dict(section["lm"]), dep_steps=8)
    return mimi, lm


def test_wav_to_pt_equals_recording_the_same_mimi_codes_by_hand(paths, models, tmp_path):
    wav = write_wav(tmp_path / "alice.wav", speech_like(2.0, 24_000, seed=1), 24_000)
    out = tmp_path / "alice.pt"
    assert make_voice.main([str(wav), "--checkpoint", str(paths.root), "--out", str(out), "--dtype", "float32"]) == 0

    # by hand: the WAV's int16 samples, pyloudnorm to -24 LUFS, 1920-sample frames, Mimi from a fresh state
    with wave.open(str(wav)) as w:
        x = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768
    x = pyloudnorm.normalize.loudness(x, pyloudnorm.Meter(24_000).integrated_loudness(x), -24.0)
    n = -(-x.size // 1920)
    frames = np.zeros(n * 1920, np.float32)
    frames[: x.size] = x
    mimi, lm = models
    enc = StreamingEncoder(mimi, slots=1)
    codes = torch.stack([enc.step(torch.from_numpy(f)[None], torch.ones(1, dtype=torch.bool))[0, :8]
                         for f in frames.reshape(n, 1920)])
    cfg = lm.cfg
    voice = prompt.make_voice(lm.embed, codes, torch.tensor(cfg.delays),
                              prompt.initial_tokens(cfg.text_card, cfg.card, cfg.num_streams))
    save_voice(tmp_path / "by_hand.pt", voice)

    ours, theirs = torch.load(out, weights_only=True), torch.load(tmp_path / "by_hand.pt", weights_only=True)
    assert set(ours) == {"embeddings", "cache"} and ours["embeddings"].shape == (n - 1, 1, 1, cfg.dim)
    assert torch.equal(ours["cache"], theirs["cache"]) and torch.equal(ours["embeddings"], theirs["embeddings"])
    assert len({tuple(c.tolist()) for c in codes}) > n // 2  # the codes follow the audio, not a constant
    load_voice(out, cfg.dim, cfg.delays, cfg.text_card, cfg.card)  # the talker accepts it


@pytest.mark.parametrize("gain", [0.03, 0.3, 4.0])
def test_normalised_audio_measures_minus_24_lufs(gain):
    pcm = gain * speech_like(3.0, 24_000, seed=2)[0]
    out = voice_audio.normalize(pcm)
    assert out.dtype == np.float32 and out.shape == pcm.shape
    assert abs(pyloudnorm.Meter(24_000).integrated_loudness(out) - (-24.0)) <= 0.5


def test_a_48khz_stereo_file_is_its_first_channel_at_24khz(paths, tmp_path):
    stereo = speech_like(2.0, 48_000, seed=3, channels=2)
    both = voice_audio.read_audio(write_wav(tmp_path / "stereo.wav", stereo, 48_000))
    first = voice_audio.read_audio(write_wav(tmp_path / "left.wav", stereo[:1], 48_000))
    assert both.dtype == np.float32 and abs(both.size - 48_000) <= 1920  # 2 s at 24 kHz (+ resampler tail)
    assert np.array_equal(both, first)  # the first channel, resampled
    assert abs(pyloudnorm.Meter(24_000).integrated_loudness(voice_audio.normalize(both)) + 24.0) <= 0.5
    out = tmp_path / "stereo.pt"
    assert make_voice.main([str(tmp_path / "stereo.wav"), "--checkpoint", str(paths.root), "--out", str(out)]) == 0
    assert torch.load(out, weights_only=True)["embeddings"].shape[0] == -(-both.size // 1920) - 1


@pytest.mark.parametrize("audio,kind", [
    (b"RIFF....WAVEfmt not really", "not_audio"),
    ("silent", "silent"),
    ("short", "too_short"),
])
def test_audio_that_cannot_be_a_voice_is_refused_with_its_kind(tmp_path, audio, kind):
    if audio == "silent":
        audio = write_wav(tmp_path / "s.wav", np.zeros((1, 24_000), np.float32), 24_000).read_bytes()
    elif audio == "short":
        audio = write_wav(tmp_path / "s.wav", speech_like(0.2, 24_000, seed=4), 24_000).read_bytes()
    with pytest.raises(voice_audio.InvalidVoiceAudio) as e:
        voice_audio.normalize(voice_audio.read_audio(audio))
    assert e.value.kind == kind
    with pytest.raises(voice_audio.InvalidVoiceAudio) as e:
        voice_audio.read_audio(write_wav(tmp_path / "long.wav", speech_like(3.0, 8_000, 5), 8_000), max_seconds=2.0)
    assert e.value.kind == "too_long"


async def inline(fn):
    return fn()


async def test_the_talker_records_a_voice_once_and_the_recording_equals_the_offline_tool(paths, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(paths.root, ckpt)
    audio = speech_like(1.5, 24_000, seed=6)
    write_wav(ckpt / "voices" / "Alice.wav", audio, 24_000)
    mine = CheckpointPaths.open(ckpt)
    assert "Alice.wav" in mine.voice_names()
    eng = TalkerEngine.from_checkpoint(mine, slots=2)
    recorder = VoiceRecorder(mine, eng, inline, tmp_path / "cache")
    assert (await recorder.resolve("Alice.wav")).key == "Alice.wav"
    assert recorder.encoder.encodes == 1
    recorder.close()
    cached = list((tmp_path / "cache").glob("*.pt"))
    assert len(cached) == 1
    tool = tmp_path / "tool.pt"
    assert make_voice.main([str(ckpt / "voices" / "Alice.wav"), "--checkpoint", str(ckpt), "--out", str(tool),
                            "--dtype", "float32"]) == 0
    a, b = torch.load(cached[0], weights_only=True), torch.load(tool, weights_only=True)
    assert torch.equal(a["embeddings"], b["embeddings"]) and torch.equal(a["cache"], b["cache"])

    job = eng.begin(0, "Alice.wav", "Hi.", GREEDY)
    assert job.prompt_frames == b["embeddings"].shape[0] + 1 + 12 + len(eng.tokenizer.encode_persona("Hi."))

    # the same audio shipped with an open: its own key and its own file (enrolled recordings are bounded and
    # forgotten apart from the bundled ones), the same recording; a second talker reads it from the disk cache
    pcm = voice_audio.read_audio(ckpt / "voices" / "Alice.wav")
    lease = await recorder.resolve("alice", pcm)
    assert lease.key.startswith("@") and recorder.encoder.encodes == 2
    recorder.close()
    enrolled = list((tmp_path / "cache").glob("enrolled-*.pt"))
    assert len(enrolled) == 1 and len(list((tmp_path / "cache").glob("*.pt"))) == 2
    c = torch.load(enrolled[0], weights_only=True)
    assert torch.equal(c["embeddings"], b["embeddings"]) and torch.equal(c["cache"], b["cache"])
    fresh = TalkerEngine.from_checkpoint(mine, slots=2)
    again = VoiceRecorder(mine, fresh, inline, tmp_path / "cache")
    key = (await again.resolve("alice", pcm)).key
    assert key == lease.key and again.encoder.encodes == 0  # no recording: the cache had it
    assert fresh.begin(1, key, "Hi.", GREEDY).prompt_frames == job.prompt_frames


async def test_the_service_serves_audio_voices_by_name_and_shipped_with_the_open(paths, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(paths.root, ckpt)
    write_wav(ckpt / "voices" / "Bob.wav", speech_like(1.2, 16_000, seed=7), 16_000)
    cfg = TalkerConfig(checkpoint=str(ckpt), port=0, metrics_port=0, slots=2, tick_ms=20.0, drain_deadline_s=1.0,
                       voice_cache_dir=str(tmp_path / "cache"), max_voice_seconds=5.0)
    svc = await TalkerService(cfg).start()
    channel = grpc.aio.insecure_channel(svc.address)
    stub = talker_pb2_grpc.TalkerStub(channel)

    async def talk(sid, voice, audio=b""):
        call = stub.Talk()
        await call.write(talker_pb2.TalkRequest(open=talker_pb2.TalkOpen(
            stream=common_pb2.StreamOpen(stream_id=sid), voice=voice, persona="Hi.", voice_audio=audio,
            sampling=talker_pb2.Sampling(greedy=True, seed=1))))
        first = await call.read()
        for seq in range(3):
            await call.write(talker_pb2.TalkRequest(frame=common_pb2.CodesFrame(seq=seq, codes=[seq] * 8)))
        await call.done_writing()
        outs = []
        while (m := await call.read()) is not grpc.aio.EOF:
            outs.append(m.output)
        return first.ready, outs

    try:
        ready, outs = await talk("a", "Bob.wav")
        assert ready.output_delay_frames == 0 and len(outs) == 3
        shipped = speech_like(1.0, 24_000, seed=8)[0]
        ready, outs = await talk("b", "carol", shipped.astype("<f4").tobytes())
        assert ready.prefill_frames > 12 and len(outs) == 3
        for voice, audio, bad in [("carol", b"\x00" * 5, "float32"), ("a/b", shipped.tobytes(), "enrolled"),
                                  ("carol", np.zeros(24_000, "<f4").tobytes(), "silent"),
                                  ("carol", np.ones(6 * 24_000, "<f4").tobytes(), "at most 5")]:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await talk("c", voice, audio)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and bad in e.value.details()
        ready, outs = await talk("d", "Bob.wav")  # the service is unharmed
        assert len(outs) == 3
    finally:
        await channel.close()
        await svc.stop()
