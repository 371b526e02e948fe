"""Voices on the gateway: the list, and enrollment from audio.

    GET    /v1/voices          {"object": "list", "upload": bool, "data": [{"name", "kind", "seconds"}],
                               "has_more": bool, "last_id": name | null}: the bundled voices (asked of a
                               talker, by name), then the enrolled ones (by name). ?limit=1..100 (100)
                               and ?after=NAME (the previous page's last_id) page through it
    PUT    /v1/voices/NAME     body: an audio file sphn reads (wav, flac, mp3, ogg): enrolls NAME (201)
                               or replaces it (200)
    DELETE /v1/voices/NAME     forgets NAME, and the talkers' recordings of its audio (200):
                               {"name", "deleted": true, "recordings": [{"talker", "outcome"}]}

PUT and DELETE exist only with --voice-upload, which needs the gateway's API key (Bearer); GET is
open, like the page. Names are [A-Za-z0-9_-]{1,64} (services/common/voice_names.py). A name may not
shadow what clients already name: a bundled voice ("NATF2.pt", or "NATF2") can be neither
overwritten nor deleted (403 bundled_voice), and a voice alias ("marin", any case) cannot be
enrolled (409 voice_name_reserved; an old file of that name is ignored). At most `max_voices`
voices and `voices_total_bytes` of stored audio (409 voice_limit_reached; replacing a voice counts
its new size only). An upload is at most `voice_upload_bytes` bytes and, decoded,
`voice_min_seconds`..`voice_max_seconds` long; audio that is not audio, is empty, silent, too short
or too long is a 4xx with a typed code.

Before any byte of a body is read (`before_body`, from the request parser): the route, the key, the
name and the length are checked, so an unauthenticated or refused upload costs nothing. The audio
is then decoded and checked in a bounded child process (services/common/audio_sandbox.py): a
decoder bomb or a decoder crash is a typed 4xx, never the gateway's memory or its event loop.

Storage: one file per voice, DIR/NAME.f32: float32 samples at 24 kHz, the upload's first channel,
not normalised (the talker records it exactly as the reference records an audio file). Written
to a temporary file and renamed under a lock on DIR itself (the caps are checked under it), so a
half-written voice is never visible, and of two uploads of one name the later rename wins whole.
The gateway's workers share DIR; gateways on several hosts share it as a volume. A session's open
reads the file and ships the samples to the talker (TalkOpen.voice_audio), so every cell can use
every enrolled voice, and a voice deleted while sessions use it only stops new sessions.

Recordings. Each talker records a voice's audio once and keeps the recording (memory and disk
cache, each bounded in bytes, keyed by the samples' sha256). A DELETE, and a PUT that replaces a
voice, then asks every talker it knows to forget the old audio's recording (recordings.py:
ForgetVoice, within voice_forget_timeout_s each). The DELETE answers 200 whatever the talkers
say, since the name is gone either way, and lists each talker's outcome: "forgotten",
"deferred" (a session starting with it keeps it until its prompt is in its slot; sessions
already talking never read it again), "not_held", or, unconfirmed, "unreachable", "timed_out",
"refused". An unconfirmed talker keeps the recording until its own bounds evict it
(gateway_voice_forgets_total{outcome} counts each). The same audio enrolled under two names
shares one recording: deleting one name makes the other's next session record it again.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import numpy as np
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from services.common import audio_sandbox, voice_audio, voice_names
from services.gateway import auth
from services.gateway.http_requests import error_response as _error
from services.gateway.http_requests import json_response as _json
from services.gateway.recordings import Pruned, audio_sha256, forget_everywhere

log = logging.getLogger("gateway.voices")

PREFIX = "/v1/voices"
SUFFIX = ".f32"
BUNDLED_TTL_S = 10.0  # how long a talker's list of bundled voices is reused
MAX_PAGE = 100  # voices in one GET /v1/voices answer (and its default)


class VoiceLimit(Exception):
    """Storing one more voice would pass max_voices or voices_total_bytes."""


class VoiceStore:
    """The enrolled voices in one folder (module doc: one atomic file per voice, caps under a lock)."""

    def __init__(self, directory: str | Path, max_voices: int, max_bytes: int):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_voices, self.max_bytes = max_voices, max_bytes

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

    def write(self, name: str, pcm: np.ndarray) -> bytes | None:
        """Store (atomically, within the caps); the audio it replaced, or None if the name is new.
        VoiceLimit past a cap."""
        data = pcm.astype("<f4").tobytes()
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".upload-", suffix=SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            with self._locked():
                sizes = self._sizes()
                new = name not in sizes
                sizes[name] = len(data)
                if len(sizes) > self.max_voices or sum(sizes.values()) > self.max_bytes:
                    raise VoiceLimit(f"at most {self.max_voices} voices and {self.max_bytes} bytes of audio are kept "
                                     f"(now {len(sizes) - new} voices, {sum(sizes.values()) - len(data)} bytes "
                                     f"without this one): delete one first")
                old = None if new else self.read(name)
                os.replace(tmp, self._path(name))
            return old
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def is_full(self) -> bool:
        """No room for one more voice (by count): checked before an upload's body is read."""
        return len(self._sizes()) >= self.max_voices

    @contextmanager
    def _locked(self):
        fd = os.open(self.dir, os.O_RDONLY)  # the folder itself: workers and other gateways on this host
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _sizes(self) -> dict[str, int]:
        out = {}
        for p in self.dir.glob(f"*{SUFFIX}"):
            name = p.name[: -len(SUFFIX)]
            if voice_names.is_enrolled(name):
                try:
                    out[name] = p.stat().st_size
                except FileNotFoundError:  # deleted meanwhile
                    pass
        return out

    def delete(self, name: str) -> bytes | None:
        """Remove a voice; its audio (for the talkers' recordings to be forgotten), or None if there was none."""
        with self._locked():  # read and removed together: a PUT of the name waits, then writes anew
            audio = self.read(name)
            if audio is not None:
                self._path(name).unlink(missing_ok=True)
            return audio

    def list(self) -> list[tuple[str, float]]:
        """(name, seconds) of every voice, by name."""
        return [(name, round(size / 4 / voice_audio.SAMPLE_RATE, 2)) for name, size in sorted(self._sizes().items())]


