"""Input audio: a WAV file or a synthetic speech-like signal, cut into 80 ms append events."""

from __future__ import annotations

import base64
import hashlib
import wave
from pathlib import Path

import numpy as np

from .config import FRAME_PERIOD_S, FRAME_SAMPLES, SAMPLE_RATE_HZ

# Vowel formants (F1, F2, F3 in Hz) of an adult voice: /a/, /i/, /u/, /e/, /o/.
_VOWELS = np.array([[730, 1090, 2440], [270, 2290, 3010], [300, 870, 2240], [530, 1840, 2480], [570, 840, 2410]])
_FORMANT_BANDWIDTH_HZ = np.array([90.0, 110.0, 170.0])


def read_wav(path: Path) -> np.ndarray:
    """Mono float32 samples at 24 kHz in [-1, 1] (integer PCM WAV; channels averaged, rate resampled)."""
    try:
        with wave.open(str(path), "rb") as wav:
            channels, width, rate = wav.getnchannels(), wav.getsampwidth(), wav.getframerate()
            raw = wav.readframes(wav.getnframes())
    except (wave.Error, EOFError) as exc:
        raise ValueError(f"{path}: not an integer-PCM WAV file ({exc})") from None
    if width == 1:
        pcm = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width in (2, 4):
        pcm = np.frombuffer(raw, f"<i{width}").astype(np.float32) / float(1 << (8 * width - 1))
    else:
        raise ValueError(f"{path}: unsupported WAV sample width {width} bytes")
    if channels > 1:
        pcm = pcm.reshape(-1, channels).mean(axis=1)
    if rate != SAMPLE_RATE_HZ and pcm.size:
        n_out = max(1, round(pcm.size * SAMPLE_RATE_HZ / rate))
        pcm = np.interp(np.linspace(0, pcm.size - 1, n_out), np.arange(pcm.size), pcm)
    pcm = np.ascontiguousarray(pcm, dtype=np.float32)
    if not pcm.size or not np.isfinite(pcm).all():
        raise ValueError(f"{path}: the WAV holds no finite audio")
    return pcm


def synth_speech(n_frames: int, seed: int = 0) -> np.ndarray:
    """A deterministic speech-like test signal: `n_frames` x 80 ms of 24 kHz float32.

    Not speech, but shaped like it so a codec and a VAD treat it as voice: "words" of 1-4
    syllables (150-300 ms each) separated by 150-400 ms pauses; each syllable is a glottal
    harmonic series (F0 100-180 Hz, falling intonation, 5 Hz vibrato) shaped by the three
    formants of a vowel, with a raised-cosine envelope and a little aspiration noise.
    The same (n_frames, seed) always gives the same samples.
    """
    rng = np.random.default_rng(seed)
    n = n_frames * FRAME_SAMPLES
    f0 = np.zeros(n, np.float64)  # 0 where silent
    env = np.zeros(n, np.float64)
    syllables: list[tuple[int, int, np.ndarray]] = []  # (start, end, formants)
    pos = int(rng.integers(0, int(0.1 * SAMPLE_RATE_HZ)))
    while pos < n:
        base_f0 = rng.uniform(100, 180)
        for syllable in range(int(rng.integers(1, 5))):
            length = int(rng.uniform(0.15, 0.3) * SAMPLE_RATE_HZ)
            end = min(pos + length, n)
            t = np.arange(end - pos) / SAMPLE_RATE_HZ
            f0[pos:end] = base_f0 * (1.0 - 0.08 * syllable) * (1.0 - 0.15 * t / 0.3) + 3.0 * np.sin(2 * np.pi * 5 * t)
            env[pos:end] = np.sin(np.pi * np.arange(end - pos) / length) ** 2
            syllables.append((pos, end, _VOWELS[rng.integers(0, len(_VOWELS))]))
            pos = end
            if pos >= n:
                break
        pos += int(rng.uniform(0.15, 0.4) * SAMPLE_RATE_HZ)

    phase = 2 * np.pi * np.cumsum(f0) / SAMPLE_RATE_HZ
    voice = np.zeros(n, np.float64)
    voiced = f0 > 0
    k = np.arange(1, 40)[:, None]  # harmonics up to ~4-7 kHz
    for start, end, formants in syllables:
        freq = k * f0[start:end].mean()
        # Resonance peaks around the vowel's formants; a 1/k glottal source tilt.
        gain = sum(
            0.5**i / (1.0 + ((freq - formants[i]) / _FORMANT_BANDWIDTH_HZ[i]) ** 2) for i in range(3)
        ) * np.where(freq < 0.45 * SAMPLE_RATE_HZ, 1.0 / k, 0.0)
        voice[start:end] = (gain * np.sin(k * phase[start:end])).sum(axis=0)
    voice += 0.02 * rng.standard_normal(n) * voiced
    voice *= env
    peak = np.max(np.abs(voice)) if n else 0.0
    return (0.3 * voice / peak if peak > 0 else voice).astype(np.float32)


def input_signal(wav: Path | None, max_frames: int, seed: int) -> tuple[np.ndarray, dict[str, object]]:
    """The samples to stream (at most `max_frames` frames, never looped) and their identity for the report."""
    if wav is None:
        pcm = synth_speech(max_frames, seed)
        identity: dict[str, object] = {"source": "synthetic_speech_like", "seed": seed}
    else:
        pcm = read_wav(wav)[: max_frames * FRAME_SAMPLES]
        identity = {"source": "wav", "name": wav.name, "sha256": hashlib.sha256(wav.read_bytes()).hexdigest()}
    identity["frames"] = frame_count(pcm)
    identity["duration_s"] = round(pcm.size / SAMPLE_RATE_HZ, 6)
    return pcm, identity


def frame_count(pcm: np.ndarray) -> int:
    return -(-pcm.size // FRAME_SAMPLES)


def append_event(pcm: np.ndarray, seq: int, input_format: str) -> dict[str, object]:
    """`input_audio_buffer.append` for frame `seq` (the last frame zero-padded to 1920 samples)."""
    frame = pcm[seq * FRAME_SAMPLES : (seq + 1) * FRAME_SAMPLES]
    frame = np.pad(frame, (0, FRAME_SAMPLES - frame.size))
    if input_format == "pcm16":
        payload = np.clip(np.round(frame * 32767.0), -32768, 32767).astype("<i2").tobytes()
    else:
        payload = frame.astype("<f4").tobytes()
    return {
        "type": "input_audio_buffer.append",
        "audio": base64.b64encode(payload).decode("ascii"),
        "format": input_format,
        "sample_rate_hz": SAMPLE_RATE_HZ,
        "duration_ms": round(FRAME_PERIOD_S * 1000),
        "audio_end_ms": round((seq + 1) * FRAME_PERIOD_S * 1000),
    }
