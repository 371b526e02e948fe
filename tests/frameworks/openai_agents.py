"""The OpenAI Agents SDK's realtime agent (`openai-agents`, `agents.realtime`), unmodified, against the
gateway's Realtime wire, as its docs show it: a RealtimeAgent run by a RealtimeRunner, with the model's
URL in `model_config`.

Paced 80 ms pcm16 frames go in through session.send_audio(); mid-stream the application calls
session.interrupt(), which makes the SDK send conversation.item.truncate and response.cancel, and, on the
server's conversation.item.truncated, conversation.item.retrieve. Reports counts, the SDK's own error
events (it surfaces every server `error` to the application) and every raw server event.
"""

from __future__ import annotations

import asyncio
import time

import fw_common as fw
from agents.realtime import RealtimeAgent, RealtimeRunner

PERSONA = "You are a friendly pirate."


async def main() -> None:
    a = fw.args()
    pcm = fw.read_speech(a.speech)
    opened_before = fw.metric(a.url, "gateway_sessions_opened_total")
    frames_in_before = fw.metric(a.url, "gateway_frames_in_total")
    agent = RealtimeAgent(name="pirate", instructions=PERSONA)
    runner = RealtimeRunner(agent, config={"model_settings": {"model_name": "personaplex"}})
    events, errors, samples = [], [], [0]
    session = await runner.run(model_config={
        "url": a.url.replace("http://", "ws://") + "/v1/realtime?model=personaplex",
        "api_key": "unused",
        "initial_model_settings": {"voice": a.voice or "ash"},  # the SDK's default voice, through the aliases
    })

    async def read() -> None:
        async for ev in session:
            if ev.type == "raw_model_event" and ev.data.type == "raw_server_event":
                events.append(fw.short_event(ev.data.data))
            elif ev.type == "audio":
                samples[0] += len(ev.audio.data) // 2
            elif ev.type == "error":
                errors.append({"error": str(ev.error)[:300]})

    frames = lambda: samples[0] // fw.FRAME  # noqa: E731
    async with session:
        reader = asyncio.create_task(read())
        # Phase A: speech in, and the output it is owed (input frames - the model's delay).
        sent_a = await fw.paced(fw.frames_of(pcm, 0, a.frames_a), lambda f: session.send_audio(f.tobytes()))
        await fw.wait_until(lambda: frames() >= sent_a - a.delay, 30)
        received_a = frames()
        server_in_a = fw.metric(a.url, "gateway_frames_in_total") - frames_in_before
        # Phase B: session.interrupt() mid-stream; the session goes on.
        at_interrupt = await fw.interrupt_mid_stream(pcm, a, lambda f: session.send_audio(f.tobytes()),
                                                     session.interrupt, frames)
        await fw.wait_until(lambda: any(e["type"] == "conversation.item.retrieved" for e in events), 10)
        await asyncio.sleep(0.8)
        opened = fw.metric(a.url, "gateway_sessions_opened_total") - opened_before
        reader.cancel()
    fw.report(sent_a=sent_a, received_a=received_a, server_frames_in_a=server_in_a,
              received_after_interrupt=frames() - at_interrupt, errors=errors, sessions_opened=opened,
              events=events, texts=sum(1 for e in events if e["type"].endswith("transcript.delta") and e["delta"]),
              at=time.time())


asyncio.run(main())
