"""A talker session's status (services/talker/session.py): the legal moves and the refusal of the others."""

from __future__ import annotations

import itertools

import pytest

from services.talker.session import TRANSITIONS, IllegalTransition, Session, SessionStatus

S = SessionStatus
LEGAL = {(S.HELD, S.PREFILLING), (S.HELD, S.FAILED), (S.HELD, S.CLOSED),
         (S.PREFILLING, S.LIVE), (S.PREFILLING, S.FAILED), (S.PREFILLING, S.CLOSED),
         (S.LIVE, S.ENDED), (S.LIVE, S.FAILED), (S.LIVE, S.CLOSED),
         (S.ENDED, S.CLOSED), (S.FAILED, S.CLOSED)}


def session(status: SessionStatus = S.HELD) -> Session:
    return Session(stream_id="s", slot=3, voice=None, persona="", sampling=None, seed=1, status=status)


def test_a_session_opens_held():
    assert session().status is S.HELD


@pytest.mark.parametrize("start, to", list(itertools.product(S, S)))
def test_every_move_is_allowed_exactly_when_the_table_says_so(start, to):
    s = session(start)
    if (start, to) in LEGAL:
        s.move(to)
        assert s.status is to
    else:
        with pytest.raises(IllegalTransition, match=f"from {start.value} to {to.value}"):
            s.move(to)
        assert s.status is start  # a refused move changes nothing


def test_the_table_is_the_one_the_test_states():
    assert {(a, b) for a, targets in TRANSITIONS.items() for b in targets} == LEGAL
    assert set(TRANSITIONS) == set(S)


@pytest.mark.parametrize("path", [
    [S.PREFILLING, S.LIVE, S.ENDED, S.CLOSED],  # a whole conversation
    [S.PREFILLING, S.LIVE, S.FAILED, S.CLOSED],  # a step failed
    [S.PREFILLING, S.CLOSED],  # re-primed (or dropped) before go-live
    [S.FAILED, S.CLOSED],  # a frame over the backlog while held
])
def test_the_lives_a_session_leads(path):
    s = session()
    for to in path:
        s.move(to)
    assert s.status is S.CLOSED and s.status.over


def test_over_means_no_more_engine_work():
    assert {st for st in S if st.over} == {S.ENDED, S.FAILED, S.CLOSED}
