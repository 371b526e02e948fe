"""Hostile input, second round (issue 31): the gateway's part, each attack replayed on real sockets.

One stack (encoder, talker, decoder and gateway processes; three slots). Its gateway has an API
key, voice upload, and short bounds so attacks end in seconds: 12 connections, a 2 s send
deadline, a 1 s close timeout. A second gateway on the same cell has the default configuration
(no key, no upload) but a 2 s request deadline, for the HTTP attacks that need no credential.
Each test shows the fix with what the probe measured:
- memory: the gateway's RSS before and after, within a stated bound;
- sockets: the gateway's ESTABLISHED sockets (from /proc/net/tcp) and open fds back at baseline;
- other sessions: a paced bystander session (`Bystander`) keeps getting its output frames with no
  gap over BYSTANDER_GAP_S, and slots and gauges return to baseline.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import socket
import struct
import threading
import time
import wave
from pathlib import Path

import numpy as np
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as sync_connect

from services.gateway.conversation import MAX_CLIENT_PARTS, MAX_CLIENT_TEXT_CHARS
from tests.reliability_helpers import (SyncRT, append, gateway_metric, leak_baseline, rss_mb, stage_counts, tone,
                                       wait_until)
from tools.run_stack import GatewayProcess, Stack

KEY = "hostile-2-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_CONNECTIONS = 12
SEND_TIMEOUT_S = 2.0
CLOSE_TIMEOUT_S = 1.0
MAX_VOICES = 3
VOICES_TOTAL_BYTES = 700_000  # three 2 s voices (192 000 bytes each) fit; 2 s + 2 s + 4 s do not
GATEWAY_ARGS = ["--stall-timeout", "30", "--open-timeout", "120", "--cleanup-timeout", "20"]
BYSTANDER_GAP_S = 2.0  # a paced session's output frames come every 80 ms; the probe saw stalls of 40 s and more


# ---- attack material ----------------------------------------------------------------------------

def wav_bytes(seconds: float, rate: int = 24_000, seed: int = 0) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    x = 0.3 * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t)) * np.sin(2 * np.pi * (150 + 50 * seed) * t)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((x * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def wav_saying_zero_hz() -> bytes:
    """A WAV whose header says 0 Hz: symphonia panics (TimeBase 1/0), a PanicException in Python."""
    data = bytearray(wav_bytes(3.0))
    data[24:32] = struct.pack("<II", 0, 0)  # sample rate, byte rate
    return bytes(data)


def _crc8(data: bytes) -> int:
    c = 0
    for b in data:
        c ^= b
        for _ in range(8):
            c = ((c << 1) ^ 0x07) & 0xFF if c & 0x80 else (c << 1) & 0xFF
    return c


def _crc16(data: bytes) -> int:
    c = 0
    for b in data:
        c ^= b << 8
        for _ in range(8):
            c = ((c << 1) ^ 0x8005) & 0xFFFF if c & 0x8000 else (c << 1) & 0xFFFF
    return c


def _coded_number(n: int) -> bytes:
    """FLAC's UTF-8-like frame number."""
    if n < 0x80:
        return bytes([n])
    nbytes = next(k for k, top in ((2, 0x7FF), (3, 0xFFFF), (4, 0x1FFFFF)) if n <= top)
    tail = []
    for _ in range(nbytes - 1):
        tail.append(0x80 | (n & 0x3F))
        n >>= 6
    return bytes([((0xFF << (8 - nbytes)) & 0xFF) | n] + tail[::-1])


def flac_bomb(frames: int = 4000, rate: int = 48_000, claimed_seconds: float | None = None) -> bytes:
    """FLAC made only of CONSTANT subframes: 13 bytes per 65535 samples (51 KiB ~ 91 minutes at 48 kHz,
    over 1 GB of float32 decoded whole). claimed_seconds: what STREAMINFO says (default: the truth)."""
    block = 65535
    total = frames * block if claimed_seconds is None else int(claimed_seconds * rate)
    info = struct.pack(">HH", block, block) + bytes(6)
    info += ((rate << 44) | (15 << 36) | total).to_bytes(8, "big") + bytes(16)  # mono, 16 bits
    out = bytearray(b"fLaC" + bytes([0x80]) + len(info).to_bytes(3, "big") + info)
    for i in range(frames):
        head = bytearray([0xFF, 0xF8, 0x70, 0x08]) + _coded_number(i) + struct.pack(">H", block - 1)
        head.append(_crc8(head))
        frame = bytes(head) + b"\x00" + struct.pack(">h", 1000)  # one CONSTANT subframe
        out += frame + struct.pack(">H", _crc16(frame))
    return bytes(out)


