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
    events, errors, generations = [], [], []
    audio_samples = [0]  # all generations
    texts: list[str] = []
    reconnects = [0]
    opened_before = fw.metric(a.url, "gateway_sessions_opened_total")
    frames_in_before = fw.metric(a.url, "gateway_frames_in_total")

    async with aiohttp.ClientSession() as http:
        kw = {"voice": a.voice} if a.voice else {}
        model = RealtimeModel(base_url=a.url + "/v1", api_key="unused", http_session=http, **kw)
        sess = model.session()
        sess.on("openai_server_event_received", lambda ev: events.append(fw.short_event(ev)))
        sess.on("error", lambda e: errors.append(str(getattr(e.error, "body", None) or e.error)))
        sess.on("session_reconnected", lambda e: reconnects.__setitem__(0, reconnects[0] + 1))

        async def read_message(msg) -> None:
            async def audio():
                async for frame in msg.audio_stream:
                    audio_samples[0] += frame.samples_per_channel

            async def text():
                async for piece in msg.text_stream:
                    texts.append(str(piece))

            await asyncio.gather(audio(), text())

        async def read_generation(gen) -> None:
            generations.append(gen.response_id)
            async for msg in gen.message_stream:
                asyncio.ensure_future(read_message(msg))

        sess.on("generation_created", lambda gen: asyncio.ensure_future(read_generation(gen)))
        await sess.update_instructions(PERSONA)  # as AgentSession does with Agent(instructions=...) at start

        def push(frame) -> None:
            sess.push_audio(rtc.AudioFrame(frame.tobytes(), fw.SAMPLE_RATE, 1, len(frame)))

        # Phase A: speech in, and the output it is owed (input frames - the model's delay).
        sent_a = await fw.paced(fw.frames_of(pcm, 0, a.frames_a), push)
        frames = lambda: audio_samples[0] // fw.FRAME  # noqa: E731
        await fw.wait_until(lambda: frames() >= sent_a - a.delay, 30)
        received_a = frames()
        server_in_a = fw.metric(a.url, "gateway_frames_in_total") - frames_in_before
        # Phase B: interrupt() mid-stream (response.cancel); the session goes on.
        interrupt_at = a.frames_b // 4
        before_interrupt = [0]

        def push_b(frame) -> None:
            push(frame)
            push_b.n += 1
            if push_b.n == interrupt_at:
                before_interrupt[0] = frames()
                sess.interrupt()
        push_b.n = 0
        await fw.paced(fw.frames_of(pcm, a.frames_a, a.frames_b), push_b)
        await fw.wait_until(lambda: frames() >= received_a + a.frames_b - a.delay - 2, 20)
        await asyncio.sleep(0.3)
        received_b = frames() - before_interrupt[0]
        opened = fw.metric(a.url, "gateway_sessions_opened_total") - opened_before
        await sess.aclose()
    fw.report(sent_a=sent_a, received_a=received_a, server_frames_in_a=server_in_a, received_after_interrupt=received_b,
              generations=len(generations), texts=len([t for t in texts if t]), errors=errors, reconnects=reconnects[0],
              sessions_opened=opened, events=events, at=time.time())


asyncio.run(main())
