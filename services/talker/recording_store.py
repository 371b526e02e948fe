"""Which recordings of enrolled voices the talker keeps in memory: a byte-bounded LRU with leases.

No threads, no device, no event loop: the recorder (voice_recorder.py) asks the store and applies
its answers to the engine (add_voice / forget_voice on the compute thread).

    store = RecordingStore(max_bytes=1 << 30)
    dropped = store.admit("@ab12", nbytes)        # room made first: the keys to drop from the engine
    store.lease("@ab12")                          # a session needs it until its prompt is in its slot
    outcome, dropped = store.forget("@ab12")      # ForgetVoice: FORGOTTEN, DEFERRED or NOT_HELD
    dropped = store.release("@ab12")              # the lease ends: a forgotten recording goes now

What a recording costs (`nbytes`, the recorder counts it): its embeddings on the host and the KV
prefix the engine computes for it on the device once a session begins with it. The store holds at
most `max_bytes` of them, least recently leased evicted first. A leased recording is never
evicted: between a session's resolve and its engine begin() (a held open waits up to 10 s, a busy
prefill queue a few) the engine must still find it; once the prompt is in the slot the session no
longer reads it and its lease ends. When leased recordings alone fill the bound, a new one is
refused (StoreFull), so memory stays within the bound.

A ForgetVoice (the gateway deleted the voice) on a leased recording marks it FORGETTING: no
session is cut, and the recording goes when its last lease ends. A new session that brings the
same audio meanwhile (the voice enrolled again) revives it; the sessions that were waiting for
the recording when it was forgotten do not.

Bundled voices are not here: they are the checkpoint's, kept for the process's life.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass


class Holding(enum.Enum):
    HELD = "held"  # new sessions use it
    FORGETTING = "forgetting"  # forgotten while leased: dropped when its last lease ends


class ForgetOutcome(enum.Enum):
    FORGOTTEN = "forgotten"  # dropped now
    DEFERRED = "deferred"  # in use (or still recording): dropped when its sessions no longer need it
    NOT_HELD = "not_held"  # not in memory (never recorded here, evicted, or forgotten already)


class StoreFull(Exception):
    """The recording does not fit: leased recordings fill the bound, or it alone is larger."""


@dataclass
class _Entry:
    nbytes: int
    leases: int = 0
    holding: Holding = Holding.HELD


class RecordingStore:
    def __init__(self, max_bytes: int):
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently leased first
        self.held_bytes = 0
        self.evictions = 0  # recordings evicted to make room, so far

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def leases(self, key: str) -> int:
        entry = self._entries.get(key)
        return entry.leases if entry else 0

    def holding(self, key: str) -> Holding | None:
        entry = self._entries.get(key)
        return entry.holding if entry else None

    def room_for(self, nbytes: int) -> bool:
        """Whether admit(nbytes) would succeed now (checked before a recording is made)."""
        leased = sum(e.nbytes for e in self._entries.values() if e.leases)
        return nbytes <= self.max_bytes - leased

    def admit(self, key: str, nbytes: int, holding: Holding = Holding.HELD) -> list[str]:
        """Store a new recording, unleased and most recent; returns the keys evicted to make room (the
        caller drops them from the engine). StoreFull (nothing evicted) if leased ones leave no room."""
        if key in self._entries:
            raise ValueError(f"recording {key} is already held")
        if not self.room_for(nbytes):
            leased = sum(e.nbytes for e in self._entries.values() if e.leases)
            raise StoreFull(f"a recording of {nbytes} bytes does not fit: {leased} of the {self.max_bytes} bytes "
                            f"for recorded voices are in use by sessions starting now")
        evicted = []
        for old, entry in list(self._entries.items()):
            if self.held_bytes + nbytes <= self.max_bytes:
                break
            if not entry.leases:
                self._drop(old)
                evicted.append(old)
        self.evictions += len(evicted)
        self._entries[key] = _Entry(nbytes, holding=holding)
        self.held_bytes += nbytes
        return evicted

    def lease(self, key: str, revive: bool = True) -> bool:
        """Take a lease on a held recording (False if it is not held), and make it the most recent.
        revive: a FORGETTING one is HELD again (a session that brings its audio after the forget)."""
        entry = self._entries.get(key)
        if entry is None:
            return False
        entry.leases += 1
        if revive:
            entry.holding = Holding.HELD
        self._entries.move_to_end(key)
        return True

    def release(self, key: str) -> list[str]:
        """End one lease; returns [key] if that dropped a FORGETTING recording, else []."""
        entry = self._entries.get(key)
        if entry is None or entry.leases == 0:
            raise ValueError(f"recording {key} has no lease to release")
        entry.leases -= 1
        if entry.leases == 0 and entry.holding is Holding.FORGETTING:
            self._drop(key)
            return [key]
        return []

    def forget(self, key: str) -> tuple[ForgetOutcome, list[str]]:
        """Forget a recording: at once if no session holds a lease, else when the last one ends."""
        entry = self._entries.get(key)
        if entry is None:
            return ForgetOutcome.NOT_HELD, []
        if entry.leases:
            entry.holding = Holding.FORGETTING
            return ForgetOutcome.DEFERRED, []
        self._drop(key)
        return ForgetOutcome.FORGOTTEN, [key]

    def _drop(self, key: str) -> None:
        self.held_bytes -= self._entries.pop(key).nbytes
