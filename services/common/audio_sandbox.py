"""A client's audio file, checked as a voice (audio_decode.check_voice) in a child process with bounds.

    pcm = await check_voice_apart(data, min_seconds=2.0, max_seconds=30.0)

Why a child: a decoder is a large attack surface (sphn wraps symphonia's Rust decoders). In the
child, whatever a file does stays there: a Rust panic, an allocation failure that aborts the
process, a loop that does not end. The child runs `python -m services.common.audio_sandbox` with

    address space   MEMORY_BYTES (RLIMIT_AS, set by the child on itself before it reads a byte)
    CPU time        CPU_SECONDS (RLIMIT_CPU)
    wall clock      TIMEOUT_S, then it is killed

and answers on stdout: exit 0 and the float32 samples (24 kHz, little-endian), or exit 3 and
`{"kind", "message"}` for audio that cannot be a voice. Anything else (killed, out of memory, a
crash) is InvalidVoiceAudio(not_audio). Inside, audio_decode.read_audio already reads the header first and
stops decoding at max_seconds, so a well-formed bomb costs nothing either.

Cost: one interpreter start with numpy, sphn and pyloudnorm imported (no torch: audio_decode.py has
no model code), about 1 s on a laptop CPU, per enrollment (rare: a person enrolls a voice once).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import sys
from pathlib import Path

import numpy as np

from services.common import audio_decode

log = logging.getLogger("audio_sandbox")

MEMORY_BYTES = 768 * 1024 * 1024  # the interpreter with its imports takes ~260 MB of address space
CPU_SECONDS = 15
TIMEOUT_S = 20.0
_INVALID = 3  # exit status: the audio cannot be a voice (stdout says why)
_REPO_ROOT = Path(__file__).resolve().parents[2]


async def check_voice_apart(data: bytes, min_seconds: float, max_seconds: float) -> np.ndarray:
    """audio_decode.check_voice(data, min_seconds, max_seconds) in a bounded child process; refusals are
    voice_audio.InvalidVoiceAudio."""
    from services.common import voice_audio  # here: the child must not import torch (checkpoint.py)

    env = {**os.environ, "RUST_BACKTRACE": "0", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.common.audio_sandbox", repr(min_seconds), repr(max_seconds),
        str(MEMORY_BYTES), str(CPU_SECONDS), cwd=_REPO_ROOT, env=env,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(data), TIMEOUT_S)
    except asyncio.TimeoutError:
        raise voice_audio.InvalidVoiceAudio(f"decoding took longer than {TIMEOUT_S:g} s", "not_audio") from None
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    if proc.returncode == 0:
        return np.frombuffer(out, dtype="<f4").astype(np.float32)
    if proc.returncode == _INVALID:
        why = json.loads(out)
        raise voice_audio.InvalidVoiceAudio(why["message"], why["kind"])
    log.info("the audio check exited %s: %s", proc.returncode, err[-300:].decode("utf-8", "replace").strip())
    raise voice_audio.InvalidVoiceAudio(f"the decoder failed on this file (exit status {proc.returncode})",
                                        "not_audio")


def _child(argv: list[str]) -> int:
    min_seconds, max_seconds, memory, cpu = float(argv[0]), float(argv[1]), int(argv[2]), int(argv[3])
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    data = sys.stdin.buffer.read()
    try:
        pcm = audio_decode.check_voice(data, min_seconds, max_seconds)
    except audio_decode.AudioRefused as e:
        sys.stdout.write(json.dumps({"kind": e.kind, "message": str(e)}))
        return _INVALID
    sys.stdout.buffer.write(pcm.astype("<f4").tobytes())
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
