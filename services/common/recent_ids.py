"""The last ids seen, bounded in count and in bytes, with O(1) membership.

    ids = RecentIds(max_items=4096, max_bytes=256 * 1024, max_len=128)
    ids.add("sess_1.ab12")    # the oldest are forgotten first once either bound is passed
    "sess_1.ab12" in ids      # O(1)
    ids.discard("sess_1.ab12")

Used for the operation ids a gateway connection de-duplicates (services/gateway/realtime.py) and
the ended stream ids a stage link remembers (services/common/link.py).
"""

from __future__ import annotations

from collections import OrderedDict


class RecentIds:
    """The last ids seen: membership in O(1), at most `max_items` ids and `max_bytes` characters
    in all (the oldest are forgotten first). Ids longer than `max_len` are the caller's to refuse
    before they get here."""

    def __init__(self, max_items: int = 1024, max_bytes: int = 64 * 1024, max_len: int = 128):
        self.max_items, self.max_bytes, self.max_len = max_items, max_bytes, max_len
        self.bytes = 0
        self._ids: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, op: str) -> bool:
        return op in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, op: str) -> None:
        assert len(op) <= self.max_len, "refuse over-long ids before remembering them"
        if op in self._ids:
            return
        self._ids[op] = None
        self.bytes += len(op)
        while len(self._ids) > self.max_items or self.bytes > self.max_bytes:
            old, _ = self._ids.popitem(last=False)
            self.bytes -= len(old)

    def discard(self, op: str) -> None:
        if self._ids.pop(op, False) is None:
            self.bytes -= len(op)
