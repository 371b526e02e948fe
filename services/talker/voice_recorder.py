"""Voices from audio, recorded as NVIDIA's reference server records them, once per voice.

    recorder = VoiceRecorder(paths, engine, compute, cache_dir)
    key = await recorder.resolve("NATF2.pt")                 # a recorded prompt: used as it is
    key = await recorder.resolve("Alice.wav")                # audio in voices/: recorded on first use
    key = await recorder.resolve("alice", pcm=samples)       # audio shipped with the open (an enrolled voice)

Recording (`record`): the audio prepared by services/common/voice_audio.py (24 kHz, first channel,
-24 LUFS, 1920-sample frames), Mimi-encoded frame by frame from a fresh streaming state, and each
frame stepped as a voice-prompt frame by prompt.make_voice. The result is the published `.pt`
format; it is kept on disk under `cache_dir` (named by a digest of the audio and of the model
files, so another checkpoint never reads it) and given to the engine, which computes its KV prefix
once, in prefill pieces. The Mimi encode runs in a process of its own (voice_encoder.py: it never
delays a tick); the embedding lookup runs on the engine's thread (`compute`), so the device is
never used from two threads. Nothing of a recording runs on the event loop: the audio's digest is
taken on a worker thread (hashlib lets go of the GIL).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Awaitable, Callable

import numpy as np
import sphn
import torch

from services.common import voice_audio, voice_names
from services.common.checkpoint import CheckpointPaths, InvalidVoice
from services.talker import prompt
from services.talker.voice_encoder import VoiceEncoder, voice_codes
from services.talker.voices import VoicePrompt, load_voice, save_voice

log = logging.getLogger("talker.voices")


def published(voice: VoicePrompt) -> VoicePrompt:
    """The voice as the published file holds it (bf16 embeddings on the CPU): the same whether
    recorded now or read back from the disk cache."""
    return VoicePrompt(embeddings=voice.embeddings.to("cpu", torch.bfloat16), cache=voice.cache.cpu())


def record(pcm: np.ndarray, mimi, embed, delays: torch.Tensor, initial: torch.Tensor,
           device: str | torch.device = "cpu") -> VoicePrompt:
    """24 kHz audio (first channel, not yet normalised) -> the voice prompt, as the reference records it."""
    return published(prompt.make_voice(embed, voice_codes(pcm, mimi), delays, initial, device))


def audio_digest(pcm: np.ndarray) -> str:
    return hashlib.sha256(pcm.astype("<f4").tobytes()).hexdigest()


def recording_digest(paths: CheckpointPaths, pcm: np.ndarray) -> str:
    """Names a recording: the same audio (bundled or shipped) and the same model files, the same recording."""
    return hashlib.sha256(model_digest(paths).encode() + pcm.astype("<f4").tobytes()).hexdigest()[:32]


def model_digest(paths: CheckpointPaths) -> str:
    """Names the model files a recording depends on (the LM's embeddings and Mimi): path, size, mtime."""
    h = hashlib.sha256()
    for f in (paths.lm, paths.mimi):
        st = f.stat()
        h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:16]


