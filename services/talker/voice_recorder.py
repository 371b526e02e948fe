"""Voices from audio, recorded as NVIDIA's reference server records them, once per voice.

    recorder = VoiceRecorder(paths, engine, compute, cache_dir)
    lease = await recorder.resolve("NATF2.pt")               # a recorded prompt: used as it is
    lease = await recorder.resolve("Alice.wav")              # audio in voices/: recorded on first use
    lease = await recorder.resolve("alice", pcm=samples)     # audio shipped with the open (an enrolled voice)
    engine.begin(slot, lease.key, ...); ...; lease.release() # once the prompt is in the slot (or never begun)
    outcome = await recorder.forget(sha256_hex)              # ForgetVoice: the gateway deleted that audio

Recording (`record`): the audio prepared by services/common/voice_audio.py (24 kHz, first channel,
-24 LUFS, 1920-sample frames), Mimi-encoded frame by frame from a fresh streaming state, and each
frame stepped as a voice-prompt frame by prompt.make_voice. The result is the published `.pt`
format; it is kept on disk under `cache_dir` (recording_files.py: named by a digest of the audio
and of the model files, so another checkpoint never reads it) and given to the engine, which
computes its KV prefix once, in prefill pieces.

What a recording costs the ticks of the sessions already talking (issue 31). The Mimi encode runs in
a process of its own (voice_encoder.py). On the engine's thread (`compute`, so the device is never
used from two threads) run two kinds of work, each bounded whatever the voice's length: the
embedding lookup (engine.embed_voice), one call that only launches a few dozen small kernels and
queues the copy to the host, which a worker thread waits for; and the voice's KV prefix, computed
by the prefill pieces of the first session that begins with it, at most prefill_chunk_frames
positions per piece, scheduled by the clock like any prompt's pieces (one riding each main step,
more in a period's slack), as the captured graph of voice embeddings that warm-up records
(engine._VoicePrefix). Each is measured on the compute thread: the
duplex_talker_voice_compute_seconds{part} histogram, the "recorded" log line (the lookup) and the
engine's "KV prefix ... computed in N piece(s)" line. Nothing of a recording runs on the event
loop: the audio's digest and the prompt columns are taken on worker threads.

Bounds. A recording of an enrolled voice (audio shipped with an open) is held in memory within
`memory_bytes` (recording_store.py: embeddings and KV prefix counted together, least recently
used evicted first, never one a session is starting with: its lease) and on disk within
`disk_bytes` (recording_files.py). `forget` drops one from both (a session starting with it keeps
it until its prompt is in its slot). Bundled voices are never evicted or forgotten: as many as
the checkpoint holds.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import re
import time
from pathlib import Path
from typing import Awaitable, Callable

import numpy as np
import sphn
import torch

from services.common import voice_audio, voice_names
from services.common.checkpoint import CheckpointPaths, InvalidVoice
from services.common.errors import InvalidArgument, ResourceExhausted, retry_hint
from services.talker import prompt
from services.talker.engine import VoiceLookup
from services.talker.recording_files import RecordingFiles
from services.talker.recording_store import ForgetOutcome, Holding, RecordingStore, StoreFull
from services.talker.voice_encoder import VoiceEncoder, voice_codes
from services.talker.voices import RING, VoicePrompt

log = logging.getLogger("talker.voices")


def published(voice: VoicePrompt) -> VoicePrompt:
    """The voice as the published file holds it (bf16 embeddings on the CPU): the same whether
    recorded now or read back from the disk cache."""
    return VoicePrompt(embeddings=voice.embeddings.to("cpu", torch.bfloat16), cache=voice.cache.cpu())


def record(pcm: np.ndarray, mimi, embed, delays: torch.Tensor, initial: torch.Tensor,
           device: str | torch.device = "cpu") -> VoicePrompt:
    """24 kHz audio (first channel, not yet normalised) -> the voice prompt, as the reference records it."""
    return published(prompt.make_voice(embed, voice_codes(pcm, mimi), delays, initial, device))



SHA256_HEX = re.compile(r"[0-9a-f]{64}")
ENROLLED_KEY_CHARS = 24  # hex digits of the audio's sha256 in its engine key
MAX_SECONDS = 60.0  # default bound of a voice's audio (TalkerConfig.max_voice_seconds)
MEMORY_BYTES = 1 << 30  # default bound of the recordings held in memory (TalkerConfig.voice_memory_bytes)
DISK_BYTES = 2 << 30  # default bound of the enrolled recordings on disk (TalkerConfig.voice_cache_bytes)
LEASE_ATTEMPTS = 3  # a recording evicted between its arrival and its waiters' leases is recorded again
FULL_RETRY_S = 5.0  # the retry hint of voice_store_full: sessions starting now go live within seconds


def audio_sha256(pcm: np.ndarray) -> str:
    """The sha256 (hex) of the audio as TalkOpen.voice_audio carries it (float32 little-endian): what
    ForgetVoice names it by."""
    return hashlib.sha256(pcm.astype("<f4").tobytes()).hexdigest()


def enrolled_key(sha: str) -> str:
    """The engine's key for shipped audio: '@' is never in a bundled or enrolled name."""
    return "@" + sha[:ENROLLED_KEY_CHARS]


