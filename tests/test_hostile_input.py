"""Hostile and faulty input never costs memory, slots or other people's sessions (issue 20).

Each test replays one attack of the outside probe against a real stack (encoder, talker,
decoder and gateway processes; two slots) and shows the fix:
- memory: the gateway's RSS before and after, within a stated bound;
- gauges: every stage's free slots and `gateway_sessions_active` back to their baseline;
- other sessions: a heartbeat round trip on another connection stays fast, and a paced
  session (`Feeder`) keeps getting frames.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect as sync_connect

from services.gateway.bounded import OutputQueue, RecentIds, brief
from tests.reliability_helpers import (Feeder, SyncRT, append, assert_nothing_leaked, async_wait_until, gateway_metric,
                                       http_get, leak_baseline, rss_mb, stage_counts, steady_feeder, tone, wait_until)
from tools.run_stack import Stack

GATEWAY_ARGS = ["--stall-timeout", "30", "--open-timeout", "120", "--cleanup-timeout", "20"]
MAX_MESSAGE_BYTES = 2 * 1024 * 1024  # the gateway's default max_message_bytes


# ---- the bounded pieces on their own ------------------------------------------------------------

def test_brief_never_expands_a_client_value():
    assert brief("abc") == "'abc'"
    long = brief("é" * 1_000_000)
    assert len(long) < 80 and "1000000 characters" in long
    assert brief(10**5000).startswith("an integer of") and brief(-3) == "-3"
    assert brief([1] * 10**6) == "a JSON array of 1000000 item(s)" and brief({"a": 1}) == "a JSON object of 1 item(s)"
    assert brief(None) == "None" and brief(1.5) == "1.5" and brief(True) == "True"


async def test_output_queue_is_bounded_in_bytes_and_in_count():
    q = OutputQueue(max_items=100, max_bytes=1000)
    q.put_nowait("x" * 600)
    with pytest.raises(asyncio.QueueFull):
        q.put_nowait("y" * 401)  # 1001 bytes: over the byte bound though only 2 items
    q.put_nowait(b"z" * 400)
    assert q.bytes == 1000 and q.qsize() == 2
    assert await q.get() == "x" * 600 and q.bytes == 400
    small = OutputQueue(max_items=2, max_bytes=10**6)
    small.put_nowait("a")
    small.put_nowait("b")
    with pytest.raises(asyncio.QueueFull):
        small.put_nowait("c")
    small.finish()  # the end marker is never refused
    assert [await small.get() for _ in range(3)] == ["a", "b", None]


def test_recent_ids_bounded_in_count_and_bytes_with_constant_time_lookup():
    ids = RecentIds(max_items=1000, max_bytes=10_000, max_len=100)
    for i in range(5000):
        ids.add(f"{i:0100d}")  # 100 characters each: the byte bound (100 ids) binds first
    assert len(ids) == 100 and ids.bytes == 10_000
    assert f"{4999:0100d}" in ids and f"{4899:0100d}" not in ids
    few = RecentIds(max_items=3)
    for op in ("a", "b", "c", "a", "d"):
        few.add(op)
    assert "a" not in few and {"b", "c", "d"} == {op for op in "abcd" if op in few}  # a repeat does not refresh
    t0 = time.perf_counter()
    assert not any(f"{i:0100d}" in ids for i in range(4900))
    assert time.perf_counter() - t0 < 0.5  # a dict lookup, not a scan of every id
    with pytest.raises(AssertionError):
        ids.add("x" * 101)


# ---- the stack --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stack(tiny_checkpoint):
    with Stack(tiny_checkpoint, sessions=2, gateway_args=GATEWAY_ARGS) as s:
        yield s


@pytest.fixture(scope="module")
def feeder(stack):
    """The untouched session: paced audio for the whole module."""
    with steady_feeder(stack) as f:
        yield f


@pytest.fixture(scope="module")
def baseline(stack, feeder):
    return leak_baseline(stack)


def heartbeat_rtt(rt: SyncRT) -> float:
    t0 = time.monotonic()
    rt.send({"type": "session.heartbeat", "event_id": "hb"})
    while (ev := rt.recv(30))["type"] != "session.heartbeat_ack":
        pass
    assert ev["client_event_id"] == "hb"
    return time.monotonic() - t0


def open_session(stack, **session) -> SyncRT:
    rt = SyncRT(stack.gateway.ws_url)
    rt.send({"type": "session.update", "session": {"type": "realtime", **session}})
    assert rt.recv(120)["type"] == "session.created"
    assert rt.recv(30)["type"] == "session.updated"
    return rt


def gateway_log_bytes(gateway) -> int:
    return len(gateway.log_tail(chars=10**9))


def internal_errors(stack) -> float:
    _, body = http_get(stack.gateway.http_url + "/metrics")
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.decode().splitlines()
               if line.startswith("gateway_errors_total{") and 'code="internal"' in line)


def raw_socket_client(gateway, rcvbuf: int = 4096) -> socket.socket:
    """A socket to the gateway with a small receive buffer: a client that stops reading is felt at once."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((gateway.host, gateway.port))
    return sock


