"""Audio files -> 24 kHz samples, bounded, and the checks a voice's audio must pass.

    pcm = read_audio("alice.wav", max_seconds=30)   # sphn: any format it reads; 24 kHz; first channel
    pcm = check_voice(data, 2.0, 30.0)              # an upload: bounded, long enough, audible

numpy, sphn and pyloudnorm only (no model code, no torch), so the sandbox that decodes a client's
file (audio_sandbox.py) starts in about a second. Every refusal is AudioRefused with a `kind` a
client can act on: not_audio, too_short, too_long, silent. voice_audio.py raises the same as
InvalidVoiceAudio, the type the talker and the gateway catch.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import sphn

from services.common.frame import SAMPLE_RATE

# BS.1770 gates blocks below -70 LUFS: audio with no block above it has no integrated loudness.
SILENCE_LUFS = -70.0
MIN_SECONDS = 0.4  # one 400 ms loudness block; shorter audio has no integrated loudness either
# What a header may say before anything is decoded (a 30 s bound is then at most ~92 MB of samples).
MAX_RATE = 96_000
MAX_CHANNELS = 8
_PAST_THE_CAP_S = 0.1  # decoded past max_seconds, to tell audio that is too long from audio that is not


class AudioRefused(ValueError):
    """Audio that cannot be a voice; `kind` says why."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


def read_audio(source: str | Path | bytes, max_seconds: float | None = None) -> np.ndarray:
    """An audio file (a path, or its bytes) -> float32 [T] at 24 kHz: decoded by sphn, resampled,
    its first channel.

    Bounded before decoding: the header's sample rate and channels are checked first (at most
    MAX_RATE Hz and MAX_CHANNELS), and with `max_seconds` decoding stops just past it (too_long),
    whatever the file says its duration is, so memory stays within about max_seconds x rate x
    channels x 4 bytes. Every decoder failure, a Rust panic included, is AudioRefused(not_audio)."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        fd, name = tempfile.mkstemp(prefix="voice-", suffix=".audio")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(source)
            return read_audio(name, max_seconds)
        finally:
            os.unlink(name)
    try:
        reader = sphn.FileReader(str(source))
        rate, channels = int(reader.sample_rate), int(reader.channels)
        if not (0 < rate <= MAX_RATE and 0 < channels <= MAX_CHANNELS):
            raise AudioRefused(f"the file says {rate} Hz and {channels} channel(s): at most {MAX_RATE} Hz and "
                               f"{MAX_CHANNELS} channels are read", "not_audio")
        pcm = reader.decode_all() if max_seconds is None else reader.decode(0.0, max_seconds + _PAST_THE_CAP_S)
        if max_seconds is not None and np.shape(pcm)[-1] > max_seconds * rate:
            raise AudioRefused(f"the audio lasts more than {max_seconds:g} s, at most {max_seconds:g} s allowed",
                               "too_long")
        if rate != SAMPLE_RATE and np.size(pcm):
            pcm = sphn.resample(np.ascontiguousarray(pcm[:1]), src_sample_rate=rate, dst_sample_rate=SAMPLE_RATE)
    except AudioRefused:
        raise
    except BaseException as e:
        if not _is_decoder_failure(e):
            raise
        raise AudioRefused(f"not an audio file sphn can read ({type(e).__name__})", "not_audio") from None
    pcm = np.asarray(pcm, dtype=np.float32)
    if pcm.ndim != 2 or pcm.shape[0] < 1 or pcm.shape[1] == 0:
        raise AudioRefused("the file holds no audio samples", "too_short")
    first = np.ascontiguousarray(pcm[0], dtype=np.float32)
    if not np.isfinite(first).all():
        raise AudioRefused("the audio holds non-finite samples", "not_audio")
    return first


def _is_decoder_failure(e: BaseException) -> bool:
    """sphn raises plain exceptions for what it cannot decode, and a Rust panic in the decoder arrives as
    pyo3's PanicException, a BaseException (a WAV header saying 0 Hz panics in symphonia)."""
    return isinstance(e, Exception) or type(e).__name__ == "PanicException"


def loudness(pcm: np.ndarray) -> float:
    """Integrated loudness in LUFS (ITU-R BS.1770 via pyloudnorm); -inf for silence."""
    import pyloudnorm

    if pcm.size < MIN_SECONDS * SAMPLE_RATE:
        raise AudioRefused(f"the audio lasts {pcm.size / SAMPLE_RATE:.2f} s, at least {MIN_SECONDS} s needed",
                           "too_short")
    return float(pyloudnorm.Meter(SAMPLE_RATE).integrated_loudness(pcm))


def check_audible(pcm: np.ndarray) -> float:
    """The audio's loudness, or AudioRefused(silent) if BS.1770 finds nothing to measure."""
    lufs = loudness(pcm)
    if not np.isfinite(lufs) or lufs <= SILENCE_LUFS:
        raise AudioRefused("the audio is silent (no 400 ms block above -70 LUFS)", "silent")
    return lufs


def check_voice(source: str | Path | bytes, min_seconds: float, max_seconds: float) -> np.ndarray:
    """Audio a client sends to become a voice: read_audio bounded by max_seconds, at least
    min_seconds long, and audible. The 24 kHz samples, or AudioRefused with its kind."""
    pcm = read_audio(source, max_seconds)
    if pcm.size < min_seconds * SAMPLE_RATE:
        raise AudioRefused(f"the audio lasts {pcm.size / SAMPLE_RATE:.2f} s, at least {min_seconds:g} s needed",
                           "too_short")
    check_audible(pcm)
    return pcm
