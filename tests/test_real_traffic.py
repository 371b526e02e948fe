"""Real traffic at the front door (issue 28): the SDK open, audio before go-live, a burst.

A real stack (encoder, talker, decoder, gateway; two slots) and Realtime clients over real sockets:
- the SDK open (`?model=` then session.update at once) on a full cell is never refused, prefills
  its prompt once, and a second session.update racing the unfinished prefill cancels it;
- audio sent while the prompt is still prefilling is held (the newest frames) and the session lives;
- a burst beyond what the cell can prefill within the talker's bound: the refused callers get a
  typed retry-later before any audio, the admitted ones talk, and every gauge returns to baseline.
"""

from __future__ import annotations

import socket
import time
import urllib.request

import pytest
from websockets.exceptions import ConnectionClosed

from tests.reliability_helpers import SyncRT, append, assert_nothing_leaked, leak_baseline, tone
from tools.run_stack import Stack

GATEWAY_ARGS = ["--stall-timeout", "30", "--open-timeout", "120", "--cleanup-timeout", "20"]
# About 160 prompt frames (the tiny model's window is 255): with 8-frame prefill pieces, 20 of them.
LONG_PERSONA = "You are a patient teacher who explains every step slowly and kindly. " * 8
SLOW_PREFILL = ["--prefill-chunk-frames", "8"]


def talker_counter(stack, name: str, label: str = "") -> float:
    body = urllib.request.urlopen(stack.cell_procs[0].talker.metrics_url, timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
               if line.startswith(name) and label in line and not line.startswith("#"))


def sdk_connect(stack) -> SyncRT:
    """What the openai SDK, LiveKit's openai plugin and pipecat do: connect with ?model=."""
    rt = SyncRT(stack.gateway.ws_url + "&model=personaplex")
    created = rt.recv(60)
    assert created["type"] == "session.created", created
    return rt


@pytest.fixture(scope="module")
def stack(tiny_checkpoint):
    with Stack(tiny_checkpoint, sessions=2, gateway_args=GATEWAY_ARGS, talker_args=SLOW_PREFILL) as s:
        yield s


def test_sdk_open_on_a_full_cell_prefills_once_and_a_racing_update_cancels_the_prefill(stack):
    """Another caller holds one of two slots. An SDK client takes the other at connect (its prompt on
    hold), then changes its persona twice at once: both updates are answered session.updated with
    the last persona, nothing is refused although the cell is full, the held prompt started once
    (why="prime") and was re-primed once, and only one prompt went live (the first was cancelled
    mid-prefill). Audio then gets frames."""
    baseline = leak_baseline(stack)
    started = {w: talker_counter(stack, "duplex_talker_prompts_started_total", f'why="{w}"')
               for w in ("prime", "reprime", "hold_ended", "frame")}
    went_live = talker_counter(stack, "duplex_talker_prefill_seconds_count")
    other = sdk_connect(stack)
    assert other.next_reply(30)["type"] == "session.updated"  # its default prompt, after the hold
    rt = sdk_connect(stack)
    rt.send({"type": "session.update", "event_id": "u1", "session": {"instructions": LONG_PERSONA}})
    rt.send({"type": "session.update", "event_id": "u2", "session": {"instructions": "You are brief."}})
    updated = [rt.next_reply(60) for _ in range(2)]
    assert [e["type"] for e in updated] == ["session.updated"] * 2, updated
    assert all(e["session"]["instructions"] == "You are brief." for e in updated)
    rt.send(append(tone(8)))
    while rt.frames < 5:
        ev = rt.recv(60)
        assert ev["type"] != "error", ev
    now = {w: talker_counter(stack, "duplex_talker_prompts_started_total", f'why="{w}"') for w in started}
    assert {w: now[w] - started[w] for w in started} == {"prime": 1, "reprime": 1, "hold_ended": 1, "frame": 0}
    assert talker_counter(stack, "duplex_talker_prefill_seconds_count") - went_live == 2  # other's, and rt's last
    rt.close()
    other.close()
    assert_nothing_leaked(stack, baseline)


def test_an_sdk_open_that_sends_nothing_starts_its_default_prompt_when_the_hold_ends(stack):
    baseline = leak_baseline(stack)
    before = talker_counter(stack, "duplex_talker_prompts_started_total", 'why="hold_ended"')
    rt = sdk_connect(stack)
    assert rt.next_reply(30)["type"] == "session.updated"  # the default prompt, live after the hold (500 ms)
    assert talker_counter(stack, "duplex_talker_prompts_started_total", 'why="hold_ended"') - before == 1
    rt.send(append(tone(4)))
    while rt.frames < 3:
        ev = rt.recv(60)
        assert ev["type"] != "error", ev
    rt.close()
    assert_nothing_leaked(stack, baseline)


