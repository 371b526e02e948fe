"""The voice-agent frameworks people build on, unmodified, against the real stack (stage processes on
the tiny checkpoint, the real gateway): LiveKit Agents' openai and nvidia (PersonaPlex) plugins, a
pipecat pipeline with a context aggregator, and the OpenAI Agents SDK's RealtimeAgent.

The clients live in their own virtual environment (`make test` builds `.venv-frameworks`): pipecat
pins protobuf<7 while the runtime's grpcio-tools needs protobuf>=7.35, so they cannot share one.
Each client script (tests/frameworks/) runs there, drives its framework and prints one JSON report;
the checks are here. Every server event a client received is checked against the `openai` package's
typed models, strictly.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import wave
from pathlib import Path

import numpy as np
import pytest

from tests.openai_events import validate_server_event
from tests.realtime_client import RT
from tools.load_driver.input_audio import synth_speech
from tools.procs import REPO_ROOT
from tools.run_stack import Stack

FW_PYTHON = Path(os.environ.get("FRAMEWORKS_PYTHON", REPO_ROOT / ".venv-frameworks" / "bin" / "python"))
SCRIPTS = REPO_ROOT / "tests" / "frameworks"
GATEWAY_ARGS = ["--stall-timeout", "30", "--open-timeout", "120", "--cleanup-timeout", "20"]
# Opus on /api/chat: the client's encoder and the server's decoder each may hold back part of a frame.
OPUS_FRAMES_HELD = 2


@pytest.fixture(scope="module")
def stack(tiny_checkpoint):
    if not FW_PYTHON.exists():
        pytest.fail(f"{FW_PYTHON} is missing: `make setup-frameworks` (part of `make test`) builds it")
    with Stack(tiny_checkpoint, sessions=2, codec_args=["--slots", "3"], gateway_args=GATEWAY_ARGS) as s:
        yield s


@pytest.fixture(scope="module")
def speech(tmp_path_factory) -> Path:
    """Speech-like input (voiced syllables and pauses), 6 s, as a 24 kHz int16 WAV."""
    x = synth_speech(75, seed=3)
    path = tmp_path_factory.mktemp("speech") / "speech.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(24_000)
        w.writeframes((np.clip(x, -1, 1) * 32767).round().astype("<i2").tobytes())
    return path


@pytest.fixture(scope="module")
def delay(stack) -> int:
    """The model's output delay in frames, as the server reports it."""
    async def probe():
        rt = await RT.connect(stack.gateway.ws_url)
        created = await rt.open()
        await rt.close()
        return created["session"]["capabilities"]["output_delay_frames"]
    return asyncio.run(probe())


