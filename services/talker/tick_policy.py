"""What the conversation clock does in a period, decided from the time and measured step times.

No threads, no device, no event loop: the clock (clock.py) passes the time, the period's end and
its sessions (session.py), and reports what each step and prefill piece took.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from services.talker.session import Session, SessionStatus

LAG_FRAMES = 2  # default catch_up_lag_frames (TalkerConfig's too)
# Share of the period kept free beyond a measured time (an EMA) when deciding whether a wait, a
# catch-up step or a prefill piece still ends before the next deadline: a step above its average
# must end in time too.
STEP_HEADROOM = 0.1
# The same for a catch-up step: each is a CUDA graph of a fixed row count, measured per bucket,
# and its spread is small (on the H200 at 160 slots an 8-row step took 11.7-12.7 ms, its GPU time
# within 1 ms of that: bench.catch_up_check). A tenth of the period would keep the 8-row step out
# of the 23 ms after a 57 ms main step, so a session that fell behind would stay behind.
CATCH_UP_HEADROOM = 0.03
# A catch-up bucket's average older than this is predicted from its prior again (catch_up_cost), and
# its next measurement starts a new average. A step is measured only when it runs, and it runs only
# when its prediction fits: a few slow ones (beside the decoder's GPU work, say) could raise the
# average past what ever fits, and then nothing would lower it again, so the sessions behind would
# stay behind for the rest of the process. Retrying a stale bucket costs at most one late tick per
# this long (0.3 % of ticks at 80 ms), if it is still slow.
CATCH_UP_STALE_S = 30.0
# A session that sent a frame within this many periods is talking: its next frame is due.
TALKING_PERIODS = 1.5
# The input wait also leaves room for the slowest of the last RECENT_STEPS main steps (plus
# WAIT_MARGIN_S for the outputs): the average alone lets a wait and a slow step together run a
# tick past its period.
RECENT_STEPS = 256
WAIT_MARGIN_S = 0.003


def check_lag_frames(n: int) -> None:
    """catch_up_lag_frames' one check (TickPolicy's and TalkerConfig's): a session at least one frame behind."""
    if n < 1:
        raise ValueError(f"catch_up_lag_frames must be >= 1, got {n}")


def ema(average: float | None, sample: float) -> float:
    """A running average of measured times: the first sample (average None), then 80/20."""
    return sample if average is None else 0.8 * average + 0.2 * sample


class CatchUp(enum.Enum):
    FITS = "fits"  # it ends before the deadline
    FORCED = "forced"  # it does not, but a session is too far behind to wait


