"""Process-wide settings each stage applies once at start, before its server runs.

Why the GIL switch interval: a stage runs its model on one compute thread beside the asyncio loop
that serves its gRPC streams. Nearly every torch call (a graph replay, a copy, `.cpu()`) releases
the GIL and must take it back afterwards; while the loop thread is busy with 160 sessions' messages,
each take-back waits until the loop thread is made to yield, which CPython does only every
`sys.getswitchinterval()` (5 ms by default). A step's dozen torch calls then wait tens of ms for
the GIL alone; at 0.2 ms they wait about a millisecond, and the loop thread's own throughput does
not measurably change. `python -m bench.gil_switch` measures both on a CPU; the numbers are in
bench/RESULTS.md.
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