def run_client(script: str, stack, speech: Path, delay: int, *args: str) -> dict:
    proc = subprocess.run([str(FW_PYTHON), str(SCRIPTS / script), "--url", stack.gateway.http_url, "--speech",
                           str(speech),
                           "--delay", str(delay), *args], capture_output=True, text=True, timeout=180, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_events(events: list[dict]) -> dict[str, int]:
    """Every event validates; deltas only inside their response; returns counts by type."""
    counts: dict[str, int] = {}
    open_responses: set[str] = set()
    for ev in events:
        validate_server_event(ev)
        counts[ev["type"]] = counts.get(ev["type"], 0) + 1
        if ev["type"] == "response.created":
            open_responses.add(ev["response"]["id"])
        elif ev["type"] == "response.done":
            open_responses.discard(ev["response"]["id"])
        elif ev["type"].endswith(".delta"):
            assert open_responses == {ev["response_id"]}, ev["type"]
    return counts


def cancelled_then_continued(events: list[dict]) -> bool:
    types = [(e["type"], e.get("response", {}).get("status")) for e in events]
    i = types.index(("response.done", "cancelled"))
    rest = types[i:]
    return ("response.created", "in_progress") in rest and any(t == "response.output_audio.delta" for t, _ in rest)



def check_counts(r: dict, delay: int, codec_held: int = 0) -> None:
    """Speech in; at least (input frames - the model's delay) audio frames out, and text."""
    assert r["server_frames_in_a"] >= r["sent_a"] - codec_held, r
    assert r["received_a"] >= r["server_frames_in_a"] - delay, r
    assert r["texts"] > 0, r


async def hold_sessions(stack, n: int) -> list[RT]:
    held = []
    for _ in range(n):
        rt = await RT.connect(stack.gateway.ws_url)
        assert (await rt.open())["type"] == "session.created"
        held.append(rt)
    return held


# ---- LiveKit Agents: livekit-plugins-openai (the Realtime wire) ------------------------------------

def test_livekit_openai_plugin_streams_interrupts_and_goes_on(stack, speech, delay):
    r = run_client("livekit_openai.py", stack, speech, delay)
    check_counts(r, delay)
    counts = check_events(r["events"])
    assert counts["response.output_audio_transcript.delta"] >= r["sent_a"] - delay
    assert r["errors"] == [] and r["reconnects"] == 0 and r["sessions_opened"] == 1, r
    # interrupt() sent response.cancel: the response ended cancelled, the next one started, audio went on.
    assert cancelled_then_continued(r["events"]) and r["generations"] >= 2
    assert r["received_after_interrupt"] >= 8, r
    updated = [e for e in r["events"] if e["type"] == "session.updated"][-1]["session"]
    assert updated["voice"] == "NATF2.pt"  # the plugin's default 'marin', through the alias table
    assert updated["instructions"] == "You are a friendly pirate."  # update_instructions(), before any audio
    assert "audio.input.transcription" in updated["not_in_effect"]


def test_livekit_openai_plugin_refused_voice_keeps_the_session(stack, speech, delay):
    r = run_client("livekit_openai.py", stack, speech, delay, "--voice", "no-such-voice")
    errors = [e for e in r["events"] if e["type"] == "error"]
    assert [e["error"]["code"] for e in errors] == ["invalid_voice"], errors
    assert r["reconnects"] == 0 and r["sessions_opened"] == 1, r  # no retry: one connection, still serving
    check_counts(r, delay)
    check_events(r["events"])


# ---- LiveKit Agents: livekit-plugins-nvidia[personaplex] (/api/chat) -----------------------------

def test_livekit_nvidia_plugin_streams_interrupts_and_goes_on(stack, speech, delay):
    r = run_client("livekit_nvidia.py", stack, speech, delay)
    check_counts(r, delay, OPUS_FRAMES_HELD)
    assert r["errors"] == [] and r["reconnects"] == 0 and r["sessions_opened"] == 1, r
    # interrupt() ends the plugin's generation; the next audio on the same socket opens another.
    assert r["generations"] >= 2 and r["received_after_interrupt"] >= 8, r


def test_livekit_nvidia_plugin_stops_on_a_refused_upgrade(stack, speech, delay):
    """A close after the upgrade made the plugin retry every second, forever; an HTTP refusal of the
    upgrade is an error it does not retry: one attempt, for a bad voice (400) and for a full cell (503)."""
    r = run_client("livekit_nvidia.py", stack, speech, delay, "--scenario", "refused", "--voice", "NOPE")
    assert r["refusals"] == 1 and r["sessions_opened"] == 0, r
    assert len(r["errors"]) == 1 and not r["errors"][0]["recoverable"] and "400" in r["errors"][0]["error"], r

    async def full():
        held = await hold_sessions(stack, 2)
        try:
            return await asyncio.to_thread(run_client, "livekit_nvidia.py", stack, speech, delay, "--scenario", "full")
        finally:
            for rt in held:
                await rt.close()
    r = asyncio.run(full())
    assert r["refusals"] == 1 and r["sessions_opened"] == 0, r
    assert len(r["errors"]) == 1 and "503" in r["errors"][0]["error"], r


def test_livekit_nvidia_update_instructions_reconnects_into_a_full_cell(stack, speech, delay):
    """update_instructions() closes and at once reconnects: with the other slot taken, the plugin's
    own slot must be admitted again (admission waits for the slot being released)."""
    async def run():
        held = await hold_sessions(stack, 1)
        try:
            return await asyncio.to_thread(run_client, "livekit_nvidia.py", stack, speech, delay, "--scenario",
                                           "reconnect")
        finally:
            await held[0].close()
    r = asyncio.run(run())
    assert r["reconnects"] == 1 and r["refusals"] == 0 and r["sessions_opened"] == 2 and r["errors"] == [], r
    assert r["received_after_reconnect"] >= 10, r


# ---- pipecat: a standard pipeline with a context aggregator --------------------------------------

def test_pipecat_pipeline_with_context_aggregator(stack, speech, delay):
    r = run_client("pipecat_client.py", stack, speech, delay)
    check_counts(r, delay)
    counts = check_events(r["events"])
    assert counts["response.output_audio_transcript.delta"] >= r["sent_a"] - delay
    assert "error" not in counts and r["errors"] == [] and r["sessions_opened"] == 1, r
    # the context's message item was acknowledged; the interruption's clear, cancel and truncate were served
    assert any(e["type"] == "conversation.item.added" and e["item"]["role"] == "user" for e in r["events"])
    assert counts["input_audio_buffer.cleared"] == 1 and counts["conversation.item.truncated"] == 1
    assert cancelled_then_continued(r["events"]) and r["received_after_interrupt"] >= 8, r


def test_pipecat_refused_voice_is_one_error_on_one_connection(stack, speech, delay):
    r = run_client("pipecat_client.py", stack, speech, delay, "--scenario", "refused", "--voice", "nope")
    errors = [e for e in r["events"] if e["type"] == "error"]
    assert [e["error"]["code"] for e in errors] == ["invalid_voice"] and r["sessions_opened"] == 1, r
    check_events(r["events"])


def test_pipecat_persona_update_after_audio_is_answered_and_the_audio_goes_on(stack, speech, delay):
    """The context's system message differs from the service's instructions, and the microphone streams
    from the start: pipecat's session.update (its persona) reaches a session already hearing audio. It is
    answered session.updated with the change under not_in_effect (the primed persona stays), never an
    error (pipecat stops at any), and the audio goes on."""
    r = run_client("pipecat_client.py", stack, speech, delay, "--scenario", "persona")
    counts = check_events(r["events"])
    assert "error" not in counts and r["errors"] == [] and r["sessions_opened"] == 1, r
    check_counts(r, delay)
    # The first response starts with the first accepted audio: what comes after it, came after audio.
    started = next(i for i, e in enumerate(r["events"]) if e["type"] == "response.created")
    late = [e["session"] for e in r["events"][started:] if e["type"] == "session.updated"]
    assert late, "pipecat sent no session.update after the audio started"
    primed = next(e for e in r["events"] if e["type"] == "session.created")["session"]["instructions"]
    for session in late:
        assert session["instructions"] == primed and "primed" in session["not_in_effect"]["instructions"], session
    assert cancelled_then_continued(r["events"]) and r["received_after_interrupt"] >= 8, r


# ---- the OpenAI Agents SDK: a RealtimeAgent with an interrupt -------------------------------------

def test_openai_agents_sdk_streams_interrupts_once_and_goes_on(stack, speech, delay):
    """session.interrupt() sends conversation.item.truncate and response.cancel (one interruption: one
    cancelled response, not two) and, on conversation.item.truncated, conversation.item.retrieve (answered
    with the item); the audio goes on in the next response. The SDK surfaces every server error: none."""
    r = run_client("openai_agents.py", stack, speech, delay)
    check_counts(r, delay)
    counts = check_events(r["events"])
    assert "error" not in counts and r["errors"] == [] and r["sessions_opened"] == 1, r
    updated = [e for e in r["events"] if e["type"] == "session.updated"][-1]["session"]
    assert (updated["instructions"], updated["voice"]) == ("You are a friendly pirate.", "NATM1.pt")  # 'ash', aliased
    done = [e["response"] for e in r["events"] if e["type"] == "response.done"]
    assert [d["status"] for d in done] == ["cancelled"], done
    truncated = next(e for e in r["events"] if e["type"] == "conversation.item.truncated")
    retrieved = next(e for e in r["events"] if e["type"] == "conversation.item.retrieved")
    assert retrieved["item"]["id"] == truncated["item_id"] == done[0]["output"][0]["id"]
    assert cancelled_then_continued(r["events"]) and r["received_after_interrupt"] >= 8, r