# ---- row 2: huge values echoed in errors --------------------------------------------------------

def test_huge_unknown_event_types_from_a_client_that_never_reads_cost_no_memory(stack, feeder, baseline):
    """40 events of 2 MB whose `type` is a million "é", from a client that never reads: each gets
    a short `unknown_event` (the type cut to a prefix), logged once per session at most 20 times.
    Bound: the gateway's RSS grows by less than 40 MB (the probe saw +271 MB), its log by less
    than 20 kB (+167 MB), and a heartbeat on another connection answers within 0.5 s."""
    other = SyncRT(stack.gateway.ws_url)
    heartbeat_rtt(other)
    pid = stack.gateway.proc.pid
    rss0, log0 = rss_mb(pid), gateway_log_bytes(stack.gateway)
    stuck = sync_connect(stack.gateway.ws_url, sock=raw_socket_client(stack.gateway), max_size=None, open_timeout=60,
                         legacy=True)
    big = json.dumps({"type": "é" * 1_000_000}, ensure_ascii=False)
    assert MAX_MESSAGE_BYTES - 100_000 < len(big.encode()) <= MAX_MESSAGE_BYTES
    rtts = []
    for i in range(40):
        stuck.send(big)
        if i % 8 == 7:
            rtts.append(heartbeat_rtt(other))
    rtts.append(heartbeat_rtt(other))
    grown, logged = rss_mb(pid) - rss0, gateway_log_bytes(stack.gateway) - log0
    print(f"\n[hostile] 40 x 2 MB unknown types: gateway RSS +{grown:.1f} MB, log +{logged} B, "
          f"heartbeat max {max(rtts) * 1000:.0f} ms")
    assert grown < 40, grown
    assert logged < 20_000, logged
    assert max(rtts) < 0.5, rtts
    # The errors themselves are short: read them now.
    for _ in range(40):
        ev = json.loads(stuck.recv(30))
        assert ev["type"] == "error" and ev["error"]["code"] == "unknown_event", ev
        assert len(ev["error"]["message"]) < 200, ev
    stuck.close()
    other.close()
    feeder.check_alive(1)
    assert_nothing_leaked(stack, baseline)


# ---- row 3: operation ids -----------------------------------------------------------------------

def test_operation_ids_are_bounded_per_id_and_in_total(stack, feeder, baseline):
    """150 one-sample appends each with a distinct 1.9 MB operation_id: each is refused as
    `bad_event` (ids are at most 128 characters), nothing is remembered. Bound: RSS +40 MB (the
    probe saw +277 MB) and another connection's heartbeat within 0.4 s (917 ms). Ids within the
    bound still deduplicate: a repeated one is ignored, a new one is not."""
    rt = open_session(stack)
    other = SyncRT(stack.gateway.ws_url)
    heartbeat_rtt(other)
    pid = stack.gateway.proc.pid
    rss0 = rss_mb(pid)
    one = append(tone(1)[:1])
    rtts = []
    for i in range(150):
        rt.send({**one, "operation_id": f"{i:07d}" + "x" * 1_900_000})
        ev = rt.next_reply()
        assert ev["type"] == "error" and ev["error"]["code"] == "bad_event", ev
        assert ev["error"]["param"] == "operation_id", ev
        assert len(ev["error"]["message"]) < 200
        if i % 30 == 0:
            rtts.append(heartbeat_rtt(other))
    grown = rss_mb(pid) - rss0
    print(f"\n[hostile] 150 x 1.9 MB operation ids: gateway RSS +{grown:.1f} MB, "
          f"heartbeat max {max(rtts) * 1000:.0f} ms")
    assert grown < 40 and max(rtts) < 0.4, (grown, rtts)
    # Within the bound, ids still deduplicate: the same id twice sends one packet.
    frame = append(tone(1))
    for op in ("op-a", "op-a", "op-b"):
        rt.send({**frame, "operation_id": op})
    rt.send({"type": "session.close"})
    while (ev := rt.recv(60))["type"] != "session.closed":
        assert ev["type"] != "error", ev
    assert ev["frames_in"] == 2, ev  # op-a once, op-b once (the 1-sample appends were refused)
    rt.close()
    other.close()
    feeder.check_alive(1)
    assert_nothing_leaked(stack, baseline)


