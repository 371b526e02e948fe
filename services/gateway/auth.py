"""Who may open a WebSocket when the operator set an API key, including from a browser.

A browser's WebSocket cannot send an Authorization header, so the gateway takes the credential the
way OpenAI's Realtime API does for browsers:

    POST /v1/realtime/client_secrets    Authorization: Bearer <API key>
        -> {"value": "ek_...", "expires_at": <unix seconds>}    a short-lived client secret
    new WebSocket(url, ["realtime", "openai-insecure-api-key." + value])

A connection is admitted with `Authorization: Bearer <key or client secret>`, or with the
subprotocol `openai-insecure-api-key.<key or client secret>` next to `realtime` (the server then
answers with the `realtime` subprotocol). Client secrets are an HMAC of the key, so every gateway
worker (and replica with the same key) accepts the ones any of them minted, with no shared state.

`ClientSecrets` keeps this process's part (server.py has one):
- minting is rate-limited per key: `rate_per_s` a second after a burst of `burst` (a token
  bucket), then 429 with the seconds to wait;
- a client secret opens one connection, until it expires: this process remembers the ones spent
  (at most SPENT_MAX unexpired; past that new ones are refused until some expire). Nothing is
  shared between processes, so with `--workers N` one secret opens at most N connections, one per
  worker. A connection it opened lives on after the expiry.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import secrets
import time
from collections import OrderedDict

from websockets.datastructures import Headers

SUBPROTOCOL = "realtime"
KEY_SUBPROTOCOL = "openai-insecure-api-key."
_PREFIX = "ek_"
SPENT_MAX = 8192  # unexpired spent secrets one process remembers (~1 MB)


def _mac(key: str, body: str) -> str:
    return hmac.new(key.encode(), body.encode(), hashlib.sha256).hexdigest()[:32]


def mint(key: str, ttl_s: float, now: float | None = None) -> tuple[str, int]:
    """A client secret valid for `ttl_s` seconds, and its expiry (unix seconds)."""
    expires_at = int((time.time() if now is None else now) + ttl_s)
    body = f"{_PREFIX}{expires_at}_{secrets.token_hex(8)}"
    return f"{body}_{_mac(key, body)}", expires_at


def accepts(key: str, credential: str, now: float | None = None) -> bool:
    """True when `credential` is the API key itself or an unexpired client secret minted with it."""
    return is_key(key, credential) or secret_expiry(key, credential, now) is not None


def is_key(key: str, credential: str) -> bool:
    return hmac.compare_digest(credential.encode(), key.encode())


def secret_expiry(key: str, credential: str, now: float | None = None) -> int | None:
    """The expiry (unix seconds) of an unexpired client secret minted with `key`; None for anything else."""
    body, _, mac = credential.rpartition("_")
    parts = body[len(_PREFIX):].split("_")
    expiry = parts[0] if body.startswith(_PREFIX) and len(parts) == 2 else ""
    if not (expiry.isascii() and expiry.isdigit() and len(expiry) <= 12):  # 12 digits: no huge int() to parse
        return None
    if int(expiry) < (time.time() if now is None else now):
        return None
    return int(expiry) if hmac.compare_digest(mac.encode(), _mac(key, body).encode()) else None


def bearer_is_key(key: str | None, headers: Headers) -> bool:
    """The request's `Authorization: Bearer` token is the API key itself (never a client secret)."""
    scheme, _, token = headers.get("Authorization", "").partition(" ")
    return bool(key) and scheme.lower() == "bearer" and is_key(key, token.strip())


class Admission(enum.Enum):
    KEY = "key"  # the API key (or no key is configured)
    SECRET = "secret"  # an unexpired client secret, spent now
    SPENT = "spent"  # a client secret that already opened a connection here
    BUSY = "busy"  # a valid secret, but SPENT_MAX unexpired secrets are remembered: retry shortly
    REFUSED = "refused"  # no credential, or a wrong or expired one


class RateLimited(Exception):
    def __init__(self, retry_after_s: int):
        super().__init__(f"retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


class ClientSecrets:
    """This process's minting rate and spent secrets (module doc)."""

    def __init__(self, key: str | None, ttl_s: float, rate_per_s: float, burst: int):
        self.key, self.ttl_s, self.rate_per_s, self.burst = key or "", ttl_s, rate_per_s, burst
        self._tokens, self._at = float(burst), time.monotonic()
        self._spent: OrderedDict[str, int] = OrderedDict()  # secret -> its expiry, in spending order

    def mint(self) -> tuple[str, int]:
        """A new client secret and its expiry; RateLimited past the rate."""
        if self.rate_per_s > 0:
            now = time.monotonic()
            self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.rate_per_s)
            self._at = now
            if self._tokens < 1:
                raise RateLimited(max(1, int(-(-(1 - self._tokens) // self.rate_per_s))))
            self._tokens -= 1
        return mint(self.key, self.ttl_s)

    def admit(self, headers: Headers) -> Admission:
        """Whether a connection offering these credentials may open; a client secret is spent here."""
        if not self.key:
            return Admission.KEY
        outcome = Admission.REFUSED
        now = time.time()
        for credential in offered_credentials(headers):
            if is_key(self.key, credential):
                return Admission.KEY
            expiry = secret_expiry(self.key, credential, now)
            if expiry is None:
                continue
            self._forget_expired(now)
            if credential in self._spent:
                outcome = Admission.SPENT
            elif len(self._spent) >= SPENT_MAX:
                outcome = Admission.BUSY
            else:
                self._spent[credential] = expiry
                return Admission.SECRET
        return outcome

    def _forget_expired(self, now: float) -> None:
        # Spent in order, with one TTL: expiries come nearly in order; a late one waits behind an early one.
        while self._spent and next(iter(self._spent.values())) < now:
            self._spent.popitem(last=False)


def offered_credentials(headers: Headers) -> list[str]:
    """What a request offers: its bearer token and any `openai-insecure-api-key.` subprotocol."""
    out = []
    scheme, _, token = headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        out.append(token.strip())
    for value in headers.get_all("Sec-WebSocket-Protocol"):
        out += [p.strip()[len(KEY_SUBPROTOCOL):] for p in value.split(",") if p.strip().startswith(KEY_SUBPROTOCOL)]
    return out


def select_subprotocol(connection, offered) -> str | None:
    """Answer `realtime` when the client offers it (a browser that offers subprotocols needs one
    back); never the key subprotocol, and no subprotocol for a client that offers none."""
    return SUBPROTOCOL if SUBPROTOCOL in offered else None
