"""A link's outbox: the entries one end of a multiplexed link (common.proto) has queued and not yet sent.

Both ends use it: a stage's `Link` (common/link.py) for its answers, the gateway's `StageLink`
(gateway/links.py) for its requests. Its writer takes everything queued at once and sends it as
messages of at most MESSAGE_BYTES and MESSAGE_ENTRIES each, so the entries of one loop turn (a
tick's outputs, an encoder batch's codes) cost one message, not one per session.

Bounds (docs/limits.md, "Stage links"):
- one message: MESSAGE_BYTES and MESSAGE_ENTRIES at most (one entry alone may be larger: it goes alone;
  every peer receives up to 16 MiB, and a stage refuses a message of more than 8192 entries);
- the unsent entries: `room_bytes` (OUTBOX_BYTES by default). Past it `room()` waits until the
  writer has taken them; what the writer of each end does with a peer that never reads is its own
  rule (a stage's write deadline, the gateway's hard limit).

Threading: one event loop; nothing here blocks.
"""

from __future__ import annotations

import asyncio
from typing import Iterator

OUTBOX_BYTES = 32 * 2**20  # unsent entries on one link before a writer waits for room
MESSAGE_BYTES = 2 * 2**20  # one outgoing link message at most this big (the peer's receive limit is larger)
MESSAGE_ENTRIES = 4096  # and with at most this many entries (a stage refuses more than 8192: common.proto)


class Outbox:
    """Entries queued for one link, counted in bytes as they are queued."""

    def __init__(self, room_bytes: int = OUTBOX_BYTES):
        self.room_bytes = room_bytes
        self.bytes = 0  # the unsent entries' serialized size
        self.ready = asyncio.Event()  # something is queued: the writer's cue
        self._entries: list[tuple[object, int]] = []  # (entry, its bytes)
        self._room = asyncio.Event()
        self._room.set()
        self._closed = False

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry) -> None:
        """Queue one entry. Never waits: a writer that must not outgrow the bound awaits `room()` after."""
        size = entry.ByteSize()
        self._entries.append((entry, size))
        self.bytes += size
        if self.bytes > self.room_bytes:
            self._room.clear()
        self.ready.set()

    async def room(self) -> None:
        """Wait while the unsent entries are over `room_bytes` (the peer reads too slowly); at once after close()."""
        while self.bytes > self.room_bytes and not self._closed:
            self._room.clear()
            await self._room.wait()

    def take(self) -> list[list]:
        """Everything queued, as the messages it is sent in (lists of entries), and the room it held."""
        entries, self._entries, self.bytes = self._entries, [], 0
        self.ready.clear()
        self._room.set()
        return list(messages(entries))

    def drop(self) -> None:
        """Forget what is queued (the link is gone: nothing of it can be sent)."""
        self._entries, self.bytes = [], 0
        self._room.set()

    def close(self) -> None:
        """No writer waits for room any more."""
        self._closed = True
        self._room.set()


def messages(entries: list[tuple[object, int]], max_bytes: int = MESSAGE_BYTES,
             max_entries: int = MESSAGE_ENTRIES) -> Iterator[list]:
    """(entry, bytes) pairs -> consecutive runs of at most max_bytes and max_entries each (one entry
    alone may be larger than max_bytes)."""
    chunk, size = [], 0
    for entry, n in entries:
        if chunk and (size + n > max_bytes or len(chunk) == max_entries):
            yield chunk
            chunk, size = [], 0
        chunk.append(entry)
        size += n
    if chunk:
        yield chunk
