"""What a client can make the gateway hold is bounded in bytes: its queued output, the operation
ids it asked to remember, and any of its values echoed back in an error or a log line.

    brief(value)              a short, printable stand-in for a client value (never its whole repr)
    OutputQueue(n, bytes)     messages waiting for one client's socket, bounded in count and bytes;
                              tagged ones can be dropped unsent (a cancelled response's audio)
    RecentIds(n, bytes, len)  the last operation ids seen, O(1) lookup, bounded in count and bytes
                              (services/common/recent_ids.py, shared with the stages' links)
"""

from __future__ import annotations

import asyncio
from collections import deque

from services.common.recent_ids import RecentIds  # noqa: F401 (re-exported: realtime.py and tests import it here)

BRIEF_CHARS = 40


def brief(value: object, limit: int = BRIEF_CHARS) -> str:
    """A client value for an error or log line: strings cut to `limit` characters (and quoted),
    containers and huge integers named by their size, never expanded."""
    if isinstance(value, str):
        cut = value[:limit]
        return repr(cut) + (f"... ({len(value)} characters)" if len(value) > limit else "")
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return repr(value)
    if isinstance(value, int):
        # str() of an int is quadratic in its digits (and refused past 4300): describe big ones.
        return str(value) if value.bit_length() <= 64 else f"an integer of {value.bit_length()} bits"
    if isinstance(value, (list, dict)):
        return f"a JSON {'array' if isinstance(value, list) else 'object'} of {len(value)} item(s)"
    return f"a {type(value).__name__}"


class OutputQueue:
    """One client's outgoing messages (str or bytes), bounded in count and total bytes.

    `put_nowait` raises asyncio.QueueFull past either bound (the caller cuts the client off);
    `finish()` queues the end marker (None), which is never refused."""

    def __init__(self, max_items: int, max_bytes: int):
        self.max_items, self.max_bytes = max_items, max_bytes
        self.bytes = 0
        self._items: deque = deque()
        self._ready = asyncio.Event()

    def qsize(self) -> int:
        return len(self._items)

    def put_nowait(self, msg: str | bytes, tag: str | None = None, first: bool = False) -> None:
        """Queue `msg` last (or `first`: a resumed connection's greeting goes before what waited)."""
        size = len(msg)  # JSON text here is ASCII (json.dumps escapes the rest): characters = bytes
        if len(self._items) >= self.max_items or self.bytes + size > self.max_bytes:
            raise asyncio.QueueFull
        if first:
            self._items.appendleft((tag, msg))
        else:
            self._items.append((tag, msg))
        self.bytes += size
        self._ready.set()

    def drop(self, tag: str) -> int:
        """Drop the queued messages put with this tag; returns how many."""
        kept = deque(item for item in self._items if item[0] != tag or item[1] is None)
        dropped = len(self._items) - len(kept)
        self._items = kept
        self.bytes = sum(len(m) for _, m in kept if m is not None)
        return dropped

    def finish(self) -> None:
        self._items.append((None, None))
        self._ready.set()

    async def get(self) -> str | bytes | None:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        msg = self._items.popleft()[1]
        if msg is not None:
            self.bytes -= len(msg)
        return msg
