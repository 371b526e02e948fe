"""Per-stream frame sequence numbers: each seq is consumed exactly once, in order.

The contract (common.proto, CodesFrame.seq): the first frame after `open` has
seq 0, every later frame exactly one more. A repeated (or older) seq is
INVALID_ARGUMENT, a gap is FAILED_PRECONDITION. `check` only inspects; the
caller calls `advance` once the frame was accepted for processing, so a refused
frame never moves the counter and never reaches the codec or model.
"""

from __future__ import annotations

from services.common.errors import SeqGap, SeqRepeated


class SequenceChecker:
    def __init__(self, start: int = 0):
        self.expected = start  # the seq the next frame must carry

    def check(self, seq: int) -> None:
        """Raise SeqRepeated / SeqGap unless `seq` is exactly the expected one."""
        if seq < self.expected:
            raise SeqRepeated(f"frame seq {seq} was already received (expected {self.expected}); it is not processed "
                              "twice")
        if seq > self.expected:
            raise SeqGap(f"frame seq {seq} skips ahead: expected {self.expected} ({seq - self.expected} frame(s) "
                         "missing)")

    def advance(self) -> None:
        self.expected += 1

    def accept(self, seq: int) -> None:
        """check + advance, for callers that process the frame right away."""
        self.check(seq)
        self.advance()
