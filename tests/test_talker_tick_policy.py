"""The conversation clock's decisions (services/talker/tick_policy.py) with plain numbers: times in
seconds of an 80 ms period, no engine, no threads, no event loop."""

from __future__ import annotations

import pytest

from services.talker.clock import slow_tick_cause
from services.talker.session import Session, SessionStatus
from services.talker.tick_policy import CATCH_UP_STALE_S, CatchUp, TickPolicy

TICK = 0.08
HEADROOM = 0.008  # a tenth of the period
CATCH_UP_HEADROOM = 0.0024  # 3 % of it: a catch-up step's (a graph of fixed rows, its time measured)


LIVE, PREFILLING = SessionStatus.LIVE, SessionStatus.PREFILLING


def session(name: str = "s", *, status: SessionStatus = LIVE, queued: int = 0, last_input_at: float = float("-inf"),
            **fields) -> Session:
    s = Session(stream_id=name, slot=0, voice=None, persona="", sampling=None, seed=1, status=status,
                last_input_at=last_input_at, **fields)
    s.inputs.extend((i, [0] * 8) for i in range(queued))
    return s


def test_a_frame_that_arrives_after_the_input_wait_makes_its_session_skip_the_tick():
    policy = TickPolicy(TICK, input_wait_s=0.015)
    policy.step_measured(0.05)
    start, period_end = 10.0, 10.08
    late, on_time = session("late", last_input_at=9.95), session("on_time", queued=1, last_input_at=9.99)
    assert policy.frame_due(late, start) and not policy.frame_due(on_time, start)
    until = policy.input_wait_end(start, period_end)
    assert until == pytest.approx(10.015)  # input_wait_s: the step's share (50 + 8 ms) leaves 22
    # late's frame comes at 10.016: the wait is over, the tick steps on_time alone and late skips it.
    assert policy.batch([late, on_time]) == [on_time]
    late.inputs.append((0, [0] * 8))
    assert policy.batch([late, on_time]) == [late, on_time]  # (at 10.014 it would have ridden the tick)


def test_the_input_wait_never_runs_into_the_steps_share_of_the_period():
    policy = TickPolicy(TICK, input_wait_s=0.04)
    policy.step_measured(0.05)
    assert policy.input_wait_end(0.0, TICK) == pytest.approx(TICK - 0.05 - HEADROOM)  # 22 ms, not 40
    policy.step_measured(0.2)  # an EMA: 0.8 * 50 + 0.2 * 200 = 80 ms
    assert policy.step_s == pytest.approx(0.08)
    assert policy.input_wait_end(0.0, TICK) < 0.0  # no time to wait at all
    assert TickPolicy(TICK).input_wait_end(0.0, TICK) is None  # input_wait_s 0: never wait


def test_the_input_wait_leaves_room_for_the_slowest_recent_step():
    policy = TickPolicy(TICK, input_wait_s=0.015)
    for _ in range(20):
        policy.step_measured(0.05)
    assert policy.input_wait_end(0.0, TICK) == pytest.approx(0.015)  # 50 ms steps: the whole wait
    policy.step_measured(0.07)  # one slow step: the average moves 4 ms, the bound 20
    assert policy.input_wait_end(0.0, TICK) == pytest.approx(TICK - 0.07 - 0.003)
    policy.step_measured(0.2, catch_up_rows=8)  # catch-up steps do not count
    assert policy.input_wait_end(0.0, TICK) == pytest.approx(TICK - 0.07 - 0.003)
    for _ in range(256):  # out of the window of recent steps
        policy.step_measured(0.05)
    assert policy.input_wait_end(0.0, TICK) == pytest.approx(0.015)


def test_only_a_talking_live_session_with_nothing_queued_is_waited_for():
    policy, now = TickPolicy(TICK, input_wait_s=0.015), 100.0
    assert policy.frame_due(session(last_input_at=now - 0.119), now)  # a frame within 1.5 periods
    assert not policy.frame_due(session(), now)  # silent: no frame yet
    assert not policy.frame_due(session(last_input_at=now - 0.121), now)  # quiet for over 1.5 periods
    assert not policy.frame_due(session(last_input_at=now - 0.01, queued=1), now)  # its frame is here
    assert not policy.frame_due(session(last_input_at=now - 0.01, input_done=True), now)  # no more frames
    assert not policy.frame_due(session(last_input_at=now - 0.01, status=PREFILLING), now)  # not stepped yet