# ---- what is measured -------------------------------------------------------------------------

def established(port: int) -> int:
    """TCP connections in ESTABLISHED state whose local port is `port` (the server's side)."""
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "01" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    n += 1
    return n


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def log_has_unretrieved_task(gw: GatewayProcess) -> bool:
    return "Task exception was never retrieved" in gw.log_tail(chars=10**8)


class Bystander:
    """A paced session in a background thread: one frame in every 80 ms, with the arrival time of each
    output frame. The session an attack must not touch."""

    def __init__(self, url: str, headers: dict):
        self.rt = SyncRT(url, additional_headers=headers)
        self.rt.send({"type": "session.update", "session": {"type": "realtime", "instructions": "You are steady."}})
        assert self.rt.recv(120)["type"] == "session.created"
        self.arrivals: list[float] = []
        self.errors: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert wait_until(lambda: len(self.arrivals) >= 5 or self.errors, 60) and not self.errors, self.errors

    def _run(self) -> None:
        frame = append(tone(1, 300))
        next_at = time.monotonic()
        while not self._stop.is_set():
            if time.monotonic() >= next_at:
                self.rt.send(frame)
                next_at += 0.08
            try:
                ev = json.loads(self.rt.ws.recv(max(0.001, next_at - time.monotonic())))
            except TimeoutError:
                continue
            if ev["type"] == "response.output_audio.delta":
                self.arrivals.append(time.monotonic())
            elif ev["type"] == "error":
                self.errors.append(ev)

    def assert_on_time(self, since: float) -> None:
        """Frames kept coming from `since` to now, no gap over BYSTANDER_GAP_S."""
        now = time.monotonic()
        times = [since] + [t for t in self.arrivals if t > since] + [now]
        worst = max(b - a for a, b in zip(times, times[1:]))
        assert not self.errors, self.errors
        assert worst <= BYSTANDER_GAP_S, f"the bystander's output stalled {worst:.2f} s"

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.rt.close()


# ---- raw clients ----------------------------------------------------------------------------------

def raw_request(gw, data: bytes, wait_s: float = 10.0) -> bytes:
    """Send `data` on a fresh socket and read until the server closes it (or wait_s passes)."""
    with socket.create_connection((gw.host, gw.port), timeout=wait_s) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except (TimeoutError, ConnectionResetError):
            pass
        return out


def status_and_json(reply: bytes) -> tuple[int, dict]:
    head, _, body = reply.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body) if body.startswith(b"{") else {}


