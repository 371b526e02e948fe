"""The conversation clock's decisions (services/talker/tick_policy.py) with plain numbers: times in
seconds of an 80 ms period, no engine, no threads, no event loop."""

from __future__ import annotations

import pytest

from services.talker.clock import slow_tick_cause
from services.talker.session import Session
from services.talker.tick_policy import CatchUp, TickPolicy

TICK = 0.08
HEADROOM = 0.008  # a tenth of the period


def session(name: str = "s", *, live: bool = True, queued: int = 0, last_input_at: float = float("-inf"),
            **fields) -> Session:
    s = Session(stream_id=name, slot=0, voice=None, persona="", sampling=None, seed=1, live=live,
                last_input_at=last_input_at, **fields)
    s.inputs.extend((i, [0] * 8) for i in range(queued))
    return s


def test_a_frame_that_arrives_after_the_input_wait_makes_its_session_skip_the_tick():
    policy = TickPolicy(TICK, input_wait_s=0.015)
    policy.step_measured(0.05, catch_up=False)
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
    policy.step_measured(0.05, catch_up=False)
    assert policy.input_wait_end(0.0, TICK) == pytest.approx(TICK - 0.05 - HEADROOM)  # 22 ms, not 40
    policy.step_measured(0.2, catch_up=False)  # an EMA: 0.8 * 50 + 0.2 * 200 = 80 ms
    assert policy.step_s == pytest.approx(0.08)
    assert policy.input_wait_end(0.0, TICK) < 0.0  # no time to wait at all
    assert TickPolicy(TICK).input_wait_end(0.0, TICK) is None  # input_wait_s 0: never wait


def test_the_input_wait_leaves_room_for_the_slowest_recent_step():
    policy = TickPolicy(TICK, input_wait_s=0.015)
    for _ in range(20):
        policy.step_measured(0.05, catch_up=False)
    assert policy.input_wait_end(0.0, TICK) == pytest.approx(0.015)  # 50 ms steps: the whole wait
    policy.step_measured(0.07, catch_up=False)  # one slow step: the average moves 4 ms, the bound 20
    assert policy.input_wait_end(0.0, TICK) == pytest.approx(TICK - 0.07 - 0.003)
    policy.step_measured(0.2, catch_up=True)  # catch-up steps do not count
    assert policy.input_wait_end(0.0, TICK) == pytest.approx(TICK - 0.07 - 0.003)
    for _ in range(256):  # out of the window of recent steps
        policy.step_measured(0.05, catch_up=False)
    assert policy.input_wait_end(0.0, TICK) == pytest.approx(0.015)


def test_only_a_talking_live_session_with_nothing_queued_is_waited_for():
    policy, now = TickPolicy(TICK, input_wait_s=0.015), 100.0
    assert policy.frame_due(session(last_input_at=now - 0.119), now)  # a frame within 1.5 periods
    assert not policy.frame_due(session(), now)  # silent: no frame yet
    assert not policy.frame_due(session(last_input_at=now - 0.121), now)  # quiet for over 1.5 periods
    assert not policy.frame_due(session(last_input_at=now - 0.01, queued=1), now)  # its frame is here
    assert not policy.frame_due(session(last_input_at=now - 0.01, input_done=True), now)  # no more frames
    assert not policy.frame_due(session(last_input_at=now - 0.01, live=False), now)  # not stepped yet


def test_a_step_takes_live_sessions_with_a_frame_and_the_lag_counts_frames_besides_it():
    a, b, idle, opening = session("a", queued=3), session("b", queued=1), session("idle"), session(live=False, queued=2)
    batch = TickPolicy.batch([a, b, idle, opening])
    assert batch == [a, b]
    assert TickPolicy.lag_frames(batch) == 2 and TickPolicy.lag_frames([b]) == 0


def test_a_catch_up_step_is_judged_by_its_own_measured_cost():
    policy = TickPolicy(TICK)
    policy.step_measured(0.05, catch_up=False)
    # Unmeasured, a catch-up step is taken to cost a main step: 50 + 8 ms do not fit in 40.
    assert policy.catch_up(now=0.04, period_end=TICK, steps_run=1, lag=1) is CatchUp.NONE
    policy.step_measured(0.018, catch_up=True)
    assert policy.catch_up_s == pytest.approx(0.018) and policy.step_s == pytest.approx(0.05)
    assert policy.catch_up(now=0.04, period_end=TICK, steps_run=1, lag=1) is CatchUp.FITS  # 18 + 8 ms in 40
    assert policy.catch_up(now=0.04, period_end=TICK, steps_run=3, lag=1) is CatchUp.FITS  # as many as fit


def test_a_catch_up_step_that_would_not_fit_is_not_taken_unless_a_session_is_too_far_behind():
    policy = TickPolicy(TICK)
    policy.step_measured(0.05, catch_up=False)
    policy.step_measured(0.018, catch_up=True)
    now = TICK - 0.018 - HEADROOM + 0.001  # 1 ms too late for one
    assert policy.catch_up(now, TICK, steps_run=1, lag=1) is CatchUp.NONE  # one frame behind: the next tick's
    assert policy.catch_up(now, TICK, steps_run=1, lag=2) is CatchUp.FORCED  # two: one step past the deadline
    assert policy.catch_up(now, TICK, steps_run=2, lag=5) is CatchUp.NONE  # and only one per tick
    patient = TickPolicy(TICK, catch_up_lag_frames=3, step_s=0.05, catch_up_s=0.018)
    assert patient.catch_up(now, TICK, steps_run=1, lag=2) is CatchUp.NONE
    assert patient.catch_up(now, TICK, steps_run=1, lag=3) is CatchUp.FORCED
    assert policy.catch_up(now - 0.002, TICK, steps_run=1, lag=1) is CatchUp.FITS
    with pytest.raises(ValueError, match="catch_up_lag_frames"):
        TickPolicy(TICK, catch_up_lag_frames=0)


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
    live, failed = session("live"), session("failed", live=False, failed=True)
    closed, ended = session("closed", live=False, closed=True), session("ended", live=False, ended=True)
    first, second = session("first", live=False), session("second", live=False)
    assert TickPolicy.next_prompt([live, failed, closed, ended, first, second]) is first
    assert TickPolicy.next_prompt([live, ended]) is None


def test_a_slow_tick_is_counted_by_what_it_held():
    assert slow_tick_cause(steps=2, late_start_s=0.0) == "catch_up"
    assert slow_tick_cause(steps=1, late_start_s=0.02) == "late_start"
    assert slow_tick_cause(steps=1, late_start_s=0.001) == "wait_and_step"
