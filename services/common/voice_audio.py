"""A voice prompt's audio, prepared exactly as NVIDIA's reference server prepares it before recording:

    pcm = read_audio("alice.wav")          # sphn: any format it reads; resampled to 24 kHz; first channel
    pcm = normalize(pcm)                   # -24 LUFS integrated loudness (ITU-R BS.1770, pyloudnorm)
    frames = to_frames(pcm)                # [N, 1920], the last frame zero-padded

Audio only (numpy, sphn, pyloudnorm): the gateway checks uploads with it without any model code;
the talker (services/talker/voice_recorder.py) and tools/make_voice.py then encode the frames with
Mimi and record them. Reading and checking are audio_decode.py's (bounded before decoding; a client's
file is read in a bounded child process, audio_sandbox.py); here every refusal is InvalidVoiceAudio
with a `kind` a client can act on.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np

from services.common import audio_decode
from services.common.audio_decode import MAX_CHANNELS, MAX_RATE, MIN_SECONDS, SILENCE_LUFS  # noqa: F401 (re-exported)
from services.common.checkpoint import InvalidVoice
from services.common.frame import FRAME_SAMPLES, SAMPLE_RATE  # noqa: F401 (SAMPLE_RATE re-exported)

TARGET_LUFS = -24.0


class InvalidVoiceAudio(InvalidVoice):
    """Audio that cannot be a voice. kind: not_audio, too_short, too_long, silent."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


@contextlib.contextmanager
def _typed():
    try:
        yield
    except audio_decode.AudioRefused as e:
        raise InvalidVoiceAudio(str(e), e.kind) from None


def read_audio(source: str | Path | bytes, max_seconds: float | None = None) -> np.ndarray:
    """audio_decode.read_audio: float32 [T] at 24 kHz, its first channel; decoding stops at max_seconds."""
    with _typed():
        return audio_decode.read_audio(source, max_seconds)


def check_voice(source: str | Path | bytes, min_seconds: float, max_seconds: float) -> np.ndarray:
    """audio_decode.check_voice: read_audio bounded by max_seconds, at least min_seconds long, audible."""
    with _typed():
        return audio_decode.check_voice(source, min_seconds, max_seconds)


def loudness(pcm: np.ndarray) -> float:
    """Integrated loudness in LUFS (ITU-R BS.1770 via pyloudnorm); -inf for silence."""
    with _typed():
        return audio_decode.loudness(pcm)


def check_audible(pcm: np.ndarray) -> float:
    """The audio's loudness, or InvalidVoiceAudio(silent) if BS.1770 finds nothing to measure."""
    with _typed():
        return audio_decode.check_audible(pcm)


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
