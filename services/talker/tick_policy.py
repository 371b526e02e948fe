"""What the conversation clock does in a period, decided from the time and measured step times.

No threads, no device, no event loop: the clock (clock.py) passes the time, the period's end and
its sessions (session.py), and reports what each step and prefill piece took.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from services.talker.session import Session

LAG_FRAMES = 2  # default catch_up_lag_frames
# Share of the period kept free beyond a measured time (an EMA) when deciding whether a wait, a
# catch-up step or a prefill piece still ends before the next deadline: a step above its average
# must end in time too.
STEP_HEADROOM = 0.1
# A session that sent a frame within this many periods is talking: its next frame is due.
TALKING_PERIODS = 1.5
# The input wait also leaves room for the slowest of the last RECENT_STEPS main steps (plus
# WAIT_MARGIN_S for the outputs): the average alone lets a wait and a slow step together run a
# tick past its period.
RECENT_STEPS = 256
WAIT_MARGIN_S = 0.003


def ema(average: float | None, sample: float) -> float:
    """A running average of measured times: the first sample (average None), then 80/20."""
    return sample if average is None else 0.8 * average + 0.2 * sample


class CatchUp(enum.Enum):
    NONE = "none"  # no catch-up step this tick
    FITS = "fits"  # it ends before the deadline
    FORCED = "forced"  # it does not, but a session is too far behind to wait


@dataclass
class TickPolicy:
    tick_s: float
    # At the deadline, wait up to this long for frames that are due but not here yet: a session
    # whose frames arrive just after the deadline is then stepped on time instead of alternating
    # between a skipped tick and a catch-up step.
    input_wait_s: float = 0.0
    # Frames a session must be behind (queued before the main step, besides the one it takes) for
    # a catch-up step to run even past the deadline: the trade between latency and late ticks.
    catch_up_lag_frames: int = LAG_FRAMES
    # Measured times (EMAs, seconds). A catch-up step runs only the sessions still behind (idle
    # rows attend over one KV entry), so it costs a fraction of a main step and has its own
    # average; until one is measured it is taken to cost a main step.
    step_s: float = 0.0
    catch_up_s: float | None = None
    piece_s: float = 0.0  # a prefill piece run alone, GPU time included
    slack_s: float | None = None  # time left in the period after a tick
    recent_steps: collections.deque = field(default_factory=lambda: collections.deque(maxlen=RECENT_STEPS))

    def __post_init__(self) -> None:
        if self.catch_up_lag_frames < 1:
            raise ValueError(f"catch_up_lag_frames must be >= 1, got {self.catch_up_lag_frames}")

    @property
    def headroom_s(self) -> float:
        return STEP_HEADROOM * self.tick_s

    # ---- measurements ----------------------------------------------------------------------

    def step_measured(self, seconds: float, catch_up: bool) -> None:
        if catch_up:
            self.catch_up_s = ema(self.catch_up_s, seconds)
        else:
            self.step_s = ema(self.step_s or None, seconds)
            self.recent_steps.append(seconds)

    def piece_measured(self, seconds: float) -> None:
        self.piece_s = ema(self.piece_s or None, seconds)

    def slack_measured(self, seconds: float) -> None:
        self.slack_s = ema(self.slack_s, seconds)

    # ---- the input wait ----------------------------------------------------------------------

    def input_wait_end(self, now: float, period_end: float) -> float | None:
        """Until when to wait for due frames at a tick that starts at `now` (None: never wait):
        input_wait_s at most, and never past the point where the main step, taking its average
        plus the headroom or as long as the slowest recent one, would end after period_end."""
        if self.input_wait_s <= 0:
            return None
        slowest = max(self.recent_steps, default=0.0) + WAIT_MARGIN_S
        return min(now + self.input_wait_s, period_end - max(self.step_s + self.headroom_s, slowest))

    def frame_due(self, s: Session, tick_start: float) -> bool:
        """Whether the tick should wait for s: live, talking, nothing queued, input not closed."""
        talking = s.last_input_at >= tick_start - TALKING_PERIODS * self.tick_s
        return s.live and not s.inputs and not s.input_done and talking

    # ---- steps -------------------------------------------------------------------------------

    @staticmethod
    def batch(sessions: Iterable[Session]) -> list[Session]:
        """The sessions a step takes a frame from: live ones with a frame queued. The others skip it."""
        return [s for s in sessions if s.live and s.inputs]

    @staticmethod
    def lag_frames(batch: list[Session]) -> int:
        """How far behind the main step's batch is: the frames queued besides the one it takes.
        Frames that arrive during the main step do not count: they are the next tick's, on time."""
        return max(len(s.inputs) for s in batch) - 1

    def catch_up(self, now: float, period_end: float, steps_run: int, lag: int) -> CatchUp:
        """Whether another step runs for the sessions still behind. One that fits before the
        deadline always does; when none would fit (a step over half the period), a tick whose
        main step found a session catch_up_lag_frames behind runs one anyway, so the backlog
        shrinks by a frame per tick instead of never."""
        catch_up_s = self.step_s if self.catch_up_s is None else self.catch_up_s
        if now + catch_up_s + self.headroom_s <= period_end:
            return CatchUp.FITS
        if steps_run == 1 and lag >= self.catch_up_lag_frames:
            return CatchUp.FORCED
        return CatchUp.NONE

    # ---- prefill -----------------------------------------------------------------------------

    @staticmethod
    def next_prompt(sessions: Iterable[Session]) -> Session | None:
        """The oldest session still waiting for its prompt (sessions iterate in arrival order)."""
        return next((s for s in sessions if s.waiting_for_prompt), None)

    def piece_fits(self, now: float, period_end: float) -> bool:
        """Whether a prefill piece run alone from now (its measured time plus the headroom) ends
        before period_end."""
        return now + self.piece_s + self.headroom_s <= period_end
