""""Say this" on the Realtime wire: text an application has the model speak, sent to the talker as TalkSay.

What says (realtime.py calls these):
- `conversation.item.create` of an assistant message with text parts (`output_text`, `text`): their
  text, joined by spaces. The item is recorded as any client item (conversation.py). An assistant
  item with only audio parts (a transcript of earlier speech) is recorded and not said.
- `response.create` with `response.instructions` (a server extension): the instructions are the words
  to say. A PersonaPlex persona is fixed once primed, so a response's instructions cannot instruct it;
  saying them lets LiveKit's `generate_reply(instructions=...)` reach the voice.
- `response.cancel` (and every barge-in: a truncate or delete of the playing item) drops what is not
  said yet of every say (TalkSayCancel).

The text is tokenized at the talker, not here: the talker holds the model's tokenizer and forces the
tokens by the model's text-stream rules (services/talker/say.py), and its token bound lives beside
the queue it bounds; the gateway knows the stages only through the contract. Here: the length bound
in characters, checked before anything is sent, and the says awaiting the talker's answer (each
answered exactly once, say_done or say_refused), at most MAX_PENDING_SAYS. A talker refusal comes
back as an `error` event echoing the asking event's event_id.

Errors: invalid_request_error `say_too_long` (over MAX_SAY_CHARS characters, or over the talker's
token bound), `bad_say` (no word to say, a control character, a `<system>` tag, instructions that
are not a string), `session_not_started` (no session open yet); rate_limit_error `say_queue_full`
(MAX_PENDING_SAYS unanswered here, or the talker's queued tokens at their bound).
"""

from __future__ import annotations

import collections
from typing import Callable

from duplex.v1 import talker_pb2
from services.gateway.realtime_wire import ClientError

MAX_SAY_CHARS = 2000  # as the talker's default max_say_chars: a longer text is refused here, before it is sent
MAX_PENDING_SAYS = 64  # says sent and not yet answered by the talker
_TEXT_PARTS = ("output_text", "text")  # assistant content parts whose text is said
_TYPES = {"say_queue_full": "rate_limit_error"}  # the talker's refusal kind -> error type (else invalid_request)


def item_say_text(role: str, content: list[dict]) -> str | None:
    """The text an assistant message item says (its text parts joined by spaces), or None."""
    if role != "assistant":
        return None
    text = " ".join(p["text"] for p in content if p["type"] in _TEXT_PARTS and p.get("text", "").strip())
    return text or None


def response_say_text(event: dict) -> str | None:
    """A response.create's `response.instructions` to say, or None (absent or empty)."""
    response = event.get("response")
    if not isinstance(response, dict) or response.get("instructions") is None:
        return None
    text = response["instructions"]
    if not isinstance(text, str):
        raise ClientError("bad_say", "response.instructions must be a string (the words to say)",
                          "response.instructions")
    return text if text.strip() else None


class SayRequests:
    """One Realtime session's says in flight to the talker. `send` queues a TalkRequest on the session's
    talker stream (relay.Relay.talk). Touched only from the event loop."""

    def __init__(self, send: Callable[[talker_pb2.TalkRequest], None]):
        self._send = send
        self._next_id = 0
        self.pending: collections.OrderedDict[int, str | None] = collections.OrderedDict()  # id -> event_id

    def say(self, text: str, event_id: str | None, param: str) -> int:
        """Send one say (ClientError: refused here, nothing sent). Returns its id."""
        if len(text) > MAX_SAY_CHARS:
            raise ClientError("say_too_long", f"a say has at most {MAX_SAY_CHARS} characters, got {len(text)}",
                              param)
        if len(self.pending) >= MAX_PENDING_SAYS:
            raise ClientError("say_queue_full", f"{MAX_PENDING_SAYS} says wait for the model already; send more "
                              "once some are said, or response.cancel", param, type_="rate_limit_error")
        self._next_id += 1
        self.pending[self._next_id] = event_id
        self._send(talker_pb2.TalkRequest(say=talker_pb2.TalkSay(id=self._next_id, text=text)))
        return self._next_id

    def cancel_all(self) -> None:
        """Drop what is not yet said of every say (their say_done answers come back CANCELLED)."""
        if self.pending:
            self._send(talker_pb2.TalkRequest(say_cancel=talker_pb2.TalkSayCancel(id=0)))

    def answered(self, resp: talker_pb2.TalkResponse) -> tuple[ClientError, str | None] | None:
        """The talker's say_done or say_refused: the error to send (and the event_id it echoes), or None."""
        kind = resp.WhichOneof("kind")
        answer = getattr(resp, kind)
        event_id = self.pending.pop(answer.id, None)
        if kind != "say_refused":
            return None
        err = ClientError(answer.kind or "bad_say", answer.details,
                          type_=_TYPES.get(answer.kind, "invalid_request_error"))
        return err, event_id
