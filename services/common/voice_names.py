"""What a client may call a voice (one rule for the gateway, the talker and the checkpoint layout).

- A bundled voice is a file in the checkpoint's voices/ folder, named by its basename: a recorded
  prompt ("NATF2.pt") or audio the talker records on first use ("Alice.wav").
- An enrolled voice (the gateway's /v1/voices) is a bare name: letters, digits, '_' and '-', at most
  64, no extension, so it can never be mistaken for a bundled file.
"""

from __future__ import annotations

import re

AUDIO_SUFFIXES = (".wav", ".flac", ".mp3", ".ogg")
BUNDLED = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_\-]{0,63}\.(pt|wav|flac|mp3|ogg)$")
ENROLLED = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")


def is_bundled(name: object) -> bool:
    return isinstance(name, str) and BUNDLED.match(name) is not None


def is_enrolled(name: object) -> bool:
    return isinstance(name, str) and ENROLLED.match(name) is not None


def is_audio(name: str) -> bool:
    """A bundled name that is audio to record, not a recorded prompt."""
    return name.lower().endswith(AUDIO_SUFFIXES)