# ---- row 4: numbers and nesting -----------------------------------------------------------------

@pytest.mark.parametrize("message", [
    '{"type": "session.heartbeat", "x": ' + "1" * 5000 + "}",
    '{"type": "input_audio_buffer.append", "audio": "AAAA", "sample_rate_hz": ' + "9" * 4400 + "}",
    "[" * 100_000 + "]" * 100_000,
    '{"type": "session.heartbeat", "x": ' + '{"a": ' * 50_000 + "1" + "}" * 50_000 + "}",
    '{"type": "input_audio_buffer.append", "audio": "AAAA", "sample_rate_hz": ' + "9" * 4000 + "}",
    '{"type": "input_audio_buffer.append", "audio": "AAAA", "sample_rate_hz": 1e999}',
])
def test_huge_numbers_and_deep_nesting_are_typed_errors_and_the_session_goes_on(stack, feeder, baseline, message):
    """A number past the interpreter's 4300-digit limit, a 4000-digit one (echoed briefly),
    infinity, 100 000 levels of nesting: one typed `invalid_request_error` each, and the live
    session still answers and takes audio (the probe saw a silent close 1000)."""
    rt = open_session(stack)
    rt.send(message)
    ev = rt.next_reply()
    assert ev["type"] == "error" and ev["error"]["type"] == "invalid_request_error", ev
    assert ev["error"]["code"] in ("invalid_json", "unsupported_audio_format"), ev
    assert len(ev["error"]["message"]) < 200, ev
    heartbeat_rtt(rt)
    rt.send(append(tone(2)))
    while rt.frames < 1:
        assert rt.recv(60)["type"] != "error"
    rt.close()
    assert internal_errors(stack) == 0
    assert_nothing_leaked(stack, baseline)


# ---- row 5: /api/chat seed ----------------------------------------------------------------------

@pytest.mark.parametrize("seed", ["18446744073709551616", "9223372036854775808", "²", "١٢", "1" * 5000, "-1"])
def test_api_chat_seed_out_of_range_or_not_ascii_digits_is_a_typed_refusal(stack, feeder, baseline, seed):
    """A seed out of range (`seed=2**64`) or not in ASCII digits (`seed=²`) is refused at the upgrade
    (HTTP 400, typed JSON error) as on the Realtime path (0 <= seed < 2**63), never a traceback."""
    url = f"ws://{stack.gateway.host}:{stack.gateway.port}/api/chat?" + urllib.parse.urlencode({"seed": seed})
    with pytest.raises(InvalidStatus) as e:
        sync_connect(url, max_size=None, open_timeout=60, legacy=True)
    assert e.value.response.status_code == 400
    assert json.loads(e.value.response.body)["error"]["code"] == "bad_event", e.value.response.body[:120]
    assert internal_errors(stack) == 0
    assert_nothing_leaked(stack, baseline)


# ---- row 7: the static path ---------------------------------------------------------------------

def raw_http(stack, request: bytes) -> bytes:
    with socket.create_connection((stack.gateway.host, stack.gateway.port), timeout=10) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
            if b"\r\n\r\n" in data:
                break
        return data