def ws_handshake(gw, headers: dict, rcvbuf: int = 4096) -> socket.socket:
    """A WebSocket opened by hand on a socket with a small receive buffer (a client that stops reading
    is felt at once)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(30)
    s.connect((gw.host, gw.port))
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    key = base64.b64encode(os.urandom(16)).decode()
    s.sendall((f"GET /v1/realtime?duplex=1 HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n{extra}\r\n").encode())
    head = b""
    while b"\r\n\r\n" not in head and (byte := s.recv(1)):
        head += byte
    if not head.startswith(b"HTTP/1.1 101"):
        s.close()
        raise AssertionError(head[:200])
    return s


def send_on_each(socks: list[socket.socket], send) -> None:
    """send(sock) on every socket at once, a thread each; a send the server cut off (OSError) is the point."""
    def run(sock: socket.socket) -> None:
        try:
            send(sock)
        except OSError:
            pass

    threads = [threading.Thread(target=run, args=(sock,)) for sock in socks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)


def masked_frame(opcode: int, payload: bytes) -> bytes:
    """One client frame (FIN set, masked as RFC 6455 requires of a client)."""
    n = len(payload)
    head = bytes([0x80 | opcode])
    head += bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack(">H", n) if n < 65536 \
        else bytes([0x80 | 127]) + struct.pack(">Q", n)
    mask = os.urandom(4)
    keys = np.resize(np.frombuffer(mask, np.uint8), n)
    return head + mask + (np.frombuffer(payload, np.uint8) ^ keys).tobytes()


# ---- fixtures -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def voices_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("enrolled")


@pytest.fixture(scope="module")
def stack(tiny_checkpoint, voices_dir):
    args = GATEWAY_ARGS + [
        "--api-key-env", "TEST_GW_KEY", "--voice-upload", "--voices-dir", str(voices_dir),
        "--max-voices", str(MAX_VOICES), "--voices-total-bytes", str(VOICES_TOTAL_BYTES),
        "--max-connections", str(MAX_CONNECTIONS), "--send-timeout", str(SEND_TIMEOUT_S),
        "--close-timeout", str(CLOSE_TIMEOUT_S), "--idle-connection-timeout", "3",
        "--client-secret-rate", "1", "--client-secret-burst", "3"]
    with Stack(tiny_checkpoint, sessions=3, gateway_args=args, gateway_env={"TEST_GW_KEY": KEY}) as s:
        yield s


@pytest.fixture(scope="module")
def plain(stack):
    """The default configuration (no key, no upload), with a 2 s request deadline."""
    gw = GatewayProcess(stack.cell_procs[0].spec, args=GATEWAY_ARGS + ["--request-timeout", "2"]).start()
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def bystander(stack):
    b = Bystander(stack.gateway.ws_url, AUTH)
    yield b
    b.stop()


@pytest.fixture(scope="module")
def baseline(stack, bystander):
    return leak_baseline(stack)


def assert_back_to_baseline(stack, baseline) -> None:
    counts, active = baseline
    assert wait_until(lambda: stage_counts(stack) == counts
                      and gateway_metric(stack.gateway, "gateway_sessions_active") == active, 30), \
        (stage_counts(stack), counts)


# ---- #2: conversation items while a response is live -----------------------------------------------

def test_conversation_items_are_bounded_in_bytes_while_a_response_is_live(stack, bystander, baseline):
    """After the first audio (a live response, always the oldest item), 1000 conversation.item.create
    of 16 parts x 4096 characters, echoes read. The probe saw ~72 KiB kept per item (RSS +212 MB for
    3000). Bound: the gateway's RSS grows by less than 30 MB (1000 items unbounded would be ~72 MB),
    the first items are forgotten (delete: invalid_item_id) while the live response's item is kept
    (truncate works), and the bystander is on time."""
    rt = SyncRT(stack.gateway.ws_url, additional_headers=AUTH)
    rt.send({"type": "session.update", "session": {"type": "realtime"}})
    assert rt.recv(120)["type"] == "session.created"
    rt.send(append(tone(2)))
    live = None
    while live is None:
        ev = json.loads(rt.ws.recv(60))
        live = ev["item"]["id"] if ev["type"] == "conversation.item.added" else None
    pid = stack.gateway.proc.pid
    rss0, t0 = rss_mb(pid), time.monotonic()
    parts = [{"type": "input_text", "text": "x" * MAX_CLIENT_TEXT_CHARS}] * MAX_CLIENT_PARTS
    for i in range(1000):
        rt.send(json.dumps({"type": "conversation.item.create",
                            "item": {"id": f"item_{i:05d}", "type": "message", "role": "user", "content": parts}}))
        while (ev := json.loads(rt.ws.recv(60)))["type"] != "conversation.item.done":
            assert ev["type"] != "error", ev
        if i % 100 == 99:
            rt.send(append(tone(1)))  # the session stays live (the idle bound is on audio)
    grown = rss_mb(pid) - rss0
    print(f"\n[hostile-2] 1000 items of 64 KiB after the first audio: gateway RSS +{grown:.1f} MB")
    assert grown < 30, grown
    rt.send({"type": "conversation.item.delete", "item_id": "item_00000", "event_id": "old"})
    rt.send({"type": "conversation.item.truncate", "item_id": live, "content_index": 0, "audio_end_ms": 0,
             "event_id": "live"})
    seen = {}
    while len(seen) < 2:
        ev = json.loads(rt.ws.recv(60))
        if ev["type"] == "error":
            seen[ev["error"]["event_id"]] = ev["error"]["code"]
        elif ev["type"] == "conversation.item.truncated":
            seen["live"] = ev["item_id"]
    assert seen == {"old": "invalid_item_id", "live": live}, seen
    rt.close()
    bystander.assert_on_time(t0)
    assert_back_to_baseline(stack, baseline)


# ---- #3: clients that never read ------------------------------------------------------------------

def test_a_ping_flood_from_a_client_that_never_reads_is_aborted_and_costs_no_memory(stack, bystander, baseline):
    """The probe's 5000 pings (and 400 000 more after the idle bound, +51 MB), here 20 000 pings of 125
    bytes from each of MAX_CONNECTIONS clients that never read: the pongs pass the write-buffer bound
    (1 MiB, after the 256 KiB socket buffer) and each transport is aborted within a second or two.
    Bound: RSS +30 MB, the gateway's sockets and fds back at baseline, the cap admits again, the
    bystander on time."""
    gw = stack.gateway
    pid = gw.proc.pid
    aborts0 = gateway_metric(gw, "gateway_client_aborts_total")
    base_sockets, base_fds, rss0, t0 = established(gw.port), open_fds(pid), rss_mb(pid), time.monotonic()
    ping = masked_frame(0x9, b"p" * 125)
    clients = [ws_handshake(gw, AUTH) for _ in range(MAX_CONNECTIONS - 1)]  # the bystander holds one
    with pytest.raises(InvalidStatus) as busy:
        sync_connect(gw.ws_url, additional_headers=AUTH, open_timeout=30)
    assert busy.value.response.status_code == 503

    send_on_each(clients, lambda sock: [sock.sendall(ping * 100) for _ in range(200)])
    took = time.monotonic() - t0
    assert wait_until(lambda: established(gw.port) <= base_sockets, 10), (established(gw.port), base_sockets)
    gone = time.monotonic() - t0
    grown = rss_mb(pid) - rss0
    print(f"\n[hostile-2] {len(clients)} x 20 000 pings, never read: sent in {took:.1f} s, all aborted after "
          f"{gone:.1f} s, gateway RSS +{grown:.1f} MB")
    for s in clients:
        s.close()
    assert grown < 30, grown
    assert gateway_metric(gw, "gateway_client_aborts_total") - aborts0 >= len(clients)
    assert wait_until(lambda: open_fds(pid) <= base_fds, 10), (open_fds(pid), base_fds)
    with sync_connect(gw.ws_url, additional_headers=AUTH, open_timeout=30) as ws:  # the cap admits again
        ws.send(json.dumps({"type": "session.heartbeat"}))
        assert json.loads(ws.recv(30))["type"] == "session.heartbeat_ack"
    bystander.assert_on_time(t0)
    assert_back_to_baseline(stack, baseline)


def test_a_streaming_session_that_never_reads_is_aborted_and_its_slot_and_socket_come_back(stack, bystander,
                                                                                          baseline):
    """A session that sends paced audio and never reads its output (the probe: slot freed at ~22 s, the
    socket open 100 s and more). Once the socket buffers are full a write waits SEND_TIMEOUT_S, then the
    transport is aborted: the socket is gone within 20 s of the first unread output (buffers fill at
    the output's ~65 kB/s), its slot and gauges come back, and the bystander is on time."""
    gw = stack.gateway
    base_sockets, t0 = established(gw.port), time.monotonic()
    stuck = ws_handshake(gw, AUTH)
    send_event(stuck, {"type": "session.update", "session": {"type": "realtime"}})
    frame = append(tone(1))
    aborted_at = None
    while aborted_at is None and time.monotonic() - t0 < 40:
        try:
            send_event(stuck, frame)
        except OSError:
            aborted_at = time.monotonic()
        time.sleep(0.08)
        if established(gw.port) <= base_sockets:
            aborted_at = time.monotonic()
    stuck.close()
    assert aborted_at is not None and aborted_at - t0 < 20, "the session that never reads kept its socket"
    print(f"\n[hostile-2] a streaming session that never reads: socket gone after {aborted_at - t0:.1f} s")
    assert wait_until(lambda: established(gw.port) <= base_sockets, 10)
    assert gateway_metric(gw, 'gateway_client_aborts_total{reason="send_timeout"}') >= 1
    bystander.assert_on_time(t0)
    assert_back_to_baseline(stack, baseline)


def send_event(sock: socket.socket, event: dict) -> None:
    sock.sendall(masked_frame(0x1, json.dumps(event).encode()))


def test_closes_behind_unread_output_have_a_deadline_and_the_cap_counts_closing_sockets(stack, bystander, baseline):
    """MAX_CONNECTIONS - 1 WebSockets that never read, each asking for 2.6 MB of echoes (20 items of 64
    KiB; no session needed): each is cut off when its output queue passes 2 MiB, and its close frame
    waits behind unread output until the write deadline (SEND_TIMEOUT_S) aborts the transport. All the
    while another client tries to connect every 50 ms: a closing socket still counts, so the gateway
    never holds more than MAX_CONNECTIONS sockets (the probe saw 120 under a cap of 40). After, the
    cap admits again and no socket is left."""
    gw = stack.gateway
    base_sockets, t0 = established(gw.port), time.monotonic()
    parts = [{"type": "input_text", "text": "x" * MAX_CLIENT_TEXT_CHARS}] * MAX_CLIENT_PARTS
    clients = [ws_handshake(gw, AUTH) for _ in range(MAX_CONNECTIONS - 1)]
    done = threading.Event()
    extra, refused, most = [], [], [0]

    def probe() -> None:
        while not done.is_set():
            most[0] = max(most[0], established(gw.port))
            try:
                extra.append(ws_handshake(gw, AUTH))
            except AssertionError as e:  # not a 101
                refused.append(str(e)[:40])
            except OSError:
                pass
            time.sleep(0.05)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()

    def ask(sock: socket.socket) -> None:
        for i in range(20):
            send_event(sock, {"type": "conversation.item.create",
                              "item": {"id": f"c{i}", "type": "message", "role": "user", "content": parts}})

    send_on_each(clients, ask)
    gone = wait_until(lambda: established(gw.port) <= base_sockets + len(extra), 20)
    took = time.monotonic() - t0
    done.set()
    prober.join(30)
    print(f"\n[hostile-2] {len(clients)} clients that never read their echoes: gone after {took:.1f} s; "
          f"at most {most[0]} sockets held (cap {MAX_CONNECTIONS}), {len(extra)} probes admitted after")
    for sock in clients + extra:
        sock.close()
    assert gone, (established(gw.port), base_sockets, len(extra))
    assert most[0] <= MAX_CONNECTIONS + 1, most[0]  # + 1: the probe's own socket, refused
    assert refused and all("503" in r for r in refused), refused[:3]
    assert gateway_metric(gw, 'gateway_client_aborts_total{reason="send_timeout"}') >= len(clients)
    assert wait_until(lambda: established(gw.port) <= base_sockets, 15), (established(gw.port), base_sockets)
    with sync_connect(gw.ws_url, additional_headers=AUTH, open_timeout=30):
        pass
    bystander.assert_on_time(t0)
    assert_back_to_baseline(stack, baseline)


# ---- #4: request bodies and HTTP parsing -------------------------------------------------------------

def test_unauthenticated_uploads_are_answered_before_their_body_and_cost_no_memory(stack, plain, bystander):
    """The probe's 60 `PUT /v1/voices/xN` with Content-Length 10 MiB, the body all but its last byte
    (RSS +600 MB, held 35 s). Here each is answered on its head alone (403 on the default
    configuration, 401 without the key where upload is on) and the 10 MiB sent after it are
    discarded. Bound: RSS +30 MB on both gateways; the bystander on time."""
    t0 = time.monotonic()
    for gw, status, code in ((plain, 403, "voice_upload_disabled"), (stack.gateway, 401, "unauthorized")):
        pid = gw.proc.pid
        rss0 = rss_mb(pid)
        socks = []
        for i in range(30):
            s = socket.create_connection((gw.host, gw.port), timeout=10)
            s.sendall(f"PUT /v1/voices/x{i} HTTP/1.1\r\nHost: x\r\nContent-Length: {10 * 1024 * 1024}\r\n\r\n".encode())
            reply = b""
            while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
                reply += s.recv(4096)
            got, body = status_and_json(reply)
            assert (got, body["error"]["code"]) == (status, code), reply[:300]
            socks.append(s)

        send_on_each(socks, lambda sock: sock.sendall(b"\0" * (10 * 1024 * 1024 - 1)))
        grown = rss_mb(pid) - rss0
        for s in socks:
            s.close()
        print(f"\n[hostile-2] 30 unauthenticated 10 MiB uploads ({status}): gateway RSS +{grown:.1f} MB")
        assert grown < 30, grown
    bystander.assert_on_time(t0)


@pytest.mark.parametrize("lengths", [["+5"], ["5_0"], [""], ["5, 5"], ["5", "5"], ["-1"], ["0x5"], ["٥"],
                                     ["1" * 19]])
def test_content_length_is_strict(plain, lengths):
    """`Content-Length: +N`, `N_`, empty, a list, the field twice, or not ASCII digits: 400."""
    head = "".join(f"Content-Length: {v}\r\n" for v in lengths)
    request_head = f"POST /v1/realtime/client_secrets HTTP/1.1\r\nHost: x\r\n{head}\r\n"
    reply = raw_request(plain, request_head.encode("utf-8") + b"hello")
    status, body = status_and_json(reply)
    assert (status, body["error"]["code"]) == (400, "bad_content_length"), reply[:300]


def test_transfer_encoding_pipelining_and_bodies_get_an_answer_never_silence(plain):
    """Transfer-Encoding with Content-Length (the probe: closed without a reply) is 400; chunked alone is
    400 too (bodies need a length); two pipelined requests get one 400; a body where the route takes
    none is 413; the OpenAI SDK's client_secrets body is read and ignored; a request that stops
    half-way gets 408 at the request deadline (2 s); every answer says Connection: close."""
    cases = [
        (b"POST /v1/realtime/client_secrets HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
         b"Content-Length: 5\r\n\r\n0\r\n\r\n", 400, "conflicting_length"),
        (b"POST /v1/realtime/client_secrets HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
         400, "unsupported_transfer_encoding"),
        (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n", 400,
         "pipelining_unsupported"),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc", 413, "body_too_large"),
        (b"GET //[x HTTP/1.1\r\nHost: x\r\n\r\n", 400, "bad_request"),
    ]
    for request, status, code in cases:
        reply = raw_request(plain, request)
        got, body = status_and_json(reply)
        assert (got, body["error"]["code"]) == (status, code), (request, reply[:300])
        assert b"\r\nConnection: close\r\n" in reply.split(b"\r\n\r\n")[0] + b"\r\n", reply[:300]
    sdk = json.dumps({"session": {"type": "realtime", "model": "gpt-realtime"}}).encode()
    reply = raw_request(plain, b"POST /v1/realtime/client_secrets HTTP/1.1\r\nHost: x\r\nContent-Type: "
                               b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(sdk), sdk))
    status, body = status_and_json(reply)
    assert status == 200 and body["value"].startswith("ek_"), reply[:300]
    t0 = time.monotonic()
    reply = raw_request(plain, b"GET /health HTTP/1.1\r\nHost: x\r\n", wait_s=15)
    status, body = status_and_json(reply)
    assert (status, body["error"]["code"]) == (408, "request_timeout") and 1.5 < time.monotonic() - t0 < 8, reply


