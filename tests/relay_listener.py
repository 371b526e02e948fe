"""A relay's listener for tests that drive a gateway Relay directly: everything it was told, in order."""

from __future__ import annotations


class RelayRecorder:
    def __init__(self) -> None:
        self.outputs: list = []  # OutputFrame
        self.errors: list = []  # RelayError
        self.readies: list = []  # TalkReady
        self.prime_refusals: list = []  # (prime, RelayError)
        self.say_answers: list = []  # TalkResponse

    def relay_output(self, frame) -> None:
        self.outputs.append(frame)

    def relay_failed(self, err) -> None:
        self.errors.append(err)

    def relay_live(self, ready) -> None:
        self.readies.append(ready)

    def relay_prime_refused(self, prime: int, err) -> None:
        self.prime_refusals.append((prime, err))

    def relay_say(self, answer) -> None:
        self.say_answers.append(answer)
