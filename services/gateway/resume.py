"""Session resume on the Realtime wire: the tokens, and which paused session a reconnect takes.

A Realtime session's `session.created` carries `resume_token`. When the client's connection goes away
without a close frame (a network switch, a Wi-Fi blink, the gateway's send deadline or keepalive), the
session is PAUSED instead of ended (session.py): its relay and stage sessions stay open in the same slot,
nothing is sent to the stages, and the talker, which steps no session without input, stays where it was.
A client reconnects within `resume_grace_s` with

    ws://HOST/v1/realtime?session_id=<id>      and the token as the header  X-Resume-Token: <token>
                                               or as the subprotocol       personaplex-resume-token.<token>

(the subprotocol for browsers, which cannot set headers) and its API key as for any connection. The
session goes on over the new connection: `session.resumed` first, then what was queued and not written
when the drop was noticed, then the stream. Output the model produced while paused is dropped and counted.

The token: `w<worker>.<nonce>.<mac>` with a fresh `secrets.token_urlsafe` nonce and an HMAC-SHA256, under
this process's secret, over the worker, the nonce, the session id and a digest of the API key (if one is
set), compared with hmac.compare_digest. It is bound to this session and this key; a token minted under
another key, or for another session id, does not verify.

`Resumes` (one per gateway process, in GatewayContext) maps tokens to the sessions that may be resumed,
remembers the last MAX_ENDED sessions that ended (to tell "expired" from "unknown"), and answers a resume's
handshake before the 101 with a typed refusal (`ResumeRefused`: an HTTP status and an error code) or a
claim: the session moves PAUSED -> RESUMING at once, on the event loop, so of two concurrent resumes one
claims it and the other is refused `session_in_use`.

Another worker: with `--workers N` a resume that lands on a worker other than the one its token names is
handed to that worker over a private Unix socket before anything answers it (resume_relay.py), so the
owner checks it and serves it as here. A token of another pod (another process secret) is refused 403
`invalid_resume_token`, or 421 `resume_wrong_worker` when it names a worker this gateway lacks.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import secrets
from typing import TYPE_CHECKING

from websockets.datastructures import Headers

if TYPE_CHECKING:
    from services.gateway.session import ClientSession

HEADER = "X-Resume-Token"
SUBPROTOCOL = "personaplex-resume-token."
MAX_TOKEN_CHARS = 128  # longer is not ours: refused before any parsing
MAX_ENDED = 4096  # ended sessions remembered for `session_expired` (a nonce each, ~100 bytes)


class ResumeRefused(Exception):
    """A resume's handshake refused: `status` is the HTTP answer, `code` the typed error."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def offered_token(headers: Headers) -> str | None:
    """The resume token a request offers: the header, else a `personaplex-resume-token.` subprotocol."""
    if (value := headers.get(HEADER)) is not None:
        return value.strip()
    for value in headers.get_all("Sec-WebSocket-Protocol"):
        for p in value.split(","):
            if p.strip().startswith(SUBPROTOCOL):
                return p.strip()[len(SUBPROTOCOL):]
    return None


def token_worker(token: str) -> int | None:
    """The worker a well-formed token names (`w<worker>.<nonce>.<mac>`), None for a malformed one. Not a
    check of the token: only the worker that minted it can tell (its MAC is under that process's secret)."""
    parts = token.split(".") if len(token) <= MAX_TOKEN_CHARS else []
    worker = parts[0][1:] if len(parts) == 3 and parts[0].startswith("w") else ""
    if not (worker.isascii() and worker.isdigit() and len(worker) <= 4):
        return None
    return int(worker)


