"""Who calls when, for how long, and where in the 80 ms period each call sends: a load run's traffic.

Pure decisions from the config and one seed (no I/O), so every driver process of `--procs` computes the
same plan and the rules are tested with plain numbers. Times are seconds from the shared start.

`--traffic`:
  together  every session opens first, then all stream from one shared start, session g of N at g/N of
            a period. The old pattern: flattering (nobody joins while others talk), kept as a comparison.
  arrivals  N lines. Line g's first caller dials at the g-th arrival of a steady (every 1/rate s) or
            Poisson (exponential gaps, mean 1/rate) process of --arrival-rate per second: the ramp. Each
            caller streams as soon as its own open is done. The traffic goes on --hold-s after the ramp's
            last arrival. The steady window runs from --settle-s after that arrival to the end.
  burst     N callers dial at uniform random times within --burst-window-s (a cell failing over or a
            rolling update), one call each; the traffic ends --hold-s after the window. The window is
            the whole run.
Calls (arrivals and burst): with --call-mean-s M, a call lasts F + Exp(M - F) seconds (F = --call-min-s,
the floor; its mean is M); without it, until the end. Exponential call lengths are memoryless (a call in
progress has the same time left as a new one), so a ramp caller's length is counted from the ramp's end:
the churn starts in its steady state with all N lines live. A later call's length counts from its first
frame. After a hang-up the line's next caller dials --redial-gap-s later (churn), unless fewer than F
seconds are left. Every call hangs up by the end.
Send phases: a call's first frame goes out a uniform random part of a period after its open is done (the
caller's capture phase), drawn per call; in `together`, g/N.
Each draw comes from its own generator seeded with (--traffic-seed, what, line, call).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .config import FRAME_PERIOD_S, TRAFFIC, DriverConfig

TOGETHER, ARRIVALS, BURST = TRAFFIC
_ARRIVALS, _LENGTH, _PHASE = 0, 1, 2  # the draws' generator streams


@dataclass(frozen=True)
class Plan:
    first_dial_s: tuple[float, ...]  # per line: when its first caller dials
    ramp_end_s: float  # the last first dial
    end_s: float  # every call has sent its last frame by then (the drain follows)
    window_s: tuple[float, float]  # the statistics' steady window


def _rng(config: DriverConfig, stream: int, *key: int) -> np.random.Generator:
    return np.random.default_rng([config.traffic_seed, stream, *key])


def first_dials(config: DriverConfig) -> list[float]:
    """When each line's first caller dials."""
    n = config.sessions or 0
    if config.traffic == TOGETHER:
        return [0.0] * n
    if config.traffic == BURST:
        return sorted(_rng(config, _ARRIVALS).uniform(0.0, config.burst_window_s, n).tolist())
    if config.arrivals == "steady":
        return [g / config.arrival_rate for g in range(n)]
    gaps = _rng(config, _ARRIVALS).exponential(1.0 / config.arrival_rate, max(0, n - 1))
    return [0.0, *np.cumsum(gaps).tolist()][:n]


def make_plan(config: DriverConfig) -> Plan:
    dials = first_dials(config)
    ramp_end = max(dials, default=0.0)
    if config.traffic == TOGETHER:
        end = config.load_frames * FRAME_PERIOD_S + FRAME_PERIOD_S  # + the last session's phase
        return Plan(tuple(dials), 0.0, end, (0.0, end))
    if config.traffic == BURST:
        end = config.burst_window_s + config.hold_s
        return Plan(tuple(dials), ramp_end, end, (0.0, end))
    end = ramp_end + config.hold_s
    return Plan(tuple(dials), ramp_end, end, (min(ramp_end + config.settle_s, end), end))


def call_length_s(config: DriverConfig, line: int, call: int) -> float | None:
    """F + Exp(M - F) seconds, or None without --call-mean-s (the call lasts until the end)."""
    if not config.call_mean_s:
        return None
    tail = config.call_mean_s - config.call_min_s
    return config.call_min_s + (float(_rng(config, _LENGTH, line, call).exponential(tail)) if tail > 0 else 0.0)


def hangup_s(config: DriverConfig, plan: Plan, line: int, call: int, first_frame_s: float) -> float:
    """When a call sends its last frame, given when it sent its first."""
    length = call_length_s(config, line, call)
    if length is None:
        return plan.end_s
    counted_from = max(first_frame_s, plan.ramp_end_s) if config.traffic == ARRIVALS and call == 0 else first_frame_s
    return min(plan.end_s, counted_from + length)


def next_dial_s(config: DriverConfig, plan: Plan, hung_up_s: float) -> float | None:
    """When the line dials again after a call that ended at `hung_up_s`; None: no more calls on it."""
    if config.traffic != ARRIVALS or not config.call_mean_s:
        return None
    at = hung_up_s + config.redial_gap_s
    return at if at <= plan.end_s - config.call_min_s else None


def send_phase_s(config: DriverConfig, line: int, call: int) -> float:
    """How long after its open a call sends its first frame (g/N of a period in `together`)."""
    if config.traffic == TOGETHER:
        return line * FRAME_PERIOD_S / (config.sessions or 1)
    return float(_rng(config, _PHASE, line, call).uniform(0.0, FRAME_PERIOD_S))


def input_frames(config: DriverConfig) -> int:
    """Frames of input audio the longest call can send (--load-frames in `together`)."""
    if config.traffic == TOGETHER:
        return config.load_frames
    return math.ceil(make_plan(config).end_s / FRAME_PERIOD_S) + 1
