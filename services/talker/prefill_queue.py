"""How long a prompt opened now would wait before its session goes live: the talker's admission bound.

Prompts are prefilled one after another, oldest first, in pieces (runner.py: begin() and one chunk of
up to prefill_chunk_frames): one piece rides every main step, more run in the period's slack or
back to back while no session is live (clock.py). So the wait of a new prompt is the pieces queued
ahead of it, plus its own, over the rate pieces are run at:

    wait = (pieces of every prompt waiting or on hold + pieces of one more prompt) x piece interval

- pieces of a prompt: what is left of a begun one, ceil(frames left / chunk) (at least 1: a voice's
  cached KV is copied within a piece); an unbegun one (waiting, or on hold) is taken to need as many
  as the recent prompts needed (an average, PIECES_PER_PROMPT until one was measured);
- the piece interval: the average time between two pieces completed while prompts were waiting
  (the queue busy in between), each gap counted at most one period: a piece rides every main step,
  so a longer gap is a queue that went idle unnoticed, not a slower one (an unbounded gap once
  held a cold cell's estimate over the bound for good: nothing was admitted, so nothing re-measured
  it; front door run 20). Until measured, a quarter period (a piece alone takes 10-20 ms on an
  H200, and a cold cell runs them back to back: taking one per period refused a failover's burst
  after a dozen callers, front door run 18).

No threads, no device: the clock reports each completed piece and asks for the estimate.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from services.talker.session import Session, SessionStatus

PIECES_PER_PROMPT = 2.0  # an unmeasured prompt: voice copy + persona, and the closing silence
SMOOTHING = 0.2  # weight of a new sample in the averages
UNMEASURED_INTERVAL_PERIODS = 0.25  # the piece interval until one is measured, in periods


class PrefillQueue:
    def __init__(self, tick_s: float, chunk_frames: int):
        self.chunk_frames = chunk_frames
        self.tick_s = tick_s
        self.piece_interval_s = UNMEASURED_INTERVAL_PERIODS * tick_s
        self.pieces_per_prompt = PIECES_PER_PROMPT
        self._last_piece_at: float | None = None  # None: the queue was empty since the last piece

    def piece_done(self, now: float, queue_left: bool) -> None:
        """A piece completed at `now`; `queue_left`: a prompt is still waiting after it."""
        if self._last_piece_at is not None:
            gap = min(now - self._last_piece_at, self.tick_s)
            self.piece_interval_s += SMOOTHING * (gap - self.piece_interval_s)
        self._last_piece_at = now if queue_left else None

    def queue_became_busy(self, now: float) -> None:
        """A prompt joined an empty queue: the next piece's gap counts from now."""
        if self._last_piece_at is None:
            self._last_piece_at = now

    def prompt_done(self, pieces: int) -> None:
        self.pieces_per_prompt += SMOOTHING * (pieces - self.pieces_per_prompt)

    def pieces_left(self, s: Session) -> float:
        job = s.job
        if job is None:
            return self.pieces_per_prompt
        return max(1, math.ceil((job.total_frames - job.frames_done) / self.chunk_frames))

    def wait_s(self, sessions: Iterable[Session]) -> float:
        """Seconds until a prompt opened now would be in its slot."""
        ahead = [s for s in sessions if s.status in (SessionStatus.HELD, SessionStatus.PREFILLING)]
        if not ahead:
            self._last_piece_at = None  # the queue is idle: the next gap counts from its next prompt
        return (sum(self.pieces_left(s) for s in ahead) + self.pieces_per_prompt) * self.piece_interval_s