class VoiceRecorder:
    def __init__(self, paths: CheckpointPaths, engine, compute: Callable[[Callable], Awaitable],
                 cache_dir: str | Path, max_seconds: float = 60.0):
        """compute(fn): run fn on the engine's thread and return its result (ConversationClock.compute)."""
        self.paths, self.engine, self.compute = paths, engine, compute
        self.cache_dir = Path(cache_dir)
        self.max_seconds = max_seconds
        self.encoder = VoiceEncoder(paths)
        self._bundled: list[tuple[str, float]] | None = None
        self._pending: dict[str, asyncio.Future] = {}  # key -> the recording in flight (one per voice)

    def bundled(self) -> list[tuple[str, float]]:
        """(name, seconds) of every voice in the checkpoint's voices/ folder; unreadable files are left out."""
        if self._bundled is None:
            out = []
            for name in self.paths.voice_names():
                path = self.paths.voices_dir / name
                try:
                    if voice_names.is_audio(name):
                        seconds = float(sphn.durations([str(path)])[0])
                    else:
                        emb = torch.load(path, map_location="cpu", weights_only=True, mmap=True)["embeddings"]
                        seconds = (emb.shape[0] + 1) * voice_audio.FRAME_SAMPLES / voice_audio.SAMPLE_RATE
                except Exception as e:  # listed, never served: the talker refuses it on open with the reason
                    log.warning("voice %s is unreadable (%s): not listed", name, type(e).__name__)
                    continue
                out.append((name, round(seconds, 2)))
            self._bundled = out
        return self._bundled

    async def resolve(self, name: str | None, pcm: np.ndarray | None = None) -> str | None:
        """The engine's key for a session's voice, recording it first if needed. InvalidVoice (with a
        `kind` for audio problems) for anything that cannot be a voice."""
        if pcm is None and (name is None or not voice_names.is_audio(name)):
            return name  # none, or a recorded prompt the engine loads itself
        if pcm is None:
            path = self.paths.resolve_voice(name)
            if self.engine.has_voice(name):
                return name
            key = name
            pcm = await asyncio.to_thread(voice_audio.read_audio, path, self.max_seconds)
            digest = await asyncio.to_thread(recording_digest, self.paths, pcm)
        else:
            if pcm.size > self.max_seconds * voice_audio.SAMPLE_RATE:
                raise voice_audio.InvalidVoiceAudio(f"voice audio lasts {pcm.size / voice_audio.SAMPLE_RATE:.1f} s, "
                                                    f"at most {self.max_seconds:g} s allowed", "too_long")
            key = "@" + (await asyncio.to_thread(audio_digest, pcm))[:24]  # '@': never a bundled or enrolled name
            if self.engine.has_voice(key):
                return key
            digest = await asyncio.to_thread(recording_digest, self.paths, pcm)
        if key not in self._pending:
            self._pending[key] = asyncio.ensure_future(self._load_or_record(key, digest, pcm))
            self._pending[key].add_done_callback(lambda _f, k=key: self._pending.pop(k, None))
        await asyncio.shield(self._pending[key])
        return key

    async def _load_or_record(self, key: str, digest: str, pcm: np.ndarray) -> None:
        cached = self.cache_dir / f"{digest}.pt"
        cfg = self.engine.cfg
        if cached.is_file():
            try:
                voice = await asyncio.to_thread(load_voice, cached, cfg.dim, cfg.delays, cfg.text_card, cfg.card)
            except InvalidVoice as e:
                log.warning("recorded voice %s in the cache is unreadable (%s): recording it again", cached.name, e)
                voice = None
        else:
            voice = None
        if voice is None:
            voice = await self._record(pcm)
            await asyncio.to_thread(self._save, cached, voice)
            log.info("voice %s recorded: %d frames, cached as %s", key, voice.frames, cached)
        await self.compute(lambda: self.engine.add_voice(key, voice))

    async def _record(self, pcm: np.ndarray) -> VoicePrompt:
        prepared = await self.encoder.codes(pcm)
        eng = self.engine
        delays, initial = torch.tensor(eng.cfg.delays), prompt.initial_tokens(eng.text_card, eng.card,
                                                                              eng.cfg.num_streams)
        return await self.compute(lambda: published(prompt.make_voice(eng.model.embed, prepared, delays, initial,
                                                                       eng.device)))

    def close(self) -> None:
        """Stop the recorder's process (the recordings in flight fail)."""
        self.encoder.close()

    @staticmethod
    def _save(path: Path, voice: VoicePrompt) -> None:
        """Atomically: a reader never sees half a file (another talker may share the folder)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".recording-", suffix=".pt")
        os.close(fd)
        try:
            save_voice(tmp, voice)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
