"""livekit-plugins-openai's RealtimeModel, unmodified, against the gateway's Realtime wire.

The plugin's realtime session is driven directly from asyncio (no LiveKit server), as an agent's
AgentSession drives it: push_audio() with paced 80 ms frames, generations read from its streams,
interrupt() mid-stream (it sends response.cancel). Reports counts, errors and every raw server event.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import fw_common as fw
from livekit import rtc
from livekit.plugins.openai.realtime import RealtimeModel

PERSONA = "You are a friendly pirate."


async def main() -> None:
    a = fw.args()
    pcm = fw.read_speech(a.speech)
    events = []
    opened_before = fw.metric(a.url, "gateway_sessions_opened_total")
    frames_in_before = fw.metric(a.url, "gateway_frames_in_total")

    async with aiohttp.ClientSession() as http:
        kw = {"voice": a.voice} if a.voice else {}
        model = RealtimeModel(base_url=a.url + "/v1", api_key="unused", http_session=http, **kw)
        sess = model.session()
        sess.on("openai_server_event_received", lambda ev: events.append(fw.short_event(ev)))
        out = fw.LiveKitOutput(sess)
        await sess.update_instructions(PERSONA)  # as AgentSession does with Agent(instructions=...) at start

        def push(frame) -> None:
            sess.push_audio(rtc.AudioFrame(frame.tobytes(), fw.SAMPLE_RATE, 1, len(frame)))

        # Phase A: speech in, and the output it is owed (input frames - the model's delay).
        sent_a = await fw.paced(fw.frames_of(pcm, 0, a.frames_a), push)
        await fw.wait_until(lambda: out.frames >= sent_a - a.delay, 30)
        received_a = out.frames
        server_in_a = fw.metric(a.url, "gateway_frames_in_total") - frames_in_before
        # Phase B: interrupt() mid-stream (response.cancel); the session goes on.
        at_interrupt = await fw.interrupt_mid_stream(pcm, a, push, sess.interrupt, lambda: out.frames)
        await fw.wait_until(lambda: out.frames >= received_a + a.frames_b - a.delay - 2, 20)
        await asyncio.sleep(0.3)
        opened = fw.metric(a.url, "gateway_sessions_opened_total") - opened_before
        await sess.aclose()
    fw.report(sent_a=sent_a, received_a=received_a, server_frames_in_a=server_in_a,
              received_after_interrupt=out.frames - at_interrupt, generations=len(out.generations),
              texts=len(out.texts), errors=out.errors, reconnects=out.reconnects, sessions_opened=opened, events=events,
              at=time.time())


asyncio.run(main())