def recording_digest(model: str, sha: str) -> str:
    """Names a recording: the same audio (bundled or shipped) and the same model files, the same recording."""
    return hashlib.sha256(f"{model}:{sha}".encode()).hexdigest()[:32]


def model_digest(paths: CheckpointPaths) -> str:
    """Names the model files a recording depends on (the LM's embeddings and Mimi): path, size, mtime."""
    h = hashlib.sha256()
    for f in (paths.lm, paths.mimi):
        st = f.stat()
        h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:16]


class VoiceLease:
    """A session's hold on its voice: `key` is what the engine's begin() takes. release() once the
    prompt is in the slot, or when the session ends without (idempotent). For a bundled voice or
    none it holds nothing."""

    __slots__ = ("key", "_release")

    def __init__(self, key: str | None, release: Callable[[str], None] | None = None):
        self.key, self._release = key, release

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release(self.key)


class VoiceRecorder:
    def __init__(self, paths: CheckpointPaths, engine, compute: Callable[[Callable], Awaitable],
                 cache_dir: str | Path, max_seconds: float = MAX_SECONDS, memory_bytes: int = MEMORY_BYTES,
                 disk_bytes: int = DISK_BYTES, metrics=None):
        """compute(fn): run fn on the engine's thread and return its result (ConversationClock.compute).
        metrics: TalkerMetrics (its voice counters), or None."""
        self.paths, self.engine, self.compute = paths, engine, compute
        self.max_seconds = max_seconds
        self.encoder = VoiceEncoder(paths)
        self.store = RecordingStore(memory_bytes)
        self.files = RecordingFiles(cache_dir, disk_bytes)
        self.metrics = metrics
        self._kv_bytes_per_frame = engine.kv.bytes_per_position
        longest = self.recording_bytes(math.ceil(max_seconds * voice_audio.SAMPLE_RATE / voice_audio.FRAME_SAMPLES))
        if longest > memory_bytes:
            raise ValueError(f"voice_memory_bytes ({memory_bytes}) cannot hold one voice of max_voice_seconds "
                             f"({max_seconds:g} s: {longest} bytes on this model)")
        self._model: str | None = None  # model_digest, taken once
        self._bundled: list[tuple[str, float]] | None = None
        self._pending: dict[str, asyncio.Future] = {}  # key -> the recording in flight (one per voice)
        # Enrolled keys being loaded or recorded, not yet in the store, and those of them forgotten meanwhile.
        self._arriving: set[str] = set()
        self._forgotten_arriving: set[str] = set()

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

    def recording_bytes(self, frames: int) -> int:
        """What a recording of `frames` voice frames holds: bf16 embeddings on the host and, once a session
        begins with it, its KV prefix on the device (engine._VoicePrefix: one position per embedding)."""
        positions = max(1, frames - 1)
        cache = self.engine.cfg.num_streams * RING * 8  # the token ring (LongTensor[17, RING])
        return positions * self.engine.cfg.dim * 2 + cache + min(positions, self.engine.context) * \
            self._kv_bytes_per_frame

    # ---- resolve: the voice a session begins with

    async def resolve(self, name: str | None, pcm: np.ndarray | None = None) -> VoiceLease:
        """A lease on the engine's key for a session's voice, recording it first if needed. InvalidVoice
        (with a `kind` for audio problems) for anything that cannot be a voice; ResourceExhausted
        (recorder_busy, voice_store_full) when it cannot be recorded now."""
        if pcm is None and (name is None or not voice_names.is_audio(name)):
            return VoiceLease(name)  # none, or a recorded prompt the engine loads itself
        if pcm is None:
            return await self._resolve_bundled(name)
        if pcm.size > self.max_seconds * voice_audio.SAMPLE_RATE:
            raise voice_audio.InvalidVoiceAudio(f"voice audio lasts {pcm.size / voice_audio.SAMPLE_RATE:.1f} s, "
                                                f"at most {self.max_seconds:g} s allowed", "too_long")
        sha = await asyncio.to_thread(audio_sha256, pcm)
        key = enrolled_key(sha)
        for _ in range(LEASE_ATTEMPTS):
            if self.store.lease(key):  # held: no await between the check and the lease
                return VoiceLease(key, self._release)
            self._check_room(math.ceil(pcm.size / voice_audio.FRAME_SAMPLES))  # before any work
            await self._once(key, lambda: self._load_or_record(key, sha, pcm))
            if self.store.lease(key, revive=False):  # waiting since before a forget: not revived
                return VoiceLease(key, self._release)
        raise self._full(f"voice {key} was evicted {LEASE_ATTEMPTS} times before its session could start")

    async def _resolve_bundled(self, name: str) -> VoiceLease:
        path = self.paths.resolve_voice(name)
        if not self.engine.has_voice(name):
            pcm = await asyncio.to_thread(voice_audio.read_audio, path, self.max_seconds)
            sha = await asyncio.to_thread(audio_sha256, pcm)
            await self._once(name, lambda: self._load_or_record_bundled(name, sha, pcm))
        return VoiceLease(name)  # bundled: kept for the process's life

    async def _once(self, key: str, start: Callable[[], Awaitable]) -> None:
        """Await the one recording of `key` in flight, starting it if there is none."""
        if key not in self._pending:
            self._pending[key] = asyncio.ensure_future(start())
            self._pending[key].add_done_callback(lambda _f, k=key: self._pending.pop(k, None))
        await asyncio.shield(self._pending[key])

    def _check_room(self, frames: int) -> None:
        if not self.store.room_for(self.recording_bytes(frames)):
            raise self._full("the recorded voices of the sessions starting now fill this talker's bound "
                             f"({self.store.max_bytes} bytes)")

    def _full(self, why: str) -> ResourceExhausted:
        return ResourceExhausted(f"{why}; {retry_hint(FULL_RETRY_S)}", kind="voice_store_full")

    async def _load_or_record(self, key: str, sha: str, pcm: np.ndarray) -> None:
        """An enrolled voice's recording (from the disk cache, or recorded now) into the store and the engine."""
        self._arriving.add(key)
        try:
            digest = recording_digest(await self._model_digest(), sha)
            path = self.files.path(digest, enrolled=True)
            voice = await self._load(path)
            if voice is None:
                voice, held_s = await self._record(pcm)
                kept = await asyncio.to_thread(self.files.save, path, voice)
                log.info("voice %s recorded: %d frames, its embedding lookup %.2f ms on the compute thread%s", key,
                         voice.frames, held_s * 1e3, f", cached as {path}" if kept else "")
            if key in self._forgotten_arriving:  # its file may have been written after the forget looked
                await asyncio.to_thread(self.files.forget, digest)
        except BaseException:
            self._arriving.discard(key)
            self._forgotten_arriving.discard(key)
            raise
        # From here to the compute submission, one step: a forget sees the key either arriving or in the store.
        self._arriving.discard(key)
        forgotten = key in self._forgotten_arriving
        self._forgotten_arriving.discard(key)
        try:
            evicted = self.store.admit(key, self.recording_bytes(voice.frames),
                                       Holding.FORGETTING if forgotten else Holding.HELD)
        except StoreFull as e:
            raise self._full(str(e)) from None
        if evicted:
            log.info("voices %s evicted from memory to make room for %s (%d bytes held, bound %d)",
                     ", ".join(evicted), key, self.store.held_bytes, self.store.max_bytes)
            if self.metrics is not None:
                self.metrics.voice_evictions.inc(len(evicted))

        def add() -> None:
            self._drop_unheld(evicted)
            self.engine.add_voice(key, voice)

        # Submitted in this step, before any session can lease the key and begin (the compute thread is FIFO).
        await self.compute(add)

    async def _load_or_record_bundled(self, name: str, sha: str, pcm: np.ndarray) -> None:
        path = self.files.path(recording_digest(await self._model_digest(), sha), enrolled=False)
        voice = await self._load(path)
        if voice is None:
            voice, held_s = await self._record(pcm)
            await asyncio.to_thread(self.files.save, path, voice)
            log.info("voice %s recorded: %d frames, its embedding lookup %.2f ms on the compute thread, cached as %s",
                     name, voice.frames, held_s * 1e3, path)
        await self.compute(lambda: self.engine.add_voice(name, voice))

    async def _load(self, path: Path) -> VoicePrompt | None:
        try:
            return await asyncio.to_thread(self.files.load, path, self.engine.cfg)
        except InvalidVoice as e:
            log.warning("recorded voice %s in the cache is unreadable (%s): recording it again", path.name, e)
            return None

    async def _model_digest(self) -> str:
        if self._model is None:
            self._model = await asyncio.to_thread(model_digest, self.paths)
        return self._model

    async def _record(self, pcm: np.ndarray) -> tuple[VoicePrompt, float]:
        """The voice prompt of the audio (what `record` gives, bit for bit) and the seconds its embedding
        lookup held the compute thread."""
        codes = await self.encoder.codes(pcm)
        eng = self.engine
        delays, initial = torch.tensor(eng.cfg.delays), prompt.initial_tokens(eng.text_card, eng.card,
                                                                              eng.cfg.num_streams)
        cols, ring = await asyncio.to_thread(prompt.voice_columns, codes, delays, initial)

        def lookup() -> tuple[VoiceLookup, float]:
            t0 = time.perf_counter()
            return eng.embed_voice(cols), time.perf_counter() - t0

        pending, held_s = await self.compute(lookup)  # launches only: no wait for the GPU on its thread
        embeddings = await asyncio.to_thread(pending.wait)
        if self.metrics is not None:
            self.metrics.voice_compute.labels(part="lookup").observe(held_s)
        return VoicePrompt(embeddings=embeddings, cache=ring), held_s

    # ---- leases and forgetting

    def _release(self, key: str) -> None:
        dropped = self.store.release(key)
        if dropped:
            log.info("voice %s forgotten: its last session is in its slot", key)
            self._submit_drop(dropped)

    def _submit_drop(self, keys: list[str]) -> None:
        task = asyncio.ensure_future(self.compute(lambda: self._drop_unheld(keys)))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # never "exception never retrieved"

    def _drop_unheld(self, keys: list[str]) -> None:
        """On the compute thread: drop from the engine those of `keys` the store no longer holds. Checked
        when it runs (a dict lookup, atomic under the GIL), so a drop that runs after the same audio was
        admitted again leaves its new recording alone."""
        for key in keys:
            if key not in self.store:
                self.engine.forget_voice(key)

    async def forget(self, sha: str) -> ForgetOutcome:
        """ForgetVoice: the recording of the enrolled audio whose sha256 is `sha`, from memory (now, or
        when the sessions starting with it are in their slots) and from the disk cache. A bundled
        voice is never named this way (its key is its name)."""
        if not isinstance(sha, str) or not SHA256_HEX.fullmatch(sha):
            raise InvalidArgument(f"audio_sha256 must be 64 lowercase hex digits, got {str(sha)[:80]!r}",
                                  kind="bad_digest")
        key = enrolled_key(sha)
        outcome, dropped = self.store.forget(key)
        if key in self._arriving:  # it lands forgotten: dropped once the sessions waiting for it start
            self._forgotten_arriving.add(key)
            outcome = ForgetOutcome.DEFERRED
        on_disk = await asyncio.to_thread(self.files.forget, recording_digest(await self._model_digest(), sha))
        if dropped:
            await self.compute(lambda: self._drop_unheld(dropped))
        if outcome is ForgetOutcome.NOT_HELD and on_disk:
            outcome = ForgetOutcome.FORGOTTEN
        log.info("voice %s: forget %s (%d recordings, %d bytes held)", key, outcome.value, len(self.store),
                 self.store.held_bytes)
        if self.metrics is not None:
            self.metrics.voice_forgets.labels(outcome=outcome.value).inc()
        return outcome

    def close(self) -> None:
        """Stop the recorder's process (the recordings in flight fail)."""
        self.encoder.close()
