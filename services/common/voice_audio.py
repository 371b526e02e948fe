"""A voice prompt's audio, prepared exactly as NVIDIA's reference server prepares it before recording:

    pcm = read_audio("alice.wav")          # sphn: any format it reads; resampled to 24 kHz; first channel
    pcm = normalize(pcm)                   # -24 LUFS integrated loudness (ITU-R BS.1770, pyloudnorm)
    frames = to_frames(pcm)                # [N, 1920], the last frame zero-padded

Audio only (numpy, sphn, pyloudnorm): the gateway checks uploads with it without any model code;
the talker (services/talker/voice_recorder.py) and tools/make_voice.py then encode the frames with
Mimi and record them. Every refusal is InvalidVoiceAudio with a `kind` a client can act on.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import sphn

from services.common.checkpoint import InvalidVoice
from services.common.frame import FRAME_SAMPLES, SAMPLE_RATE

TARGET_LUFS = -24.0
# BS.1770 gates blocks below -70 LUFS: audio with no block above it has no integrated loudness.
SILENCE_LUFS = -70.0
MIN_SECONDS = 0.4  # one 400 ms loudness block; shorter audio has no integrated loudness either


class InvalidVoiceAudio(InvalidVoice):
    """Audio that cannot be a voice. kind: not_audio, too_short, too_long, silent."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


def read_audio(source: str | Path | bytes, max_seconds: float | None = None) -> np.ndarray:
    """An audio file (a path, or its bytes) -> float32 [T] at 24 kHz: decoded by sphn, resampled,
    its first channel. max_seconds bounds the decoded duration (checked before resampling)."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        fd, name = tempfile.mkstemp(prefix="voice-", suffix=".audio")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(source)
            return read_audio(name, max_seconds)
        finally:
            os.unlink(name)
    try:
        pcm, rate = sphn.read(str(source))
    except Exception as e:  # sphn raises plain exceptions for anything it cannot decode
        raise InvalidVoiceAudio(f"not an audio file sphn can read ({type(e).__name__})", "not_audio") from None
    pcm = np.asarray(pcm, dtype=np.float32)
    if pcm.ndim != 2 or pcm.shape[0] < 1 or pcm.shape[1] == 0 or not rate or rate <= 0:
        raise InvalidVoiceAudio("the file holds no audio samples", "too_short")
    if max_seconds is not None and pcm.shape[1] / rate > max_seconds:
        raise InvalidVoiceAudio(f"the audio lasts {pcm.shape[1] / rate:.1f} s, at most {max_seconds:g} s allowed",
                                "too_long")
    if rate != SAMPLE_RATE:
        pcm = sphn.resample(pcm, src_sample_rate=rate, dst_sample_rate=SAMPLE_RATE)
    first = np.ascontiguousarray(pcm[0], dtype=np.float32)
    if not np.isfinite(first).all():
        raise InvalidVoiceAudio("the audio holds non-finite samples", "not_audio")
    return first


def loudness(pcm: np.ndarray) -> float:
    """Integrated loudness in LUFS (ITU-R BS.1770 via pyloudnorm); -inf for silence."""
    import pyloudnorm

    if pcm.size < MIN_SECONDS * SAMPLE_RATE:
        raise InvalidVoiceAudio(f"the audio lasts {pcm.size / SAMPLE_RATE:.2f} s, at least {MIN_SECONDS} s needed",
                                "too_short")
    return float(pyloudnorm.Meter(SAMPLE_RATE).integrated_loudness(pcm))


def check_audible(pcm: np.ndarray) -> float:
    """The audio's loudness, or InvalidVoiceAudio(silent) if BS.1770 finds nothing to measure."""
    lufs = loudness(pcm)
    if not np.isfinite(lufs) or lufs <= SILENCE_LUFS:
        raise InvalidVoiceAudio("the audio is silent (no 400 ms block above -70 LUFS)", "silent")
    return lufs


def normalize(pcm: np.ndarray) -> np.ndarray:
    """-24 LUFS integrated loudness, as the reference (`pyloudnorm.normalize.loudness`); no clipping."""
    import warnings

    import pyloudnorm

    lufs = check_audible(pcm)
    with warnings.catch_warnings():  # pyloudnorm warns when peaks pass 1.0: Mimi takes them as they are
        warnings.simplefilter("ignore")
        return pyloudnorm.normalize.loudness(pcm, lufs, TARGET_LUFS).astype(np.float32)


def to_frames(pcm: np.ndarray) -> np.ndarray:
    """[T] -> [ceil(T / 1920), 1920], the last frame zero-padded."""
    n = -(-pcm.size // FRAME_SAMPLES)
    out = np.zeros((n, FRAME_SAMPLES), dtype=np.float32)
    out.reshape(-1)[: pcm.size] = pcm
    return out
