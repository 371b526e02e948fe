"""Client-side metric definitions (all on the client's monotonic clock).

No output gives missing values (None), never zero: a zero would read as "instant".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .config import FRAME_PERIOD_S, SAMPLE_RATE_HZ, UNDERRUN_THRESHOLD_S


def linear_percentile(values: Sequence[float], q: float) -> float:
    """Percentile `q` in [0, 100] by linear interpolation between closest ranks
    (numpy's default "linear" method): position q/100 * (n - 1) in the sorted values."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = q / 100.0 * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def distribution(values: Sequence[float]) -> dict[str, object]:
    """count, median, linear p99, max and the zero-based index of the first maximal value."""
    if not values:
        return {"count": 0, "median": None, "p99": None, "max": None, "argmax_index": None}
    peak = max(values)
    return {
        "count": len(values),
        "median": float(linear_percentile(values, 50)),
        "p99": float(linear_percentile(values, 99)),
        "max": float(peak),
        "argmax_index": list(values).index(peak),
    }


@dataclass(frozen=True)
class Continuity:
    max_underrun_s: float
    underrun_event_count: int
    is_continuous: bool


def continuity_stats(
    arrivals_s: Sequence[float],
    chunk_bytes: Sequence[int],
    sample_rate: int = SAMPLE_RATE_HZ,
    sample_width: int = 2,
    threshold_s: float = UNDERRUN_THRESHOLD_S,
) -> Continuity:
    """A listener that starts playing at the first packet and consumes in real time: how long,
    at worst, was it starved? An underrun event is a packet that arrived after the audio received
    before it had run out (one per gap). Continuous means the worst starvation <= `threshold_s`.
    """
    bytes_per_s = sample_rate * sample_width
    worst, events, received = 0.0, 0, 0
    for i, (t, size) in enumerate(zip(arrivals_s, chunk_bytes, strict=True)):
        if i:
            starved_s = (t - arrivals_s[0]) - received / bytes_per_s
            if starved_s > 0:
                worst = max(worst, starved_s)
                events += 1
        received += size
    return Continuity(worst, events, worst <= threshold_s)


def timing_metrics(
    sends: Sequence[tuple[float, float, float]],
    packet_times: Sequence[float],
    packet_bytes: Sequence[int],
) -> dict[str, object]:
    """The load-mode timing fields of one session.

    sends: (planned, send_started, send_completed) per input frame; planned is on the shared schedule.
    packet_times / packet_bytes: receipt time and PCM16 size of each valid nonempty audio packet.
    """
    first_send = sends[0][1] if sends else None
    audio_s = sum(packet_bytes) / 2 / SAMPLE_RATE_HZ
    intervals_ms = [(b - a) * 1000.0 for a, b in zip(packet_times, packet_times[1:])]
    lateness = distribution([max(0.0, started - planned) * 1000.0 for planned, started, _ in sends])
    have_audio = bool(packet_times) and first_send is not None
    continuity = continuity_stats(packet_times, packet_bytes) if packet_times else None
    return {
        "client_first_audio_after_stream_start_ms": (packet_times[0] - first_send) * 1000.0 if have_audio else None,
        "client_stream_rtf": (packet_times[-1] - first_send) / audio_s if have_audio and audio_s > 0 else None,
        "client_audio_packet_interval_ms": distribution(intervals_ms),
        "client_send_lateness_ms": lateness,
        "client_pacing_warning": lateness["p99"] is not None and lateness["p99"] > FRAME_PERIOD_S * 1000.0,
        "audio_underrun_s": continuity.max_underrun_s if continuity else None,
        "audio_underrun_event_count": continuity.underrun_event_count if continuity else None,
        "audio_continuity_ok": continuity.is_continuous if continuity else None,
    }
