"""The stage chain as data: what the gateway sends each stage of a cell and what its answers mean.

    client frame -> encoder --codes--> talker --output--> decoder --pcm--> client

One `Stage` row per stage (CHAIN, in the chain's order) says:
- its link: the Link RPC and its message type, and how long the link gathers entries before it
  writes (links.py);
- its open: the request that opens a session there and the answers that accept it; OPEN_ORDER says
  which stages are opened first (relay.py's `_open` says why the talker goes alone);
- its forwarding: which stage its outputs and its graceful end go to, and the request one output
  becomes there (None: the decoder's audio goes to the client).

And what a refusal means to the client: OPEN_REFUSALS maps a stage's refused open (its status code
and error kind, the stage's `error-kind`) to the typed RelayError the wire shows, first row first;
SETTINGS_REFUSALS does so for the talker's refused settings (an open's or a re-prime's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import grpc
from google.protobuf.message import Message

from duplex.v1 import common_pb2, decoder_pb2, encoder_pb2, talker_pb2
from services.common.errors import parse_retry_hint


class RelayError(Exception):
    """A typed failure. `code` is the wire error code; `client_fault` picks invalid_request_error."""

    def __init__(self, code: str, message: str, stage: str | None = None, client_fault: bool = False,
                 retry_after_s: float | None = None):
        super().__init__(message)
        self.code = code
        self.stage = stage
        self.client_fault = client_fault
        self.message = message
        self.retry_after_s = retry_after_s  # a refusal's hint: try again after this long

    @property
    def error_type(self) -> str:
        if self.code in ("resource_exhausted", "server_busy"):
            return "rate_limit_error"
        return "invalid_request_error" if self.client_fault else "server_error"


@dataclass(frozen=True)
class StageEnd:
    """How a stage ended one session's stream (its LinkStatus)."""

    code: grpc.StatusCode
    kind: str
    details: str

    @property
    def ok(self) -> bool:
        return self.code == grpc.StatusCode.OK

    def describe(self) -> str:
        return f"{self.code.name} {self.details}".strip()


_STATUS = {c.value[0]: c for c in grpc.StatusCode}


def stage_end(status: common_pb2.LinkStatus) -> StageEnd:
    """A link's status entry as a StageEnd (an unknown code reads as UNKNOWN)."""
    return StageEnd(_STATUS.get(status.code, grpc.StatusCode.UNKNOWN), status.kind, status.details)


@dataclass(frozen=True)
class OpenParams:
    stream_id: str
    voice: str
    persona: str
    sampling: talker_pb2.Sampling
    voice_audio: bytes = b""  # an enrolled voice's samples (services/gateway/voices.py); b"": bundled
    early_outputs: bool = True  # the talker sends output k at its step's end; the relay pairs it (relay.py)
    hold_prompt_ms: int = 0  # open on hold: the prompt waits for a prime, a frame or this long (relay.py)


# ---- the chain ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Stage:
    name: str
    link_method: str  # the stub's Link RPC
    link_request: type  # its link message (entries of many sessions)
    # How long its link waits after its first unsent entry before it writes. Client frames reach the
    # gateway spread over the period, one at a time: without a wait each would be its own message to
    # the encoder (2000 a second at 160 sessions). 5 ms makes that 200 and delays a frame 2.5 ms on
    # average; a session's open or end leaves at once. The talker's and decoder's entries come in
    # bursts (one encoder batch, one tick's outputs) and leave on the next loop turn.
    flush_s: float
    open_request: Callable[[OpenParams], Message]
    open_answers: tuple[str, ...]  # the response kinds that accept an open
    next: str | None  # where its outputs and its graceful end go; None: the client
    forward: Callable[[Message], Message] | None  # one of its responses -> the next stage's request


def _stream(p: OpenParams) -> common_pb2.StreamOpen:
    return common_pb2.StreamOpen(stream_id=p.stream_id)


def _talk_open(p: OpenParams) -> talker_pb2.TalkRequest:
    return talker_pb2.TalkRequest(open=talker_pb2.TalkOpen(
        stream=_stream(p), voice=p.voice, persona=p.persona, sampling=p.sampling, voice_audio=p.voice_audio,
        early_outputs=p.early_outputs, hold_prompt_ms=p.hold_prompt_ms))


def _codes_to_talker(resp: encoder_pb2.EncodeResponse) -> talker_pb2.TalkRequest:
    return talker_pb2.TalkRequest(frame=common_pb2.CodesFrame(seq=resp.codes.seq, codes=resp.codes.codes))


