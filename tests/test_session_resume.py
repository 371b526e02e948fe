"""Session resume on the Realtime wire, end to end: real encoder, talker, decoder and gateway processes and a
raw Realtime client over real sockets (services/gateway/resume.py, session.py).

- A drop mid-call and a resume on the same worker continue the same conversation: with greedy sampling the
  text pieces (and the audio) equal those of one uninterrupted session fed the same frames. Dropped after
  every output came, nothing is lost; dropped while output is on its way, the output after the resume is
  still the uninterrupted session's, frame for frame.
- The grace period's end frees the slot in all three stages and every gauge; the token then answers 410.
- Typed refusals before the 101: a tampered token or another session's id (403), a session still attached
  (409), a token naming a worker the gateway lacks (421), two concurrent resumes (one wins, the other 409).
- With an API key: a resume needs the key as any connection does, and a token minted under another key
  does not verify.
- With `--workers 2`, a resume that lands on the other worker is piped to the session's worker
  (resume_relay.py): the conversation goes on as on the same worker; an ended session's refusal comes
  from its worker; a client that drops the relayed connection leaves no socket open in the relaying worker.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from websockets.exceptions import InvalidStatus

from services.gateway.resume import ResumeRefused, ResumeTokens
from tests.realtime_client import FRAME, RT, eventually, pcm16_b64, tone
from tools.run_stack import GatewayProcess, Stack
from tools.tls_cert import make_local_tls

pytestmark = pytest.mark.timeout(400)

GRACE_S = 6.0
GATEWAY_ARGS = ["--stall-timeout", "30", "--open-timeout", "120", "--cleanup-timeout", "20",
                "--resume-grace", str(GRACE_S)]
FRAMES = 24
INSTRUCTIONS = "You are a patient listener."
TEXT = "response.output_audio_transcript.delta"


@pytest.fixture(scope="module")
def stack(tiny_checkpoint):
    with Stack(tiny_checkpoint, sessions=2, gateway_args=GATEWAY_ARGS) as s:
        yield s


def trust(gw: GatewayProcess) -> dict:
    """The client's TLS settings for a gateway with TLS (its local CA), none for one without."""
    return {"ssl": ssl.create_default_context(cafile=gw.tls.ca)} if gw.tls else {}


def metric(gw: GatewayProcess, name: str) -> float:
    with urllib.request.urlopen(gw.http_url + "/metrics", timeout=5, context=trust(gw).get("ssl")) as r:
        body = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def talker_active(stack) -> int:
    from duplex.v1 import common_pb2, talker_pb2_grpc

    with grpc.insecure_channel(stack.cell_procs[0].talker.address) as ch:
        return talker_pb2_grpc.TalkerStub(ch).GetCapacity(common_pb2.CapacityRequest(), timeout=5).active_streams


def wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.1)
    return predicate()


@pytest.fixture
def idle(stack):
    """No session left anywhere after the test."""
    gw = stack.gateway
    yield
    assert wait_until(lambda: talker_active(stack) == 0, 30), "a talker stream is left open"
    assert metric(gw, "gateway_sessions_active") == 0 and metric(gw, "gateway_sessions_paused") == 0


X = tone(FRAMES, seed=7)


def frame(i: int) -> dict:
    return {"type": "input_audio_buffer.append", "audio": pcm16_b64(X[i * FRAME:(i + 1) * FRAME])}


async def feed(rt: RT, start: int, stop: int) -> None:
    for i in range(start, stop):
        await rt.send(frame(i))
        await asyncio.sleep(0.08)


async def opened(url: str, headers: dict | None = None, **kw) -> tuple[RT, dict]:
    rt = await RT.connect(url, headers, **kw)
    created = await rt.open(instructions=INSTRUCTIONS, extra_body={"greedy": True})
    assert created["type"] == "session.created", created
    await rt.until("session.updated", 120)
    return rt, created


async def resume(gw: GatewayProcess, session_id: str, token: str, headers: dict | None = None) -> RT:
    return await RT.connect(f"{gw.ws_url}&session_id={session_id}", {"X-Resume-Token": token, **(headers or {})},
                            **trust(gw))


