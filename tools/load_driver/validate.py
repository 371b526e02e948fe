"""Strict validation of audio packets on the wire, and acceptance of one session's audio.

Every nonempty audio delta is checked on its own: valid aggregate audio must not hide one
malformed packet. Diagnostics are fixed codes and local numbers, never server text or payloads.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

import numpy as np

from .config import FRAME_SAMPLES, SAMPLE_RATE_HZ, DriverConfig

# Both names carry audio: the current OpenAI Realtime one and the legacy one.
AUDIO_DELTA_TYPES = frozenset({"response.output_audio.delta", "response.audio.delta"})
TEXT_DELTA_TYPES = frozenset(
    {"response.output_audio_transcript.delta", "response.audio_transcript.delta", "response.output_text.delta"}
)


class PacketError(ValueError):
    """One audio packet is invalid; `code` is a fixed diagnostic safe to report."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


def decode_audio_packet(event: dict) -> bytes:
    """The PCM16 bytes of one audio delta event, or PacketError. Empty deltas are legal (b"")."""
    encoded = event.get("delta")
    if not isinstance(encoded, str):
        raise PacketError("missing_audio_delta")
    try:
        chunk = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise PacketError("invalid_audio_base64") from None
    # Strict: the canonical encoding only (no stray padding bits a lenient decoder would drop).
    if base64.b64encode(chunk).decode("ascii") != encoded:
        raise PacketError("invalid_audio_base64")
    if not chunk:
        return chunk
    if len(chunk) % 2:
        raise PacketError("unaligned_pcm16_packet")
    rate = event.get("sample_rate_hz")
    if rate != SAMPLE_RATE_HZ or isinstance(rate, bool):
        raise PacketError("invalid_audio_sample_rate")
    response_id = event.get("response_id")
    if not isinstance(response_id, str) or not response_id:
        raise PacketError("missing_audio_response_id")
    return chunk


class AcceptanceError(AssertionError):
    """A local acceptance check failed; `check` names it, `stats` holds what was computed so far."""

    def __init__(self, check: str, message: str, stats: dict[str, object]) -> None:
        super().__init__(message)
        self.check = check
        self.stats = dict(stats)


@dataclass
class ValidPacket:
    event_index: int
    received_at_s: float
    pcm: bytes
    response_id: str


def audio_stats(packets: list[ValidPacket], input_frames: int, config: DriverConfig) -> dict[str, object]:
    """Session-validation statistics; raises AcceptanceError (carrying the stats so far) on a failed check.

    Checks, in order: some PCM16 arrived; it is not all-silent; it is whole 80 ms frames; enough
    chunks; 0 <= input frames - output frames <= max deficit; enough voiced frames; one response id.
    """
    stats: dict[str, object] = {
        "audio_chunks": len(packets),
        "output_samples": sum(len(p.pcm) // 2 for p in packets),
        "output_frames": None,
        "voiced_frames": None,
        "silent_frames": None,
        "frame_deficit": None,
        "frame_coverage_ratio": None,
        "audio_rms": None,
    }
    raw = b"".join(p.pcm for p in packets)
    if not raw:
        raise AcceptanceError("pcm16_output", f"no audio: chunks={len(packets)}", stats)
    pcm = np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0
    rms = float(np.sqrt(np.mean(np.square(pcm))))
    stats["audio_rms"] = rms
    # A low floor that only catches all-zero output; audibility is checked per frame below.
    if rms <= 1e-5:
        raise AcceptanceError("audio_rms", f"output audio is silent: samples={pcm.size}, rms={rms:.3g}", stats)
    if pcm.size % FRAME_SAMPLES:
        raise AcceptanceError(
            "whole_codec_frames", f"output is not whole 80 ms frames: samples={pcm.size}", stats
        )
    frames = pcm.reshape(-1, FRAME_SAMPLES)
    output_frames = len(frames)
    voiced = int(np.count_nonzero(np.sqrt(np.mean(np.square(frames), axis=1)) >= config.voiced_frame_rms_threshold))
    stats.update(
        output_frames=output_frames,
        voiced_frames=voiced,
        silent_frames=output_frames - voiced,
        frame_deficit=input_frames - output_frames,
        frame_coverage_ratio=output_frames / input_frames if input_frames else None,
    )
    if len(packets) < config.minimum_audio_chunks:
        raise AcceptanceError(
            "audio_chunks", f"too few audio chunks: {len(packets)} < {config.minimum_audio_chunks}", stats
        )
    deficit = input_frames - output_frames
    if not 0 <= deficit <= config.max_frame_deficit:
        raise AcceptanceError(
            "frame_deficit",
            f"frame accounting: input={input_frames}, output={output_frames}, max_deficit={config.max_frame_deficit}",
            stats,
        )
    if voiced < config.min_voiced_frames:
        raise AcceptanceError(
            "voiced_frames", f"too few audible frames: {voiced} < {config.min_voiced_frames}", stats
        )
    response_ids = {p.response_id for p in packets}
    if len(response_ids) != 1:
        raise AcceptanceError(
            "response_identity", f"a continuous session has one response, got {len(response_ids)}", stats
        )
    return stats


@dataclass
class AudioScan:
    valid: list[ValidPacket]  # nonempty, valid packets only
    invalid: list[dict[str, object]]  # {"event_index", "received_at_s", "code"}
    empty_packets: int
    text_deltas: int
    text: str


def scan_events(events: list[dict], received_at: list[float], cutoff_s: float | None = None) -> AudioScan:
    """Validate every audio delta received up to `cutoff_s` (audio arriving later is excluded)."""
    scan = AudioScan([], [], 0, 0, "")
    for index, (event, at) in enumerate(zip(events, received_at, strict=True)):
        if cutoff_s is not None and at > cutoff_s:
            break
        kind = event["type"]
        if kind in TEXT_DELTA_TYPES:
            scan.text_deltas += 1
            if isinstance(event.get("delta"), str):
                scan.text += event["delta"]
        if kind not in AUDIO_DELTA_TYPES:
            continue
        try:
            pcm = decode_audio_packet(event)
        except PacketError as exc:
            scan.invalid.append({"event_index": index, "received_at_s": at, "code": exc.code})
            continue
        if pcm:
            scan.valid.append(ValidPacket(index, at, pcm, event["response_id"]))
        else:
            scan.empty_packets += 1
    return scan
