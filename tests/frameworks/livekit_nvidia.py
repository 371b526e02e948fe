"""livekit-plugins-nvidia's PersonaPlex RealtimeModel, unmodified, against the gateway's /api/chat.

Driven directly from asyncio (no LiveKit server): push_audio() with paced 80 ms frames, generations
read from its streams, interrupt() mid-stream (the plugin ends its generation; the next audio opens
another on the same socket). Scenarios:
  stream          speech in, output counted, interrupt, output continues
  refused         a voice the server does not have: how many upgrades does the plugin try?
  full            every slot taken: same question (the test holds the slots)
  reconnect       update_instructions() reconnects at once while the cell is full (the test holds
                  the other slot): the plugin's own slot must be admitted again
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import fw_common as fw
from livekit import rtc
from livekit.plugins.nvidia.experimental.realtime import RealtimeModel


async def main() -> None:
    a = fw.args()
    pcm = fw.read_speech(a.speech)
    errors, generations = [], []
    audio_samples = [0]
    texts: list[str] = []
    reconnects = [0]
    refused_before = fw.metric(a.url, "gateway_sessions_refused_total")
    opened_before = fw.metric(a.url, "gateway_sessions_opened_total")
    frames_in_before = fw.metric(a.url, "gateway_frames_in_total")
    out = {}

    async with aiohttp.ClientSession() as http:
        model = RealtimeModel(base_url=a.url.replace("http://", "ws://"), voice=a.voice or "NATF2",
                              text_prompt="You enjoy a good conversation.", http_session=http)
        sess = model.session()
        sess.on("error", lambda e: errors.append({"error": str(e.error)[:300], "recoverable": e.recoverable}))
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
        frames = lambda: audio_samples[0] // fw.FRAME  # noqa: E731

        def push(frame) -> None:
            sess.push_audio(rtc.AudioFrame(frame.tobytes(), fw.SAMPLE_RATE, 1, len(frame)))

        if a.scenario in ("refused", "full"):
            # The plugin's own retry loop runs (1 s, doubling) if it judges the fault recoverable.
            await fw.paced(fw.frames_of(pcm, 0, 50), push)
        elif a.scenario == "reconnect":
            sent = await fw.paced(fw.frames_of(pcm, 0, 10), push)
            await fw.wait_until(lambda: frames() >= sent - a.delay - 2, 30)
            before = frames()
            await sess.update_instructions("You are a patient teacher.")  # the plugin reconnects with it
            await fw.paced(fw.frames_of(pcm, 10, 25), push)
            await fw.wait_until(lambda: frames() >= before + 10, 20)
            out["received_after_reconnect"] = frames() - before
        else:
            sent_a = await fw.paced(fw.frames_of(pcm, 0, a.frames_a), push)
            await fw.wait_until(lambda: frames() >= sent_a - a.delay - 2, 30)
            await asyncio.sleep(0.5)  # what the codecs still hold comes out
            out.update(sent_a=sent_a, received_a=frames(),
                       server_frames_in_a=fw.metric(a.url, "gateway_frames_in_total") - frames_in_before)
            before = [0]

            def push_b(frame) -> None:
                push(frame)
                push_b.n += 1
                if push_b.n == a.frames_b // 4:
                    before[0] = frames()
                    sess.interrupt()
            push_b.n = 0
            await fw.paced(fw.frames_of(pcm, a.frames_a, a.frames_b), push_b)
            await asyncio.sleep(0.5)
            out["received_after_interrupt"] = frames() - before[0]
        out.update(sessions_opened=fw.metric(a.url, "gateway_sessions_opened_total") - opened_before,
                   refusals=fw.metric(a.url, "gateway_sessions_refused_total") - refused_before)
        await sess.aclose()
    fw.report(**out, generations=len(generations), texts=len([t for t in texts if t]), errors=errors,
              reconnects=reconnects[0], at=time.time())


asyncio.run(main())
