"""A voice recording's Mimi encode, in a process of its own: recording a voice never delays a tick.

    encoder = VoiceEncoder(paths)
    codes = await encoder.codes(pcm)   # 24 kHz audio -> Mimi codes [N, 8]; InvalidVoiceAudio if it cannot be a voice
    encoder.close()

The encode is the recording's model work: the audio normalised (-24 LUFS) and cut into frames
(services/common/voice_audio.py), then Mimi-encoded frame by frame from a fresh streaming state, on
the CPU (the full Mimi takes about 27 ms a frame on one core: 20 s for a 60 s voice). Run on a
thread of the talker it shares the talker's GIL with the event loop and the compute thread, and a
first session with a new voice made a bystander's ticks late (issue 31: 83 of 209 ticks over the
period). Here it runs in one spawned child process: its own GIL and memory, `threads` torch
threads, and a lower CPU priority (`nice`), so the talker's threads get the cores first. What
stays on the talker is what the recording hands the engine: one embedding lookup launched on the
compute thread (engine.embed_voice), then the voice's KV prefix in prefill pieces like any prompt
(voice_recorder.py says what each costs a tick).

Costs: the child starts with the first recording (Python, torch and Mimi's encoder half: a few
seconds, a few hundred MB) and stays for the next. At most `max_pending` recordings wait or run at
once; more are refused (ResourceExhausted, recorder_busy), so audio shipped with opens costs the
talker bounded memory and CPU. A child that dies (killed, out of memory) fails the recordings in
flight (Internal, recorder); the next recording starts a new one.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os

import numpy as np
import torch

from services.common import voice_audio
from services.common.checkpoint import CheckpointPaths, InvalidVoice
from services.common.errors import Internal, ResourceExhausted
from services.common.frame import CODEBOOKS as AGENT_CODEBOOKS

log = logging.getLogger("talker.voices")

MAX_PENDING = 4  # recordings waiting or running at once
NICE = 10  # the child's CPU priority below the talker's (0 = the same)
STOP_TIMEOUT_S = 5.0


@torch.no_grad()
def encode_frames(mimi, frames: np.ndarray) -> torch.Tensor:
    """Mimi codes [N, 8] of frames [N, 1920], encoded one by one from a fresh streaming state."""
    from services.codec.mimi import StreamingEncoder

    enc = StreamingEncoder(mimi, slots=1)
    active = torch.ones(1, dtype=torch.bool)
    codes = [enc.step(torch.from_numpy(f)[None], active)[0, :AGENT_CODEBOOKS].cpu() for f in frames]
    return torch.stack(codes).long()


def voice_codes(pcm: np.ndarray, mimi) -> torch.Tensor:
    """24 kHz audio (first channel, not yet normalised) -> the Mimi codes [N, 8] the reference records."""
    frames = voice_audio.to_frames(voice_audio.normalize(pcm))
    if frames.shape[0] < 3:
        raise voice_audio.InvalidVoiceAudio(f"a voice needs at least 3 frames (240 ms), got {frames.shape[0]}",
                                            "too_short")
    return encode_frames(mimi, frames)


class VoiceEncoder:
    """The child process and the recordings sent to it, one at a time (the event loop's side)."""

    def __init__(self, paths: CheckpointPaths, threads: int = 1, nice: int = NICE, max_pending: int = MAX_PENDING):
        self.paths, self.threads, self.nice, self.max_pending = paths, threads, nice, max_pending
        self.pending = 0  # recordings waiting or running
        self.encodes = 0  # recordings encoded (a voice found in the disk cache costs none)
        self._turn = asyncio.Lock()  # one recording in the child at a time
        self._child: multiprocessing.Process | None = None
        self._conn = None

    async def codes(self, pcm: np.ndarray) -> torch.Tensor:
        if self.pending >= self.max_pending:
            raise ResourceExhausted(f"{self.pending} voice recordings are waiting or running on this talker (at most "
                                    f"{self.max_pending}); retry in a few seconds", kind="recorder_busy")
        self.pending += 1
        try:
            async with self._turn:
                codes, refused = await asyncio.to_thread(self._in_child, pcm)
        finally:
            self.pending -= 1
        if refused is not None:
            raise voice_audio.InvalidVoiceAudio(*refused)
        self.encodes += 1
        return torch.from_numpy(codes)

    def close(self) -> None:
        """Stop the child (a recording in flight fails with Internal)."""
        child, self._child = self._child, None
        if child is not None:
            child.terminate()
            child.join(STOP_TIMEOUT_S)
            if child.is_alive():
                child.kill()
                child.join()

    # ---- on a worker thread (one at a time: _turn) -------------------------------------------

    def _in_child(self, pcm: np.ndarray):
        if self._child is None or not self._child.is_alive():
            self._start()
        try:
            self._conn.send(pcm)
            return self._conn.recv()
        except (EOFError, OSError) as e:
            self.close()
            raise Internal(f"the voice recorder's process ended during the recording ({type(e).__name__}); see the "
                           f"talker's log", kind="recorder") from None

    def _start(self) -> None:
        if not self.paths.mimi.is_file():
            raise InvalidVoice("this talker cannot record voices from audio: its checkpoint has no Mimi file")
        self.close()
        ctx = multiprocessing.get_context("spawn")  # no fork of a process with threads and a CUDA context
        self._conn, theirs = ctx.Pipe()
        self._child = ctx.Process(target=_serve, name="talker-voice-recorder", daemon=True,
                                  args=(theirs, str(self.paths.mimi), self.paths.serve_config().get("mimi"),
                                        self.threads))
        self._child.start()
        # At once, before it imports torch: even its start must not take the talker's cores.
        os.setpriority(os.PRIO_PROCESS, self._child.pid, os.getpriority(os.PRIO_PROCESS, 0) + self.nice)
        theirs.close()
        log.info("voice recorder process %d started (Mimi's encoder on the CPU, %d thread(s), nice %d)",
                 self._child.pid, self.threads, self.nice)


# ---- in the child process -------------------------------------------------------------------

def _serve(conn, mimi_path: str, section: dict | None, threads: int) -> None:
    """Load Mimi's encoder half, then answer recordings until the talker closes its end."""
    from services.codec.mimi import MimiConfig, MimiModel

    torch.set_num_threads(threads)
    cfg = MimiConfig.from_dict(section) if section else MimiConfig.full()
    mimi = MimiModel.load(mimi_path, cfg, device="cpu", keep="encode")
    while True:
        try:
            pcm = conn.recv()
        except EOFError:
            return
        conn.send(_encode(mimi, pcm))


def _encode(mimi, pcm: np.ndarray) -> tuple[np.ndarray | None, tuple[str, str] | None]:
    """(codes, None), or (None, (message, kind)) for audio that cannot be a voice (an exception
    with a `kind` does not survive the trip back)."""
    try:
        return voice_codes(pcm, mimi).numpy(), None
    except voice_audio.InvalidVoiceAudio as e:
        return None, (str(e), e.kind)
