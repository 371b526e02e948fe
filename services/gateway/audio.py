"""Client audio: strict decoding, validation, format conversion, and 1920-sample framing.

Everything here is a pure function or a small buffer with no I/O, so the gateway's
transactional rule is easy to check: a packet is decoded and validated whole
(`decode_packet`) before anything is changed; only then do its samples enter the
session's `FrameAssembler`. A refused packet leaves no trace.
"""

from __future__ import annotations

import base64
import binascii

import numpy as np
from services.common.frame import FRAME_MS, FRAME_SAMPLES, SAMPLE_RATE  # noqa: F401 (FRAME_MS: the gateway's name)


# Input formats a client may name. Output is always pcm16.
PCM16 = "pcm16"
PCM_F32LE = "pcm_f32le"
INPUT_FORMATS = (PCM16, PCM_F32LE)
_SAMPLE_BYTES = {PCM16: 2, PCM_F32LE: 4}


class AudioError(ValueError):
    """A client packet that cannot be accepted. `code` is the wire error code."""

    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.code = code
        self.param = param


def b64decode_strict(text: object, param: str = "audio") -> bytes:
    """Standard base64 with padding, nothing else (no whitespace, no URL alphabet)."""
    if not isinstance(text, str):
        raise AudioError("bad_audio", f"'{param}' must be a base64 string", param)
    try:
        return binascii.a2b_base64(text, strict_mode=True)
    except (binascii.Error, ValueError) as e:
        raise AudioError("bad_audio", f"'{param}' is not strict base64: {e}", param) from None


def b64encode(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def pcm_bytes_to_f32(data: bytes, fmt: str, max_samples: int) -> np.ndarray:
    """Little-endian PCM bytes -> float32 samples, refusing anything not whole, finite and bounded."""
    if fmt not in _SAMPLE_BYTES:
        raise AudioError("unsupported_audio_format", f"input format {fmt!r} is not one of {list(INPUT_FORMATS)}",
                         "format")
    width = _SAMPLE_BYTES[fmt]
    if len(data) == 0:
        raise AudioError("bad_audio", "audio packet is empty", "audio")
    if len(data) % width:
        raise AudioError("bad_audio", f"{len(data)} bytes is not a whole number of {fmt} samples ({width} bytes each)",
                         "audio")
    n = len(data) // width
    if n > max_samples:
        raise AudioError("bad_audio", f"audio packet has {n} samples; at most {max_samples} per packet", "audio")
    if fmt == PCM16:
        return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0
    samples = np.frombuffer(data, dtype="<f4").astype(np.float32)
    if not np.isfinite(samples).all():
        raise AudioError("bad_audio", "audio packet has non-finite samples (NaN or Inf)", "audio")
    return samples


def f32_to_pcm16_bytes(samples: np.ndarray) -> bytes:
    """Float samples in [-1, 1] -> pcm16 LE bytes (clipped; non-finite become 0)."""
    x = np.asarray(samples, dtype=np.float32)
    x = np.where(np.isfinite(x), np.clip(x, -1.0, 1.0), 0.0)  # np.nan_to_num costs 10x more per call
    return (x * 32767.0).round().astype("<i2").tobytes()


def f32_frame_bytes(frame: np.ndarray) -> bytes:
    """One frame as the stage services' wire format: 1920 float32 LE samples."""
    assert frame.shape == (FRAME_SAMPLES,), frame.shape
    return np.ascontiguousarray(frame, dtype="<f4").tobytes()


def f32_from_frame_bytes(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<f4").astype(np.float32)


class FrameAssembler:
    """Regroups packets of any length into whole 1920-sample frames.

    `push` cannot fail (validate before calling it), so a packet is either fully
    in or not in at all. Only `flush` (at close) zero-pads the final residual.
    """

    def __init__(self) -> None:
        self._residual = np.zeros(0, dtype=np.float32)

    @property
    def pending_samples(self) -> int:
        return int(self._residual.shape[0])

    def push(self, samples: np.ndarray) -> list[np.ndarray]:
        buf = np.concatenate([self._residual, samples.astype(np.float32, copy=False)])
        n = buf.shape[0] // FRAME_SAMPLES
        frames = [buf[i * FRAME_SAMPLES : (i + 1) * FRAME_SAMPLES].copy() for i in range(n)]
        self._residual = buf[n * FRAME_SAMPLES :].copy()
        return frames

    def flush(self) -> np.ndarray | None:
        """The zero-padded residual as a last frame, or None when nothing is pending."""
        if self._residual.shape[0] == 0:
            return None
        frame = np.zeros(FRAME_SAMPLES, dtype=np.float32)
        frame[: self._residual.shape[0]] = self._residual
        self._residual = np.zeros(0, dtype=np.float32)
        return frame

    def clear(self) -> int:
        dropped = self.pending_samples
        self._residual = np.zeros(0, dtype=np.float32)
        return dropped


# The Opus decoder (sphn) decodes at most this much audio per call: a longer message gets its own error.
MAX_OPUS_MESSAGE_SAMPLES = 5 * SAMPLE_RATE
_OGG_HEADER = 27


def ogg_last_granule(data: bytes) -> int | None:
    """The highest granule position (48 kHz samples, Ogg Opus) on the Ogg pages of `data`, read from
    the page headers alone; None when `data` is not a run of whole Ogg pages or carries no position."""
    i, last = 0, None
    while i < len(data):
        if data[i : i + 4] != b"OggS" or len(data) < i + _OGG_HEADER:
            return None
        nsegs = data[i + 26]
        table = data[i + _OGG_HEADER : i + _OGG_HEADER + nsegs]
        if len(table) < nsegs:
            return None
        granule = int.from_bytes(data[i + 6 : i + 14], "little", signed=True)
        if granule >= 0:  # -1: no packet ends on this page
            last = granule if last is None else max(last, granule)
        i += _OGG_HEADER + nsegs + sum(table)
    return last if i == len(data) else None
