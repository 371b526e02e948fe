"""Recordings on disk (the talker's voice cache folder): one published-format .pt per recording.

    files = RecordingFiles(cache_dir, max_enrolled_bytes)
    path = files.path(digest, enrolled=True)      # DIR/enrolled-<digest>.pt (a bundled voice: DIR/<digest>.pt)
    voice = files.load(path, cfg)                 # None if absent; InvalidVoice if unreadable
    files.save(path, voice)                       # atomic; room made first among the enrolled ones
    files.forget(digest)                          # ForgetVoice: the enrolled recording's file, if any

The digest names the audio and the model files (voice_recorder.recording_digest), so another
checkpoint never reads a recording made for this one, and a ForgetVoice that names the audio by
its sha256 finds the file without the audio. Recordings of enrolled voices (audio shipped with an
open) have their own prefix: they are bounded in bytes, least recently used first (a file's mtime,
touched when it is read), and a ForgetVoice removes them. Recordings of bundled audio voices are
never pruned or forgotten: there are as many as the checkpoint has audio files.

Another talker may share the folder: writes are atomic (a reader never sees half a file), and a
file another talker pruned is only recorded again. Every call does file work: call it on a worker
thread.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from services.talker.voices import VoicePrompt, load_voice, save_voice

log = logging.getLogger("talker.voices")

ENROLLED_PREFIX = "enrolled-"
SUFFIX = ".pt"


class RecordingFiles:
    def __init__(self, directory: str | Path, max_enrolled_bytes: int):
        self.dir = Path(directory)
        self.max_enrolled_bytes = max_enrolled_bytes
        self.pruned = 0  # enrolled recordings removed to make room, so far

    def path(self, digest: str, enrolled: bool) -> Path:
        return self.dir / f"{ENROLLED_PREFIX if enrolled else ''}{digest}{SUFFIX}"

    def load(self, path: Path, cfg) -> VoicePrompt | None:
        """The recording at `path` checked against the model (cfg: the engine's LMConfig), or None."""
        if not path.is_file():
            return None
        voice = load_voice(path, cfg.dim, cfg.delays, cfg.text_card, cfg.card)  # InvalidVoice if unreadable
        try:
            os.utime(path)  # most recently used: pruned last
        except OSError:  # removed meanwhile (another talker): what was read is whole
            pass
        return voice

    def save(self, path: Path, voice: VoicePrompt) -> bool:
        """Write atomically. An enrolled recording first makes room within max_enrolled_bytes (the
        oldest go); one larger than the bound alone is not kept (False)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".recording-", suffix=SUFFIX)
        os.close(fd)
        try:
            save_voice(tmp, voice)
            if path.name.startswith(ENROLLED_PREFIX) and not self._make_room(os.path.getsize(tmp), keep=path):
                Path(tmp).unlink(missing_ok=True)
                return False
            os.replace(tmp, path)
            return True
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def forget(self, digest: str) -> bool:
        """Remove an enrolled recording's file; True if there was one."""
        try:
            self.path(digest, enrolled=True).unlink()
            return True
        except FileNotFoundError:
            return False

    def enrolled_bytes(self) -> int:
        return sum(size for _, size, _ in self._enrolled())

    def _enrolled(self) -> list[tuple[float, int, Path]]:
        """(mtime, size, path) of every enrolled recording, oldest first."""
        out = []
        for p in self.dir.glob(f"{ENROLLED_PREFIX}*{SUFFIX}"):
            try:
                st = p.stat()
            except FileNotFoundError:  # pruned or forgotten meanwhile
                continue
            out.append((st.st_mtime, st.st_size, p))
        return sorted(out)

    def _make_room(self, nbytes: int, keep: Path) -> bool:
        if nbytes > self.max_enrolled_bytes:
            log.warning("a recording of %d bytes is larger than the voice cache's bound for enrolled voices (%d "
                        "bytes): not kept on disk", nbytes, self.max_enrolled_bytes)
            return False
        files = [f for f in self._enrolled() if f[2] != keep]  # `keep` is replaced, not added
        total = sum(size for _, size, _ in files)
        for _, size, p in files:
            if total + nbytes <= self.max_enrolled_bytes:
                break
            p.unlink(missing_ok=True)
            total -= size
            self.pruned += 1
            log.info("voice cache: %s removed to keep the enrolled recordings within %d bytes", p.name,
                     self.max_enrolled_bytes)
        return True

