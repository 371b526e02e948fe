"""A Realtime session's conversation record, shaped as the GA protocol (and SDK state machines) expect.

The model speaks continuously; the wire still shows it as responses, one at a time, each holding one
assistant message item with one audio content part:

    response.created -> conversation.item.added -> response.output_item.added -> response.content_part.added
    -> deltas -> response.output_audio.done -> response.output_audio_transcript.done -> response.content_part.done
    -> response.output_item.done -> conversation.item.done -> response.done

A response ends when the session ends, or early when the client cancels it or truncates its item
(barge-in); the next one starts at once. Legacy (beta) sessions get the beta names.

Pure bookkeeping: methods return the events to send (without event_id/server_event_seq). Records are
bounded in count and bytes, the live response's item included: at most `MAX_ITEMS` items and
`MAX_CONVERSATION_BYTES` of stored text (UTF-8, with `ITEM_OVERHEAD_BYTES` per item and 8 per kept
transcript piece); past either, the oldest items other than the live one are forgotten (a later
truncate or delete of one is `invalid_item_id`). A client item is at most 16 parts of
`MAX_CLIENT_TEXT_CHARS`; a transcript at most `MAX_TRANSCRIPT_CHARS` (later text of a very long item
is not kept; its frames are still counted). The live item alone never passes the bound: it is at most
MAX_TRANSCRIPT_CHARS x (4 + 8) bytes.
"""

from __future__ import annotations

import secrets
from array import array
from bisect import bisect_left
from collections import OrderedDict
from dataclasses import dataclass, field

from services.gateway.audio import FRAME_MS

MAX_ITEMS = 32
MAX_CONVERSATION_BYTES = 512 * 1024
ITEM_OVERHEAD_BYTES = 256  # an item's ids, role, status and part dicts, counted as this much
MAX_TRANSCRIPT_CHARS = 8_192
MAX_CLIENT_TEXT_CHARS = 4_096
MAX_CLIENT_PARTS = 16
# Content part types a client item may carry, per role (GA and beta spellings).
_CLIENT_PARTS = {"system": {"input_text"}, "user": {"input_text", "input_audio", "text"},
                 "assistant": {"output_text", "output_audio", "text", "audio"}}


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(8)}"


@dataclass
class Item:
    id: str
    role: str
    status: str = "in_progress"
    content: list[dict] = field(default_factory=list)  # client items: their (normalized) content
    # assistant items: the transcript, the output frames, and for each kept text piece its frame and
    # where it ends in the transcript (to cut the transcript at a frame)
    transcript: str = ""
    frames: int = 0
    piece_frames: array = field(default_factory=lambda: array("I"))
    piece_ends: array = field(default_factory=lambda: array("I"))
    bytes: int = 0  # what the conversation's byte bound counts for this item

    def __post_init__(self) -> None:
        texts = (p.get("text", p.get("transcript", "")) for p in self.content)
        self.bytes = ITEM_OVERHEAD_BYTES + sum(len(t.encode()) for t in texts)

    def add_frame(self, text: str) -> int:
        """Record one output frame's text piece; returns the bytes the item grew by."""
        grown = 0
        if text and len(self.transcript) + len(text) <= MAX_TRANSCRIPT_CHARS:
            self.transcript += text
            self.piece_frames.append(self.frames)
            self.piece_ends.append(len(self.transcript))
            grown = len(text.encode()) + 8
            self.bytes += grown
        self.frames += 1
        return grown

    def cut(self, frames: int) -> None:
        """Keep what the first `frames` output frames said."""
        n = bisect_left(self.piece_frames, frames)
        self.transcript = self.transcript[:self.piece_ends[n - 1]] if n else ""
        del self.piece_frames[n:], self.piece_ends[n:]
        self.frames = min(self.frames, frames)
        self.bytes = ITEM_OVERHEAD_BYTES + len(self.transcript.encode()) + 8 * len(self.piece_ends)


@dataclass
class Response:
    id: str
    item: Item
    metadata: dict | None = None


