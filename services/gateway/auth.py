"""Who may open a WebSocket when the operator set an API key, including from a browser.

A browser's WebSocket cannot send an Authorization header, so the gateway takes the credential the
way OpenAI's Realtime API does for browsers:

    POST /v1/realtime/client_secrets    Authorization: Bearer <API key>
        -> {"value": "ek_...", "expires_at": <unix seconds>}    a short-lived client secret
    new WebSocket(url, ["realtime", "openai-insecure-api-key." + value])

A connection is admitted with `Authorization: Bearer <key or client secret>`, or with the
subprotocol `openai-insecure-api-key.<key or client secret>` next to `realtime` (the server then
answers with the `realtime` subprotocol). A client secret only opens connections until it expires;
a connection it opened lives on. Client secrets are an HMAC of the key, so every gateway worker
(and replica with the same key) accepts the ones any of them minted, with no shared state.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time

from websockets.datastructures import Headers

SUBPROTOCOL = "realtime"
KEY_SUBPROTOCOL = "openai-insecure-api-key."
_PREFIX = "ek_"


def _mac(key: str, body: str) -> str:
    return hmac.new(key.encode(), body.encode(), hashlib.sha256).hexdigest()[:32]


def mint(key: str, ttl_s: float, now: float | None = None) -> tuple[str, int]:
    """A client secret valid for `ttl_s` seconds, and its expiry (unix seconds)."""
    expires_at = int((time.time() if now is None else now) + ttl_s)
    body = f"{_PREFIX}{expires_at}_{secrets.token_hex(8)}"
    return f"{body}_{_mac(key, body)}", expires_at


def accepts(key: str, credential: str, now: float | None = None) -> bool:
    """True when `credential` is the API key itself or an unexpired client secret minted with it."""
    if hmac.compare_digest(credential.encode(), key.encode()):
        return True
    body, _, mac = credential.rpartition("_")
    parts = body[len(_PREFIX):].split("_")
    expiry = parts[0] if body.startswith(_PREFIX) and len(parts) == 2 else ""
    if not (expiry.isascii() and expiry.isdigit() and len(expiry) <= 12):  # 12 digits: no huge int() to parse
        return False
    if int(expiry) < (time.time() if now is None else now):
        return False
    return hmac.compare_digest(mac.encode(), _mac(key, body).encode())


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
