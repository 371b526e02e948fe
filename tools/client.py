"""Command-line client for the Realtime duplex wire.

    python -m tools.client --url ws://127.0.0.1:8000/v1/realtime?duplex=1 \
        --input in.wav --output out.wav [--voice NATF2.pt --persona "You are ..."]

Reads a WAV (any rate and channel count: mixed down to mono and resampled to 24 kHz, and
it says so), sends it as pcm16 in 80 ms packets paced in real time, writes the model's
audio to a 24 kHz mono WAV and prints the transcript. A live microphone (--mic) is not
offered: no sound library is part of this project's dependencies.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import sys
import time
import wave
from dataclasses import dataclass, field

import numpy as np
from websockets.asyncio.client import connect
from services.common.frame import FRAME_SAMPLES as FRAME, SAMPLE_RATE



def read_wav(path: str, say=print) -> np.ndarray:
    """A WAV file as float32 mono 24 kHz samples."""
    with wave.open(path, "rb") as w:
        channels, width, rate, n = w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()
        raw = w.readframes(n)
    if width == 2:
        x = np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0
    elif width == 4:
        x = np.frombuffer(raw, "<i4").astype(np.float32) / 2147483648.0
    elif width == 1:
        x = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    else:
        raise SystemExit(f"{path}: {8 * width}-bit WAV is not supported (use 8, 16 or 32-bit PCM)")
    x = x.reshape(-1, channels)
    if channels != 1:
        say(f"{path}: {channels} channels mixed down to mono")
        x = x.mean(axis=1, keepdims=True)
    x = x[:, 0]
    if rate != SAMPLE_RATE:
        import sphn

        say(f"{path}: resampled from {rate} Hz to {SAMPLE_RATE} Hz")
        x = sphn.resample(x, src_sample_rate=rate, dst_sample_rate=SAMPLE_RATE).astype(np.float32)
    return x


def write_wav(path: str, samples: np.ndarray) -> None:
    pcm = (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2")
    with wave.open(path, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes(pcm.tobytes())


@dataclass
class Result:
    audio: list[np.ndarray] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    session: dict | None = None
    closed: dict | None = None

    @property
    def samples(self) -> np.ndarray:
        return np.concatenate(self.audio) if self.audio else np.zeros(0, np.float32)


async def converse(url: str, samples: np.ndarray, *, voice: str = "", persona: str | None = None,
                   api_key: str | None = None,
                   pace_s: float = FRAME / SAMPLE_RATE, close_timeout_s: float = 30.0, on_text=None) -> Result:
    """One session: send `samples` paced, collect the output until session.closed."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    result = Result()
    async with connect(url, additional_headers=headers, max_size=None) as ws:
        session = {"type": "realtime",
                   "audio": {"input": {"format": {"type": "audio/pcm", "rate": SAMPLE_RATE}, "turn_detection": None}}}
        if voice:
            session["voice"] = voice
        if persona is not None:
            session["instructions"] = persona
        await ws.send(json.dumps({"type": "session.update", "session": session}))
        closed = asyncio.Event()

        async def receive():
            async for message in ws:
                ev = json.loads(message)
                t = ev["type"]
                result.events.append(t)
                if t in ("response.output_audio.delta", "response.audio.delta"):
                    result.audio.append(np.frombuffer(base64.b64decode(ev["delta"]), "<i2").astype(np.float32)
                                        / 32768.0)
                elif t in ("response.output_audio_transcript.delta", "response.audio_transcript.delta"):
                    result.text.append(ev["delta"])
                    if on_text and ev["delta"]:
                        on_text(ev["delta"])
                elif t in ("session.created", "session.updated"):
                    result.session = ev["session"]
                elif t == "error":
                    result.errors.append(ev["error"])
                    if result.session is None:  # refused at open
                        break
                elif t == "session.closed":
                    result.closed = ev
                    break
            closed.set()

        receiver = asyncio.create_task(receive())
        # Wait for the session before sending audio.
        while result.session is None and not closed.is_set():
            await asyncio.sleep(0.01)
        if result.session is not None:
            start = time.monotonic()
            for i, off in enumerate(range(0, samples.size, FRAME)):
                if closed.is_set():
                    break
                chunk = (np.clip(samples[off : off + FRAME], -1, 1) * 32767).round().astype("<i2").tobytes()
                await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                          "audio": base64.b64encode(chunk).decode()}))
                # Paced against the start time: a late send never causes a catch-up burst of more than one packet.
                await asyncio.sleep(max(0.0, start + (i + 1) * pace_s - time.monotonic()))
            if not closed.is_set():
                await ws.send(json.dumps({"type": "session.close"}))
        try:
            await asyncio.wait_for(receiver, close_timeout_s)
        except asyncio.TimeoutError:
            receiver.cancel()
            result.errors.append({"type": "client_error", "code": "close_timeout",
                                  "message": "no session.closed in time"})
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.client", description=__doc__.split("\n")[0])
    p.add_argument("--url", default="ws://127.0.0.1:8000/v1/realtime?duplex=1")
    p.add_argument("--input", required=False, help="WAV file to say to the model")
    p.add_argument("--output", default="out.wav", help="WAV file for the model's audio")
    p.add_argument("--voice", default="", help="bundled voice prompt, e.g. NATF2.pt")
    p.add_argument("--persona", default=None, help="the persona text (instructions)")
    p.add_argument("--api-key-env", default="PERSONAPLEX_GATEWAY_API_KEY",
                   help="environment variable with the bearer key")
    p.add_argument("--mic", action="store_true", help="live microphone (not available: no sound library)")
    a = p.parse_args(argv)
    if a.mic:
        print("--mic is not available: this project ships no sound-device library; use --input FILE.wav",
              file=sys.stderr)
        return 2
    if not a.input:
        p.error("--input is required")
    samples = read_wav(a.input, say=lambda m: print(m, file=sys.stderr))
    print(f"sending {samples.size / SAMPLE_RATE:.1f}s of audio to {a.url} ...", file=sys.stderr)
    t0 = time.monotonic()
    result = asyncio.run(converse(a.url, samples, voice=a.voice, persona=a.persona,
                                  api_key=os.environ.get(a.api_key_env),
                                  on_text=lambda t: print(t, end="", flush=True)))
    print()
    for e in result.errors:
        print(f"error: {e.get('type')}/{e.get('code')}: {e.get('message')}", file=sys.stderr)
    out = result.samples
    write_wav(a.output, out)
    print(f"wrote {out.size / SAMPLE_RATE:.1f}s of audio ({len(result.audio)} frames) to {a.output} in "
          f"{time.monotonic() - t0:.1f}s; "
          f"transcript: {''.join(result.text)!r}", file=sys.stderr)
    if result.closed:
        print(f"server-side frame latency (input frame in -> its output out): {result.closed.get('frame_latency')}",
              file=sys.stderr)
    return 1 if result.errors else 0


if __name__ == "__main__":
    sys.exit(main())