async def refused(gw: GatewayProcess, session_id: str, token: str, headers: dict | None = None) -> tuple[int, str]:
    """(HTTP status, error code) of a resume the gateway refuses before the 101."""
    with pytest.raises(InvalidStatus) as e:
        await resume(gw, session_id, token, headers)
    return e.value.response.status_code, json.loads(e.value.response.body)["error"]["code"]


async def paused(gw: GatewayProcess, n: int = 1) -> None:
    assert await eventually(lambda: metric(gw, "gateway_sessions_paused") == n, 20), "the session did not pause"


def texts(rt: RT) -> list[str]:
    return [e["delta"] for e in rt.of(TEXT)]


async def outputs(rt: RT, k: int) -> None:
    """Read until k output frames came whole: k audio deltas and their k transcript deltas."""
    assert await rt.wait_frames(k) == k
    while len(texts(rt)) < k:
        assert (await rt.recv())["type"] != "error"


async def uninterrupted(stack) -> tuple[list[str], np.ndarray]:
    rt, _ = await opened(stack.gateway.ws_url)
    await feed(rt, 0, FRAMES)
    await outputs(rt, FRAMES)
    await rt.close()
    return texts(rt), rt.audio()


@pytest.fixture(scope="module")
def reference(stack):
    return asyncio.run(uninterrupted(stack))