def test_a_step_takes_live_sessions_with_a_frame_and_the_lag_counts_frames_besides_it():
    a, b, idle = session("a", queued=3), session("b", queued=1), session("idle")
    opening = session(status=PREFILLING, queued=2)
    batch = TickPolicy.batch([a, b, idle, opening])
    assert batch == [a, b]
    assert TickPolicy.lags(batch) == {a: 2, b: 0}


BUCKETS = (8, 32, 160)  # engine.row_buckets at 160 slots: compact steps of 8 and 32 rows, then every slot
MAIN_END = 0.055  # a 55 ms main step: 25 ms of the period left, 22.6 after a catch-up's headroom


def behind(n: int, queued: int = 1) -> list[Session]:
    return [session(f"s{i}", queued=queued) for i in range(n)]


def measured(**catch_up_ms) -> TickPolicy:
    """At 160 slots: a 55 ms main step, and catch-up steps of these row counts measured (ms)."""
    policy = TickPolicy(TICK, row_buckets=BUCKETS)
    policy.step_measured(0.055)
    for rows, ms in catch_up_ms.items():
        policy.step_measured(ms / 1e3, catch_up_rows=int(rows.strip("r")))
    return policy


def test_a_catch_up_step_is_the_smallest_bucket_that_holds_the_sessions_behind_if_it_fits():
    policy = measured(r8=6, r32=12)
    few, many, crowd = behind(5), behind(20), behind(100)
    step = policy.catch_up(MAIN_END, TICK, few, {}, steps_run=1)
    assert (step.kind, step.rows, step.sessions) == (CatchUp.FITS, 8, few)  # 6 + 2.4 ms in 25
    step = policy.catch_up(MAIN_END, TICK, many, {}, steps_run=1)
    assert (step.rows, step.sessions) == (32, many)  # 12 + 2.4 ms
    # 100 behind: every slot's step (55 ms) does not fit, the largest bucket that does takes 32 of them
    step = policy.catch_up(MAIN_END, TICK, crowd, {}, steps_run=1)
    assert (step.rows, step.sessions) == (32, crowd[:32])
    # later in the period only 8 rows fit: the 8 most behind first
    late = [*behind(10), *behind(3, queued=3), *behind(5, queued=2)]
    step = policy.catch_up(TICK - 0.010, TICK, late, {}, steps_run=3)
    assert step.rows == 8 and step.sessions == late[10:13] + late[13:18]
    assert policy.catch_up(TICK - 0.008, TICK, late, {}, steps_run=3) is None  # 6 + 2.4 ms in 8: none
    with pytest.raises(RuntimeError, match="row buckets"):
        TickPolicy(TICK).catch_up(0.0, TICK, few, {}, steps_run=1)


def test_a_catch_up_size_not_yet_measured_costs_its_idle_time_plus_its_rows_share_of_the_main_step():
    policy = measured()
    policy.steps_known(BUCKETS, {8: 0.008, 32: 0.010, 160: 0.018})  # idle steps at warm-up
    per_slot = (0.055 - 0.018) / 160  # what the main step pays per slot beyond its idle time
    assert policy.catch_up_cost(8) == pytest.approx(0.008 + 8 * per_slot)  # 9.9 ms: fits the 22.6 left
    assert policy.catch_up_cost(32) == pytest.approx(0.010 + 32 * per_slot) and policy.catch_up_cost(160) == 0.055
    # (the main step scaled by 8 / 18 would be 24 ms: a step that never fits, so never measured)
    step = policy.catch_up(MAIN_END, TICK, behind(3), {}, steps_run=1)
    assert step.rows == 8  # so it runs, and is measured from then on
    policy.step_measured(0.007, catch_up_rows=8)
    policy.step_measured(0.009, catch_up_rows=8)  # an EMA per bucket: 0.8 * 7 + 0.2 * 9
    assert policy.catch_up_cost(8) == pytest.approx(0.0074) and policy.catch_up_cost(32) == pytest.approx(0.0174)
    assert policy.step_s == pytest.approx(0.055)  # the main step's own average is untouched
    # no warm-up times (a clock driven by hand): the main step's cost, and with 25 ms left none fits
    bare = measured()
    assert bare.catch_up_cost(8) == pytest.approx(0.055)
    assert bare.catch_up(MAIN_END, TICK, behind(3), {}, steps_run=1) is None


