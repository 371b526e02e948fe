"""The talker's recordings of enrolled voices (audio shipped with opens) are bounded and can be forgotten
(services/talker/voice_recorder.py, recording_store.py, recording_files.py; talker.proto ForgetVoice).

One talker process on the tiny checkpoint with small bounds: memory for two 1.5 s recordings (the
longest voice allowed, 3 s, fits alone), disk for two files. Everything is observed from outside:
the talker's /metrics (duplex_talker_voice_recordings, _recording_bytes, _evictions_total,
_forgets_total), the enrolled-*.pt files of its voice cache folder, and the Talk streams.
"""

from __future__ import annotations

import hashlib
import queue
import time

import grpc
import pytest

from duplex.v1 import common_pb2, talker_pb2, talker_pb2_grpc
from services.common.errors import ERROR_KIND_KEY
from tests.reliability_helpers import http_get
from tests.test_voices_from_audio import speech_like
from tools.procs import ServiceProcess

pytestmark = pytest.mark.timeout(300)

MEMORY_BYTES = 50_000  # a 1.5 s voice holds about 21 kB on the tiny model (host + KV prefix): two fit, not three
DISK_BYTES = 10_000  # two 1.5 s recordings' files (4.8 kB each), not three
HOLD_MS = 20_000  # a held open keeps its lease until its first frame


@pytest.fixture(scope="module")
def talker(tiny_checkpoint, tmp_path_factory):
    cache = tmp_path_factory.mktemp("recorded")
    args = ["--checkpoint", str(tiny_checkpoint), "--slots", "4", "--device", "cpu", "--voice-cache-dir", str(cache),
            "--max-voice-seconds", "3", "--voice-memory-bytes", str(MEMORY_BYTES),
            "--voice-cache-bytes", str(DISK_BYTES)]
    with ServiceProcess("services.talker", args, ready_timeout=180) as proc:
        proc.cache = cache
        yield proc


@pytest.fixture(scope="module")
def stub(talker):
    with grpc.insecure_channel(talker.address) as ch:
        yield talker_pb2_grpc.TalkerStub(ch)


def voice(seed: int, seconds: float = 1.5) -> bytes:
    """A distinct voice's samples as TalkOpen.voice_audio ships them."""
    return speech_like(seconds, 24_000, seed=seed)[0].astype("<f4").tobytes()


def sha(audio: bytes) -> str:
    return hashlib.sha256(audio).hexdigest()


def metric(talker, name: str, **labels) -> float:
    return metric_at(talker.metrics_url, name, **labels)


def metric_at(url: str, name: str, **labels) -> float:
    """One sample of a /metrics page (labels in their exported order)."""
    _, body = http_get(url)
    want = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
    for line in body.decode().splitlines():
        if line.startswith(name + want + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name}{want} not in {url}")


def recordings(talker) -> tuple[int, float]:
    return int(metric(talker, "duplex_talker_voice_recordings")), metric(talker, "duplex_talker_voice_recording_bytes")


def files(talker) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in talker.cache.glob("enrolled-*.pt")}