def test_audio_during_a_slow_prefill_is_held_and_the_session_lives(stack):
    """A client that streams at real pace right after its session.update, without waiting for
    session.updated, while a long persona is prefilled: no error, the newest 12 frames reach the
    model at go-live, older ones are dropped and counted, and every frame that reached the model
    gets its output."""
    baseline = leak_baseline(stack)
    rt = sdk_connect(stack)
    rt.send({"type": "session.update", "session": {"instructions": LONG_PERSONA}})
    x = tone(12, 300)
    sent, next_at = 0, time.monotonic()
    deadline = next_at + 6.0
    while time.monotonic() < deadline:
        rt.send(append(x[(sent % 12) * 1920:(sent % 12 + 1) * 1920]))
        sent += 1
        next_at += 0.08
        while (left := next_at - time.monotonic()) > 0:
            try:
                ev = rt.recv(left)
                assert ev["type"] != "error", ev
            except TimeoutError:
                break
    rt.send({"type": "session.close"})
    while (ev := rt.recv(60))["type"] != "session.closed":
        assert ev["type"] != "error", ev
    dropped = ev["prelive_frames_dropped"]
    assert ev["frames_in"] + dropped == sent, ev
    assert ev["frames_out"] == ev["frames_in"], ev  # N in, N out for what reached the model
    assert ev["frames_in"] > 12  # it went live and streamed
    with pytest.raises(ConnectionClosed):
        rt.recv(30)
    assert_nothing_leaked(stack, baseline)


def test_a_burst_beyond_the_prefill_bound_is_refused_up_front_and_admitted_callers_talk(tiny_checkpoint):
    """A talker whose prompts may wait at most 50 ms in its prefill queue (8-frame pieces, so a long
    persona is many pieces). One SDK caller starts a long prompt; a burst of three more arrives
    while it prefills: each would wait, so each is refused before session.created with a typed
    retry-later (rate_limit_error/server_busy, a retry hint, close 1013). The admitted caller gets
    audio; slots and gauges return to baseline."""
    with Stack(tiny_checkpoint, sessions=4, gateway_args=GATEWAY_ARGS,
               talker_args=["--max-prefill-wait-s", "0.05", *SLOW_PREFILL]) as s:
        baseline = leak_baseline(s)
        first = sdk_connect(s)  # an empty queue: its estimate is one prompt's, under the bound
        first.send({"type": "session.update", "session": {"instructions": LONG_PERSONA}})
        burst = [SyncRT(s.gateway.ws_url) for _ in range(3)]
        for rt in burst:
            rt.send({"type": "session.update", "session": {"type": "realtime", "instructions": "You are quick."}})
        for rt in burst:
            ev = rt.recv(120)
            assert ev["type"] == "error" and not any(e["type"] == "session.created" for e in rt.events), ev
            assert (ev["error"]["type"], ev["error"]["code"]) == ("rate_limit_error", "server_busy"), ev
            assert "retry in" in ev["error"]["message"], ev
            with pytest.raises(ConnectionClosed) as closed:
                rt.recv(30)
            assert closed.value.rcvd.code == 1013
        assert first.next_reply(120)["type"] == "session.updated"
        first.send(append(tone(4)))
        while first.frames < 3:
            assert first.recv(60)["type"] != "error"
        first.close()
        assert talker_counter(s, "duplex_talker_prefill_busy_refusals_total") == len(burst)
        assert_nothing_leaked(s, baseline)


def test_dropping_the_connection_mid_reprime_leaves_no_slot_taken(stack):
    """The probe's attack (issue 31, defect 1): open with ?model=, send three persona changes and drop
    the TCP connection 50 ms later, again and again. Every slot comes back, and two real users then
    take both slots."""
    baseline = leak_baseline(stack)
    for i in range(4):
        rt = sdk_connect(stack)
        for k in range(3):
            rt.send({"type": "session.update", "session": {"instructions": f"You are persona {i}.{k}."}})
        time.sleep(0.05)
        rt.ws.socket.shutdown(socket.SHUT_RDWR)
        rt.ws.socket.close()
    assert_nothing_leaked(stack, baseline)
    users = [sdk_connect(stack) for _ in range(2)]
    for rt in users:
        rt.send({"type": "session.update", "session": {"instructions": "You are real."}})
        assert rt.next_reply(60)["type"] == "session.updated"
        rt.close()
    assert_nothing_leaked(stack, baseline)


def test_updates_waiting_for_the_prompt_are_bounded(stack):
    """session.updates that change nothing, sent while the prompt is not live yet, each wait for it to go
    live; at most 16 wait (a bounded list), the rest are refused typed, and the session goes on."""
    baseline = leak_baseline(stack)
    rt = sdk_connect(stack)
    for i in range(20):
        rt.send({"type": "session.update", "event_id": f"same{i}", "session": {"type": "realtime"}})
    replies = [rt.next_reply(60) for _ in range(20)]
    errors = [e for e in replies if e["type"] == "error"]
    assert [e["error"]["code"] for e in errors] == ["rate_limit_exceeded"] * 4, errors
    assert sum(e["type"] == "session.updated" for e in replies) == 16
    rt.send(append(tone(4)))
    while rt.frames < 3:
        ev = rt.recv(60)
        assert ev["type"] != "error", ev
    rt.close()
    assert_nothing_leaked(stack, baseline)