def test_a_catch_up_average_that_no_longer_fits_goes_stale_and_is_tried_again():
    """Slow catch-ups (beside the decoder, say) raise a bucket's average past what fits; it is never run
    again, so never measured: without staleness the sessions behind would stay behind for good. After
    CATCH_UP_STALE_S the prior decides again, and the next measurement starts a new average."""
    policy = measured()
    policy.steps_known(BUCKETS, {8: 0.008, 32: 0.010, 160: 0.018})
    prior = policy.catch_up_cost(8)  # 9.9 ms
    for t in (0.0, 0.08, 0.16):
        policy.step_measured(0.030, catch_up_rows=8, now=t)  # three slow ones: 30 ms
    late = TICK - 0.015  # 12.6 ms left after the headroom: the 8-row prior (9.9 ms) would fit, not its average
    assert policy.catch_up(late, TICK, behind(3), {}, steps_run=1) is None
    assert policy.catch_up_cost(8, now=20.0) == pytest.approx(0.030)  # 20 s later: still trusted
    assert policy.catch_up(20.0 + late, 20.0 + TICK, behind(3), {}, steps_run=1) is None
    t = 0.16 + CATCH_UP_STALE_S + 1
    assert policy.catch_up_cost(8, now=t) == pytest.approx(prior)  # stale: the prior again
    step = policy.catch_up(t + late, t + TICK, behind(3), {}, steps_run=1)
    assert step is not None and step.rows == 8  # tried again
    policy.step_measured(0.008, catch_up_rows=8, now=t + late)  # fast this time
    assert policy.catch_up_cost(8, now=t + 1) == pytest.approx(0.008)  # a new average, not 0.8 * 30 + 0.2 * 8
    policy.step_measured(0.010, catch_up_rows=8, now=t + 2)
    assert policy.catch_up_cost(8, now=t + 2) == pytest.approx(0.8 * 0.008 + 0.2 * 0.010)  # and blended again
    # a clock driven by hand (no times): never stale
    assert policy.catch_up_cost(8) == pytest.approx(0.8 * 0.008 + 0.2 * 0.010)


def test_a_catch_up_step_that_would_not_fit_runs_only_for_sessions_too_far_behind_in_the_bucket_that_holds_them():
    policy = measured(r8=6, r32=12, r160=50)
    now = TICK - 0.006 - CATCH_UP_HEADROOM + 0.001  # 1 ms too late for any
    far, near = behind(2, queued=3), behind(20)
    lags = {s: 2 for s in far} | {s: 0 for s in near}  # frames queued before the main step, besides its own
    assert policy.catch_up(now, TICK, near, lags, steps_run=1) is None  # a frame behind: the next tick's
    step = policy.catch_up(now, TICK, near + far, lags, steps_run=1)
    # two frames behind: one step past the deadline, 8 rows for the 2, filled with the most behind of the rest
    assert (step.kind, step.rows, step.sessions) == (CatchUp.FORCED, 8, far + near[:6])
    assert policy.catch_up(now, TICK, near + far, lags, steps_run=2) is None  # and only one per tick
    crowd = behind(40, queued=3)
    step = policy.catch_up(now, TICK, crowd, {s: 2 for s in crowd}, steps_run=1)
    assert (step.rows, step.sessions) == (160, crowd)  # 40 too far behind: every slot's step holds them
    patient = TickPolicy(TICK, catch_up_lag_frames=3, row_buckets=BUCKETS, step_s=0.055, catch_up_s={8: 0.006})
    assert patient.catch_up(now, TICK, far, lags, steps_run=1) is None
    assert patient.catch_up(now, TICK, far, {s: 3 for s in far}, steps_run=1).kind is CatchUp.FORCED
    assert policy.catch_up(now - 0.002, TICK, far, lags, steps_run=1).kind is CatchUp.FITS
    with pytest.raises(ValueError, match="catch_up_lag_frames"):
        TickPolicy(TICK, catch_up_lag_frames=0)


