"""Text an application asks the model to say (TalkSay): one session's queue of forced text tokens.

The model's text stream is its inner monologue: the token of each frame is what it is saying, and
the agent codes it samples next follow it. A say forces the words' tokens into that stream over the
next frames, so the model speaks them in its own voice, then continues on its own. The forcing keeps
the stream's own rules (text.py): a word's tokens on consecutive frames, PAD between words, EPAD
just before a word that follows padding. When each word starts is left to the model, within a bound:

    WORD_START  the next word waits for the model to begin one: a frame where it samples EPAD (kept:
                the word starts next frame) or a word-starting piece (replaced by the word's first
                token) takes it; on any other frame it pads (PAD: anything else it samples, such as a
                piece running on from the last word, is replaced), as it does while the last word
                still sounds. After `max_wait_frames` such frames the word is forced anyway (EPAD
                first if the last frame was padding), so a model that keeps listening cannot hold a
                say forever. The transcript of a say is thus exactly its words.
    IN_WORD     the word's remaining tokens, one a frame, forced unconditionally.
    IDLE        nothing queued: the model's own text.

The engine applies a step's force (engine.TextForcing: the token, and whether it waits for a word
start) inside the step, as data, so every step shape and CUDA graph serves it; this queue decides
what to offer before each step and learns from the token the step wrote. Host-only, no torch: it
runs on the event loop, like the rest of a session (clock.py).

Bounds: a say is at most `max_chars` characters (`say_too_long`); a session's queued say tokens
are at most `max_tokens` (a say that would pass it: `say_queue_full`, or `say_too_long` if it could
never fit). Each say ends exactly once: `SayDone` with SAID (its last token was written) or
CANCELLED (dropped by a cancel before it was all said), or a refusal at `add`.
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass

from services.talker.text import EPAD_ID, PAD_ID, SYSTEM_TAG, InvalidText

MAX_SAY_CHARS = 2000  # one say's text (TalkerConfig.max_say_chars)
MAX_SAY_TOKENS = 1024  # one session's queued say tokens, about a minute of speech (TalkerConfig.max_say_tokens)
# Frames a word waits for the model to start it (TalkerConfig.say_max_wait_frames): about a second, more
# than the padding after a long word, so the model paces its own speech and a pause never stalls a say.
MAX_WAIT_FRAMES = 12


def check_bounds(max_tokens: int, max_wait_frames: int, max_chars: int = MAX_SAY_CHARS) -> None:
    """The say bounds' one check (SayQueue's, and TalkerConfig's with its max_say_chars)."""
    if max_chars < 1 or max_tokens < 1 or max_wait_frames < 0:
        raise ValueError(f"max_say_chars and max_say_tokens must be >= 1 and say_max_wait_frames >= 0, got "
                         f"{max_chars}, {max_tokens}, {max_wait_frames}")


class SayError(ValueError):
    """A say refused whole (TalkSayRefused.kind): bad_say, say_too_long, say_queue_full."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class SayEnd(enum.Enum):
    SAID = "said"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class SayDone:
    """A say's end, for the session's outbox (TalkSayDone)."""

    id: int
    end: SayEnd
    tokens_said: int  # the say's word tokens written into the text stream
    tokens_dropped: int  # those a cancel dropped before they were written


@dataclass(frozen=True)
class SayRefused:
    """A say refused at `add`, for the session's outbox (TalkSayRefused); the session goes on."""

    id: int
    kind: str
    details: str


@dataclass(frozen=True)
class Force:
    """What the next step forces: `token`, and whether it waits for the model's word start."""

    token: int
    gated: bool


class Phase(enum.Enum):
    IDLE = "idle"
    WORD_START = "word_start"
    IN_WORD = "in_word"


def check_text(text: object, max_chars: int) -> str:
    """A say's text, or SayError: a non-empty str of at most max_chars characters, no control characters
    (tab and line breaks are word breaks), and no `<system>` tag (the prompt's, not the model's speech)."""
    if not isinstance(text, str) or not text.strip():
        raise SayError("bad_say", "a say needs some text")
    if len(text) > max_chars:
        raise SayError("say_too_long", f"a say has at most {max_chars} characters, got {len(text)}")
    bad = next((c for c in text if (ord(c) < 32 and c not in "\n\t\r") or c == "\x7f"), None)
    if bad is not None:
        raise SayError("bad_say", f"say text contains the control character {bad!r}")
    if SYSTEM_TAG in text:
        raise SayError("bad_say", f"say text cannot contain {SYSTEM_TAG} (the prompt's tag)")
    return text


def say_words(tokenizer, text: object, max_chars: int) -> list[list[int]]:
    """A say's words as the model's token ids (TextTokenizer.encode_words), or SayError."""
    text = check_text(text, max_chars)
    try:
        words = tokenizer.encode_words(text)
    except InvalidText as e:
        raise SayError("bad_say", f"say text cannot be tokenized: {e}") from None
    if not words:
        raise SayError("bad_say", "say text has no word the model's tokenizer knows")
    return words


