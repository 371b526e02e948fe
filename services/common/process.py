"""Process-wide settings each stage applies once at start, before its server runs.

Why the GIL switch interval: a stage runs its model on one compute thread beside the asyncio loop
that serves its gRPC streams. Nearly every torch call (a graph replay, a copy, `.cpu()`) releases
the GIL and must take it back afterwards; while the loop thread is busy with 160 sessions' messages,
each take-back waits until the loop thread is made to yield, which CPython does only every
`sys.getswitchinterval()` (5 ms by default). A step's dozen torch calls then wait tens of ms for
the GIL alone. `python -m bench.gil_switch` measures it on the 2-core development machine
(bench/results/gil_switch.json): 20 sub-ms torch calls beside a busy Python thread took 216 ms at
5 ms, 21 ms at 0.5 ms and 11.6 ms at 0.2 ms (3.7 ms alone); the busy thread's own throughput
moved only within the noise (0.77-1.23x). On the H200 at 160 sessions, 0.2 ms took the talker's
step from 15 to 3.7 ms over its GPU time (README, runs 10-11).
"""

from __future__ import annotations

import logging
import sys

import torch

log = logging.getLogger("process")

GIL_SWITCH_MS_RANGE = (0.01, 100.0)


def check_gil_switch_ms(ms: float) -> None:
    lo, hi = GIL_SWITCH_MS_RANGE
    if not lo <= ms <= hi:
        raise ValueError(f"gil_switch_ms must be in [{lo}, {hi}] (CPython's default is 5), got {ms}")


def configure_process(threads: int, gil_switch_ms: float) -> None:
    """threads > 0: torch's intra-op threads (0 leaves torch's default); gil_switch_ms: see above."""
    check_gil_switch_ms(gil_switch_ms)
    if threads > 0:
        torch.set_num_threads(threads)
    sys.setswitchinterval(gil_switch_ms / 1e3)
    log.info("torch intra-op threads %d, GIL switch interval %.2f ms", torch.get_num_threads(), gil_switch_ms)