def test_an_authorized_upload_that_expects_100_continue_is_answered_then_read(stack):
    body = wav_bytes(2.0, seed=7)
    with socket.create_connection((stack.gateway.host, stack.gateway.port), timeout=30) as s:
        s.sendall(f"PUT /v1/voices/curl HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                  f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n".encode())
        assert s.recv(4096) == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(body)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    status, answer = status_and_json(reply)
    assert (status, answer["name"]) == (201, "curl"), reply[:300]
    assert request(stack.gateway, "DELETE", "/v1/voices/curl")[0] == 200


# ---- #5 and #6: decoding bombs and decoder panics -------------------------------------------------------

def request(gw, method: str, path: str, body: bytes | None = None, key: str | None = KEY) -> tuple[int, dict]:
    import http.client

    conn = http.client.HTTPConnection(gw.host, gw.port, timeout=60)
    conn.request(method, path, body=body, headers={"Authorization": f"Bearer {key}"} if key else {})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, json.loads(data) if data else {}


@pytest.mark.parametrize("claimed", [None, 3.0])
def test_a_flac_decoding_bomb_is_refused_in_bounded_memory(stack, bystander, claimed):
    """51 KiB of CONSTANT subframes (91 minutes at 48 kHz), its header telling the truth or claiming 3 s:
    the probe saw +2 GB RSS before the 413. Decoding stops at the 30 s cap, in the sandbox: 413 too_long
    within 10 s, the gateway's RSS +30 MB, the bystander on time."""
    gw = stack.gateway
    pid = gw.proc.pid
    rss0, t0 = rss_mb(pid), time.monotonic()
    bomb = flac_bomb(claimed_seconds=claimed)
    assert len(bomb) < 60 * 1024
    status, reply = request(gw, "PUT", "/v1/voices/bomb", bomb)
    took, grown = time.monotonic() - t0, rss_mb(pid) - rss0
    print(f"\n[hostile-2] FLAC bomb (header claims {claimed or 'the truth'}): {status} in {took:.2f} s, "
          f"gateway RSS +{grown:.1f} MB")
    assert (status, reply["error"]["code"]) == (413, "too_long"), reply
    assert took < 10 and grown < 30, (took, grown)
    bystander.assert_on_time(t0)


