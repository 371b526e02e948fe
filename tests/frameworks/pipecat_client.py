"""pipecat-ai's OpenAIRealtimeLLMService, unmodified, in a standard pipeline with a context aggregator:

    speech source -> user context aggregator -> OpenAIRealtimeLLMService -> sink -> assistant aggregator

The source pushes paced 80 ms InputAudioRawFrames (a transport would); mid-stream it interrupts the
pipeline the standard way (broadcast_interruption(), as a turn analyzer does), which with local turn
handling makes the service send input_audio_buffer.clear, response.cancel and
conversation.item.truncate; a UserStoppedSpeakingFrame then makes it send commit + response.create.
pipecat treats any server `error` event as fatal, so every one of these must be accepted.

`--scenario persona`: the context carries a system message other than the service's instructions and
the microphone streams from the start, so pipecat's session.update (its persona) comes after audio.
"""

from __future__ import annotations

import asyncio
import time

import fw_common as fw
from pipecat.frames.frames import (EndFrame, ErrorFrame, InputAudioRawFrame, LLMRunFrame, StartFrame, TTSAudioRawFrame,
                                   TTSTextFrame, UserStoppedSpeakingFrame)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
from pipecat.processors.frame_processor import FrameProcessor
from pipecat.services.openai.realtime import events as rt_events
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService
from pipecat.workers.runner import WorkerRunner

SERVICE_PERSONA = "You enjoy a good conversation."
CONTEXT_PERSONA = "You are a ship's cook who loves soup."
RAW_EVENTS: list[dict] = []
REFUSED_QUIET_S = 2.0  # after the refusal: pipecat would reconnect at once if it did
_parse = rt_events.parse_server_event


def _recording_parse(message):  # observes what pipecat receives; pipecat's own parser still decides
    import json
    RAW_EVENTS.append(fw.short_event(json.loads(message)))
    return _parse(message)


rt_events.parse_server_event = _recording_parse


class Sink(FrameProcessor):
    def __init__(self):
        super().__init__()
        self.samples, self.texts, self.errors = 0, [], []

    async def process_frame(self, frame, direction):
        await super().process_frame(frame, direction)
        if isinstance(frame, TTSAudioRawFrame):
            self.samples += len(frame.audio) // 2
        elif isinstance(frame, TTSTextFrame) and frame.text:
            self.texts.append(frame.text)
        elif isinstance(frame, ErrorFrame):
            self.errors.append(frame.error[:300])
        await self.push_frame(frame, direction)


class SpeechSource(FrameProcessor):
    """What a transport does with a microphone: paced InputAudioRawFrames."""

    def __init__(self, pcm, a, sink: Sink):
        super().__init__()
        self.pcm, self.a, self.sink = pcm, a, sink
        self.out: dict = {}
        self.done = asyncio.Event()

    async def process_frame(self, frame, direction):
        await super().process_frame(frame, direction)
        await self.push_frame(frame, direction)
        if isinstance(frame, StartFrame):
            self.create_task(self._speak())

    async def _push_audio(self, chunk):
        await self.push_frame(InputAudioRawFrame(audio=chunk.tobytes(), sample_rate=fw.SAMPLE_RATE, num_channels=1))

    async def _speak(self):
        a, sink = self.a, self.sink
        frames = lambda: sink.samples // fw.FRAME  # noqa: E731
        frames_in_before = fw.metric(a.url, "gateway_frames_in_total")
        if a.scenario != "persona":  # the session opens first (session.update, context items, response.create)
            await asyncio.sleep(1.0)
        # else: as a transport does, the microphone streams from the start, and the service's
        # session.update (its persona) reaches a session that is already hearing audio.
        sent = await fw.paced(fw.frames_of(self.pcm, 0, a.frames_a), self._push_audio)
        await fw.wait_until(lambda: frames() >= sent - a.delay, 30)
        self.out.update(sent_a=sent, received_a=frames(),
                        server_frames_in_a=fw.metric(a.url, "gateway_frames_in_total") - frames_in_before)

        async def interrupt():  # what a turn analyzer does when the user barges in
            await self.broadcast_interruption()
            await self.broadcast_frame(UserStoppedSpeakingFrame)

        at_interrupt = await fw.interrupt_mid_stream(self.pcm, a, self._push_audio, interrupt, frames)
        await asyncio.sleep(0.8)
        self.out["received_after_interrupt"] = frames() - at_interrupt
        self.done.set()


async def main() -> None:
    a = fw.args()
    pcm = fw.read_speech(a.speech)
    opened_before = fw.metric(a.url, "gateway_sessions_opened_total")
    audio = rt_events.AudioConfiguration(input=rt_events.AudioInput(turn_detection=False),
                                         output=rt_events.AudioOutput(voice=a.voice) if a.voice else None)
    llm = OpenAIRealtimeLLMService(
        api_key="unused",
        base_url=a.url.replace("http://", "ws://") + "/v1/realtime",
        settings=OpenAIRealtimeLLMService.Settings(
            model="personaplex", system_instruction=SERVICE_PERSONA,
            session_properties=rt_events.SessionProperties(audio=audio)),
    )
    system = [{"role": "system", "content": CONTEXT_PERSONA}] if a.scenario == "persona" else []
    context = LLMContext([*system, {"role": "user", "content": "Hello there!"}])
    aggregators = LLMContextAggregatorPair(context)
    sink = Sink()
    source = SpeechSource(pcm, a, sink)
    pipeline = Pipeline([source, aggregators.user(), llm, sink, aggregators.assistant()])
    worker = PipelineWorker(pipeline, params=PipelineParams(audio_in_sample_rate=fw.SAMPLE_RATE,
                                                            audio_out_sample_rate=fw.SAMPLE_RATE))
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    await worker.queue_frames([LLMRunFrame()])
    run = asyncio.create_task(runner.run())
    if a.scenario == "refused":
        # pipecat stops on the error event; it does not reconnect by itself: the error, then a
        # quiet while in which a reconnect (a second open, a second error) would show.
        await fw.wait_until(lambda: any(e["type"] == "error" for e in RAW_EVENTS), 60)
        await asyncio.sleep(REFUSED_QUIET_S)
    else:
        await asyncio.wait_for(source.done.wait(), 90)
    opened = fw.metric(a.url, "gateway_sessions_opened_total") - opened_before
    await worker.queue_frame(EndFrame())
    try:
        await asyncio.wait_for(run, 20)
    except asyncio.TimeoutError:
        await runner.cancel()
    fw.report(**source.out, texts=len(sink.texts), errors=sink.errors, sessions_opened=opened, events=RAW_EVENTS,
              at=time.time())


asyncio.run(main())
