"""The cell's shared frame grid: period k starts at k * period + phase seconds of CLOCK_MONOTONIC
(time.monotonic(), asyncio's loop.time()), which every process on one machine reads alike.

Why: the encoder, talker and decoder of a cell share one GPU, and their kernels slow one another
down when they overlap (the talker's step is slower beside the codecs than alone; bench/RESULTS.md).
The talker ticks on this grid, so another process can place its own work relative to the talker's
deadlines without talking to it: an encoder with `step_phase_ms` steps once per period just before
them (services/codec/stage.py).
"""

from __future__ import annotations

import math


def next_grid_time(now: float, period: float, phase: float = 0.0) -> float:
    """The first grid time k * period + phase at or after `now`."""
    return math.ceil((now - phase) / period) * period + phase


def last_grid_time(now: float, period: float, phase: float = 0.0) -> float:
    """The latest grid time at or before `now`."""
    return math.floor((now - phase) / period) * period + phase