def _output_to_decoder(resp: talker_pb2.TalkResponse) -> decoder_pb2.DecodeRequest:
    return decoder_pb2.DecodeRequest(frame=common_pb2.CodesFrame(seq=resp.output.seq, codes=resp.output.agent_codes))


CHAIN: dict[str, Stage] = {s.name: s for s in (
    Stage("encoder", "EncodeLink", encoder_pb2.EncodeLinkRequest, 0.005,
          lambda p: encoder_pb2.EncodeRequest(open=_stream(p)), ("opened",), "talker", _codes_to_talker),
    Stage("talker", "TalkLink", talker_pb2.TalkLinkRequest, 0.0,
          _talk_open, ("ready", "held"), "decoder", _output_to_decoder),
    Stage("decoder", "DecodeLink", decoder_pb2.DecodeLinkRequest, 0.0,
          lambda p: decoder_pb2.DecodeRequest(open=_stream(p)), ("opened",), None, None),
)}
# The opens in waves: a wave is sent once every stage of the one before accepted (relay.Relay._open).
OPEN_ORDER: tuple[tuple[str, ...], ...] = (("talker",), ("encoder", "decoder"))


# ---- refusals -----------------------------------------------------------------------------------

# The talker's `error-kind` for settings it refuses (an open's or a prime's) -> the client's error code.
SETTINGS_REFUSALS = {"bad_voice": "invalid_voice", "bad_persona": "invalid_instructions",
                     "bad_sampling": "invalid_sampling"}
SETTINGS_REFUSED = "invalid_instructions"  # a settings refusal of another kind


def settings_refusal(kind: str, details: str) -> RelayError:
    """The talker refused a prompt's settings: the client's fault, named by what was refused."""
    return RelayError(SETTINGS_REFUSALS.get(kind, SETTINGS_REFUSED), details, "talker", client_fault=True)


@dataclass(frozen=True)
class OpenRefusal:
    """One row: a refused open that matches (stage, status code, error kind; None matches any) reads as
    the error `code`, with `message` formatted from the cell's name and the stage's details."""

    stage: str | None
    status: grpc.StatusCode | None
    kind: str | None
    code: str
    message: str
    client_fault: bool = False
    retry_hint: bool = False  # the details carry the stage's retry estimate (common/errors.py)
    no_details: str | None = None  # the message when the stage gave no details (None: `message` as it is)

    def matches(self, stage: str, end: StageEnd) -> bool:
        return ((self.stage is None or self.stage == stage) and (self.status is None or self.status == end.code)
                and (self.kind is None or self.kind == end.kind))

    def error(self, cell: str, stage: str, end: StageEnd) -> RelayError:
        message = self.no_details if self.no_details and not end.details else self.message.format(
            cell=cell, details=end.details)
        return RelayError(self.code, message,
                          stage if self.client_fault else None, client_fault=self.client_fault,
                          retry_after_s=parse_retry_hint(end.details) if self.retry_hint else None)


_NO_DETAILS = "talker refused the session settings"
OPEN_REFUSALS: tuple[OpenRefusal, ...] = (
    # The client's settings: the talker names what it refused.
    *(OpenRefusal("talker", grpc.StatusCode.INVALID_ARGUMENT, kind, code, "{details}", client_fault=True,
                  no_details=_NO_DETAILS) for kind, code in SETTINGS_REFUSALS.items()),
    OpenRefusal("talker", grpc.StatusCode.INVALID_ARGUMENT, None, SETTINGS_REFUSED, "{details}", client_fault=True,
                no_details=_NO_DETAILS),
    # Not a client fault: the talker's prefill queue is too long for a prompt to wait in ...
    OpenRefusal("talker", None, "prefill_busy", "server_busy", "cell {cell} is busy starting other sessions: {details}",
                retry_hint=True),
    # ... or a stage is full.
    OpenRefusal(None, grpc.StatusCode.RESOURCE_EXHAUSTED, None, "resource_exhausted", "cell {cell} has no free slot"),
)


def open_failure(cell: str, failures: dict[str, StageEnd | RelayError]) -> RelayError:
    """The error for an open that `failures` (stage -> its end, or a RelayError: no answer) refused:
    the first OPEN_REFUSALS row any stage's end matches, else the first failure as a stage problem."""
    for row in OPEN_REFUSALS:
        for stage, end in failures.items():
            if isinstance(end, StageEnd) and row.matches(stage, end):
                return row.error(cell, stage, end)
    stage, end = next(iter(failures.items()))
    why = end.describe() if isinstance(end, StageEnd) else end.message
    return RelayError("runtime_open_failed", f"{stage} did not open the stream: {why}", stage)
