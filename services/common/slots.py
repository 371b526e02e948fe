"""A fixed pool of batch slots with confirmed release.

Each live stream owns one slot (one row of the stage's batched state) from open
to close. The danger this class exists for: a stream ends (close, cancel, a
dropped client) while a batched step that includes its row is still running in
a worker thread. If the slot were handed to a new stream right then, the new
stream's reset could race with the old step, or the old step's write could land
in the new stream's state. So a slot is only free once released by its stream
*and* no in-flight step touches it:

    slot = pool.acquire()          # ResourceExhausted if none is free
    pool.pin(batch_slots)          # before handing a batch to the worker
    ... step runs in a thread ...
    pool.unpin(batch_slots)        # after the step's result is back
    pool.release(slot)             # stream ended: free now, or at its unpin

Free slots are handed out lowest index first (deterministic, easy to test).
All methods run on the event loop thread; nothing here needs a lock.
"""

from __future__ import annotations

import heapq

from services.common.errors import ResourceExhausted


class SlotPool:
    def __init__(self, total: int):
        if total < 1:
            raise ValueError(f"a slot pool needs at least 1 slot, got {total}")
        self.total = total
        self._free: list[int] = list(range(total))  # a heap
        self._held: set[int] = set()  # owned by a live stream
        self._retiring: set[int] = set()  # released while pinned; freed at unpin
        self._pins: dict[int, int] = {}  # slot -> in-flight steps touching it

    @property
    def free_count(self) -> int:
        """Slots a new stream could take now (retiring ones are not counted)."""
        return len(self._free)

    @property
    def retiring_count(self) -> int:
        return len(self._retiring)

    def acquire(self) -> int:
        if not self._free:
            busy = f"{len(self._held)} streams live" + (
                f", {len(self._retiring)} slot(s) waiting for an in-flight step" if self._retiring else ""
            )
            raise ResourceExhausted(f"no free slot: all {self.total} slots are in use ({busy})", kind="no_free_slot")
        slot = heapq.heappop(self._free)
        self._held.add(slot)
        return slot

    def release(self, slot: int) -> None:
        """The slot's stream has ended. Idempotent."""
        if slot not in self._held:
            return
        self._held.discard(slot)
        if self._pins.get(slot):
            self._retiring.add(slot)
        else:
            heapq.heappush(self._free, slot)

    def pin(self, slots) -> None:
        """Mark slots as touched by a step that is about to run (or running)."""
        for s in slots:
            self._pins[s] = self._pins.get(s, 0) + 1

    def unpin(self, slots) -> None:
        """The step that touched these slots has finished: confirm retiring slots free."""
        for s in slots:
            n = self._pins.get(s, 0) - 1
            if n > 0:
                self._pins[s] = n
                continue
            self._pins.pop(s, None)
            if s in self._retiring:
                self._retiring.discard(s)
                heapq.heappush(self._free, s)