async def second_half_continues_the_reference(rt, rt2, before: list[str], ref_text: list[str], ref_audio) -> None:
    """The resumed connection rt2 streams the second half: N in, N out over both connections, and the
    text and audio of both together equal the uninterrupted session's."""
    await feed(rt2, FRAMES // 2, FRAMES)
    await outputs(rt2, FRAMES // 2)
    _, closed = await rt2.close()
    assert closed["frames_in"] == closed["frames_out"] == FRAMES
    assert before + texts(rt2) == ref_text
    audio = np.concatenate([rt.audio(), rt2.audio()])
    assert audio.shape == ref_audio.shape and np.abs(audio - ref_audio).max() < 1e-3


async def test_a_resume_after_every_output_came_continues_the_same_conversation(stack, reference, idle):
    gw = stack.gateway
    ref_text, ref_audio = reference
    assert any(ref_text), "the reference says nothing: the comparison would be empty"
    rt, created = await opened(gw.ws_url)
    session, token = created["session"], created["resume_token"]
    assert session["capabilities"]["supports_session_resume"] is True
    assert session["capabilities"]["resume_grace_s"] == GRACE_S
    resumed_before = metric(gw, "gateway_resumes_total")
    await feed(rt, 0, FRAMES // 2)
    await outputs(rt, FRAMES // 2)
    before = texts(rt)
    rt.ws.transport.abort()  # no close frame: the connection just goes away
    await paused(gw)
    assert metric(gw, "gateway_sessions_active") == 1 and talker_active(stack) == 1  # the slot is held
    rt2 = await resume(gw, session["id"], token)
    greeting = await rt2.recv()
    assert greeting["type"] == "session.resumed", greeting
    assert greeting["session"]["id"] == session["id"]
    assert (greeting["frames_in"], greeting["frames_out"], greeting["frames_undelivered"]) == (FRAMES // 2,) * 2 + (0,)
    assert metric(gw, "gateway_sessions_paused") == 0
    assert metric(gw, "gateway_resumes_total") - resumed_before == 1
    await second_half_continues_the_reference(rt, rt2, before, ref_text, ref_audio)


async def test_a_drop_while_output_is_on_its_way_resumes_where_the_model_stopped(stack, reference, idle):
    """Output produced while paused is dropped and counted; what follows the resume is the
    uninterrupted session's output for the same frames: the talker did not step while paused."""
    gw = stack.gateway
    ref_text, _ = reference
    k = FRAMES // 2
    rt, created = await opened(gw.ws_url)
    await feed(rt, 0, k)
    dropped_before = metric(gw, "gateway_resume_dropped_frames_total")
    rt.ws.transport.abort()  # right after the last frame: its outputs are still on their way
    await paused(gw)
    await asyncio.sleep(1.0)  # the outputs of the frames sent come out while paused
    rt2 = await resume(gw, created["session"]["id"], created["resume_token"])
    greeting = await rt2.recv()
    assert greeting["type"] == "session.resumed" and greeting["frames_in"] == k, greeting
    assert greeting["frames_undelivered"] == metric(gw, "gateway_resume_dropped_frames_total") - dropped_before
    await feed(rt2, k, FRAMES)
    _, closed = await rt2.close()
    assert closed["frames_in"] == FRAMES
    after = texts(rt2)
    assert len(after) >= FRAMES - k and after[-(FRAMES - k):] == ref_text[k:]
    # every output frame went somewhere: to the old socket, dropped while paused, or to the new one
    assert closed["frames_out"] + greeting["frames_undelivered"] == FRAMES


async def test_the_grace_period_end_frees_the_slot_and_the_token_expires(stack, idle):
    gw = stack.gateway
    expired_before = metric(gw, "gateway_resume_grace_expired_total")
    rt, created = await opened(gw.ws_url)
    await feed(rt, 0, 3)
    rt.ws.transport.abort()
    await paused(gw)
    t0 = time.monotonic()
    assert await eventually(lambda: metric(gw, "gateway_sessions_paused") == 0, GRACE_S + 20)
    assert time.monotonic() - t0 > GRACE_S - 2  # not before the grace period's end
    assert await eventually(lambda: talker_active(stack) == 0 and metric(gw, "gateway_sessions_active") == 0, 30)
    assert metric(gw, "gateway_resume_grace_expired_total") - expired_before == 1
    assert await refused(gw, created["session"]["id"], created["resume_token"]) == (410, "session_expired")


async def test_bad_tokens_are_refused_typed_and_leave_the_session_resumable(stack, idle):
    gw = stack.gateway
    rt, created = await opened(gw.ws_url)
    sid, token = created["session"]["id"], created["resume_token"]
    assert await refused(gw, sid, token) == (409, "session_in_use")  # its connection is still there
    await feed(rt, 0, 2)
    rt.ws.transport.abort()
    await paused(gw)
    worker, nonce, mac = token.split(".")
    forged = f"{worker}.{nonce}.{'0' * len(mac)}"
    assert await refused(gw, sid, forged) == (403, "invalid_resume_token")
    assert await refused(gw, "sess_someone_else", token) == (403, "invalid_resume_token")
    assert await refused(gw, sid, "not a token") == (403, "invalid_resume_token")
    assert await refused(gw, sid, f"w7.{nonce}.{mac}") == (421, "resume_wrong_worker")
    other = ResumeTokens(0, None).mint(sid)[0]  # well formed, under another process's secret
    assert await refused(gw, sid, other) == (403, "invalid_resume_token")
    rt2 = await resume(gw, sid, token)  # none of that disturbed the paused session
    assert (await rt2.recv())["type"] == "session.resumed"
    await rt2.close()


async def test_two_concurrent_resumes_one_wins(stack, idle):
    gw = stack.gateway
    rt, created = await opened(gw.ws_url)
    sid, token = created["session"]["id"], created["resume_token"]
    await feed(rt, 0, 2)
    rt.ws.transport.abort()
    await paused(gw)
    outcomes = await asyncio.gather(resume(gw, sid, token), resume(gw, sid, token), return_exceptions=True)
    winners = [o for o in outcomes if isinstance(o, RT)]
    losers = [o for o in outcomes if isinstance(o, InvalidStatus)]
    assert len(winners) == 1 and len(losers) == 1, outcomes
    assert losers[0].response.status_code == 409
    assert json.loads(losers[0].response.body)["error"]["code"] == "session_in_use"
    assert (await winners[0].recv())["type"] == "session.resumed"
    await feed(winners[0], 2, 4)
    _, closed = await winners[0].close()
    assert closed["frames_in"] == 4


def test_a_token_is_bound_to_its_key_and_its_session():
    secret = b"s" * 32
    token, nonce = ResumeTokens(0, "key-a", secret).mint("sess_1")
    assert ResumeTokens(0, "key-a", secret).verify(token, "sess_1") == nonce
    for tokens, sid in ((ResumeTokens(0, "key-b", secret), "sess_1"), (ResumeTokens(0, None, secret), "sess_1"),
                        (ResumeTokens(0, "key-a", secret), "sess_2")):
        with pytest.raises(ResumeRefused) as e:
            tokens.verify(token, sid)
        assert (e.value.status, e.value.code) == (403, "invalid_resume_token")


async def test_a_resume_with_the_api_key_set_needs_the_key(stack):
    gw = GatewayProcess(stack.cell_procs[0].spec, args=GATEWAY_ARGS + ["--api-key-env", "TEST_GW_KEY"],
                        env={"TEST_GW_KEY": "k-123"}).start()
    try:
        key = {"Authorization": "Bearer k-123"}
        rt, created = await opened(gw.ws_url, key)
        sid, token = created["session"]["id"], created["resume_token"]
        await feed(rt, 0, 2)
        rt.ws.transport.abort()
        await paused(gw)
        assert await refused(gw, sid, token) == (401, "unauthorized")
        assert await refused(gw, sid, token, {"Authorization": "Bearer k-456"}) == (401, "unauthorized")
        rt2 = await resume(gw, sid, token, key)
        assert (await rt2.recv())["type"] == "session.resumed"
        await rt2.close()
        assert await eventually(lambda: metric(gw, "gateway_sessions_active") == 0, 30)
    finally:
        gw.stop()


# ---- another worker of the same gateway (resume_relay.py) ---------------------------------------


# The idle clock runs on while a session is paused: landing on the other worker may take a few drops.
WORKERS_ARGS = GATEWAY_ARGS + ["--workers", "2", "--idle-session-timeout", "300"]


@pytest.fixture(scope="module")
def workers2(stack):
    gw = GatewayProcess(stack.cell_procs[0].spec, args=WORKERS_ARGS).start()
    yield gw
    gw.stop()


def worker_pids(gw: GatewayProcess) -> dict[int, int]:
    """worker index -> pid, from the supervisor's children (`python -m services.gateway.workers INDEX ...`)."""
    pid = gw.proc.pid
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    pids = {}
    for child in children:
        argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        pids[int(argv[argv.index(b"services.gateway.workers") + 1])] = int(child)
    return pids


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def quiet_fds(pid: int) -> int:
    """A worker's open fds once this test's last /metrics request (it lands on either worker) has closed."""
    await asyncio.sleep(1.0)
    return open_fds(pid)


def relayed(gw: GatewayProcess) -> float:
    return metric(gw, 'gateway_resume_relays_total{outcome="relayed"}')


async def resume_elsewhere(gw: GatewayProcess, sid: str, token: str) -> tuple[RT, dict]:
    """A resume that the kernel handed to the worker the token does not name: (its client, session.resumed).
    Each connection lands on a worker the kernel picks by its addresses; one that lands on the session's own
    worker is dropped again, and the session pauses again, until one lands on the other."""
    for _ in range(40):
        before = relayed(gw)
        rt2 = await resume(gw, sid, token)
        greeting = await rt2.recv()
        assert greeting["type"] == "session.resumed", greeting
        if relayed(gw) > before:
            return rt2, greeting
        rt2.ws.transport.abort()
        await paused(gw)
    raise AssertionError("40 resumes in a row landed on the session's own worker")


async def workers_idle(gw: GatewayProcess) -> None:
    assert await eventually(lambda: metric(gw, "gateway_sessions_active") == 0, 30)
    assert metric(gw, "gateway_sessions_paused") == 0 and metric(gw, "gateway_resume_relays_open") == 0


async def test_a_resume_that_lands_on_another_worker_continues_the_same_conversation(workers2, reference):
    """With two workers, a resume the kernel hands to the other worker is piped to the session's own worker:
    the conversation goes on, frames pair N in / N out, and its text is the uninterrupted session's."""
    gw = workers2
    ref_text, ref_audio = reference
    rt, created = await opened(gw.ws_url)
    sid, token = created["session"]["id"], created["resume_token"]
    await feed(rt, 0, FRAMES // 2)
    await outputs(rt, FRAMES // 2)
    before = texts(rt)
    rt.ws.transport.abort()
    await paused(gw)
    rt2, greeting = await resume_elsewhere(gw, sid, token)
    assert greeting["session"]["id"] == sid
    assert (greeting["frames_in"], greeting["frames_out"], greeting["frames_undelivered"]) == (FRAMES // 2,) * 2 + (0,)
    await second_half_continues_the_reference(rt, rt2, before, ref_text, ref_audio)
    await workers_idle(gw)


async def test_a_relayed_resume_of_an_ended_session_gets_the_owners_refusal(workers2):
    gw = workers2
    rt, created = await opened(gw.ws_url)
    sid, token = created["session"]["id"], created["resume_token"]
    await rt.close()  # a close frame: the session ends, its token now answers 410 on its worker
    await workers_idle(gw)
    before, answers = relayed(gw), set()
    for _ in range(40):
        t0 = time.monotonic()
        answers.add(await refused(gw, sid, token))
        assert time.monotonic() - t0 < 5
        if relayed(gw) > before:
            break
    assert relayed(gw) > before, "no resume landed on the other worker"
    assert answers == {(410, "session_expired")}, answers
    assert metric(gw, "gateway_resume_relays_open") == 0


async def test_a_client_that_drops_a_relayed_resume_leaves_no_socket_behind(workers2):
    """The relaying worker holds two sockets while it pipes (the client's, the owner's Unix one) and none
    once the client drops; the owner sees the drop through the relay and pauses the session again."""
    gw = workers2
    rt, created = await opened(gw.ws_url)
    sid, token = created["session"]["id"], created["resume_token"]
    owner = int(token.split(".")[0][1:])
    relayer = worker_pids(gw)[1 - owner]
    await feed(rt, 0, 2)
    await outputs(rt, 2)
    rt.ws.transport.abort()
    await paused(gw)
    assert await eventually(lambda: metric(gw, "gateway_resume_relays_open") == 0, 10)
    baseline = await quiet_fds(relayer)
    rt2, greeting = await resume_elsewhere(gw, sid, token)
    assert greeting["frames_in"] == 2
    await feed(rt2, 2, 4)
    await outputs(rt2, 2)
    assert metric(gw, "gateway_resume_relays_open") == 1
    assert await quiet_fds(relayer) == baseline + 2  # the client's socket and the owner's Unix one
    rt2.ws.transport.abort()  # no close frame: the relay sees a reset
    await paused(gw)
    assert await eventually(lambda: open_fds(relayer) == baseline, 10), (open_fds(relayer), baseline)
    assert metric(gw, "gateway_resume_relays_open") == 0
    rt3 = await resume(gw, sid, token)  # whichever worker it lands on
    assert (await rt3.recv())["type"] == "session.resumed"
    _, closed = await rt3.close()
    assert closed["frames_in"] == closed["frames_out"] == 4
    await workers_idle(gw)


async def test_a_relayed_resume_works_over_tls(stack, tmp_path):
    """With TLS the relaying worker terminates it and pipes the plaintext: the resume goes on over wss."""
    tls = make_local_tls(tmp_path / "tls", ("127.0.0.1",))
    gw = GatewayProcess(stack.cell_procs[0].spec, args=WORKERS_ARGS, tls=tls).start()
    try:
        assert gw.ws_url.startswith("wss://")
        rt, created = await opened(gw.ws_url, **trust(gw))
        sid, token = created["session"]["id"], created["resume_token"]
        await feed(rt, 0, 2)
        await outputs(rt, 2)
        rt.ws.transport.abort()
        await paused(gw)
        rt2, greeting = await resume_elsewhere(gw, sid, token)
        assert greeting["frames_in"] == 2
        await feed(rt2, 2, 4)
        await outputs(rt2, 2)
        _, closed = await rt2.close()
        assert closed["frames_in"] == closed["frames_out"] == 4
        await workers_idle(gw)
    finally:
        gw.stop()
