"""Voices on the gateway: the list, and enrollment from audio.

    GET    /v1/voices          {"object": "list", "upload": bool, "data": [{"name", "kind", "seconds"}]}:
                               the bundled voices (asked of a talker) and the enrolled ones
    PUT    /v1/voices/NAME     body: an audio file sphn reads (wav, flac, mp3, ogg): enrolls NAME (201)
                               or replaces it (200)
    DELETE /v1/voices/NAME     forgets NAME (200)

PUT and DELETE exist only with --voice-upload, which needs the gateway's API key (Bearer); GET is
open, like the page. Names are [A-Za-z0-9_-]{1,64} (services/common/voice_names.py); a bundled
voice (a file name, "NATF2.pt") can be neither overwritten nor deleted. An upload is at most
`voice_upload_bytes` bytes and, decoded, `voice_min_seconds`..`voice_max_seconds` long; audio
that is not audio, is empty, silent, too short or too long is a 4xx with a typed code.

Storage: one file per voice, DIR/NAME.f32: float32 samples at 24 kHz, the upload's first channel,
not normalised (the talker records it exactly as the reference records an audio file). Written
to a temporary file and renamed, so a half-written voice is never visible, and of two uploads of
one name the later rename wins whole. The gateway's workers share DIR; gateways on several hosts
share it as a volume. A session's open reads the file and ships the samples to the talker
(TalkOpen.voice_audio), so every cell can use every enrolled voice, and a voice deleted while
sessions use it only stops new sessions: the talker keeps its own recording.

websockets' HTTP parser refuses every request body, so `accept_voice_uploads` gives the server a
parser that also reads the body of PUT /v1/voices/NAME (bounded; anything else is parsed as before).
"""

from __future__ import annotations

import asyncio
import hmac
import http
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import numpy as np
from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.exceptions import InvalidMessage
from websockets.http11 import HeaderLineTooLong, RequestLineTooLong, TooManyHeaders
from websockets.http11 import Request, Response, parse_headers, parse_line
from websockets.protocol import CONNECTING, Protocol
from websockets.server import ServerProtocol

from services.common import voice_audio, voice_names

log = logging.getLogger("gateway.voices")

PREFIX = "/v1/voices"
SUFFIX = ".f32"
BUNDLED_TTL_S = 10.0  # how long a talker's list of bundled voices is reused


def _json(status: int, obj: dict) -> Response:
    body = json.dumps(obj).encode()
    headers = Headers([("Content-Type", "application/json"), ("Content-Length", str(len(body))),
                       ("Cache-Control", "no-store")])
    return Response(status, http.HTTPStatus(status).phrase, headers, body)


def _error(status: int, code: str, message: str) -> Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return _json(status, {"error": {"type": kind, "code": code, "message": message}})


