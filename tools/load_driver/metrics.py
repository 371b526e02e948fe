"""Client-side metric definitions (all on the client's monotonic clock).

No output gives missing values (None), never zero: a zero would read as "instant".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .config import FRAME_PERIOD_S, FRAME_SAMPLES, RESYNC_S, SAMPLE_RATE_HZ, UNDERRUN_THRESHOLD_S

# One input frame's send: (planned, target, started, completed) on the client's monotonic clock.
# planned: the shared absolute schedule; target: planned + the session's re-anchoring shift so far.
Send = tuple[float, float, float, float]


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


def percentiles(values: Sequence[float], qs: Sequence[int] = (50, 90, 99)) -> dict[str, float | int | None]:
    """count, linear p<q> for each q, and max; None (not zero) for no values."""
    stats: dict[str, float | int | None] = {"count": len(values)}
    for q in qs:
        stats[f"p{q}"] = float(linear_percentile(values, q)) if values else None
    stats["max"] = float(max(values)) if values else None
    return stats


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


def own_lateness_s(sends: Sequence[Send]) -> list[float]:
    """Per frame, how late the client itself started the send: after the later of its target and the
    previous send's completion. Time blocked in the previous send (the server not reading) is excluded."""
    lateness, previous_done = [], None
    for _, target, started, done in sends:
        ready = target if previous_done is None else max(target, previous_done)
        lateness.append(max(0.0, started - ready))
        previous_done = done
    return lateness


def send_rtfs(sends: Sequence[Send]) -> tuple[float | None, float | None]:
    """(client, schedule) real-time factors of one session's send schedule; None without sends.

    schedule = (last send start + one period - first planned send) / (frames sent x period): the wall
    time the schedule took over the audio it carried; 1.0 is on time. Only re-anchored lateness
    (> RESYNC_S) and the last frame's lateness lengthen it; smaller jitter is absorbed.
    client = the same with each of those lateness terms cut to its own part (own_lateness_s): the
    schedule as stretched by the client alone, not by the server's backpressure.
    """
    if not sends:
        return None, None
    own = own_lateness_s(sends)
    slip_client = slip_schedule = 0.0
    for k, ((_, target, started, _), own_k) in enumerate(zip(sends, own)):
        late = started - target
        if late > RESYNC_S or k == len(sends) - 1:
            slip_schedule += max(0.0, late)
            slip_client += own_k
    audio_s = len(sends) * FRAME_PERIOD_S
    return (audio_s + slip_client) / audio_s, (audio_s + slip_schedule) / audio_s


def frame_latencies_ms(
    send_starts: Sequence[float], packet_times: Sequence[float], packet_samples: Sequence[int]
) -> list[float]:
    """Per frame i: output frame i received (the packet completing its 1920 samples) - input frame i's
    send start. Frames without output, or output without input, have no latency."""
    latencies, received, i = [], 0, 0
    for at, samples in zip(packet_times, packet_samples, strict=True):
        received += samples
        while i < len(send_starts) and (i + 1) * FRAME_SAMPLES <= received:
            latencies.append((at - send_starts[i]) * 1000.0)
            i += 1
    return latencies


def timing_metrics(
    sends: Sequence[Send],
    packet_times: Sequence[float],
    packet_bytes: Sequence[int],
) -> dict[str, object]:
    """The load-mode timing fields of one session.

    sends: one Send per input frame.
    packet_times / packet_bytes: receipt time and PCM16 size of each valid nonempty audio packet.
    """
    first_send = sends[0][2] if sends else None
    audio_s = sum(packet_bytes) / 2 / SAMPLE_RATE_HZ
    intervals_ms = [(b - a) * 1000.0 for a, b in zip(packet_times, packet_times[1:])]
    lateness = distribution([max(0.0, started - planned) * 1000.0 for planned, _, started, _ in sends])
    client_rtf, schedule_rtf = send_rtfs(sends)
    have_audio = bool(packet_times) and first_send is not None
    continuity = continuity_stats(packet_times, packet_bytes) if packet_times else None
    return {
        "client_first_audio_after_stream_start_ms": (packet_times[0] - first_send) * 1000.0 if have_audio else None,
        "client_stream_rtf": (packet_times[-1] - first_send) / audio_s if have_audio and audio_s > 0 else None,
        "client_audio_packet_interval_ms": distribution(intervals_ms),
        "client_send_lateness_ms": lateness,
        "client_pacing_warning": lateness["p99"] is not None and lateness["p99"] > FRAME_PERIOD_S * 1000.0,
        "client_own_send_lateness_ms": distribution([late * 1000.0 for late in own_lateness_s(sends)]),
        "client_send_blocked_ms": distribution([(done - started) * 1000.0 for _, _, started, done in sends]),
        "client_send_rtf": client_rtf,
        "send_schedule_rtf": schedule_rtf,
        "frame_latency_ms": distribution(
            frame_latencies_ms([s[2] for s in sends], packet_times, [size // 2 for size in packet_bytes])
        ),
        "audio_underrun_s": continuity.max_underrun_s if continuity else None,
        "audio_underrun_event_count": continuity.underrun_event_count if continuity else None,
        "audio_continuity_ok": continuity.is_continuous if continuity else None,
    }