def until(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not within the timeout"
        time.sleep(0.05)


class Talk:
    """A Talk stream whose open ships `audio` as an enrolled voice; frames are sent on request."""

    def __init__(self, stub, stream_id: str, audio: bytes, hold_ms: int = 0):
        self._requests: queue.Queue = queue.Queue()
        self._requests.put(talker_pb2.TalkRequest(open=talker_pb2.TalkOpen(
            stream=common_pb2.StreamOpen(stream_id=stream_id), voice="enrolled", persona="Hi.", voice_audio=audio,
            hold_prompt_ms=hold_ms, sampling=talker_pb2.Sampling(greedy=True, seed=1))))
        self._seq = 0
        self.call = stub.Talk(iter(self._requests.get, None), timeout=120)

    def first(self) -> str:
        """The kind of the first response ('held' or 'ready'), or the error kind that ended the stream."""
        try:
            return next(self.call).WhichOneof("kind")
        except grpc.RpcError as e:
            return dict(e.trailing_metadata() or ()).get(ERROR_KIND_KEY, "")

    def talk(self, frames: int = 3) -> list[str]:
        """Send `frames` frames and half-close: the kinds of every response until the stream ends OK."""
        for _ in range(frames):
            self._requests.put(talker_pb2.TalkRequest(frame=common_pb2.CodesFrame(seq=self._seq, codes=[5] * 8)))
            self._seq += 1
        self._requests.put(None)
        return [r.WhichOneof("kind") for r in self.call]


def session(stub, stream_id: str, audio: bytes) -> list[str]:
    t = Talk(stub, stream_id, audio)
    return [t.first(), *t.talk()]


def test_recordings_are_bounded_in_bytes_least_recently_used_first(talker, stub):
    """Three voices shipped one after another: memory holds two (the least recently used is evicted),
    the disk cache keeps its bound; a voice used again comes back (evicting the oldest) and talks."""
    evicted0 = metric(talker, "duplex_talker_voice_evictions_total")
    for i in range(3):
        assert session(stub, f"bounded-{i}", voice(100 + i)) == ["ready", "output", "output", "output"]
    held, nbytes = recordings(talker)
    assert held == 2 and 0 < nbytes <= MEMORY_BYTES
    assert metric(talker, "duplex_talker_voice_evictions_total") - evicted0 == 1
    on_disk = files(talker)
    assert len(on_disk) == 2 and sum(on_disk.values()) <= DISK_BYTES  # the oldest file was removed
    assert session(stub, "bounded-again", voice(100)) == ["ready", "output", "output", "output"]
    assert recordings(talker)[0] == 2 and metric(talker, "duplex_talker_voice_evictions_total") - evicted0 == 2
    assert sum(files(talker).values()) <= DISK_BYTES


def test_a_recording_a_session_is_starting_with_is_never_evicted(talker, stub):
    """Two held opens lease their voices (memory full of leased recordings): a third new voice is refused
    at once (RESOURCE_EXHAUSTED voice_store_full) and evicts neither. Once one held session's prompt is
    in its slot its lease ends, the third voice fits, and both held sessions talk."""
    a, b = Talk(stub, "lease-a", voice(200), HOLD_MS), Talk(stub, "lease-b", voice(201), HOLD_MS)
    assert (a.first(), b.first()) == ("held", "held")
    third = Talk(stub, "lease-c", voice(202))
    assert third.first() == "voice_store_full"
    assert a.talk() == ["ready", "output", "output", "output"]  # a's lease ended at its ready
    assert session(stub, "lease-c2", voice(202)) == ["ready", "output", "output", "output"]
    assert b.talk() == ["ready", "output", "output", "output"]  # b's recording was not the one evicted


def forget(stub, audio_sha256: str) -> int:
    return stub.ForgetVoice(talker_pb2.ForgetVoiceRequest(audio_sha256=audio_sha256), timeout=10).outcome


def test_forget_voice_drops_a_recording_from_memory_and_disk(talker, stub):
    """After its session, ForgetVoice drops the recording (gauge and file); a later open that ships the
    same audio records it again. A digest nothing was recorded for is NOT_HELD; a malformed one is
    INVALID_ARGUMENT (bad_digest)."""
    audio = voice(300)
    assert session(stub, "forget-1", audio)[0] == "ready"
    held, _ = recordings(talker)
    on_disk = files(talker)
    forgotten0 = metric(talker, "duplex_talker_voice_forgets_total", outcome="forgotten")
    assert forget(stub, sha(audio)) == talker_pb2.FORGET_OUTCOME_FORGOTTEN
    assert recordings(talker)[0] == held - 1
    assert len(files(talker)) == len(on_disk) - 1
    assert metric(talker, "duplex_talker_voice_forgets_total", outcome="forgotten") == forgotten0 + 1
    assert forget(stub, sha(audio)) == talker_pb2.FORGET_OUTCOME_NOT_HELD
    assert session(stub, "forget-2", audio)[0] == "ready"  # recorded again
    assert recordings(talker)[0] == held and len(files(talker)) == len(on_disk)
    for bad in ["", "0" * 63, "G" * 64, sha(audio).upper()]:
        with pytest.raises(grpc.RpcError) as e:
            forget(stub, bad)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert dict(e.value.trailing_metadata())[ERROR_KIND_KEY] == "bad_digest"


def test_a_recording_forgotten_while_a_session_starts_with_it_stays_until_its_prompt_is_in(talker, stub):
    """A held open leases its voice; ForgetVoice then answers DEFERRED and the file goes at once, but the
    recording stays in memory: the session's prompt starts later (its first frame) and it talks. Its
    ready ends the lease and the recording goes."""
    audio = voice(400)
    held_talk = Talk(stub, "deferred", audio, HOLD_MS)
    assert held_talk.first() == "held"
    held, _ = recordings(talker)
    on_disk = len(files(talker))
    assert forget(stub, sha(audio)) == talker_pb2.FORGET_OUTCOME_DEFERRED
    assert recordings(talker)[0] == held  # still there for the prompt
    assert len(files(talker)) == on_disk - 1
    assert held_talk.talk(5) == ["ready"] + ["output"] * 5
    until(lambda: recordings(talker)[0] == held - 1)
    assert forget(stub, sha(audio)) == talker_pb2.FORGET_OUTCOME_NOT_HELD
    assert metric(talker, "duplex_talker_voice_forgets_total", outcome="deferred") >= 1
