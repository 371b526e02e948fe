"""Server events checked against the `openai` package's typed models, strictly (no coercion).

The duplex wire (vLLM-Omni) adds two events of its own that OpenAI's protocol has no model for, and this
server a third (session.resumed: services/gateway/resume.py).
Legacy (beta-named) sessions are checked against the beta models, except the session object: the
beta model pins `model` to OpenAI's model names, so session.created/updated are checked as GA.
"""

from __future__ import annotations

from openai.types.beta.realtime import RealtimeServerEvent as BetaServerEvent
from openai.types.realtime import RealtimeServerEvent
from pydantic import TypeAdapter

GA = TypeAdapter(RealtimeServerEvent)
BETA = TypeAdapter(BetaServerEvent)
DUPLEX_ONLY = {"session.closed", "session.heartbeat_ack", "session.resumed"}


def validate_server_event(event: dict, legacy: bool = False) -> None:
    """Raises pydantic.ValidationError when the event does not match its typed model."""
    if event.get("type") in DUPLEX_ONLY:
        return
    beta = legacy and not event.get("type", "").startswith("session.")
    (BETA if beta else GA).validate_python(event, strict=True)
