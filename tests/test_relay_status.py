"""The gateway's two status machines, as tables: a relay's (relay.RelayStatus) and a client
session's (session.SessionStatus). Each legal move is allowed, every other one raises, and every
status is reachable from the first and leads to an end."""

from __future__ import annotations

import pytest

from services.common.status import IllegalTransition
from services.gateway import relay, session
from services.gateway.relay import RelayStatus as R
from services.gateway.session import SessionStatus as S

RELAY_MOVES = {
    (R.OPENING, R.OPEN), (R.OPENING, R.FAILED), (R.OPENING, R.REFUSED),
    (R.OPEN, R.CLOSING), (R.OPEN, R.FAILED), (R.OPEN, R.ABORTING),
    (R.CLOSING, R.FAILED), (R.CLOSING, R.ABORTING),
    (R.FAILED, R.ABORTING), (R.FAILED, R.REFUSED),
    (R.ABORTING, R.ENDED),
}
SESSION_MOVES = {
    (S.WAITING, S.OPENING), (S.WAITING, S.LIVE), (S.WAITING, S.CLOSING), (S.WAITING, S.ENDED),
    (S.WAITING, S.CUT_OFF),
    (S.OPENING, S.WAITING), (S.OPENING, S.LIVE), (S.OPENING, S.ENDED), (S.OPENING, S.CUT_OFF),
    (S.LIVE, S.PAUSED), (S.LIVE, S.CLOSING), (S.LIVE, S.ENDED), (S.LIVE, S.CUT_OFF),
    (S.PAUSED, S.RESUMING), (S.PAUSED, S.CLOSING), (S.PAUSED, S.ENDED), (S.PAUSED, S.CUT_OFF),
    (S.RESUMING, S.LIVE), (S.RESUMING, S.PAUSED), (S.RESUMING, S.CLOSING), (S.RESUMING, S.ENDED),
    (S.RESUMING, S.CUT_OFF),
    (S.CLOSING, S.ENDED), (S.CLOSING, S.CUT_OFF),
}
MACHINES = [(relay, R, RELAY_MOVES, R.OPENING, {R.ENDED, R.REFUSED}),
            (session, S, SESSION_MOVES, S.WAITING, {S.ENDED, S.CUT_OFF})]


@pytest.mark.parametrize("module, status, moves, first, ends", MACHINES, ids=["relay", "session"])
def test_exactly_the_listed_moves_are_legal(module, status, moves, first, ends):
    for a in status:
        for b in status:
            if (a, b) in moves:
                assert module.advance(a, b) is b
            else:
                with pytest.raises(IllegalTransition):
                    module.advance(a, b)


@pytest.mark.parametrize("module, status, moves, first, ends", MACHINES, ids=["relay", "session"])
def test_every_status_is_reached_from_the_first_and_only_the_ends_lead_nowhere(module, status, moves, first, ends):
    reached, frontier = {first}, [first]
    while frontier:
        a = frontier.pop()
        for b in status:
            if (a, b) in moves and b not in reached:
                reached.add(b)
                frontier.append(b)
    assert reached == set(status)
    assert {a for a in status if not any((a, b) in moves for b in status)} == ends


def test_a_relay_that_was_counted_leaves_the_count_only_through_abort():
    """A relay counts in its cell's live sessions from a successful open (OPEN, or FAILED while the
    open was still answered) until ENDED; the only way to ENDED is ABORTING, and an open that did not
    succeed ends REFUSED, never counted."""
    into_ended = {a for a, b in RELAY_MOVES if b is R.ENDED}
    assert into_ended == {R.ABORTING}
    assert {a for a, b in RELAY_MOVES if b is R.ABORTING} == {R.OPEN, R.CLOSING, R.FAILED}
    assert not any(a is R.REFUSED for a, _ in RELAY_MOVES)