class VoiceStore:
    """The enrolled voices in one folder (module doc: one atomic file per voice)."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)

    def _path(self, name: str) -> Path:
        assert voice_names.is_enrolled(name)  # callers check: the name is a plain file name then
        return self.dir / f"{name}{SUFFIX}"

    def exists(self, name: str) -> bool:
        return self._path(name).is_file()

    def read(self, name: str) -> bytes | None:
        try:
            return self._path(name).read_bytes()
        except FileNotFoundError:
            return None

    def write(self, name: str, pcm: np.ndarray) -> bool:
        """Store (atomically); True if the name is new."""
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".upload-", suffix=SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(pcm.astype("<f4").tobytes())
            new = not self._path(name).exists()
            os.replace(tmp, self._path(name))
            return new
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def delete(self, name: str) -> bool:
        try:
            self._path(name).unlink()
            return True
        except FileNotFoundError:
            return False

    def list(self) -> list[tuple[str, float]]:
        out = []
        for p in sorted(self.dir.glob(f"*{SUFFIX}")):
            name = p.name[: -len(SUFFIX)]
            if voice_names.is_enrolled(name):
                try:
                    out.append((name, round(p.stat().st_size / 4 / voice_audio.SAMPLE_RATE, 2)))
                except FileNotFoundError:  # deleted meanwhile
                    pass
        return out


class Voices:
    """The /v1/voices routes and the enrolled audio a session's open ships (`for_open`)."""

    def __init__(self, config, pool):
        self.cfg, self.pool = config, pool
        self.upload = bool(config.voice_upload)
        if self.upload and not config.api_key:
            raise ValueError("voice upload needs the gateway's API key (enrollment is never open to anyone)")
        directory = config.voices_dir or Path(tempfile.gettempdir()) / "personaplex-gateway-voices"
        self.store = VoiceStore(directory) if self.upload or config.voices_dir else None
        self._bundled: tuple[float, list[tuple[str, float]]] = (0.0, [])

    def is_enrolled(self, name: str) -> bool:
        """Whether `name` is an enrolled voice now (checked again when a session opens with it)."""
        return self.store is not None and voice_names.is_enrolled(name) and self.store.exists(name)

    def for_open(self, name: str) -> tuple[str, bytes]:
        """(the voice name for the talker, the enrolled audio to ship with it, or b"" for a bundled
        voice). A bare name maps to the enrolled voice of that name; "NAME.pt" too when only an
        enrolled NAME exists (a client that appended the bundled suffix)."""
        if self.store is None or not name:
            return name, b""
        stem = name[:-3] if name.endswith(".pt") else name
        if voice_names.is_enrolled(stem) and (audio := self.store.read(stem)) is not None:
            return stem, audio
        return name, b""

    # ---- routes

    async def handle(self, request: Request) -> Response:
        path = request.path.split("?", 1)[0]
        name = path[len(PREFIX) + 1:] if path.startswith(PREFIX + "/") else None
        method = request.method
        if path == PREFIX and method == "GET":
            return await self._list()
        if name is None:
            return _error(405 if path == PREFIX else 404, "not_found", f"{method} {path[:80]} is not a voices route")
        if method not in ("PUT", "DELETE"):
            return _error(405, "method_not_allowed", "voices take PUT (enroll) and DELETE")
        if not self.upload:
            return _error(403, "voice_upload_disabled", "voice enrollment is off on this server (--voice-upload)")
        if not self._authorized(request):
            return _error(401, "unauthorized", "missing or wrong bearer API key")
        if voice_names.is_bundled(name):
            return _error(403, "bundled_voice", f"{name[:80]!r} is a bundled voice: it cannot be replaced or deleted")
        if not voice_names.is_enrolled(name):
            return _error(400, "invalid_voice_name", f"voice names are 1 to 64 of A-Z a-z 0-9 _ -, got {name[:80]!r}")
        if method == "DELETE":
            if not await asyncio.to_thread(self.store.delete, name):
                return _error(404, "voice_not_found", f"no enrolled voice {name!r}")
            log.info("voice %s deleted", name)
            return _json(200, {"name": name, "deleted": True})
        return await self._enroll(name, request)

    def _authorized(self, request: Request) -> bool:
        key = self.cfg.api_key
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        return bool(key) and scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())

    async def _enroll(self, name: str, request: Request) -> Response:
        body = getattr(request, "body", None)
        if body is None:
            too_big = getattr(request, "body_too_large", None)
            if too_big is not None:
                return _error(413, "voice_too_large", f"the upload is {too_big} bytes, at most "
                                                      f"{self.cfg.voice_upload_bytes} allowed")
            return _error(411, "length_required", "send the audio file as the body, with a Content-Length")
        if not body:
            return _error(400, "empty_audio", "the upload is empty")
        try:
            pcm = await asyncio.to_thread(self._check, body)
        except voice_audio.InvalidVoiceAudio as e:
            return _error(413 if e.kind == "too_long" else 400, e.kind, str(e))
        bundled = {n.rsplit(".", 1)[0] for n, _ in await self._bundled_voices()}
        if name in bundled:
            return _error(403, "bundled_voice", f"{name!r} is the name of a bundled voice")
        created = await asyncio.to_thread(self.store.write, name, pcm)
        seconds = round(pcm.size / voice_audio.SAMPLE_RATE, 2)
        log.info("voice %s %s: %.2f s", name, "enrolled" if created else "replaced", seconds)
        return _json(201 if created else 200, {"name": name, "kind": "enrolled", "seconds": seconds})

    def _check(self, body: bytes) -> np.ndarray:
        pcm = voice_audio.read_audio(body, self.cfg.voice_max_seconds)
        if pcm.size < self.cfg.voice_min_seconds * voice_audio.SAMPLE_RATE:
            raise voice_audio.InvalidVoiceAudio(f"the audio lasts {pcm.size / voice_audio.SAMPLE_RATE:.2f} s, at "
                                                f"least {self.cfg.voice_min_seconds:g} s needed", "too_short")
        voice_audio.check_audible(pcm)
        return pcm

    async def _list(self) -> Response:
        data = [{"name": n, "kind": "bundled", "seconds": s} for n, s in await self._bundled_voices()]
        if self.store is not None:
            data += [{"name": n, "kind": "enrolled", "seconds": s} for n, s in await asyncio.to_thread(self.store.list)]
        return _json(200, {"object": "list", "upload": self.upload, "data": data})

    async def _bundled_voices(self) -> list[tuple[str, float]]:
        """A serving talker's bundled voices, reused for BUNDLED_TTL_S; [] when no talker answers."""
        from duplex.v1 import talker_pb2

        at, voices = self._bundled
        if time.monotonic() - at < BUNDLED_TTL_S:
            return voices
        for cell in self.pool.candidates() or list(self.pool.cells.values()):
            try:
                reply = await cell.stubs["talker"].ListVoices(talker_pb2.ListVoicesRequest(), timeout=2.0)
            except Exception as e:  # that cell is down or older: ask the next
                log.debug("cell %s did not list its voices: %s", cell.name, type(e).__name__)
                continue
            voices = [(v.name, round(v.seconds, 2)) for v in reply.voices if voice_names.is_bundled(v.name)]
            self._bundled = (time.monotonic(), voices)
            return voices
        return voices