def test_a_wav_saying_zero_hz_is_a_typed_400_and_the_socket_is_answered_and_closed(stack, bystander):
    """Ten uploads of a WAV whose header says 0 Hz (the probe: a PanicException escaped, no reply in
    40 s, sockets never closed, fds grew, 'Task exception was never retrieved'). Each is 400 not_audio,
    answered and closed: the gateway's fds and sockets are back at baseline, nothing unretrieved."""
    gw = stack.gateway
    pid = gw.proc.pid
    base_fds, base_sockets, t0 = open_fds(pid), established(gw.port), time.monotonic()
    for _ in range(10):
        status, reply = request(gw, "PUT", "/v1/voices/zero", wav_saying_zero_hz())
        assert (status, reply["error"]["code"]) == (400, "not_audio"), reply
    assert wait_until(lambda: open_fds(pid) <= base_fds and established(gw.port) <= base_sockets, 10), \
        (open_fds(pid), base_fds)
    assert not log_has_unretrieved_task(gw)
    assert "zero" not in {v["name"] for v in request(gw, "GET", "/v1/voices")[1]["data"]}
    bystander.assert_on_time(t0)


def test_a_decoder_that_crashes_or_blows_its_memory_is_contained_in_the_sandbox(monkeypatch):
    """The sandbox itself: with its address space cut to 300 MB and the cap lifted to 3000 s, decoding
    the bomb fails inside the child (Rust aborts on a failed allocation: the whole process would die),
    and the caller gets InvalidVoiceAudio(not_audio); a panic too."""
    from services.common import audio_sandbox, voice_audio

    pcm = asyncio.run(audio_sandbox.check_voice_apart(wav_bytes(2.5), 2.0, 30.0))
    assert pcm.dtype == np.float32 and pcm.size == 60_000
    monkeypatch.setattr(audio_sandbox, "MEMORY_BYTES", 300 * 1024 * 1024)
    for data, max_seconds in ((flac_bomb(), 3000.0), (wav_saying_zero_hz(), 30.0)):
        with pytest.raises(voice_audio.InvalidVoiceAudio) as e:
            asyncio.run(audio_sandbox.check_voice_apart(data, 2.0, max_seconds))
        assert e.value.kind == "not_audio", e.value


