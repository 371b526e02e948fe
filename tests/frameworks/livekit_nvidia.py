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
    refused_before = fw.metric(a.url, "gateway_sessions_refused_total")
    opened_before = fw.metric(a.url, "gateway_sessions_opened_total")
    frames_in_before = fw.metric(a.url, "gateway_frames_in_total")
    report = {}

    async with aiohttp.ClientSession() as http:
        model = RealtimeModel(base_url=a.url.replace("http://", "ws://"), voice=a.voice or "NATF2",
                              text_prompt="You enjoy a good conversation.", http_session=http)
        sess = model.session()
        out = fw.LiveKitOutput(sess)

        def push(frame) -> None:
            sess.push_audio(rtc.AudioFrame(frame.tobytes(), fw.SAMPLE_RATE, 1, len(frame)))

        if a.scenario in ("refused", "full"):
            # The plugin's own retry loop runs (1 s, doubling) if it judges the fault recoverable.
            await fw.paced(fw.frames_of(pcm, 0, 50), push)
        elif a.scenario == "reconnect":
            sent = await fw.paced(fw.frames_of(pcm, 0, 10), push)
            await fw.wait_until(lambda: out.frames >= sent - a.delay - 2, 30)
            before = out.frames
            await sess.update_instructions("You are a patient teacher.")  # the plugin reconnects with it
            await fw.paced(fw.frames_of(pcm, 10, 25), push)
            await fw.wait_until(lambda: out.frames >= before + 10, 20)
            report["received_after_reconnect"] = out.frames - before
        else:
            sent_a = await fw.paced(fw.frames_of(pcm, 0, a.frames_a), push)
            await fw.wait_until(lambda: out.frames >= sent_a - a.delay - 2, 30)
            await asyncio.sleep(0.5)  # what the codecs still hold comes out
            report.update(sent_a=sent_a, received_a=out.frames,
                          server_frames_in_a=fw.metric(a.url, "gateway_frames_in_total") - frames_in_before)
            at_interrupt = await fw.interrupt_mid_stream(pcm, a, push, sess.interrupt, lambda: out.frames)
            await asyncio.sleep(0.5)
            report["received_after_interrupt"] = out.frames - at_interrupt
        report.update(sessions_opened=fw.metric(a.url, "gateway_sessions_opened_total") - opened_before,
                      refusals=fw.metric(a.url, "gateway_sessions_refused_total") - refused_before)
        await sess.aclose()
    fw.report(**report, generations=len(out.generations), texts=len(out.texts), errors=out.errors,
              reconnects=out.reconnects, at=time.time())


asyncio.run(main())
