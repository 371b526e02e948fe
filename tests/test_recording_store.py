"""The talker's store of recorded enrolled voices (services/talker/recording_store.py), with plain numbers:
bounded in bytes with least-recently-leased eviction, leases that protect a recording a session is
starting with, and forgetting (at once, or when the last lease ends)."""

from __future__ import annotations

import pytest

from services.talker.recording_store import ForgetOutcome, Holding, RecordingStore, StoreFull


def test_admitting_past_the_bound_evicts_the_least_recently_leased_first():
    store = RecordingStore(max_bytes=300)
    assert store.admit("a", 100) == [] and store.admit("b", 100) == [] and store.admit("c", 100) == []
    assert store.lease("a")  # used again: now the most recent
    store.release("a")
    assert store.admit("d", 150) == ["b", "c"]  # the two oldest, until it fits
    assert store.held_bytes == 250 and "a" in store and "d" in store and len(store) == 2
    assert store.evictions == 2
    assert store.admit("e", 300) == ["a", "d"] and store.held_bytes == 300


def test_a_leased_recording_is_never_evicted_and_a_full_store_refuses_without_evicting():
    store = RecordingStore(max_bytes=300)
    store.admit("a", 100)
    store.admit("b", 100)
    assert store.lease("a") and store.lease("b")
    assert store.admit("c", 100) == []  # room left: nothing evicted
    assert store.room_for(0) and not store.room_for(101)
    with pytest.raises(StoreFull):
        store.admit("d", 150)  # a and b are leased: only c could go, and 150 would still not fit
    assert len(store) == 3 and store.held_bytes == 300  # the refusal evicted nothing
    assert store.admit("d", 100) == ["c"]
    with pytest.raises(StoreFull):
        store.admit("huge", 301)  # larger than the bound alone


def test_forgetting_an_unleased_recording_drops_it_at_once():
    store = RecordingStore(max_bytes=300)
    store.admit("a", 100)
    assert store.forget("a") == (ForgetOutcome.FORGOTTEN, ["a"])
    assert "a" not in store and store.held_bytes == 0
    assert store.forget("a") == (ForgetOutcome.NOT_HELD, [])
    assert not store.lease("a")


def test_forgetting_a_leased_recording_waits_for_its_last_lease():
    store = RecordingStore(max_bytes=300)
    store.admit("a", 100)
    store.lease("a")
    store.lease("a")
    assert store.forget("a") == (ForgetOutcome.DEFERRED, [])
    assert store.holding("a") is Holding.FORGETTING and store.held_bytes == 100
    assert store.release("a") == []  # one session still starting with it
    assert store.release("a") == ["a"]
    assert "a" not in store and store.held_bytes == 0
    with pytest.raises(ValueError):
        store.release("a")


def test_a_session_bringing_the_audio_after_the_forget_revives_it_one_waiting_since_before_does_not():
    store = RecordingStore(max_bytes=300)
    store.admit("a", 100, Holding.FORGETTING)  # forgotten while it was being recorded
    assert store.lease("a", revive=False)  # a session that was waiting for the recording
    assert store.holding("a") is Holding.FORGETTING
    assert store.lease("a")  # a new open that ships the audio (enrolled again)
    assert store.holding("a") is Holding.HELD
    assert store.release("a") == [] and store.release("a") == []
    assert "a" in store and store.leases("a") == 0


def test_a_forgetting_recording_whose_sessions_left_is_evictable():
    store = RecordingStore(max_bytes=200)
    store.admit("a", 100, Holding.FORGETTING)  # its waiting sessions never leased it (they went away)
    store.admit("b", 100)
    assert store.admit("c", 100) == ["a"]