# ---- risks: voice names, caps, the list; client secrets ----------------------------------------------

def test_enrolled_names_cannot_shadow_an_alias_or_a_bundled_voice(stack, voices_dir):
    """`marin` (LiveKit's default voice, an alias) in any case is 409 voice_name_reserved before its body
    is read; a bundled stem is 403. A file of that name put in the folder by hand is ignored: not
    listed, and a session asking for `marin` opens with the alias's voice."""
    gw = stack.gateway
    for name in ("marin", "MARIN", "Alloy"):
        status, reply = request(gw, "PUT", f"/v1/voices/{name}", wav_bytes(2.0))
        assert (status, reply["error"]["code"]) == (409, "voice_name_reserved"), reply
    assert request(gw, "PUT", "/v1/voices/NATF2", wav_bytes(2.0))[0] == 403
    (voices_dir / "marin.f32").write_bytes(np.zeros(48_000, "<f4").tobytes())
    try:
        assert "marin" not in {v["name"] for v in request(gw, "GET", "/v1/voices")[1]["data"]}
        rt = SyncRT(gw.ws_url, additional_headers=AUTH)
        rt.send({"type": "session.update", "session": {"type": "realtime", "voice": "marin"}})
        assert rt.recv(120)["type"] == "session.created"
        rt.close()
    finally:
        (voices_dir / "marin.f32").unlink()


