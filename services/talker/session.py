"""One stream's record on the conversation clock, and what the clock puts in its outbox."""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field


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


@dataclass(eq=False)
class Session:
    """One stream's place on the clock. Touched only from the event loop."""

    stream_id: str
    slot: int
    voice: str | None
    persona: str
    sampling: object  # engine SamplingParams
    seed: int
    # Ready, then Output..., then END or an exception (the stream's error). Unbounded:
    # at most one Output per accepted input frame, and input is bounded by the backlog.
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    # (step index, codes[8]): step k takes input frame k, or k-1 on a step-ahead engine (None for k = 0)
    inputs: collections.deque = field(default_factory=collections.deque)
    received: int = 0  # input frames pushed
    held: Output | None = None  # step ahead: output k, computed before input k arrived
    early_outputs: bool = False  # send output k at its step's end, never held (TalkOpen.early_outputs)
    prime: int = 0  # which prompt this is: 0 the open's, else its TalkPrime.prime (clock.reprime)
    on_hold: bool = False  # its slot is taken, its prompt not started yet (TalkOpen.hold_prompt_ms)
    backlog_allowance: int = 0  # frames queued before go-live that the backlog bound does not count
    job: object = None  # engine PrefillJob while prefilling
    live: bool = False  # prefill done, Ready sent: the clock steps it
    closed: bool = False  # no more engine work for it
    input_done: bool = False  # the client half-closed: end once the queue is drained
    stepping: bool = False  # a frame of it is in the step running now (its output is still to come)
    failed: bool = False  # an error went to its outbox: no more engine work
    ended: bool = False  # END went to its outbox: no more engine work
    out_seq: int = 0
    prefill_started: float = 0.0
    last_input_at: float = float("-inf")  # loop time of its latest input frame
    pieces_ms: list = field(default_factory=list)  # per prefill piece: (total, begin, launch, device wait) ms
    say: object = None  # say.SayQueue from its first TalkSay: the text its steps force (the clock passes it)

    @property
    def waiting_for_prompt(self) -> bool:
        """Opened, its prompt not yet in the slot, and still wanted."""
        return not (self.on_hold or self.live or self.ended or self.closed or self.failed)

    def begin_args(self) -> tuple:
        """engine.begin()'s arguments for this session's prompt."""
        return self.slot, self.voice, self.persona, self.sampling