class Conversation:
    def __init__(self, conversation_id: str, legacy: bool = False):
        self.conversation_id = conversation_id
        self.legacy = legacy
        self.current: Response | None = None
        self.items: OrderedDict[str, Item] = OrderedDict()
        self.bytes = 0  # the items' `bytes`, summed

    # ---- event shapes ---------------------------------------------------------

    def _item_object(self, item: Item) -> dict:
        if item.role != "assistant":
            return {"id": item.id, "object": "realtime.item", "type": "message", "role": item.role,
                    "status": item.status, "content": item.content}
        content = [] if item.status == "in_progress" else [self._audio_part(item, "content")]
        return {"id": item.id, "object": "realtime.item", "type": "message", "role": "assistant", "status": item.status,
                "content": content}

    def _audio_part(self, item: Item, where: str) -> dict:
        # An item's content entry is typed output_audio (GA) / audio (beta); a content part event's is audio.
        kind = "output_audio" if where == "content" and not self.legacy else "audio"
        return {"type": kind, "transcript": item.transcript}

    def _response_object(self, r: Response, status: str, details: dict | None = None) -> dict:
        obj = {"object": "realtime.response", "id": r.id, "status": status, "conversation_id": self.conversation_id,
               "output_modalities": ["audio"], "output": [self._item_object(r.item)] if status != "in_progress" else []}
        if details:
            obj["status_details"] = details
        if r.metadata is not None:
            obj["metadata"] = r.metadata
        return obj

    def _where(self, r: Response) -> dict:
        return {"response_id": r.id, "item_id": r.item.id, "output_index": 0, "content_index": 0}

    # ---- the assistant's responses -------------------------------------------

    def start(self, metadata: dict | None = None) -> list[dict]:
        """Open the next response and its item (the previous one must be finished)."""
        assert self.current is None
        previous = next(reversed(self.items), None)
        item = self._remember(Item(new_id("item"), "assistant"))
        r = self.current = Response(new_id("resp"), item, metadata)
        added = {"type": "conversation.item.created" if self.legacy else "conversation.item.added",
                 "previous_item_id": previous, "item": self._item_object(item)}
        return [
            {"type": "response.created", "response": self._response_object(r, "in_progress")},
            added,
            {"type": "response.output_item.added", "response_id": r.id, "output_index": 0,
             "item": self._item_object(item)},
            {"type": "response.content_part.added", **self._where(r), "part": {"type": "audio", "transcript": ""}},
        ]

    def delta_fields(self, text: str) -> dict:
        """Record one output frame's text piece; returns the ids its two deltas carry."""
        r = self.current
        assert r is not None
        grown = r.item.add_frame(text)
        if grown:
            self.bytes += grown
            self._evict()
        return self._where(r)

    def finish(self, status: str, reason: str | None = None, error: dict | None = None) -> list[dict]:
        """End the current response: 'completed', 'cancelled' (reason client_cancelled) or 'failed'."""
        r, self.current = self.current, None
        if r is None:
            return []
        r.item.status = "completed" if status == "completed" else "incomplete"
        details = None
        if status == "cancelled":
            details = {"type": "cancelled", "reason": reason or "client_cancelled"}
        elif status == "failed":
            details = {"type": "failed", "error": error or {}}
        audio_done, transcript_done = (("response.audio.done", "response.audio_transcript.done") if self.legacy
                                       else ("response.output_audio.done", "response.output_audio_transcript.done"))
        events = [
            {"type": audio_done, **self._where(r)},
            {"type": transcript_done, **self._where(r), "transcript": r.item.transcript},
            {"type": "response.content_part.done", **self._where(r), "part": self._audio_part(r.item, "part")},
            {"type": "response.output_item.done", "response_id": r.id, "output_index": 0,
             "item": self._item_object(r.item)},
        ]
        if not self.legacy:
            events.append({"type": "conversation.item.done", "item": self._item_object(r.item)})
        events.append({"type": "response.done", "response": self._response_object(r, status, details)})
        return events

    # ---- items the client names --------------------------------------------

    def has(self, item_id: object) -> bool:
        return isinstance(item_id, str) and item_id in self.items

    def truncate(self, item_id: str, audio_end_ms: int) -> dict:
        """Cut an assistant item's transcript to what was heard (whole 80 ms frames, rounded up)."""
        item = self.items[item_id]
        self.bytes -= item.bytes
        item.cut(-(-audio_end_ms // FRAME_MS))
        self.bytes += item.bytes
        return {"type": "conversation.item.truncated", "item_id": item_id, "content_index": 0,
                "audio_end_ms": min(audio_end_ms, item.frames * FRAME_MS)}

    def add_client_item(self, item_id: str, role: str, content: list[dict]) -> list[dict]:
        """A message item the client adds (context a framework replays): recorded and acknowledged."""
        previous = next(reversed(self.items), None)
        item = self._remember(Item(item_id, role, status="completed", content=content))
        added = {"type": "conversation.item.created" if self.legacy else "conversation.item.added",
                 "previous_item_id": previous, "item": self._item_object(item)}
        return [added] if self.legacy else [added, {"type": "conversation.item.done", "item": self._item_object(item)}]

    def retrieved(self, item_id: str) -> dict:
        """An item as it stands now (an assistant item in progress has its content once it ends)."""
        return {"type": "conversation.item.retrieved", "item": self._item_object(self.items[item_id])}

    def delete(self, item_id: str) -> dict:
        self.bytes -= self.items.pop(item_id).bytes
        return {"type": "conversation.item.deleted", "item_id": item_id}

    def _remember(self, item: Item) -> Item:
        self.items[item.id] = item
        self.bytes += item.bytes
        self._evict()
        return item

    def _evict(self) -> None:
        """Forget the oldest items past the count or byte bound; the live response's item is kept
        (it is often the oldest: it opened at the first audio, and client items came after)."""
        live = self.current.item.id if self.current is not None else None
        for item_id in list(self.items):
            if len(self.items) <= MAX_ITEMS and self.bytes <= MAX_CONVERSATION_BYTES:
                return
            if item_id != live:
                self.bytes -= self.items.pop(item_id).bytes


def client_message_content(role: object, content: object) -> list[dict] | None:
    """A client message item's content, normalized to text parts; None when it is not a valid message."""
    if (not isinstance(role, str) or role not in _CLIENT_PARTS or not isinstance(content, list)
            or len(content) > MAX_CLIENT_PARTS):
        return None
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str) or kind not in _CLIENT_PARTS[role]:
            return None
        text = part.get("text", part.get("transcript", ""))
        if not isinstance(text, str):
            return None
        entry = {"type": kind}
        if kind in ("input_audio", "output_audio", "audio"):
            entry["transcript"] = text[:MAX_CLIENT_TEXT_CHARS]  # the audio itself is not kept
        else:
            entry["text"] = text[:MAX_CLIENT_TEXT_CHARS]
        parts.append(entry)
    return parts