@pytest.mark.parametrize("path, status", [
    (b"/\x00", b"400"), (b"/index.html\x00.js", b"400"), (b"/\x1b[31m", b"400"), (b"/%00", b"404"),
    (b"/" + b"a" * 5000, b"404"), (b"/..%2f..%2fetc%2fpasswd", b"404"),
])
def test_control_characters_in_the_path_are_a_4xx_not_a_traceback(stack, feeder, path, status):
    """A control character in the path (`GET /\\x00`) is a 4xx, not a 500 traceback from the static lookup."""
    reply = raw_http(stack, b"GET " + path + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert reply.split(b" ", 2)[1] == status, reply[:200]
    assert internal_errors(stack) == 0



# ---- /api/chat: the Opus per-message cap ------------------------------------------------------------

def test_opus_message_over_five_seconds_gets_its_own_error_and_the_session_goes_on(stack, feeder, baseline):
    """The Opus decoder takes at most 5 s per message: 6 s in one message is `bad_audio` saying
    so (not "not Ogg/Opus"), and the same stream's next pages still decode into output."""
    import sphn

    url = f"ws://{stack.gateway.host}:{stack.gateway.port}/api/chat?text_prompt=Hi"
    writer = sphn.OpusStreamWriter(24_000)
    x = tone(90)  # 7.2 s
    pages = [writer.append_pcm(x[i : i + 1920]) for i in range(0, x.size, 1920)]
    with sync_connect(url, max_size=None, open_timeout=60, legacy=True) as ws:
        assert ws.recv(120) == b"\x00"
        ws.send(b"\x01" + b"".join(pages[:75]))  # 6 s
        while (msg := ws.recv(30))[0] != 5:
            pass
        assert msg[1:].startswith(b"bad_audio:") and b"at most 5 s per message" in msg, msg
        for page in pages[75:]:
            ws.send(b"\x01" + page)
        got_audio = False
        while not got_audio:
            msg = ws.recv(60)
            assert msg[0] != 5, msg
            got_audio = msg[0] == 1
    feeder.check_alive(1)
    assert_nothing_leaked(stack, baseline)


# ---- row 1: a session.update that cannot reopen ---------------------------------------------------

class Racer:
    """A client in a loop: connect, open, hold the slot briefly, close; takes any slot that frees."""

    def __init__(self, url: str):
        self.url, self.opened, self.refused = url, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                rt = SyncRT(self.url)
                rt.send({"type": "session.update", "session": {"type": "realtime"}})
                ev = rt.recv(60)
                if ev["type"] == "session.created":
                    self.opened += 1
                    time.sleep(0.3)
                else:
                    assert ev["error"]["code"] == "resource_exhausted", ev
                    self.refused += 1
                rt.close()
            except (ConnectionClosed, OSError, TimeoutError):
                pass
            time.sleep(0.005)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def _after_refused_reopen(rt: SyncRT, first_error: dict) -> str:
    """What follows a refused reopen: the old session goes on ("kept"), or session.closed then a
    1013/1011 close ("closed"). Anything else fails."""
    ev = rt.next_reply(30)
    if ev["type"] == "session.closed":
        with pytest.raises(ConnectionClosed) as e:
            rt.recv(30)
        assert e.value.rcvd.code in (1013, 1011), e.value
        return "closed"
    assert ev["type"] == "session.heartbeat_ack", (first_error, ev)
    return "kept"


@pytest.mark.parametrize("persona", ["You are brisk.", "You are\x00 brisk."])
def test_session_update_that_cannot_reopen_is_typed_and_gauges_return(stack, feeder, baseline, persona):
    """A full cell (the feeder and A hold both slots) and three clients racing for any slot that
    frees. A changes its persona before any audio, six times: a valid persona gives either
    session.updated (new persona live) or, when a racer took the freed slot, a typed
    resource_exhausted and a clearly closed session (session.closed, close 1013); a persona the
    talker refuses (NUL) gives invalid_instructions and the old session, untouched. Never a
    silently dead session. After everyone leaves, every gauge is back at baseline (the probe saw
    gateway_sessions_active stuck at 1)."""
    racers = [Racer(stack.gateway.ws_url) for _ in range(3)]
    outcomes: dict[str, int] = {}
    try:
        for round_ in range(6):
            rt = None
            while rt is None:  # A gets in when a racer lets go
                candidate = SyncRT(stack.gateway.ws_url)
                candidate.send({"type": "session.update", "session": {"type": "realtime"}})
                if candidate.recv(60)["type"] == "session.created":
                    assert candidate.recv(30)["type"] == "session.updated"
                    rt = candidate
                else:
                    candidate.close()
                    time.sleep(0.02)
            rt.send({"type": "session.update", "event_id": f"u{round_}", "session": {"instructions": persona}})
            rt.send({"type": "session.heartbeat"})
            # The heartbeat is answered at once; the update once its prompt is live (or refused).
            acked = False
            while (ev := rt.next_reply(60))["type"] == "session.heartbeat_ack":
                acked = True
            if ev["type"] == "session.updated":
                assert ev["session"]["instructions"] == persona and "\x00" not in persona
                outcome = "updated"
            else:
                assert ev["type"] == "error" and ev["error"]["event_id"] == f"u{round_}", ev
                expected = "invalid_instructions" if "\x00" in persona else "resource_exhausted"
                assert ev["error"]["code"] == expected, ev
                outcome = "kept" if acked else _after_refused_reopen(rt, ev)
            assert outcome == "kept" if "\x00" in persona else outcome in ("updated", "closed"), outcome
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            if outcome != "closed":  # the session works: audio in, frames out
                rt.send(append(tone(2)))
                while rt.frames < 1:
                    assert rt.recv(60)["type"] != "error"
            rt.close()
    finally:
        for r in racers:
            r.stop()
    print(f"\n[hostile] persona {persona!r}: {outcomes}; racers opened {sum(r.opened for r in racers)}")
    assert sum(r.refused for r in racers) > 0  # the cell really was contended
    feeder.check_alive(1)
    assert_nothing_leaked(stack, baseline)


# ---- idle timeouts (risk 8) --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def idle_gateway(stack):
    """A second gateway on the same cell with short idle bounds (1.5 s)."""
    from tools.run_stack import GatewayProcess

    gw = GatewayProcess(stack.cell_procs[0].spec, args=GATEWAY_ARGS + ["--idle-connection-timeout", "1.5"],
                        env={"GATEWAY_IDLE_SESSION_TIMEOUT_S": "1.5"}).start()
    yield gw
    gw.stop()


def _closed_for_idleness(rt: SyncRT, keep_alive: dict | None = None) -> tuple[float, list[dict]]:
    t0, seen = time.monotonic(), []
    with pytest.raises(ConnectionClosed) as e:
        while True:
            if keep_alive:
                try:
                    rt.send(keep_alive)
                except ConnectionClosed:  # what the server sent before closing is still read below
                    keep_alive = None
            try:
                seen.append(rt.recv(0.3))
            except TimeoutError:
                pass
            assert time.monotonic() - t0 < 20
    assert e.value.rcvd.code == 1008 and e.value.rcvd.reason == "idle timeout", e.value
    return time.monotonic() - t0, seen


def test_idle_connection_session_and_chat_are_closed_and_slots_come_back(stack, feeder, baseline, idle_gateway):
    """With 1.5 s bounds: a WebSocket that only sends heartbeats and never opens a session, a session
    that never appends audio, and an /api/chat session that sends no audio are each closed with a
    typed `idle_timeout` (close 1008) within a few seconds, and their slots come back. A paced
    session on the same gateway is not touched."""
    url = idle_gateway.ws_url
    paced = Feeder(url, instructions="You are steady.")
    time.sleep(3)  # twice the bound: a session that sends audio is never idle
    paced.check_alive(3)
    assert paced.stop()["frames_out"] > 0
    no_session = SyncRT(url)
    took, seen = _closed_for_idleness(no_session, keep_alive={"type": "session.heartbeat"})
    assert 1.4 < took < 6 and [e["error"]["code"] for e in seen if e["type"] == "error"] == ["idle_timeout"], seen
    silent = SyncRT(url)
    silent.send({"type": "session.update", "session": {"type": "realtime"}})
    took, seen = _closed_for_idleness(silent)
    types = [e["type"] for e in seen]
    assert types[:3] == ["session.created", "session.updated", "error"] and types[-1] == "session.closed", types
    assert seen[2]["error"]["code"] == "idle_timeout"
    chat_url = f"ws://{idle_gateway.host}:{idle_gateway.port}/api/chat?text_prompt=Hi"
    with sync_connect(chat_url, max_size=None, open_timeout=60, legacy=True) as ws:
        assert ws.recv(60) == b"\x00"
        t0 = time.monotonic()
        msgs = []
        with pytest.raises(ConnectionClosed) as e:
            while True:
                msgs.append(ws.recv(20))
        assert e.value.rcvd.code == 1008 and 1.4 < time.monotonic() - t0 < 6
        assert msgs[-1][0] == 5 and msgs[-1][1:].startswith(b"idle_timeout:"), msgs[-1:]
    feeder.check_alive(1)
    assert_nothing_leaked(stack, baseline)


# ---- row 6 and risk 9: stage ports, Drain, readiness -------------------------------------------------

def listening_addresses(port: int) -> set[str]:
    """The local addresses with a listening TCP socket on `port` (from /proc/net/tcp and tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, hexport = local.rsplit(":", 1)
                if state == "0A" and int(hexport, 16) == port:  # 32-bit words in host (little-endian) order
                    raw = b"".join(bytes.fromhex(addr[i : i + 8])[::-1] for i in range(0, len(addr), 8))
                    ip = ipaddress.ip_address(raw)
                    found.add(str(getattr(ip, "ipv4_mapped", None) or ip))
    return found


def test_stage_ports_listen_on_loopback_only(stack):
    """The probe found the encoder and decoder (gRPC and metrics) on every interface."""
    for cell in stack.cell_procs:
        for proc in cell.all():
            for port in (proc.port, proc.metrics_port):
                assert listening_addresses(port) == {"127.0.0.1"}, (proc.module, port, listening_addresses(port))


def test_drain_needs_the_token_and_can_be_cancelled_and_readiness_follows(stack, feeder, baseline):
    """`Drain(deadline_s=1e-6)` without the token (the probe's attack) is UNAUTHENTICATED and the
    feeder goes on. With it, the gateway's /health turns 503 "draining" (liveness stays 200) and a
    new session is refused with `server_shutting_down` (close 1013), not `resource_exhausted`.
    Drain(cancel=true) brings readiness and admission back."""
    import grpc

    from duplex.v1 import common_pb2, decoder_pb2_grpc

    health = stack.gateway.http_url + "/health"
    with grpc.insecure_channel(stack.cell_procs[0].decoder.address) as ch:
        stub = decoder_pb2_grpc.DecoderStub(ch)
        for md in ((), (("authorization", "Bearer guess"),)):
            with pytest.raises(grpc.RpcError) as e:
                stub.Drain(common_pb2.DrainRequest(deadline_s=1e-6), timeout=10, metadata=md)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        feeder.check_alive(2)
        admin = (("authorization", f"Bearer {stack.admin_token}"),)
        stub.Drain(common_pb2.DrainRequest(deadline_s=0), timeout=10, metadata=admin)
        try:
            assert wait_until(lambda: http_get(health)[0] == 503, 10), http_get(health)
            assert json.loads(http_get(health)[1])["status"] == "draining"
            assert http_get(health + "/live")[0] == 200
            rt = SyncRT(stack.gateway.ws_url)
            rt.send({"type": "session.update", "session": {"type": "realtime"}})
            ev = rt.recv(60)
            assert ev["type"] == "error" and ev["error"]["code"] == "server_shutting_down", ev
            with pytest.raises(ConnectionClosed) as closed:
                rt.recv(30)
            assert closed.value.rcvd.code == 1013
            feeder.check_alive(2)  # a drain with no deadline never touches a live session
        finally:
            stub.Drain(common_pb2.DrainRequest(cancel=True), timeout=10, metadata=admin)
    assert wait_until(lambda: http_get(health)[0] == 200, 10)
    open_session(stack).close()
    assert_nothing_leaked(stack, baseline)


# ---- risk 11: a browser with an API key ---------------------------------------------------------------

def test_client_secrets_are_short_lived_and_bound_to_the_key():
    from services.gateway import auth

    value, expires_at = auth.mint("k", ttl_s=60, now=1000.0)
    assert expires_at == 1060 and value.startswith("ek_1060_")
    assert auth.accepts("k", value, now=1059.0) and auth.accepts("k", "k")
    assert not auth.accepts("k", value, now=1061.0)  # expired
    assert not auth.accepts("other", value, now=1000.0)  # minted with another key
    forged = value.replace("ek_1060_", "ek_9999_")
    assert not auth.accepts("k", forged, now=1000.0)  # the expiry is under the MAC
    for junk in ("", "ek_", "ek_x_y_z", "ek_١٢_a_b", "k " * 1000, "ek_" + "9" * 5000 + "_a_b"):
        assert not auth.accepts("k", junk, now=1000.0)


def test_api_key_over_the_wire_header_subprotocol_and_client_secret(stack, feeder, baseline):
    """With an API key: no credential or a wrong one is 401; the key as bearer works (SDKs); a
    client secret minted by POST /v1/realtime/client_secrets with the key works as the
    `openai-insecure-api-key.` subprotocol (browsers), and the server answers `realtime`; the
    secret expires, cannot mint another, and a forged one is refused."""
    from websockets.exceptions import InvalidStatus

    from tools.run_stack import GatewayProcess

    key = "wire-test-key"
    gw = GatewayProcess(stack.cell_procs[0].spec, args=GATEWAY_ARGS + ["--client-secret-ttl", "2"],
                        env={"PERSONAPLEX_GATEWAY_API_KEY": key}).start()
    secrets_url = gw.http_url + "/v1/realtime/client_secrets"

    def post(headers: dict) -> tuple[int, dict]:
        req = urllib.request.Request(secrets_url, method="POST", headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def refused(**kw) -> int:
        with pytest.raises(InvalidStatus) as e:
            sync_connect(gw.ws_url, open_timeout=30, **kw)
        return e.value.response.status_code

    try:
        assert refused() == 401 and refused(additional_headers={"Authorization": "Bearer nope"}) == 401
        assert refused(subprotocols=["realtime", "openai-insecure-api-key.nope"]) == 401
        assert post({})[0] == 401 and post({"Authorization": "Bearer nope"})[0] == 401
        assert http_get(secrets_url)[0] == 405
        status, secret = post({"Authorization": f"Bearer {key}"})
        assert status == 200 and secret["expires_at"] - time.time() <= 2.5, secret
        assert post({"Authorization": f"Bearer {secret['value']}"})[0] == 401  # a secret cannot mint a secret
        with sync_connect(gw.ws_url, open_timeout=30, additional_headers={"Authorization": f"Bearer {key}"}) as ws:
            ws.send(json.dumps({"type": "session.heartbeat"}))
            assert json.loads(ws.recv(30))["type"] == "session.heartbeat_ack"
        protocols = ["realtime", f"openai-insecure-api-key.{secret['value']}"]
        with sync_connect(gw.ws_url, open_timeout=30, subprotocols=protocols) as ws:
            assert ws.subprotocol == "realtime"
            ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime"}}))
            assert json.loads(ws.recv(60))["type"] == "session.created"
        forged = secret["value"][:-4] + ("0000" if not secret["value"].endswith("0000") else "1111")
        assert refused(subprotocols=["realtime", f"openai-insecure-api-key.{forged}"]) == 401
        time.sleep(2.5)
        assert refused(subprotocols=protocols) == 401  # expired
    finally:
        gw.stop()
    feeder.check_alive(1)
    assert_nothing_leaked(stack, baseline)


# ---- one session's failure never touches another --------------------------------------------------

async def test_a_failing_session_among_healthy_ones_on_one_cell_fails_alone(tiny_checkpoint):
    """Four sessions on one cell through the gateway's Relay (one shared link per stage): one
    floods its input past a stage's per-session bound (the incident's RESOURCE_EXHAUSTED), the
    other three are paced. The flooder fails alone, with its own typed talker error; the three keep
    getting frames (no error, no "RPC already finished"), close with confirmed cleanup, and every
    slot comes back."""
    from duplex.v1 import talker_pb2
    from services.gateway.cells import CellPool
    from services.gateway.config import GatewayConfig, parse_cells
    from services.gateway.relay import OpenParams, open_on_cells
    from tests.relay_listener import RelayRecorder

    with Stack(tiny_checkpoint, sessions=4, with_gateway=False) as stack:  # the test is the cell's client
        pool = CellPool(GatewayConfig(cells=parse_cells(stack.cell_procs[0].spec)))
        await pool.start()
        await pool.wait_first_poll()
        opened = []
        heard = [RelayRecorder() for _ in range(4)]
        try:
            for i in range(4):
                params = lambda i=i: OpenParams(f"iso-{i}", "", "You are calm.",  # noqa: E731
                                                talker_pb2.Sampling(seed=i + 1))
                opened.append(await open_on_cells(pool.candidates(), params, heard[i], open_timeout_s=120,
                                                  stall_timeout_s=30, cleanup_timeout_s=20))
            flooder, healthy = opened[0], opened[1:]
            errors = {i: heard[i].errors for i in range(4)}
            x = tone(400, 200)
            frames = [x[k * 1920 : (k + 1) * 1920] for k in range(400)]

            async def paced(p, n: int) -> None:
                t0 = time.monotonic()
                for k in range(n):
                    await p.send_frame(frames[k])
                    await asyncio.sleep(max(0.0, t0 + (k + 1) * 0.08 - time.monotonic()))

            async def flood() -> None:
                for k in range(400):  # 32 s of input at once: far past the talker's 2 s backlog bound
                    if flooder.failed:
                        return
                    try:
                        await flooder.send_frame(frames[k])
                    except Exception:
                        return

            pace = [asyncio.create_task(paced(p, 60)) for p in healthy]
            await asyncio.sleep(0.5)
            await flood()
            assert await async_wait_until(lambda: flooder.failed is not None, 30), "the flooder never failed"
            at_failure = {i: len(heard[i].outputs) for i in range(4)}
            await asyncio.gather(*pace)
            err = flooder.failed
            # The first stage whose per-session input bound it overran (the link's inbox or the talker's backlog).
            assert err.stage in ("encoder", "talker") and "RESOURCE_EXHAUSTED" in err.message, \
                (err.code, err.stage, err.message)
            assert errors[0] == [err]
            for i in (1, 2, 3):
                assert errors[i] == [], (i, [(e.code, e.message) for e in errors[i]])
                outputs = len(heard[i].outputs)
                assert outputs - at_failure[i] >= 10, (i, at_failure, outputs)  # still flowing after the failure
            assert [await p.close() for p in healthy] == [True, True, True]
            await flooder.abort()
        finally:
            for p in opened:
                await p.abort()
            await pool.stop()
        freed = wait_until(lambda: all(free == 4 and active == 0 for free, active in stage_counts(stack).values()), 30)
        assert freed, stage_counts(stack)


def test_connections_beyond_the_bound_get_503_and_health_still_answers(stack):
    """Open WebSockets per gateway process are bounded (--max-connections): one more is HTTP 503
    `server_busy`, /health still answers, and a freed connection makes room."""
    from websockets.exceptions import InvalidStatus

    from tools.run_stack import GatewayProcess

    gw = GatewayProcess(stack.cell_procs[0].spec, args=GATEWAY_ARGS + ["--max-connections", "3"]).start()
    try:
        held = [sync_connect(gw.ws_url, open_timeout=30, legacy=True) for _ in range(3)]
        with pytest.raises(InvalidStatus) as e:
            sync_connect(gw.ws_url, open_timeout=30, legacy=True)
        assert e.value.response.status_code == 503 and b"server_busy" in e.value.response.body
        assert http_get(gw.http_url + "/health")[0] == 200
        held.pop().close()
        time.sleep(0.2)
        held.append(sync_connect(gw.ws_url, open_timeout=30, legacy=True))
        for ws in held:
            ws.close()
    finally:
        gw.stop()


def test_a_client_that_stops_reading_is_cut_off_by_the_byte_bound(stack, feeder, baseline):
    """The output queue's byte bound on its own (its count bound set out of reach): a session whose
    client never reads is cut off (close 1008, gateway_slow_client_cutoffs_total) once about 30 kB
    of output wait for it, and the feeder on the same cell goes on."""
    from tools.run_stack import GatewayProcess

    gw = GatewayProcess(stack.cell_procs[0].spec, args=GATEWAY_ARGS + [
        "--output-queue-events", "1000000", "--output-queue-bytes", "30000", "--send-buffer-bytes", "8192"]).start()
    try:
        # It never reads, so it never sees the gateway's close frame either: its close at the end is
        # cleanup, not waited for (websockets' 10 s default would be most of this test).
        stuck = sync_connect(gw.ws_url, sock=raw_socket_client(gw), max_size=None, open_timeout=60,
                             legacy=True, max_queue=1, close_timeout=0.5)
        stuck.send(json.dumps({"type": "session.update", "session": {"type": "realtime"}}))
        frame = json.dumps(append(tone(1)))
        deadline = time.monotonic() + 90
        while gateway_metric(gw, "gateway_slow_client_cutoffs_total") < 1:
            assert time.monotonic() < deadline, "the client that never reads was not cut off"
            try:
                stuck.send(frame)
            except ConnectionClosed:
                break
            time.sleep(0.08)
        assert wait_until(lambda: gateway_metric(gw, "gateway_slow_client_cutoffs_total") == 1, 30)
        assert wait_until(lambda: gateway_metric(gw, "gateway_sessions_active") == 0, 30)
        stuck.close()
    finally:
        gw.stop()
    feeder.check_alive(2)
    assert_nothing_leaked(stack, baseline)