@dataclass(eq=False)
class _Say:
    id: int
    words: collections.deque  # of list[int]: the words not started yet
    tokens_said: int = 0

    @property
    def tokens_left(self) -> int:
        return sum(len(w) for w in self.words)


class SayQueue:
    """One session's says, in order. Touched only from the event loop (clock.py, server.py)."""

    def __init__(self, max_tokens: int = MAX_SAY_TOKENS, max_wait_frames: int = MAX_WAIT_FRAMES):
        check_bounds(max_tokens, max_wait_frames)
        self.max_tokens, self.max_wait_frames = max_tokens, max_wait_frames
        self._says: collections.deque[_Say] = collections.deque()  # the first one is being said
        self.phase = Phase.IDLE
        self._word: collections.deque[int] = collections.deque()  # IN_WORD: the forced tokens still to write
        self._waited = 0  # WORD_START: frames the next word has waited for the model
        self._last_written = PAD_ID  # the text token the session's last step wrote
        self._offered: tuple[_Say, Force] | None = None  # what the running step forces, and for which say
        self.queued_tokens = 0  # word tokens of all says not yet written (the bound counts these)

    def add(self, say_id: int, words: list[list[int]]) -> None:
        """Queue a say after the others (SayError: refused whole, nothing changes)."""
        if not isinstance(say_id, int) or say_id < 1 or any(s.id == say_id for s in self._says):
            raise SayError("bad_say", f"say id must be a positive number not already queued, got {say_id!r}")
        n = sum(len(w) for w in words)
        if n > self.max_tokens:
            raise SayError("say_too_long", f"the say is {n} tokens; a session queues at most {self.max_tokens}")
        if self.queued_tokens + n > self.max_tokens:
            raise SayError("say_queue_full", f"{self.queued_tokens} say tokens are queued and this say has {n}; at "
                           f"most {self.max_tokens} wait at once (wait until some are said, or cancel)")
        self._says.append(_Say(say_id, collections.deque(list(w) for w in words)))
        self.queued_tokens += n
        if self.phase is Phase.IDLE:
            self._start_word()

    def cancel(self, say_id: int = 0) -> list[SayDone]:
        """Drop say `say_id` (0: every say) from what is not yet said; an id not queued is no-op."""
        dropped = [s for s in self._says if say_id in (0, s.id)]
        if not dropped:
            return []
        current = self._says[0]
        self._says = collections.deque(s for s in self._says if s not in dropped)
        done = []
        for s in dropped:
            left = s.tokens_left + (len(self._word) if s is current and self.phase is Phase.IN_WORD else 0)
            self.queued_tokens -= left
            done.append(SayDone(s.id, SayEnd.CANCELLED, s.tokens_said, left))
        if current in dropped:
            self._word.clear()
            self._start_word()
        return done

    def next_force(self) -> Force | None:
        """What the session's next step forces (None: the model's own text). Offered until stepped()."""
        force = self._force()
        self._offered = (self._says[0], force) if force is not None else None
        return force

    def _force(self) -> Force | None:
        if self.phase is Phase.IN_WORD:
            return Force(self._word[0], gated=False)
        if self.phase is Phase.WORD_START:
            first = self._says[0].words[0][0]
            if self._waited < self.max_wait_frames:
                return Force(first, gated=True)
            # Waited out: the word starts now, after an EPAD where the model was padding (the rule).
            return Force(EPAD_ID if self._last_written == PAD_ID else first, gated=False)
        return None

    def stepped(self, written: int) -> list[SayDone]:
        """The step that took next_force()'s offer ran and wrote text token `written`: advance."""
        offered, self._offered = self._offered, None
        self._last_written = written
        if offered is None or not self._says or offered[0] is not self._says[0]:
            return []  # nothing was forced, or its say was cancelled while the step ran
        force = offered[1]
        if self.phase is Phase.WORD_START:
            if written == EPAD_ID:  # the model (or the waited-out force) starts the word next frame
                self._begin_word(skip_first=False)
            elif written == force.token:  # the word's first token took the model's word start
                self._begin_word(skip_first=True)
            else:  # the model padded (the engine wrote PAD for anything but a word start)
                self._waited += 1
                return []
        else:  # IN_WORD: an unconditional force is always written
            self._word.popleft()
            self._count_said(1)
        return self._word_done() if not self._word else []

    def _begin_word(self, skip_first: bool) -> None:
        say = self._says[0]
        self._word = collections.deque(say.words.popleft())
        self.phase = Phase.IN_WORD
        if skip_first:
            self._word.popleft()
            self._count_said(1)

    def _count_said(self, n: int) -> None:
        self._says[0].tokens_said += n
        self.queued_tokens -= n

    def _word_done(self) -> list[SayDone]:
        """The current word is all written: the say's next word, or its end and the next say."""
        say = self._says[0]
        if say.words:
            self._start_word()
            return []
        self._says.popleft()
        self._start_word()
        return [SayDone(say.id, SayEnd.SAID, say.tokens_said, 0)]

    def _start_word(self) -> None:
        self._waited = 0
        self.phase = Phase.WORD_START if self._says else Phase.IDLE
