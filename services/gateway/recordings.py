"""The talkers' recordings of a voice the gateway deleted or replaced: forgotten on every cell.

    outcomes = await forget_everywhere(pool.cells.values(), audio, timeout_s=2.0)
    # {"127.0.0.1:50052": Pruned.FORGOTTEN, "10.0.0.7:50052": Pruned.UNREACHABLE, ...}

A talker records an enrolled voice the first time a session ships its audio, and keeps the
recording (memory and disk cache) under the audio's sha256 (talker.proto ForgetVoice). The
gateway names that digest to every talker it knows, at once, each call within `timeout_s`, with
the link token (stage_gate.py). A talker that cannot be reached keeps its recording until its
own byte bounds evict it (least recently used first, in memory and on disk); the DELETE still
answers, and says which talkers did not confirm (voices.py).
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import logging
from collections.abc import Iterable

import grpc

from duplex.v1 import talker_pb2
from services.common.stage_gate import link_metadata

log = logging.getLogger("gateway.voices")


class Pruned(enum.Enum):
    """What one talker did with a ForgetVoice."""

    FORGOTTEN = "forgotten"  # dropped (memory and disk)
    DEFERRED = "deferred"  # a session starting with it keeps it until its prompt is in its slot
    NOT_HELD = "not_held"  # that talker never recorded it (or evicted it already)
    UNREACHABLE = "unreachable"  # no connection (UNAVAILABLE)
    TIMED_OUT = "timed_out"  # no answer within the deadline
    REFUSED = "refused"  # any other status: an older talker (UNIMPLEMENTED), a wrong link token, ...

    @property
    def confirmed(self) -> bool:
        return self in (Pruned.FORGOTTEN, Pruned.DEFERRED, Pruned.NOT_HELD)


_OUTCOMES = {talker_pb2.FORGET_OUTCOME_FORGOTTEN: Pruned.FORGOTTEN, talker_pb2.FORGET_OUTCOME_DEFERRED: Pruned.DEFERRED,
             talker_pb2.FORGET_OUTCOME_NOT_HELD: Pruned.NOT_HELD}
_FAILURES = {grpc.StatusCode.UNAVAILABLE: Pruned.UNREACHABLE, grpc.StatusCode.DEADLINE_EXCEEDED: Pruned.TIMED_OUT}


def audio_sha256(audio: bytes) -> str:
    """The digest a talker names a recording by: of the audio exactly as TalkOpen.voice_audio ships it."""
    return hashlib.sha256(audio).hexdigest()


async def forget_everywhere(cells: Iterable, audio: bytes, timeout_s: float) -> dict[str, Pruned]:
    """ForgetVoice on every cell's talker at once; each talker's outcome, by its address."""
    request = talker_pb2.ForgetVoiceRequest(audio_sha256=audio_sha256(audio))
    talkers = {cell.address.talker: cell.stubs["talker"] for cell in cells}

    async def one(address: str, stub) -> Pruned:
        try:
            reply = await stub.ForgetVoice(request, timeout=timeout_s, metadata=link_metadata())
        except grpc.aio.AioRpcError as e:
            outcome = _FAILURES.get(e.code(), Pruned.REFUSED)
            log.warning("talker %s did not forget recording %s: %s %s", address, request.audio_sha256[:16],
                        e.code().name, (e.details() or "")[:200])
            return outcome
        return _OUTCOMES.get(reply.outcome, Pruned.REFUSED)

    outcomes = await asyncio.gather(*(one(a, s) for a, s in talkers.items()))
    return dict(zip(talkers, outcomes))
