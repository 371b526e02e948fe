"""One stream's record on the conversation clock, and what the clock puts in its outbox."""

from __future__ import annotations

import asyncio
import collections
import enum
from dataclasses import dataclass, field

from services.common.pairing import OutputPairing


@dataclass
class Ready:
    slot: int
    prefill_frames: int
    prefill_ms: float
    output_delay_frames: int
    seed: int
    prime: int = 0  # which prompt went live: 0 the open's, n the n-th prime's (TalkReady.prime)


@dataclass
class Output:
    seq: int
    input_seq: int
    text_token: int
    text_piece: str
    agent_codes: list[int]


@dataclass
class PrimeRefused:
    """A prime whose settings the talker refused: the session goes on with the prompt it had."""

    prime: int
    kind: str
    details: str


END = None  # outbox sentinel: the session ended normally (input closed, all queued frames stepped)


class SessionStatus(enum.Enum):
    """Where a session is in its life on the clock; its legal moves are TRANSITIONS (Session.move)."""

    HELD = "held"  # its slot taken, its prompt not started (TalkOpen.hold_prompt_ms)
    PREFILLING = "prefilling"  # its prompt queued or running in pieces (prefill_queue.py)
    LIVE = "live"  # its prompt in the slot, Ready sent: the clock steps it
    ENDED = "ended"  # END went to its outbox: input closed and every queued frame stepped
    FAILED = "failed"  # an error went to its outbox
    CLOSED = "closed"  # off the clock (ConversationClock.close)

    @property
    def over(self) -> bool:
        """No more engine work for it: its outcome is in its outbox, or it is off the clock."""
        return self in (SessionStatus.ENDED, SessionStatus.FAILED, SessionStatus.CLOSED)


# Every status may close (the servicer closes the session however it ended, a reprime closes the
# old one); an error can come until the stream's outcome is decided.
TRANSITIONS: dict[SessionStatus, frozenset[SessionStatus]] = {
    SessionStatus.HELD: frozenset({SessionStatus.PREFILLING, SessionStatus.FAILED, SessionStatus.CLOSED}),
    SessionStatus.PREFILLING: frozenset({SessionStatus.LIVE, SessionStatus.FAILED, SessionStatus.CLOSED}),
    SessionStatus.LIVE: frozenset({SessionStatus.ENDED, SessionStatus.FAILED, SessionStatus.CLOSED}),
    SessionStatus.ENDED: frozenset({SessionStatus.CLOSED}),
    SessionStatus.FAILED: frozenset({SessionStatus.CLOSED}),
    SessionStatus.CLOSED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A move TRANSITIONS does not allow: a bug in the clock, never a client's doing."""


@dataclass(eq=False)
class Session:
    """One stream's place on the clock. Touched only from the event loop."""

    stream_id: str
    slot: int
    voice: str | None
    persona: str
    sampling: object  # engine SamplingParams
    seed: int
    status: SessionStatus = SessionStatus.HELD
    # Ready, then Output..., then END or an exception (the stream's error). Unbounded:
    # at most one Output per accepted input frame, and input is bounded by the backlog.
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    # (step index, codes[8]): step k takes input frame k, or k-1 on a step-ahead engine (None for k = 0)
    inputs: collections.deque = field(default_factory=collections.deque)
    received: int = 0  # input frames pushed
    # Step ahead: output k, computed before input k arrived, waits there for it (services/common/pairing.py)
    pairing: OutputPairing = field(default_factory=OutputPairing)
    early_outputs: bool = False  # send output k at its step's end, the caller pairs it (TalkOpen.early_outputs)
    prime: int = 0  # which prompt this is: 0 the open's, else its TalkPrime.prime (clock.reprime)
    backlog_allowance: int = 0  # frames queued before go-live that the backlog bound does not count
    job: object = None  # engine PrefillJob while prefilling
    input_done: bool = False  # the client half-closed: end once the queue is drained
    stepping: bool = False  # a frame of it is in the step running now (its output is still to come)
    out_seq: int = 0
    prefill_started: float = 0.0
    last_input_at: float = float("-inf")  # loop time of its latest input frame
    pieces_ms: list = field(default_factory=list)  # per prefill piece: (total, begin, launch, device wait) ms
    say: object = None  # say.SayQueue from its first TalkSay: the text its steps force (the clock passes it)

    def move(self, to: SessionStatus) -> None:
        """Change status, or raise IllegalTransition if TRANSITIONS does not allow it."""
        if to not in TRANSITIONS[self.status]:
            raise IllegalTransition(f"session {self.stream_id} (slot {self.slot}) cannot go from "
                                    f"{self.status.value} to {to.value}")
        self.status = to

    def begin_args(self) -> tuple:
        """engine.begin()'s arguments for this session's prompt."""
        return self.slot, self.voice, self.persona, self.sampling