# ---- request bodies --------------------------------------------------------------------------------


def accept_voice_uploads(max_body_bytes: int):
    """A `create_connection` for websockets' serve(): its connections also read the body of
    PUT /v1/voices/NAME, at most max_body_bytes (a larger one is flagged for a 413, not read)."""

    def create(protocol: ServerProtocol, *args, **kwargs) -> ServerConnection:
        protocol.parser = _parse(protocol, max_body_bytes)  # nothing was fed yet: replace the primed parser
        next(protocol.parser)
        return ServerConnection(protocol, *args, **kwargs)

    return create


def _parse(p: ServerProtocol, max_body_bytes: int):
    """ServerProtocol.parse with a request parser that reads one upload body."""
    if p.state is CONNECTING:
        try:
            request = yield from _read_request(p.reader, max_body_bytes)
        except (RequestLineTooLong, HeaderLineTooLong, TooManyHeaders) as exc:  # websockets' own replies
            p.handshake_exc = exc
            status = (http.HTTPStatus.REQUEST_URI_TOO_LONG if isinstance(exc, RequestLineTooLong)
                      else http.HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE)
            p.send_response(p.reject(status, f"Failed to open a WebSocket connection: {exc}.\n"))
            yield  # send_response replaced the parser: this one is never resumed
        except Exception as exc:  # as websockets does for a request it cannot parse: close without a reply
            p.handshake_exc = InvalidMessage("did not receive a valid HTTP request")
            p.handshake_exc.__cause__ = exc
            p.send_eof()
            p.parser = p.discard()
            next(p.parser)
            yield
        p.events.append(request)
    yield from Protocol.parse(p)


def _read_request(reader, max_body_bytes: int):
    """websockets' Request.parse, but a PUT to a voice route may carry a Content-Length body."""
    request_line = yield from parse_line(reader.read_line, RequestLineTooLong)
    raw_method, raw_path, raw_protocol = request_line.split(b" ", 2)
    if raw_protocol not in (b"HTTP/1.1", b"HTTP/1.0"):
        raise ValueError("unsupported protocol")
    method, path = raw_method.decode("ascii"), raw_path.decode("ascii")
    headers = yield from parse_headers(reader.read_line)
    if "Transfer-Encoding" in headers:
        raise NotImplementedError("transfer codings aren't supported")
    request = Request(path, headers, method, raw_protocol.decode("ascii"))
    lengths = set(headers.get_all("Content-Length"))
    upload = method == "PUT" and path.startswith(PREFIX + "/")
    if lengths <= {"0"}:
        if upload and lengths:
            request.body = b""  # an empty upload: refused as such, not as a missing length
        return request
    if not upload or len(lengths) != 1:
        raise ValueError("unsupported request body")
    n = int(lengths.pop())
    if not 0 <= n <= max_body_bytes:
        request.body_too_large = n
        return request
    request.body = bytes((yield from reader.read_exact(n)))
    return request