def test_with_sessions_behind_the_input_wait_leaves_room_for_the_smallest_catch_up_step():
    policy = TickPolicy(TICK, input_wait_s=0.015, row_buckets=BUCKETS)
    for _ in range(20):
        policy.step_measured(0.05)
    policy.step_measured(0.01, catch_up_rows=8)
    assert policy.input_wait_end(0.0, TICK) == pytest.approx(0.015)  # nobody behind: the whole wait
    # behind: 80 - 50 - 8 (the main step's share) - 10 - 2.4 (the 8-row catch-up's) = 9.6 ms
    expected = TICK - 0.05 - HEADROOM - 0.01 - CATCH_UP_HEADROOM
    assert policy.input_wait_end(0.0, TICK, behind=True) == pytest.approx(expected)
    for _ in range(40):  # 57 ms main steps (160 slots beside the codecs): 2.6 ms of wait, and the catch-up fits
        policy.step_measured(0.057)
    until = policy.input_wait_end(0.0, TICK, behind=True)
    assert until == pytest.approx(TICK - 0.057 - HEADROOM - 0.01 - CATCH_UP_HEADROOM, abs=1e-6)
    assert policy.catch_up(until + 0.057, TICK, behind(3), {}, steps_run=1).rows == 8
    assert policy.input_wait_end(0.0, TICK, behind=False) == pytest.approx(0.015)


def test_catch_up_steps_take_only_frames_owed_to_the_period():
    late, lagging, on_time = session("late"), session("lagging"), session("on_time")
    owed = TickPolicy.owed({lagging: 2, on_time: 0}, skipped=[late])
    # on_time's next frame, if it arrives during the main step, is the next tick's
    assert owed == {lagging: 2, late: 1}


def test_a_prefill_piece_that_would_not_fit_is_not_run():
    policy = TickPolicy(TICK)
    assert policy.piece_fits(0.0, HEADROOM + 0.001) and not policy.piece_fits(0.0, HEADROOM - 0.001)  # unmeasured
    policy.piece_measured(0.03)
    policy.piece_measured(0.05)  # 0.8 * 30 + 0.2 * 50 = 34 ms
    assert policy.piece_s == pytest.approx(0.034)
    slack_start = 0.035  # a tick that took 35 ms leaves 45
    assert policy.piece_fits(slack_start, TICK)  # 34 + 8 ms
    assert not policy.piece_fits(slack_start + 0.004, TICK)  # 4 ms later it would end past the deadline


def test_the_next_prompt_is_the_oldest_still_waiting():
    live, failed = session("live"), session("failed", status=SessionStatus.FAILED)
    closed, ended = session("closed", status=SessionStatus.CLOSED), session("ended", status=SessionStatus.ENDED)
    held = session("held", status=SessionStatus.HELD)
    first, second = session("first", status=PREFILLING), session("second", status=PREFILLING)
    assert TickPolicy.next_prompt([live, failed, closed, ended, held, first, second]) is first
    assert TickPolicy.next_prompt([live, ended]) is None


def test_a_slow_tick_is_counted_by_what_it_held():
    assert slow_tick_cause(steps=2, late_start_s=0.0) == "catch_up"
    assert slow_tick_cause(steps=1, late_start_s=0.02) == "late_start"
    assert slow_tick_cause(steps=1, late_start_s=0.001) == "wait_and_step"


def test_the_prefill_queue_estimate_is_bounded_and_recovers_when_the_queue_is_idle():
    """A prompt's wait: the pieces ahead of it plus its own, at the measured piece interval. A gap over
    a period counts as one period (a piece rides every main step), and an idle queue forgets when its
    last piece ran, so an estimate can never stay over the bound with nothing queued (front door run 20)."""
    from types import SimpleNamespace

    from services.talker.prefill_queue import PIECES_PER_PROMPT, UNMEASURED_INTERVAL_PERIODS, PrefillQueue

    q = PrefillQueue(tick_s=0.08, chunk_frames=64)
    assert q.wait_s([]) == pytest.approx(PIECES_PER_PROMPT * UNMEASURED_INTERVAL_PERIODS * 0.08)
    waiting = SimpleNamespace(status=SessionStatus.PREFILLING, job=SimpleNamespace(total_frames=200, frames_done=8))
    held = SimpleNamespace(status=SessionStatus.HELD, job=None)
    live = SimpleNamespace(status=SessionStatus.LIVE, job=None)
    q.queue_became_busy(0.0)
    for t in (0.5, 100.0, 200.0):  # gaps far over a period: each counts one period
        q.piece_done(t, queue_left=True)
    assert q.piece_interval_s <= 0.08
    assert q.wait_s([waiting, held, live]) == pytest.approx((3 + PIECES_PER_PROMPT + PIECES_PER_PROMPT)
                                                            * q.piece_interval_s)
    q.wait_s([live])  # nothing queued: the stale last piece is forgotten
    q.piece_done(1000.0, queue_left=False)
    assert q.piece_interval_s <= 0.08
