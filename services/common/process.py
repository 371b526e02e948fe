"""Process-wide settings each stage applies once at start, before its server runs.

Why the GIL switch interval: a stage runs its model on one compute thread beside the asyncio loop
that serves its gRPC streams. Nearly every torch call (a graph replay, a copy, `.cpu()`) releases
the GIL and must take it back afterwards; while the loop thread is busy with 160 sessions' messages,
each take-back waits until the loop thread is made to yield, which CPython does only every
`sys.getswitchinterval()` (5 ms by default). A step's dozen torch calls then wait tens of ms for
the GIL alone; at 0.2 ms they wait about a millisecond, and the loop thread's own throughput does
not measurably change. `python -m bench.gil_switch` measures both on a CPU; the numbers are in
bench/RESULTS.md.

Why a fixed mmap threshold: glibc serves a block over its mmap threshold from mmap and gives it
back when freed, but it raises the threshold to the size of each such block freed (up to 32 MiB),
and from then on keeps blocks that size in its arenas. A stage receives link messages of up to
16 MiB (and refuses them, services/common/link.py): 40 refused 13 MB messages left a talker
+96 MB over its start; with the threshold fixed at 1 MiB, +29 MB (tests/test_hostile_stage.py).
"""

from __future__ import annotations

import ctypes
import logging
import sys

import torch

log = logging.getLogger("process")

GIL_SWITCH_MS_RANGE = (0.01, 100.0)
MMAP_THRESHOLD_BYTES = 2**20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


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
    fixed = fix_mmap_threshold()
    log.info("torch intra-op threads %d, GIL switch interval %.2f ms, malloc mmap threshold %s",
             torch.get_num_threads(), gil_switch_ms, f"{MMAP_THRESHOLD_BYTES} B" if fixed else "glibc's (not glibc)")


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Blocks of `nbytes` and more from mmap, always (see above); False where there is no glibc."""
    try:
        return bool(ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, nbytes))
    except (OSError, AttributeError):
        return False