def test_voice_count_and_bytes_are_capped_and_the_list_is_paginated(stack, voices_dir):
    """At most MAX_VOICES voices (a new one past it: 409 before its body is read; a replacement is
    fine) and VOICES_TOTAL_BYTES of audio (a bigger replacement past it: 409, the old one kept). The
    list pages with ?limit and ?after: every voice exactly once, in order, has_more false at the end."""
    gw = stack.gateway
    names = [f"cap{i}" for i in range(MAX_VOICES)]
    try:
        for i, name in enumerate(names):
            assert request(gw, "PUT", f"/v1/voices/{name}", wav_bytes(2.0, seed=i))[0] == 201
        status, reply = request(gw, "PUT", "/v1/voices/one_more", wav_bytes(2.0))
        assert (status, reply["error"]["code"]) == (409, "voice_limit_reached"), reply
        assert request(gw, "PUT", f"/v1/voices/{names[0]}", wav_bytes(2.5))[0] == 200  # replaced, still 3
        status, reply = request(gw, "PUT", f"/v1/voices/{names[1]}", wav_bytes(4.0))  # 2.5 + 4 + 2 s: over
        assert (status, reply["error"]["code"]) == (409, "voice_limit_reached"), reply
        assert (voices_dir / f"{names[1]}.f32").stat().st_size == 2 * 24_000 * 4  # the old one, whole
        full = request(gw, "GET", "/v1/voices")[1]
        assert full["has_more"] is False and full["last_id"] == full["data"][-1]["name"]
        paged, after = [], ""
        while True:
            status, page = request(gw, "GET", f"/v1/voices?limit=2{'&after=' + after if after else ''}")
            assert status == 200 and len(page["data"]) <= 2
            paged += page["data"]
            if not page["has_more"]:
                break
            after = page["last_id"]
        assert paged == full["data"] and {n for n in names} <= {v["name"] for v in paged}
        for bad in ("0", "101", "x", "-1", "1" * 40):
            status, reply = request(gw, "GET", f"/v1/voices?limit={bad}")
            assert (status, reply["error"]["code"]) == (400, "invalid_limit"), (bad, reply)
    finally:
        for name in names:
            request(gw, "DELETE", f"/v1/voices/{name}")
    assert not [p for p in voices_dir.iterdir() if p.name.startswith("cap")]