class ResumeTokens:
    """Mint and check tokens under one process secret, for one worker and one API key."""

    def __init__(self, worker: int, api_key: str | None, secret: bytes | None = None):
        self.worker = worker
        self._secret = secret or secrets.token_bytes(32)
        self._key_digest = hashlib.sha256((api_key or "").encode()).hexdigest()

    def _mac(self, worker: int, nonce: str, session_id: str) -> str:
        body = f"{worker}.{nonce}.{session_id}.{self._key_digest}".encode()
        return hmac.new(self._secret, body, hashlib.sha256).hexdigest()[:43]

    def mint(self, session_id: str) -> tuple[str, str]:
        """(token, nonce) for a new resumable session."""
        nonce = secrets.token_urlsafe(16)
        return f"w{self.worker}.{nonce}.{self._mac(self.worker, nonce, session_id)}", nonce

    def verify(self, token: str, session_id: str) -> str:
        """The nonce of a token this process minted for `session_id`; ResumeRefused otherwise."""
        worker = token_worker(token)
        if worker is None:
            raise ResumeRefused(403, "invalid_resume_token", "the resume token is malformed")
        if worker != self.worker:  # with --workers N, resume_relay.py hands such a resume to its worker first
            raise ResumeRefused(421, "resume_wrong_worker",
                                f"the session lives on gateway worker {worker}, this is worker {self.worker} "
                                "(a token of another gateway, or of another pod)")
        _, nonce, mac = token.split(".")
        if not hmac.compare_digest(mac.encode(), self._mac(self.worker, nonce, session_id).encode()):
            raise ResumeRefused(403, "invalid_resume_token",
                                "the resume token does not belong to this session id (or was minted under "
                                "another API key)")
        return nonce


class Resumes:
    """This process's resumable sessions (module doc). Everything runs on the event loop."""

    def __init__(self, tokens: ResumeTokens, grace_s: float):
        self.tokens = tokens
        self.grace_s = grace_s
        self.shutting_down = False  # the gateway is stopping: a lost connection ends its session
        self._sessions: dict[str, ClientSession] = {}  # nonce -> session
        self._nonces: dict[int, str] = {}  # id(session) -> nonce
        self._ended: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._claims: dict[object, ClientSession] = {}  # a resume's connection -> the session it claimed

    @property
    def enabled(self) -> bool:
        return self.grace_s > 0

    def register(self, session: ClientSession) -> str:
        """A new resumable session: its token (session.created carries it)."""
        token, nonce = self.tokens.mint(session.session_id)
        self._sessions[nonce] = session
        self._nonces[id(session)] = nonce
        return token

    def forget(self, session: ClientSession) -> None:
        """The session ended: its token now answers `session_expired`."""
        nonce = self._nonces.pop(id(session), None)
        if nonce is None:
            return
        self._sessions.pop(nonce, None)
        self._ended[nonce] = None
        while len(self._ended) > MAX_ENDED:
            self._ended.popitem(last=False)
        self.unclaim(session)

    def claim(self, session_id: str, token: str, conn: object) -> ClientSession:
        """The paused session this resume takes, now RESUMING for `conn`; ResumeRefused otherwise."""
        if not self.enabled or self.shutting_down:
            raise ResumeRefused(404, "session_not_found", "this gateway does not resume sessions"
                                if not self.enabled else "this gateway is shutting down")
        nonce = self.tokens.verify(token, session_id)
        session = self._sessions.get(nonce)
        if session is None:
            if nonce in self._ended:
                raise ResumeRefused(410, "session_expired", f"session {session_id} has ended (closed, or its "
                                    f"{self.grace_s:g} s resume grace period ran out)")
            raise ResumeRefused(404, "session_not_found", f"no session {session_id} on this gateway worker")
        if not session.claim_resume(conn):
            raise ResumeRefused(409, "session_in_use", f"session {session_id} is not paused: its connection has "
                                "not dropped (as far as the gateway knows) or another resume holds it")
        self._claims[conn] = session
        return session

    def take_claim(self, conn: object) -> ClientSession | None:
        """The session this upgraded connection claimed at its handshake (None: not a resume)."""
        return self._claims.pop(conn, None)

    def unclaim(self, session: ClientSession) -> None:
        """The session's claim lapsed (the resuming connection never came)."""
        for conn in [c for c, s in self._claims.items() if s is session]:
            del self._claims[conn]

    def end_paused(self) -> None:
        """At shutdown: every paused session ends now (its grace would keep the gateway waiting)."""
        self.shutting_down = True
        for session in list(self._sessions.values()):
            session.end_if_paused()
