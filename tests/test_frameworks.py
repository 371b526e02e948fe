"""The voice-agent frameworks people build on, unmodified, against the real stack (stage processes on
the tiny checkpoint, the real gateway): LiveKit Agents' openai and nvidia (PersonaPlex) plugins, a
pipecat pipeline with a context aggregator, the OpenAI Agents SDK's RealtimeAgent, and the Node.js
`openai` SDK over wss (it cannot speak anything else).

The Python clients live in their own virtual environment (`make test` builds `.venv-frameworks`):
pipecat pins protobuf<7 while the runtime's grpcio-tools needs protobuf>=7.35, so they cannot share
one. The Node client is installed from tests/frameworks/node/package-lock.json into its git-ignored
node_modules (`make setup-node-clients`, part of `make test`). Each client script (tests/frameworks/)
drives its framework and prints one JSON report; the checks are here. Every server event a client
received is checked against the `openai` package's typed models, strictly.
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
from tools.run_stack import GatewayProcess
from tools.tls_cert import make_local_tls

FW_PYTHON = Path(os.environ.get("FRAMEWORKS_PYTHON", REPO_ROOT / ".venv-frameworks" / "bin" / "python"))
SCRIPTS = REPO_ROOT / "tests" / "frameworks"
NODE_CLIENTS = SCRIPTS / "node"
NODE_KEY = "node-sdk-key"
GATEWAY_ARGS = ["--stall-timeout", "30", "--open-timeout", "120", "--cleanup-timeout", "20"]
# Opus on /api/chat: the client's encoder and the server's decoder each may hold back part of a frame.
OPUS_FRAMES_HELD = 2


@pytest.fixture(scope="module")
def stack(shared_stack):
    """conftest's shared stack (2 sessions, codec stages with a spare slot, these gateway flags)."""
    if not FW_PYTHON.exists():
        pytest.fail(f"{FW_PYTHON} is missing: `make setup-frameworks` (part of `make test`) builds it")
    assert shared_stack.gateway_args == GATEWAY_ARGS
    return shared_stack


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
    return report_of(client_process([str(FW_PYTHON), str(SCRIPTS / script)], stack.gateway.http_url, speech, delay,
                                    *args))


def client_process(cmd: list[str], url: str, speech: Path, delay: int, *args: str,
                   env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*cmd, "--url", url, "--speech", str(speech), "--delay", str(delay), *args],
                          capture_output=True, text=True, timeout=180, cwd=REPO_ROOT, env=env)


def report_of(proc: subprocess.CompletedProcess) -> dict:
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


# ---- the Node.js openai SDK, over wss ----------------------------------------------------------------

@pytest.fixture(scope="module")
def tls_gateway(stack, tmp_path_factory):
    """A second gateway on the stack's cell: https and wss with a certificate made now (a local CA's, never
    committed) and an API key."""
    if not (NODE_CLIENTS / "node_modules" / "openai").is_dir():
        pytest.fail(f"{NODE_CLIENTS}/node_modules is missing: `make setup-node-clients` (part of `make test`)")
    tls = make_local_tls(tmp_path_factory.mktemp("tls"), ("127.0.0.1", "localhost"))
    gw = GatewayProcess(stack.cell_procs[0].spec, args=GATEWAY_ARGS, tls=tls,
                        env={"PERSONAPLEX_GATEWAY_API_KEY": NODE_KEY}).start()
    yield gw
    gw.stop()


def run_node(gw: GatewayProcess, speech: Path, delay: int, *args: str, trust: bool = True,
             key: str = NODE_KEY) -> subprocess.CompletedProcess:
    env = {**os.environ, "OPENAI_API_KEY": key}
    env.pop("NODE_EXTRA_CA_CERTS", None)
    if trust:
        env["NODE_EXTRA_CA_CERTS"] = str(gw.tls.ca)  # how a user trusts the local CA
    return client_process(["node", str(NODE_CLIENTS / "realtime_wss.mjs")], gw.http_url, speech, delay, *args,
                          env=env)


@pytest.mark.parametrize("transport", ["ws", "websocket"])  # the key as a bearer header / as a subprotocol
def test_node_openai_sdk_streams_over_wss_and_cancels_once(tls_gateway, speech, delay, transport):
    r = report_of(run_node(tls_gateway, speech, delay, "--transport", transport))
    assert r["url"].startswith("wss://127.0.0.1:"), r["url"]
    check_counts(r, delay)
    counts = check_events(r["events"])
    errors = [e for e in r["events"] if e["type"] == "error"]
    assert not errors and r["errors"] == [] and r["sessions_opened"] == 1, (errors, r["errors"], r["sessions_opened"])
    assert [e["response"]["status"] for e in r["events"] if e["type"] == "response.done"] == ["cancelled",
                                                                                              "completed"]
    assert cancelled_then_continued(r["events"]) and r["received_after_interrupt"] >= 8, r
    assert counts["session.closed"] == 1


def test_node_openai_sdk_refuses_an_untrusted_certificate_and_the_gateway_a_wrong_key(tls_gateway, speech, delay):
    untrusted = run_node(tls_gateway, speech, delay, trust=False)
    assert untrusted.returncode != 0 and "certificate" in untrusted.stderr, untrusted.stderr[-2000:]
    wrong = run_node(tls_gateway, speech, delay, key="wrong")
    assert wrong.returncode != 0 and "401" in wrong.stderr, wrong.stderr[-2000:]
