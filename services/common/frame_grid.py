"""The cell's shared frame grid: period k starts at k * period + phase seconds of CLOCK_MONOTONIC
(time.monotonic(), asyncio's loop.time()), which every process on one machine reads alike.

Why: the talker ticks on this grid, so its deadlines are known to every process of the cell (and
to a benchmark) without asking it: period k's deadline is the same number in each of them.
"""

from __future__ import annotations

import math


def next_grid_time(now: float, period: float, phase: float = 0.0) -> float:
    """The first grid time k * period + phase at or after `now`."""
    return math.ceil((now - phase) / period) * period + phase


def last_grid_time(now: float, period: float, phase: float = 0.0) -> float:
    """The latest grid time at or before `now`."""
    return math.floor((now - phase) / period) * period + phase