@dataclass(frozen=True)
class CatchUpStep:
    """One catch-up step: the sessions it takes a frame from, most behind first, and the rows of the
    engine step that runs them (a compact bucket, or every slot: engine.row_buckets)."""

    kind: CatchUp
    sessions: list[Session]
    rows: int


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
    # The row counts of the steps the engine can run, ascending (engine.row_buckets): compact
    # buckets, then every slot. A catch-up step runs the smallest that holds the sessions behind,
    # or the largest that fits with the most behind of them.
    row_buckets: tuple[int, ...] = ()
    # The engine's warm-up time of an idle step of each row count (engine.warm_step_s): the fixed
    # part of a catch-up step of a size not yet measured here (catch_up_cost).
    warm_s: dict[int, float] = field(default_factory=dict)
    # Measured times (EMAs, seconds): the main step, catch-up steps by row count, prefill pieces.
    step_s: float = 0.0
    catch_up_s: dict[int, float] = field(default_factory=dict)
    catch_up_at: dict[int, float] = field(default_factory=dict)  # when each was last measured (the clock's time)
    piece_s: float = 0.0  # a prefill piece run alone, GPU time included
    slack_s: float | None = None  # time left in the period after a tick
    recent_steps: collections.deque = field(default_factory=lambda: collections.deque(maxlen=RECENT_STEPS))

    def __post_init__(self) -> None:
        check_lag_frames(self.catch_up_lag_frames)

    @property
    def headroom_s(self) -> float:
        return STEP_HEADROOM * self.tick_s

    @property
    def catch_up_headroom_s(self) -> float:
        return CATCH_UP_HEADROOM * self.tick_s

    # ---- measurements ----------------------------------------------------------------------

    def steps_known(self, row_buckets: tuple[int, ...], warm_s: dict[int, float]) -> None:
        """The engine's step sizes and their idle warm-up times (see the fields)."""
        self.row_buckets, self.warm_s = tuple(sorted(row_buckets)), dict(warm_s)

    def step_measured(self, seconds: float, catch_up_rows: int | None = None, now: float | None = None) -> None:
        """A main step's time (catch_up_rows None) or a catch-up step's of that many rows, measured at
        `now` (None: a clock driven by hand, whose averages never go stale)."""
        if catch_up_rows is not None:
            average = None if self._stale(catch_up_rows, now) else self.catch_up_s.get(catch_up_rows)
            self.catch_up_s[catch_up_rows] = ema(average, seconds)
            if now is not None:
                self.catch_up_at[catch_up_rows] = now
        else:
            self.step_s = ema(self.step_s or None, seconds)
            self.recent_steps.append(seconds)

    def piece_measured(self, seconds: float) -> None:
        self.piece_s = ema(self.piece_s or None, seconds)

    def slack_measured(self, seconds: float) -> None:
        self.slack_s = ema(self.slack_s, seconds)

    # ---- the input wait ----------------------------------------------------------------------

    def _stale(self, rows: int, now: float | None) -> bool:
        """Whether the average of `rows`-row catch-ups is too old to trust (CATCH_UP_STALE_S)."""
        at = self.catch_up_at.get(rows)
        return now is not None and at is not None and now - at > CATCH_UP_STALE_S

    def input_wait_end(self, now: float, period_end: float, behind: bool = False) -> float | None:
        """Until when to wait for due frames at a tick that starts at `now` (None: never wait):
        input_wait_s at most, and never past the point where the main step, taking its average
        plus the headroom or as long as the slowest recent one, would end after period_end.

        With sessions behind (`behind`), the wait also leaves room after the main step for the
        smallest catch-up step: waiting prevents a session from falling behind, a catch-up brings
        8 back, and a wait that uses the whole slack makes sessions that fell behind stay behind."""
        if self.input_wait_s <= 0:
            return None
        slowest = max(self.recent_steps, default=0.0) + WAIT_MARGIN_S
        reserve = 0.0
        if behind and self.row_buckets:
            reserve = self.catch_up_cost(self.row_buckets[0], now) + self.catch_up_headroom_s
        return min(now + self.input_wait_s, period_end - reserve - max(self.step_s + self.headroom_s, slowest))

    def frame_due(self, s: Session, tick_start: float) -> bool:
        """Whether the tick should wait for s: live, talking, nothing queued, input not closed."""
        talking = s.last_input_at >= tick_start - TALKING_PERIODS * self.tick_s
        return s.status is SessionStatus.LIVE and not s.inputs and not s.input_done and talking

    # ---- steps -------------------------------------------------------------------------------

    @staticmethod
    def batch(sessions: Iterable[Session]) -> list[Session]:
        """The sessions a step takes a frame from: live ones with a frame queued. The others skip it."""
        return [s for s in sessions if s.status is SessionStatus.LIVE and s.inputs]

    @staticmethod
    def lags(batch: list[Session]) -> dict[Session, int]:
        """How far behind each session of the main step's batch is: the frames queued besides the one
        it takes. Frames that arrive during the main step do not count: they are the next tick's, on time."""
        return {s: len(s.inputs) - 1 for s in batch}

    @staticmethod
    def owed(lags: dict[Session, int], skipped: Iterable[Session]) -> dict[Session, int]:
        """The frames a tick's catch-up steps may take from each session after its main step: a
        session's lag, and one for a session that the main step skipped (its frame came late). A
        frame that arrives during the main step from a session the main step took is the next
        tick's, on time: taking it early would leave that session nothing at the next deadline,
        where the input wait would wait for it, and spend catch-up rows owed to sessions behind."""
        return {s: lag for s, lag in lags.items() if lag > 0} | {s: 1 for s in skipped}

    def catch_up_cost(self, rows: int, now: float | None = None) -> float:
        """Predicted seconds of a catch-up step of `rows` rows at `now`: its measured average. Before one
        is measured, or once its average is stale (CATCH_UP_STALE_S): a step costs a fixed part, what
        it costs idle (its warm-up time), plus its active rows' share of the rest, at the rate the main
        step pays per slot beyond its own idle time.
        (Scaling the main step by warm(rows) / warm(every slot) would scale the fixed part by the
        main step's rest too, about 3x at 160 full-context slots: 55 ms against 18 idle, bench/RESULTS.md;
        and a step predicted not to fit is never run, so never measured.) Without warm-up times (a
        clock driven by hand): the main step's."""
        if rows in self.catch_up_s and not self._stale(rows, now):
            return self.catch_up_s[rows]
        every = self.row_buckets[-1] if self.row_buckets else None
        warm, warm_every = self.warm_s.get(rows), self.warm_s.get(every)
        if warm is None or warm_every is None:
            return self.step_s
        per_slot = max(0.0, self.step_s - warm_every) / every
        return min(self.step_s, warm + per_slot * rows)

    def catch_up(self, now: float, period_end: float, behind: list[Session], lags: dict[Session, int],
                 steps_run: int) -> CatchUpStep | None:
        """The next step of a tick for the sessions still behind (live, a frame queued), or None.

        It ends before the deadline: the smallest bucket that holds them all if it fits, else the
        largest that fits, with the most behind of them. When none fits, a tick whose main step
        found sessions catch_up_lag_frames behind (`lags`) runs one anyway (once: steps_run 1), in
        the smallest bucket that holds those, filled with the most behind of the others (a row
        costs little beside the step's fixed part), so the backlog shrinks by a frame per tick
        instead of never."""
        if not self.row_buckets:
            raise RuntimeError("the policy needs the engine's row buckets (steps_known) before a catch-up")
        order = sorted(behind, key=lambda s: -len(s.inputs))  # most behind first, arrival order among equals
        holding = self._holding(len(order))
        for rows in reversed([b for b in self.row_buckets if b <= holding]):
            if now + self.catch_up_cost(rows, now) + self.catch_up_headroom_s <= period_end:
                return CatchUpStep(CatchUp.FITS, order[:rows], rows)
        far = [s for s in order if lags.get(s, 0) >= self.catch_up_lag_frames]
        if steps_run != 1 or not far:
            return None
        rows = self._holding(len(far))
        rest = [s for s in order if lags.get(s, 0) < self.catch_up_lag_frames]
        return CatchUpStep(CatchUp.FORCED, (far + rest)[:rows], rows)

    def _holding(self, n: int) -> int:
        """The smallest row count that holds n sessions (every slot's, the last, holds any)."""
        return next((b for b in self.row_buckets if b >= n), self.row_buckets[-1])

    # ---- prefill -----------------------------------------------------------------------------

    @staticmethod
    def next_prompt(sessions: Iterable[Session]) -> Session | None:
        """The oldest session still waiting for its prompt (sessions iterate in arrival order)."""
        return next((s for s in sessions if s.status is SessionStatus.PREFILLING), None)

    def piece_fits(self, now: float, period_end: float) -> bool:
        """Whether a prefill piece run alone from now (its measured time plus the headroom) ends
        before period_end."""
        return now + self.piece_s + self.headroom_s <= period_end
