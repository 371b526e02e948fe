"""The SentencePiece text tokenizer of a checkpoint (`tokenizer_spm_32k_3.model`).

Ids 0..3 are special in PersonaPlex: 0 end-pad (also unk), 1 BOS, 2 EOS, 3 PAD. The model
emits PAD (3) on most frames; only real pieces become transcript text. The persona prompt is
wrapped in `<system>` tags, which the tokenizer keeps as one piece.

The text stream's rules while the model speaks (as its training data is laid out, Kyutai's
interleaver): each word is tokenized alone and its tokens sit on consecutive frames from the
frame the word starts; PAD fills the frames after it until the next word; the frame just before
a word's first token is EPAD (0) when it would have been PAD. A word's first piece carries the
word mark, so `word_starts()` tells where a word may begin.

    tok = TextTokenizer.load(paths.tokenizer)
    tok.encode_persona("You are kind.")   # [<system>, ..., <system>] ids, no BOS/EOS
    tok.piece(1234)                        # " hello" (word mark -> space), "" for 0..3
    tok.encode_words("Hello there")        # [[ids of "Hello"], [ids of "there"]]: what a say forces
"""

from __future__ import annotations

from pathlib import Path

import sentencepiece as spm

EPAD_ID = 0  # end of padding: the frame before a word's first token, when the model padded before it
PAD_ID = 3
NUM_SPECIAL = 4  # ids 0..3: end-pad/unk, BOS, EOS, PAD
SYSTEM_TAG = "<system>"
_WORD_MARK = "\u2581"  # SentencePiece's "▁"


class InvalidText(ValueError):
    """Text that cannot be tokenized (not a str, or contains NUL / unpaired surrogates)."""


class TextTokenizer:
    def __init__(self, processor: spm.SentencePieceProcessor):
        self.sp = processor
        self.vocab_size = processor.get_piece_size()
        # Pieces decoded once: text_piece() runs for every slot on every frame.
        self._pieces = [self._render(i) for i in range(self.vocab_size)]

    @classmethod
    def load(cls, path: str | Path) -> "TextTokenizer":
        sp = spm.SentencePieceProcessor()
        if not sp.Load(str(path)):  # pragma: no cover - Load raises on failure in 0.2
            raise OSError(f"cannot load SentencePiece model {path}")
        return cls(sp)

    def _render(self, i: int) -> str:
        if i < NUM_SPECIAL or self.sp.IsControl(i) or self.sp.IsUnknown(i):
            return ""
        return self.sp.IdToPiece(i).replace(_WORD_MARK, " ")

    def piece(self, token: int) -> str:
        """The transcript text of one text token: word mark -> space; "" for specials and out-of-vocab ids."""
        if 0 <= token < self.vocab_size:
            return self._pieces[token]
        return ""

    def encode(self, text: str) -> list[int]:
        """Plain ids, no BOS/EOS."""
        if not isinstance(text, str):
            raise InvalidText(f"text must be a str, got {type(text).__name__}")
        if "\x00" in text:
            raise InvalidText("text contains a NUL character")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidText(f"text is not valid Unicode: {e.reason}") from None
        return list(self.sp.EncodeAsIds(text))

    def encode_words(self, text: str) -> list[list[int]]:
        """Each whitespace-separated word's ids, tokenized alone (the text stream's rule, module doc).
        Ids that carry no text (unknown pieces: id 0 is also EPAD; specials) are dropped, and so is a
        word left with no text but its word mark."""
        words = []
        for word in text.split():
            ids = [i for i in self.encode(word) if 0 <= i < self.vocab_size and self._pieces[i]]
            if "".join(self._pieces[i] for i in ids).strip():
                words.append(ids)
        return words

    def word_starts(self) -> list[bool]:
        """Per id: whether the model begins a word with it (EPAD, or a piece carrying the word mark)."""
        return [i == EPAD_ID or self._pieces[i].startswith(" ") for i in range(self.vocab_size)]

    def decode(self, ids: list[int]) -> str:
        return self.sp.DecodeIds([i for i in ids if i >= NUM_SPECIAL])

    @staticmethod
    def wrap_persona(text: str) -> str:
        """The reference server's rule: the stripped text as it stands if it starts and ends with
        `<system>` (so `<system>` alone stays one tag), else `<system> text <system>`; "" for an
        empty (or all-whitespace) persona."""
        t = text.strip()
        if not t or (t.startswith(SYSTEM_TAG) and t.endswith(SYSTEM_TAG)):
            return t
        return f"{SYSTEM_TAG} {t} {SYSTEM_TAG}"

    def encode_persona(self, text: str) -> list[int]:
        """The persona's prompt tokens. An empty persona has none: the reference server crashes on it,
        and its prompt flow with no text tokens is the voice and the two silences alone."""
        return self.encode(self.wrap_persona(text))
