""""Say this" on the Realtime wire, end to end: real encoder, talker, decoder and gateway processes and a
raw Realtime client over a real socket (services/gateway/say.py, services/talker/say.py).

- An assistant conversation.item.create with text mid-call is spoken: the transcript deltas carry its
  text as the model's own, in order, and the audio still pairs N frames out for N frames in. What is
  refused is one typed error echoing the asking event's id, and the session goes on: a text over the
  gateway's bound (and its item is not recorded), instructions that are not text, a say over the
  talker's queued-token bound (rate_limit_error say_queue_full).
- response.create with instructions (the server extension LiveKit's generate_reply reaches): the
  playing response completes, a new one opens carrying the create's metadata, and says them; a
  response.cancel midway drops what was not said yet.
- Before any session is open, a say is refused (session_not_started).
"""

from __future__ import annotations

import asyncio

import pytest

from tests.realtime_client import FRAME, RT, pcm16_b64, tone
from tools.run_stack import Stack

pytestmark = pytest.mark.timeout(300)

GATEWAY_ARGS = ["--stall-timeout", "30", "--open-timeout", "120", "--cleanup-timeout", "20"]
MAX_SAY_TOKENS = 64
TALKER_ARGS = ["--say-max-wait-frames", "1", "--max-say-tokens", str(MAX_SAY_TOKENS)]
FIRST = "Thank you for your order, it will arrive on Monday."  # 18 tokens of the tiny tokenizer
SECOND = " ".join(["the weather is kind today"] * 4)  # 32 tokens


@pytest.fixture(scope="module")
def stack(tiny_checkpoint):
    with Stack(tiny_checkpoint, sessions=2, gateway_args=GATEWAY_ARGS, talker_args=TALKER_ARGS) as s:
        yield s


class Call:
    """One Realtime session, its events read by a background task while the test speaks."""

    def __init__(self, rt: RT):
        self.rt = rt
        self.sent = 0
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def open(cls, stack) -> "Call":
        rt = await RT.connect(stack.gateway.ws_url)
        created = await rt.open(instructions="You are kind.", extra_body={"greedy": True})
        assert created["type"] == "session.created", created
        assert created["session"]["capabilities"]["supports_say"] is True
        await rt.until("session.updated")
        return cls(rt)

    async def _read(self) -> None:
        while (await self.rt.recv(120))["type"] != "session.closed":
            pass

    async def speak(self, frames: int, until=None) -> None:
        """`frames` paced 80 ms frames of audio (stopping early once until() holds)."""
        x = tone(frames, seed=self.sent)
        for i in range(frames):
            await self.rt.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(x[i * FRAME:(i + 1) * FRAME])})
            self.sent += 1
            await asyncio.sleep(0.08)
            if until is not None and until():
                return

    async def wait(self, predicate, timeout: float = 60.0) -> None:
        async def poll():
            while not predicate():
                assert not self._reader.done()
                await asyncio.sleep(0.02)
        await asyncio.wait_for(poll(), timeout)

    async def close(self) -> dict:
        await self.rt.send({"type": "session.close"})
        await asyncio.wait_for(self._reader, 120)
        await self.rt.ws.close()
        return self.rt.of("session.closed")[0]

    def transcript(self, response_id: str | None = None) -> str:
        return "".join(e["delta"] for e in self.rt.of("response.output_audio_transcript.delta")
                       if response_id in (None, e["response_id"]))

    def errors(self) -> dict[str, tuple[str, str]]:
        """event_id -> (type, code) of every error."""
        return {e["error"].get("event_id"): (e["error"]["type"], e["error"]["code"]) for e in self.rt.of("error")}


def assistant_item(text: str, item_id: str | None = None, part: str = "output_text") -> dict:
    item = {"type": "message", "role": "assistant",
            "content": [{"type": part, "transcript" if part == "output_audio" else "text": text}]}
    return {"type": "conversation.item.create", "item": item if item_id is None else {"id": item_id, **item}}


async def test_an_assistant_item_is_said_in_order_and_refusals_are_typed(stack):
    call = await Call.open(stack)
    rt = call.rt
    await call.speak(6)
    await rt.send({"event_id": "say-1", **assistant_item(FIRST, "item_first")})
    await rt.send({"event_id": "say-2", **assistant_item(SECOND)})
    await rt.send({"event_id": "full", **assistant_item(SECOND)})  # 18 + 32 queued: 32 more pass 64
    await rt.send({"event_id": "long", **assistant_item("a" * 2001, "item_long")})
    await rt.send({"event_id": "bad", "type": "response.create", "response": {"instructions": 12}})
    await rt.send({"event_id": "heard", **assistant_item("Earlier words.", "item_heard", part="output_audio")})
    await call.speak(110, until=lambda: SECOND in call.transcript())
    await call.speak(4)
    closed = await call.close()
    assert call.errors() == {"full": ("rate_limit_error", "say_queue_full"),
                             "long": ("invalid_request_error", "say_too_long"),
                             "bad": ("invalid_request_error", "bad_say")}
    added = {e["item"]["id"] for e in rt.of("conversation.item.added")}
    assert {"item_first", "item_heard"} <= added and "item_long" not in added  # a refused say records nothing
    transcript = call.transcript()
    assert FIRST in transcript and SECOND in transcript, transcript
    assert transcript.index(FIRST) < transcript.index(SECOND)
    assert "Earlier words." not in transcript  # an audio transcript item is context only
    assert transcript.count(SECOND) == 1  # the refused one was not said
    # the audio still pairs: one audio and one transcript delta per output frame, as many as frames in
    audio, text = rt.of("response.output_audio.delta"), rt.of("response.output_audio_transcript.delta")
    assert len(audio) == len(text) == closed["frames_out"] == closed["frames_in"] == call.sent


async def test_response_create_instructions_are_said_in_a_new_response_and_cancel_drops_the_rest(stack):
    call = await Call.open(stack)
    rt = call.rt
    await call.speak(4)
    first_response = rt.of("response.created")[0]["response"]["id"]
    await rt.send({"type": "response.create", "event_id": "gen-1",
                   "response": {"instructions": SECOND, "metadata": {"client_event_id": "gen-1"}}})
    await call.wait(lambda: len(rt.of("response.created")) == 2)
    done = rt.of("response.done")[0]["response"]
    assert done["id"] == first_response and done["status"] == "completed"
    created = rt.of("response.created")[1]["response"]
    assert created["metadata"] == {"client_event_id": "gen-1"}  # what generate_reply waits for
    said = created["id"]
    await call.speak(60, until=lambda: "the weather is" in call.transcript(said))
    await rt.send({"type": "response.cancel"})
    await call.wait(lambda: len(rt.of("response.done")) == 2)
    assert rt.of("response.done")[1]["response"]["status"] == "cancelled"
    await call.speak(100)  # time enough to say all four
    closed = await call.close()
    assert not rt.of("error"), rt.of("error")
    assert "the weather is" in call.transcript(said)
    # cut midway: the first of its four "weather"s, and at most one more that the talker said before the
    # cancel reached it (the outputs in flight then come in the response the cancel started)
    assert 1 <= call.transcript().count("weather") <= 2, call.transcript()
    assert closed["frames_in"] == call.sent


async def test_a_say_before_any_session_is_refused(stack):
    rt = await RT.connect(stack.gateway.ws_url)
    await rt.send({"event_id": "early", **assistant_item("Hello there.")})
    err = await rt.recv(30)
    assert err["type"] == "error" and err["error"]["code"] == "session_not_started"
    assert err["error"]["event_id"] == "early"
    await rt.ws.close()