class Voices:
    """The /v1/voices routes and the enrolled audio a session's open ships (`for_open`)."""

    def __init__(self, config, pool, metrics=None):
        """metrics: GatewayMetrics (its voice_forgets counter), or None."""
        self.cfg, self.pool, self.metrics = config, pool, metrics
        self.upload = bool(config.voice_upload)
        if self.upload and not config.api_key:
            raise ValueError("voice upload needs the gateway's API key (enrollment is never open to anyone)")
        directory = config.voices_dir or Path(tempfile.gettempdir()) / "personaplex-gateway-voices"
        self.store = (VoiceStore(directory, config.max_voices, config.voices_total_bytes)
                      if self.upload or config.voices_dir else None)
        self.aliases = {name.lower() for name, _ in config.voice_aliases}
        self._bundled: tuple[float, list[tuple[str, float]]] = (0.0, [])

    def is_enrolled(self, name: str) -> bool:
        """Whether `name` is an enrolled voice now (checked again when a session opens with it)."""
        return (self.store is not None and voice_names.is_enrolled(name) and name.lower() not in self.aliases
                and self.store.exists(name))

    def for_open(self, name: str) -> tuple[str, bytes]:
        """(the voice name for the talker, the enrolled audio to ship with it, or b"" for a bundled
        voice). A bare name maps to the enrolled voice of that name; "NAME.pt" too when only an
        enrolled NAME exists (a client that appended the bundled suffix)."""
        if self.store is None or not name:
            return name, b""
        stem = name[:-3] if name.endswith(".pt") else name
        if (voice_names.is_enrolled(stem) and stem.lower() not in self.aliases
                and (audio := self.store.read(stem)) is not None):
            return stem, audio
        return name, b""

    # ---- routes

    def before_body(self, path: str, headers: Headers, length: int | None) -> Response | None:
        """For PUT /v1/voices/NAME, on the request's head alone: the refusal, or None to read the body."""
        refusal = self._refusal("PUT", path[len(PREFIX) + 1:], headers)
        if refusal is not None:
            return refusal
        if length is None:
            return _error(411, "length_required", "send the audio file as the body, with a Content-Length")
        if length > self.cfg.voice_upload_bytes:
            return _error(413, "voice_too_large", f"the upload is {length} bytes, at most "
                                                  f"{self.cfg.voice_upload_bytes} allowed")
        return None

    def _refusal(self, method: str, name: str, headers: Headers) -> Response | None:
        """What refuses a PUT or DELETE of `name` before its audio matters (the same before and after
        the body is read)."""
        if not self.upload:
            return _error(403, "voice_upload_disabled", "voice enrollment is off on this server (--voice-upload)")
        if not auth.bearer_is_key(self.cfg.api_key, headers):
            return _error(401, "unauthorized", "missing or wrong bearer API key")
        if voice_names.is_bundled(name):
            return _error(403, "bundled_voice", f"{name[:80]!r} is a bundled voice: it cannot be replaced or deleted")
        if not voice_names.is_enrolled(name):
            return _error(400, "invalid_voice_name", f"voice names are 1 to 64 of A-Z a-z 0-9 _ -, got {name[:80]!r}")
        if method == "PUT" and name.lower() in self.aliases:
            return _error(409, "voice_name_reserved", f"{name!r} is a voice alias clients use (--voice-aliases): "
                                                      "enroll it under another name")
        if method == "PUT" and name in {n.rsplit(".", 1)[0] for n, _ in self._bundled[1]}:
            return _error(403, "bundled_voice", f"{name!r} is the name of a bundled voice")
        if method == "PUT" and not self.store.exists(name) and self.store.is_full():
            return _error(409, "voice_limit_reached", f"at most {self.cfg.max_voices} voices are enrolled: "
                                                      "delete one first")
        return None

    async def handle(self, request: Request) -> Response:
        url = urlsplit(request.path)
        path = url.path
        name = path[len(PREFIX) + 1:] if path.startswith(PREFIX + "/") else None
        method = request.method
        if path == PREFIX and method == "GET":
            return await self._list(dict(parse_qsl(url.query)))
        if name is None:
            return _error(405 if path == PREFIX else 404, "not_found", f"{method} {path[:80]} is not a voices route")
        if method not in ("PUT", "DELETE"):
            return _error(405, "method_not_allowed", "voices take PUT (enroll) and DELETE")
        refusal = await asyncio.to_thread(self._refusal, method, name, request.headers)
        if refusal is not None:
            return refusal
        if method == "DELETE":
            audio = await asyncio.to_thread(self.store.delete, name)
            if audio is None:
                return _error(404, "voice_not_found", f"no enrolled voice {name!r}")
            pruned = await self._forget_recordings(audio)
            log.info("voice %s deleted (talkers: %s)", name, ", ".join(f"{t} {o.value}" for t, o in pruned.items()))
            return _json(200, {"name": name, "deleted": True,
                               "recordings": [{"talker": t, "outcome": o.value} for t, o in sorted(pruned.items())]})
        return await self._enroll(name, request)

    async def _forget_recordings(self, audio: bytes) -> dict[str, Pruned]:
        """Every known talker forgets its recording of `audio` (recordings.py); each talker's outcome."""
        pruned = await forget_everywhere(list(self.pool.cells.values()), audio, self.cfg.voice_forget_timeout_s)
        if self.metrics is not None:
            for outcome in pruned.values():
                self.metrics.voice_forgets.labels(outcome.value).inc()
        return pruned

    async def _enroll(self, name: str, request: Request) -> Response:
        body = getattr(request, "body", None)  # the request parser read it (before_body said yes)
        if body is None:
            return _error(411, "length_required", "send the audio file as the body, with a Content-Length")
        if not body:
            return _error(400, "empty_audio", "the upload is empty")
        bundled = {n.rsplit(".", 1)[0] for n, _ in await self._bundled_voices()}
        if name in bundled:
            return _error(403, "bundled_voice", f"{name!r} is the name of a bundled voice")
        try:
            pcm = await audio_sandbox.check_voice_apart(body, self.cfg.voice_min_seconds, self.cfg.voice_max_seconds)
        except voice_audio.InvalidVoiceAudio as e:
            return _error(413 if e.kind == "too_long" else 400, e.kind, str(e))
        try:
            replaced = await asyncio.to_thread(self.store.write, name, pcm)
        except VoiceLimit as e:
            return _error(409, "voice_limit_reached", str(e))
        seconds = round(pcm.size / voice_audio.SAMPLE_RATE, 2)
        log.info("voice %s %s: %.2f s", name, "enrolled" if replaced is None else "replaced", seconds)
        if replaced is not None and audio_sha256(replaced) != audio_sha256(pcm.astype("<f4").tobytes()):
            await self._forget_recordings(replaced)  # the old audio's: no session ships it again
        return _json(201 if replaced is None else 200, {"name": name, "kind": "enrolled", "seconds": seconds})

    async def _list(self, query: dict[str, str]) -> Response:
        limit_text, after = query.get("limit", str(MAX_PAGE)), query.get("after", "")
        if not (limit_text.isascii() and limit_text.isdigit() and len(limit_text) <= 3
                and 1 <= int(limit_text) <= MAX_PAGE):
            return _error(400, "invalid_limit", f"limit is an integer from 1 to {MAX_PAGE}")
        data = [{"name": n, "kind": "bundled", "seconds": s} for n, s in await self._bundled_voices()]
        if self.store is not None:
            data += [{"name": n, "kind": "enrolled", "seconds": s} for n, s in await asyncio.to_thread(self.store.list)
                     if n.lower() not in self.aliases]
        if after:  # the order: bundled then enrolled, each by name (a bundled name has a '.', an enrolled one not)
            key = lambda v: (v["kind"] != "bundled", v["name"])  # noqa: E731
            mark = (not voice_names.is_bundled(after), after)
            data = [v for v in data if key(v) > mark]
        page = data[: int(limit_text)]
        return _json(200, {"object": "list", "upload": self.upload, "data": page, "has_more": len(data) > len(page),
                           "last_id": page[-1]["name"] if page else None})

    async def _bundled_voices(self) -> list[tuple[str, float]]:
        """A serving talker's bundled voices (by name), reused for BUNDLED_TTL_S; [] when no talker answers."""
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
            voices = sorted((v.name, round(v.seconds, 2)) for v in reply.voices if voice_names.is_bundled(v.name))
            self._bundled = (time.monotonic(), voices)
            return voices
        return voices