def test_client_secret_minting_is_rate_limited_and_a_secret_opens_one_connection(stack):
    """With a burst of 3 and 1 a second: the 4th mint at once is 429 with Retry-After, a later one
    works. A secret opens one connection; offered again it is 401."""
    gw = stack.gateway
    url = gw.http_url + "/v1/realtime/client_secrets"

    def mint() -> tuple[int, dict, str | None]:
        import urllib.error
        import urllib.request

        req = urllib.request.Request(url, method="POST", headers=AUTH)
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, json.loads(r.read()), None
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read()), e.headers.get("Retry-After")

    time.sleep(3)  # a full bucket
    minted = [mint() for _ in range(4)]
    assert [m[0] for m in minted] == [200, 200, 200, 429], minted
    assert minted[3][1]["error"]["code"] == "rate_limit_exceeded" and int(minted[3][2]) >= 1
    time.sleep(int(minted[3][2]))
    assert mint()[0] == 200
    protocols = ["realtime", f"openai-insecure-api-key.{minted[0][1]['value']}"]
    with sync_connect(gw.ws_url, subprotocols=protocols, open_timeout=30) as ws:
        assert ws.subprotocol == "realtime"
        with pytest.raises(InvalidStatus) as again:
            sync_connect(gw.ws_url, subprotocols=protocols, open_timeout=30)
        assert again.value.response.status_code == 401
        assert b"already opened its connection" in again.value.response.body
