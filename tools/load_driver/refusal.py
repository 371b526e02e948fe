"""A typed retry-later: what counts as one, and the delay it asks for.

A try is refused when, before the caller heard any audio, the server said "not now" in a typed way:
  - a Realtime `error` whose code is server_busy or resource_exhausted;
  - a WebSocket close with code 1013 (try again later);
  - HTTP 503 at the WebSocket handshake.
The delay is the server's: `error.retry_after_s` (seconds), the hint the error's message ends with
("... retry in 1.5 s", services/common/errors.py), or the Retry-After header (seconds); without one,
FALLBACK_DELAY_S. after_created says the session had been created first: an SDK open that
lost its slot at its session.update, not a refusal up front.
Anything else that ends a try is not a refusal: before admission a failure, after it a kill or a
failure (load.py's call_status).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from services.common.errors import parse_retry_hint

from .validate import AUDIO_DELTA_TYPES

RETRY_LATER_CODES = ("server_busy", "resource_exhausted")
RETRY_LATER_CLOSE = 1013
RETRY_LATER_HTTP = 503
FALLBACK_DELAY_S = 1.0


@dataclass(frozen=True)
class Refusal:
    kind: str  # "error" | "close" | "http"
    code: str  # the error code, the close code or the HTTP status
    after_created: bool
    retry_after_s: float | None  # the delay the server gave, if any
    at_s: float  # when it came (time.monotonic())

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.code}"

    def delay_s(self, most_s: float) -> float:
        """How long to wait before the next try: the server's delay (at most `most_s`), else the fallback."""
        return FALLBACK_DELAY_S if self.retry_after_s is None else min(self.retry_after_s, most_s)

    def as_row(self) -> dict[str, Any]:
        return {"type": self.name, "after_created": self.after_created, "retry_after_s": self.retry_after_s,
                "at_s": self.at_s}


def _seconds(value: Any) -> float | None:
    """A non-negative finite number of seconds, from a number or its text; None otherwise."""
    if isinstance(value, bool):
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def event_refusal(events: list[dict[str, Any]], received_at: list[float], close_code: int | None,
                  closed_at: float | None) -> Refusal | None:
    """The typed retry-later that ended a try before any audio delta arrived, or None."""
    created = False
    for event, at in zip(events, received_at):
        kind = event["type"]
        if kind in AUDIO_DELTA_TYPES:
            return None
        created = created or kind == "session.created"
        body = event.get("error") if kind == "error" else None
        if isinstance(body, dict) and body.get("code") in RETRY_LATER_CODES:
            delay = _seconds(body.get("retry_after_s"))
            if delay is None and isinstance(body.get("message"), str):
                delay = parse_retry_hint(body["message"])
            return Refusal("error", body["code"], created, delay, at)
    if close_code == RETRY_LATER_CLOSE:
        return Refusal("close", str(RETRY_LATER_CLOSE), created, None, closed_at or 0.0)
    return None


def http_refusal(status: int, headers: Any, at: float) -> Refusal | None:
    """HTTP 503 at the handshake (its Retry-After in seconds, if it gives one), or None for another status."""
    if status != RETRY_LATER_HTTP:
        return None
    return Refusal("http", str(status), False, _seconds(headers.get("Retry-After")), at)
