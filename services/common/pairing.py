"""The step-ahead pairing rule, in one place: output k leaves once input k is in.

A step-ahead talker (services/talker/engine.py, the personaplex alignment) runs step k as soon as
input k-1 is in, so output k can exist a period before input k arrives. Its caller still gets N
outputs for N inputs, in order: an output whose input is not in yet waits here. At most one waits:
step k+1 needs input k, so output k+1 cannot exist while output k still waits for input k; a
second one is a bug upstream and raises PairingError.

One pairing per stream, run where the outputs are paired:
- the talker's clock, for a session opened without TalkOpen.early_outputs (services/talker/clock.py);
- the gateway's relay, which opens its sessions with early outputs and pairs the decoded frames
  (services/gateway/relay.py).

The caller counts its inputs and passes the count (`inputs_in`); this class holds the one output
that waits and decides when it leaves. Touched from one event loop only.
"""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class PairingError(Exception):
    """A second output would wait for its input: the producer ran more than one step ahead."""

    def __init__(self, input_seq: int, held_input_seq: int):
        super().__init__(f"an output for input {input_seq} came while the output for input {held_input_seq} "
                         f"still waits for its input")
        self.input_seq, self.held_input_seq = input_seq, held_input_seq


class OutputPairing(Generic[T]):
    def __init__(self) -> None:
        self._held: tuple[int, T] | None = None  # (its input's seq, the output)
        self._input_ended = False

    @property
    def held(self) -> T | None:
        """The output waiting for its input, if any."""
        return None if self._held is None else self._held[1]

    def pair(self, input_seq: int, output: T, inputs_in: int) -> T | None:
        """`output`, computed for input `input_seq`, when that input is among the `inputs_in` in so far:
        it leaves now. Otherwise None: it waits for its input (release), or, once the input has ended,
        is dropped (the surplus step of the last input)."""
        if input_seq < inputs_in:
            return output
        if self._input_ended:
            return None
        if self._held is not None:
            raise PairingError(input_seq, self._held[0])
        self._held = (input_seq, output)
        return None

    def release(self, inputs_in: int) -> T | None:
        """The waiting output, once its input is among the `inputs_in` in: it leaves now. Else None."""
        if self._held is None or self._held[0] >= inputs_in:
            return None
        output, self._held = self._held[1], None
        return output

    def end_input(self) -> None:
        """No more inputs come: the waiting output, and any later one whose input is not in, is dropped."""
        self._input_ended = True
        self._held = None
