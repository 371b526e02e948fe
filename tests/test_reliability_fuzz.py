"""Fuzzing the gateway's client-facing input, and hostile voice / persona names.

One real stack (encoder, talker, decoder, gateway processes; capacity three) serves the whole
module. Throughout, an untouched paced session (`Feeder`) must keep getting output, and every
test ends with the stage slot counts and the gateway's gauges back where they started.

The hypothesis tests are derandomized (stable in CI) and print how many cases they ran.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import shutil
import urllib.parse

import grpc
import numpy as np
import pytest
import sphn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect as sync_connect

from duplex.v1 import common_pb2, talker_pb2, talker_pb2_grpc
from services.common import voice_names
from services.common.errors import ERROR_KIND_KEY
from services.gateway.config import DEFAULT_VOICE_ALIASES
from tests.reliability_helpers import (FRAME, SR, SyncRT, assert_nothing_leaked, f32_b64, gateway_metric, leak_baseline,
                                       rss_mb, steady_feeder, tone)
from tools.run_stack import Stack

# A generous talker backlog: on a loaded 2-core machine the tiny talker can fall seconds behind,
# and these tests are about input handling and faults, not about the backlog bound (churn tests that).
TALKER_ARGS = ["--max-backlog-s", "30"]
GATEWAY_ARGS = ["--stall-timeout", "30", "--open-timeout", "120", "--cleanup-timeout", "20"]
MAX_MESSAGE_BYTES = 2 * 1024 * 1024  # the gateway's default max_message_bytes
MAX_INSTRUCTIONS = 4000  # the gateway's default max_instructions_chars
FUZZ = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])

# Client events the gateway serves (valid ones do not answer with an error); anything else is unknown.
KNOWN_EVENTS = {
    "session.update", "input_audio_buffer.append", "input_audio_buffer.clear", "session.close", "response.cancel",
    "session.heartbeat", "input_audio_buffer.commit", "response.create", "session.resume", "barge_in",
    "session.barge_in",
    "input_audio_buffer.barge_in", "output_audio_buffer.clear", "conversation.item.truncate",
    "conversation.item.create", "conversation.item.delete",
}
REFUSED_FEATURES = ["barge_in", "input_audio_buffer.barge_in", "output_audio_buffer.clear", "session.barge_in",
                    "session.resume"]
SESSION_KEYS = {"type", "model", "modalities", "output_modalities", "input_audio_format", "output_audio_format",
                "audio",
                "voice", "instructions", "turn_detection", "extra_body",
                # standard fields accepted and reported as not in effect
                "max_output_tokens", "tool_choice", "tracing", "tools", "id", "session_id", "object"}
# The documented voice rule (README): a bundled basename (no path), a bare name (enrolled, else the
# bundled NAME.pt, refused by the talker if missing), or an alias.
VOICE_RULE = re.compile(f"{voice_names.BUNDLED.pattern}|{voice_names.ENROLLED.pattern}")
VOICE_ALIASES = dict(DEFAULT_VOICE_ALIASES)

COUNTS: dict[str, int] = {}


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint (big files linked, voices copied) with decoy voice files just outside
    voices/: if any traversal were followed, a session would open with a decoy instead of failing."""
    root = tmp_path_factory.mktemp("ckpt")
    ck = root / "ckpt"
    ck.mkdir()
    for f in tiny_checkpoint.iterdir():
        if f.is_dir():
            shutil.copytree(f, ck / f.name)
        else:
            (ck / f.name).symlink_to(f)
    good = ck / "voices" / "NATF2.pt"
    for decoy in (ck / "x.pt", root / "x.pt", ck / "voices" / "sub" / "y.pt", ck / "voices" / "..pt"):
        decoy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(good, decoy)
    return ck


@pytest.fixture(scope="module")
def stack(checkpoint):
    with Stack(checkpoint, sessions=3, talker_args=TALKER_ARGS, gateway_args=GATEWAY_ARGS) as s:
        yield s


@pytest.fixture(scope="module")
def feeder(stack):
    """The untouched session: paced audio for the whole module."""
    with steady_feeder(stack) as f:
        yield f


@pytest.fixture(scope="module")
def baseline(stack, feeder):
    """Slot counts and gateway gauges with only the feeder open: every test returns to these."""
    return leak_baseline(stack)


def report(name: str) -> None:
    print(f"\n[fuzz] {name}: {COUNTS.get(name, 0)} cases")


# ---- strategies: each case is (message, expected error codes, client event_id or None) ----------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=16),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
event_ids = st.none() | st.text(min_size=1, max_size=20)
extras = st.dictionaries(st.text(max_size=8).filter(lambda k: k not in ("type", "event_id")), json_values, max_size=3)


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except (ValueError, RecursionError):
        return False


def _event(type_: str, eid, fields: dict) -> tuple[str, str | None]:
    ev = {**fields, "type": type_}
    if eid is not None:
        ev["event_id"] = eid
    return json.dumps(ev), eid


@st.composite
def not_json(draw):
    if draw(st.booleans()):
        return draw(st.binary(max_size=64)), {"invalid_json"}, None  # a binary frame on the JSON endpoint
    text = draw(st.text(max_size=60) | st.sampled_from(["{", "[" * 5000, '{"type": "x"', "{'type': 'x'}", "\x00"]))
    if _parses(text):
        text = text + "}{"
    return text, {"invalid_json"}, None


@st.composite
def not_an_event(draw):
    value = draw(json_values
                 | st.dictionaries(st.just("type"), json_values.filter(lambda v: not isinstance(v, str)), min_size=1))
    if isinstance(value, dict) and isinstance(value.get("type"), str):
        value["type"] = [value["type"]]
    return json.dumps(value), {"bad_event"}, None


@st.composite
def unknown_event(draw):
    type_ = draw(st.text(max_size=40).filter(lambda t: t not in KNOWN_EVENTS))
    msg, eid = _event(type_, draw(event_ids), draw(extras))
    return msg, {"unknown_event"}, eid


@st.composite
def refused_feature(draw):
    msg, eid = _event(draw(st.sampled_from(REFUSED_FEATURES)), draw(event_ids), draw(extras))
    return msg, {"unsupported_feature"}, eid


def _valid_b64(draw) -> str:
    return f32_b64(draw(st.integers(1, 400).map(lambda n: np.full(n, 0.1, np.float32))))


@st.composite
def bad_append(draw):
    """One flaw in an otherwise plausible append (the session's format is pcm_f32le)."""
    flaw = draw(st.sampled_from(["audio_type", "b64_mutation", "odd_bytes", "non_finite", "rate", "format"]))
    fields: dict = {"audio": _valid_b64(draw)}
    code = "bad_audio"
    if flaw == "audio_type":
        fields["audio"] = draw(json_values.filter(lambda v: not isinstance(v, str)))
    elif flaw == "b64_mutation":
        s = fields["audio"]
        i = draw(st.integers(0, len(s)))
        how = draw(st.sampled_from(["insert", "strip_pad", "extra_pad", "urlsafe"]))
        if how == "insert":
            s = s[:i] + draw(st.sampled_from([" ", "\n", "\t", "!", "-", "_", "*", "é", "=", "\x00", "."])) + s[i:]
        elif how == "strip_pad":
            s = s.rstrip("=") + ("" if s.endswith("=") else "A")
        elif how == "extra_pad":
            s = s + "=" * draw(st.integers(1, 3))
        else:
            s = s.replace("+", "-").replace("/", "_") + "-_"
        try:
            base64.b64decode(s.encode("utf-8"), validate=True)
            fields["audio"] = s + "!"  # the mutation happened to stay valid: make it invalid for sure
        except (binascii.Error, ValueError):
            fields["audio"] = s
    elif flaw == "odd_bytes":
        n = draw(st.integers(0, 64).filter(lambda n: n % 4))
        fields["audio"] = base64.b64encode(bytes(draw(st.binary(min_size=n, max_size=n)))).decode() if n else ""
    elif flaw == "non_finite":
        x = np.full(draw(st.integers(1, 300)), 0.1, np.float32)
        x[draw(st.integers(0, x.size - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
        fields["audio"] = f32_b64(x)
    elif flaw == "rate":
        fields["sample_rate_hz"] = draw(json_values.filter(lambda v: v != SR))
        code = "unsupported_audio_format"
    else:
        fields["format"] = draw(json_values.filter(lambda v: v != "pcm_f32le")
                                | st.sampled_from(["pcm16", "pcm_s16le", "g711_ulaw"]))
        code = "unsupported_audio_format"
    msg, eid = _event("input_audio_buffer.append", draw(event_ids), fields)
    return msg, {code}, eid


@st.composite
def bad_session_update(draw):
    flaw = draw(st.sampled_from(["not_object", "unknown_key", "voice", "instructions", "type", "speed"]))
    if flaw == "not_object":
        session, code = draw(json_values.filter(lambda v: not isinstance(v, dict))), "bad_event"
    elif flaw == "unknown_key":
        session = draw(st.dictionaries(st.text(max_size=12).filter(lambda k: k not in SESSION_KEYS), json_values,
                                       min_size=1, max_size=3))
        code = "bad_event"
    elif flaw == "voice":
        v = draw(st.text(max_size=80).filter(lambda v: v and not VOICE_RULE.match(v) and v.lower() not in VOICE_ALIASES)
                 | json_values.filter(lambda v: v is not None and not isinstance(v, str)))
        session, code = {"voice": v}, "invalid_voice"
    elif flaw == "instructions":
        v = draw(json_values.filter(lambda v: not isinstance(v, str)) | st.just("x" * (MAX_INSTRUCTIONS + 1)))
        session, code = {"instructions": v}, "bad_event"
    elif flaw == "type":
        session, code = {"type": draw(json_values.filter(lambda v: v != "realtime"))}, "bad_event"
    else:
        speed = draw(json_values.filter(lambda v: isinstance(v, bool) or v != 1.0))
        session, code = {"audio": {"output": {"speed": speed}}}, "unsupported_feature"
    msg, eid = _event("session.update", draw(event_ids), {"session": session})
    return msg, {code}, eid


any_bad_message = st.one_of(not_json(), not_an_event(), unknown_event(), refused_feature(), bad_append(),
                            bad_session_update())


# ---- the Realtime wire ---------------------------------------------------------------------------

class FuzzSession:
    """A long-lived pcm_f32le session that takes every fuzz case, fed good frames in between."""

    def __init__(self, url: str):
        self.rt = SyncRT(url)
        self.rt.send({"type": "session.update", "session": {"type": "realtime", "input_audio_format": "pcm_f32le"}})
        assert self.rt.recv(120)["type"] == "session.created"
        assert self.rt.recv(30)["type"] == "session.updated"
        self.sent = 0
        self.x = tone(1, 180)

    def good_append(self) -> None:
        self.rt.send({"type": "input_audio_buffer.append", "audio": f32_b64(self.x)})
        self.sent += 1

    def keep_flowing(self) -> None:
        """A good frame now and then (never more than a few ahead of the output: no backlog)."""
        if self.sent - self.rt.frames < 4:
            self.good_append()

    def works(self, new_frames: int = 2, timeout: float = 60.0) -> None:
        """Good appends still yield output (what 'the session survives' means)."""
        target = self.rt.frames + new_frames
        for _ in range(new_frames + 1):
            self.good_append()
        while self.rt.frames < target:
            ev = self.rt.recv(timeout)
            assert ev["type"] != "error", ev

    def close(self) -> dict:
        self.rt.send({"type": "session.close"})
        while (ev := self.rt.recv(60))["type"] != "session.closed":
            assert ev["type"] != "error", ev
        self.rt.close()
        return ev


@pytest.fixture(scope="module")
def fuzz_session(stack, feeder):
    s = FuzzSession(stack.gateway.ws_url)
    s.good_append()  # audio has started: the session's settings are fixed from here on
    yield s


@FUZZ
@given(case=any_bad_message)
def test_every_malformed_event_gets_one_typed_error_and_the_session_goes_on(stack, feeder, baseline, fuzz_session,
                                                                            case):
    """Random JSON (any types and nesting), wrong field types, unknown and refused events,
    broken base64 (bad characters, padding, whitespace, URL alphabet), odd byte counts, NaN/inf
    samples, rate and format changes mid-session, binary frames: each gets exactly one
    `invalid_request_error` with the expected code (echoing a string event_id), and the session's
    good appends keep producing output. The feeder session is checked at the end."""
    message, codes, eid = case
    fuzz_session.rt.send(message)
    ev = fuzz_session.rt.next_reply()
    assert ev["type"] == "error", (message[:200], ev)
    assert ev["error"]["type"] == "invalid_request_error" and ev["error"]["code"] in codes, (message[:200], ev)
    if eid is not None:
        assert ev["error"].get("event_id") == eid, (message[:200], ev)
    COUNTS["realtime"] = COUNTS.get("realtime", 0) + 1
    fuzz_session.keep_flowing()


def test_after_fuzzing_the_session_still_works_and_nothing_leaked(stack, feeder, baseline, fuzz_session):
    """Runs after the hypothesis test: the fuzzed session still turns good appends into output,
    the feeder kept going, the close accounts for every frame, and the slots come back."""
    report("realtime")
    assert COUNTS.get("realtime", 0) >= 150
    errors = [e for e in fuzz_session.rt.events if e["type"] == "error"]
    assert len(errors) == COUNTS["realtime"]  # exactly one error per case, none for the good appends
    fuzz_session.works()
    feeder.check_alive(2)
    closed = fuzz_session.close()
    assert closed["frames_in"] == fuzz_session.sent >= closed["frames_out"] > 0, (closed, fuzz_session.sent)
    assert closed["cleanup_confirmed"] is True
    assert_nothing_leaked(stack, baseline)


# ---- hostile sizes: huge strings in every string field, big numbers, deep nesting ------------------

HUGE = (10_000, 300_000, 1_500_000)  # characters; the largest still fits the 2 MB message bound as UTF-8
HUGE_CHARS = ("a", "é", "\x00", "\"", "\u2028")
SHORT_REPLY = 2_000  # an error event about a hostile value stays this small, whatever the value's size

# A field of an otherwise good event -> the error code a hostile (wrong type / huge) value there gets.
# Session fields are checked before the session's lock, so a live session judges them the same way.
HOSTILE_FIELDS = {
    ("input_audio_buffer.append", "audio"): "bad_audio",
    ("input_audio_buffer.append", "format"): "unsupported_audio_format",
    ("input_audio_buffer.append", "sample_rate_hz"): "unsupported_audio_format",
    ("input_audio_buffer.append", "operation_id"): "bad_event",
    ("session.update", "session"): "bad_event",
    ("session.update", "session.voice"): "invalid_voice",
    ("session.update", "session.instructions"): "bad_event",
    ("session.update", "session.type"): "bad_event",
    ("session.update", "session.input_audio_format"): "unsupported_audio_format",
    ("session.update", "session.audio.input.format.type"): "unsupported_audio_format",
    ("session.update", "session.audio.input.format.rate"): "unsupported_audio_format",
    ("session.update", "session.extra_body.seed"): "bad_event",
}
PLACEHOLDER = "@@HOSTILE@@"


def _with_field(type_: str, path: str) -> dict:
    """A good event of `type_` whose field at `path` (dots) holds the placeholder."""
    ev: dict = {"type": type_,
                "audio": f32_b64(np.full(10, 0.1, np.float32))} if type_.startswith("input") else {"type": type_}
    keys = path.split(".")
    node = ev
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    node[keys[-1]] = PLACEHOLDER
    return ev


@st.composite
def hostile_sizes(draw):
    """One hostile value in one field: a huge string (every string field, also type and event_id, and
    unknown keys), a huge or extreme number (digits past the parser's 4300 limit are invalid JSON), or
    deep nesting (past the parser's depth: invalid JSON). Returns (message text, codes)."""
    kind = draw(st.sampled_from(["string", "number", "nesting"]))
    (type_, path), code = draw(st.sampled_from(sorted(HOSTILE_FIELDS.items())))
    if kind == "string":
        n, ch = draw(st.sampled_from(HUGE)), draw(st.sampled_from(HUGE_CHARS))
        where = draw(st.sampled_from(["field", "type", "event_id", "key"]))
        value = json.dumps(ch * n, ensure_ascii=draw(st.booleans()))
        if len(value.encode()) > MAX_MESSAGE_BYTES - 1000:  # "\u00e9" * 1.5 M: keep under the message bound
            value = json.dumps(ch * (n // 8), ensure_ascii=True)
        if where == "type":
            return json.dumps({"type": PLACEHOLDER}).replace(f'"{PLACEHOLDER}"', value), {"unknown_event"}
        if where == "event_id":
            return json.dumps({"type": "session.heartbeat", "event_id": PLACEHOLDER}).replace(f'"{PLACEHOLDER}"',
                                                                                              value), {"bad_event"}
        if where == "key" and type_ == "session.update":
            return '{"type": "session.update", "session": {' + value + ': 1}}', {"bad_event"}
        if path == "audio":  # never valid base64 ("aaaa..." is: a real packet, no error)
            value = json.dumps("!" + ch * n if len(value) < MAX_MESSAGE_BYTES // 2 else "!" + ch * (n // 8))
        return json.dumps(_with_field(type_, path)).replace(f'"{PLACEHOLDER}"', value), {code}
    if kind == "number":
        digits = draw(st.sampled_from([20, 400, 4300, 4301, 100_000]))
        number = draw(st.sampled_from(["", "-"])) + "9" * digits + draw(st.sampled_from(["", ".5", "e999", "e-999"]))
        if "." in number or "e" in number or digits <= 4300:
            codes = {code, "invalid_json"}  # a float (inf, 0.0, huge) or a legal integer: judged as the field
        else:
            codes = {"invalid_json"}  # an integer over the digit limit
        if path == "session.extra_body.seed" and "e-999" in number:
            codes = {code}  # 0.0 is not an integer seed
        return json.dumps(_with_field(type_, path)).replace(f'"{PLACEHOLDER}"', number), codes
    depth = draw(st.sampled_from([50, 500, 5_000, 200_000]))
    opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
    nested = opener * depth + "1" + closer * depth
    return json.dumps(_with_field(type_, path)).replace(f'"{PLACEHOLDER}"', nested), {code, "invalid_json"}


@pytest.fixture(scope="module")
def hostile_session(stack, feeder):
    s = FuzzSession(stack.gateway.ws_url)
    s.good_append()
    yield s


@settings(max_examples=80, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=hostile_sizes())
def test_huge_strings_big_numbers_and_deep_nesting_get_short_typed_errors(stack, feeder, baseline, hostile_session,
                                                                          case):
    """Each hostile size is one short `invalid_request_error` (the value is never echoed whole) and
    the session goes on; memory and other sessions are checked by the next test."""
    message, codes = case
    hostile_session.rt.send(message)
    ev = hostile_session.rt.next_reply()
    assert ev["type"] == "error" and ev["error"]["type"] == "invalid_request_error", (message[:200], ev)
    assert ev["error"]["code"] in codes, (message[:200], ev)
    assert len(json.dumps(ev)) < SHORT_REPLY, (message[:200], json.dumps(ev)[:400])
    COUNTS["hostile"] = COUNTS.get("hostile", 0) + 1
    hostile_session.keep_flowing()


def test_after_hostile_sizes_the_session_works_memory_is_bounded_and_nothing_leaked(stack, feeder, baseline,
                                                                                    hostile_session):
    report("hostile")
    assert COUNTS.get("hostile", 0) >= 60
    hostile_session.works()
    feeder.check_alive(2)
    rss = rss_mb(stack.gateway.proc.pid)
    assert rss < 400, rss  # about 100 MB at rest; the probe grew it by 270 MB with 40 messages
    closed = hostile_session.close()
    assert closed["cleanup_confirmed"] is True
    assert_nothing_leaked(stack, baseline)


@pytest.mark.parametrize("message, close_code", [
    ("", None), (b"", None),
    ("x" * (MAX_MESSAGE_BYTES + 1), 1009), (b"\x01" * (MAX_MESSAGE_BYTES + 1), 1009),
    (json.dumps({"type": "input_audio_buffer.append", "audio": "A" * MAX_MESSAGE_BYTES}), 1009),
])
def test_empty_and_oversized_messages(stack, feeder, baseline, message, close_code):
    """Empty text/binary messages: a typed invalid_json, session goes on. Over the gateway's
    max message size: the documented close 1009 (message too big), the session is released,
    and a reconnect gets a working session."""
    s = FuzzSession(stack.gateway.ws_url)
    s.good_append()
    s.rt.send(message)
    if close_code is None:
        ev = s.rt.next_reply()
        assert ev["type"] == "error" and ev["error"]["code"] == "invalid_json", ev
        s.works()
        s.close()
    else:
        with pytest.raises(ConnectionClosed) as e:
            while True:
                assert s.rt.recv(30)["type"] != "error"
        assert e.value.rcvd is not None and e.value.rcvd.code == close_code, e.value
        again = FuzzSession(stack.gateway.ws_url)
        again.works()
        again.close()
    feeder.check_alive(1)
    assert_nothing_leaked(stack, baseline)


# ---- voice and persona ---------------------------------------------------------------------------

HOSTILE_VOICES = [
    "../x.pt", "../../x.pt", "..%2Fx.pt", "..%2fx.pt", "%2e%2e/x.pt", "sub/y.pt", "voices/NATF2.pt", "/etc/passwd.pt",
    "/tmp/x.pt", "..\\x.pt", "sub\\y.pt", "NATF2.pt\x00.wav", "NATF2\x00.pt", "..pt", ".pt", "NATF2․pt", "ＮＡＴＦ2.pt",
    "NATF2.pt\u200b", "NATF2\u2024pt", "NATF2.pt ", " NATF2.pt", "NATF2.PT", "NATF2.wav", "NATF2.pt/", "~/x.pt",
    "C:\\x.pt", "file:///x.pt", "N" * 300 + ".pt", "N" * 100_000, "$(id).pt", "NATF2.pt;rm", "NOPE.pt", "x.pt",
]


def _refused(rt: SyncRT, session: dict) -> dict:
    rt.send({"type": "session.update", "event_id": "open1", "session": {"type": "realtime", **session}})
    ev = rt.recv(60)
    assert ev["type"] == "error", (repr(session)[:120], ev)
    return ev["error"]


def test_hostile_voice_names_are_refused_typed_and_nothing_is_opened(stack, feeder, baseline):
    """Path traversal (../, encoded, absolute, backslashes), NUL bytes, unicode look-alikes,
    non-.pt, very long names, and well-formed names that are not bundled: each an
    `invalid_voice`, on `session.voice` and `session.audio.output.voice`, no session opened
    (decoy .pt files sit where a traversal would land), slots unchanged; empty means no voice."""
    opened = gateway_metric(stack.gateway, "gateway_sessions_opened_total")
    rt = SyncRT(stack.gateway.ws_url)
    for voice in HOSTILE_VOICES:
        for session in ({"voice": voice}, {"audio": {"output": {"voice": voice}}}):
            err = _refused(rt, session)
            assert err["type"] == "invalid_request_error" and err["code"] == "invalid_voice", (voice[:80], err)
            COUNTS["voice"] = COUNTS.get("voice", 0) + 1
    assert gateway_metric(stack.gateway, "gateway_sessions_opened_total") == opened
    assert_nothing_leaked(stack, baseline)
    # The connection is still usable: empty voice is the documented "no voice prompt".
    rt.send({"type": "session.update", "session": {"type": "realtime", "voice": ""}})
    assert rt.recv(120)["type"] == "session.created"
    rt.close()
    feeder.check_alive(1)
    assert_nothing_leaked(stack, baseline)
    report("voice")


def test_oversized_and_unrepresentable_personas_are_refused_typed(stack, feeder, baseline):
    """Persona over the gateway's cap (bad_event), under the cap but longer than the model's
    window, or with control characters (invalid_instructions, judged by the talker): typed,
    nothing left open, and a normal persona still opens on the same connection."""
    rt = SyncRT(stack.gateway.ws_url)
    cases = [
        ("x" * (MAX_INSTRUCTIONS + 1), "bad_event"),
        ("é" * (MAX_INSTRUCTIONS + 1), "bad_event"),
        (" ".join(["You are patient and kind."] * 150)[:MAX_INSTRUCTIONS], "invalid_instructions"),
        ("You are\x00 kind.", "invalid_instructions"),
        ("You are\x1b[31m kind.", "invalid_instructions"),
    ]
    for persona, code in cases:
        err = _refused(rt, {"instructions": persona})
        assert err["type"] == "invalid_request_error" and err["code"] == code, (persona[:60], err)
        assert err.get("event_id") == "open1"
    assert_nothing_leaked(stack, baseline)
    rt.send({"type": "session.update", "session": {"type": "realtime", "instructions": "You are fine."}})
    assert rt.recv(120)["type"] == "session.created"
    rt.close()
    feeder.check_alive(1)
    assert_nothing_leaked(stack, baseline)


def test_talker_refuses_hostile_voices_itself(stack, checkpoint, baseline):
    """Defence in depth: straight to the talker's gRPC port (no gateway), traversal names that
    point at real decoy voice files are INVALID_ARGUMENT with error-kind bad_voice, no slot taken."""
    talker = stack.cell_procs[0].talker.address
    names = ["../x.pt", "../../x.pt", "sub/y.pt", str(checkpoint / "x.pt"), "..pt", "NATF2.pt\x00", "..\\x.pt",
             "N" * 300 + ".pt"]
    with grpc.insecure_channel(talker) as ch:
        stub = talker_pb2_grpc.TalkerStub(ch)
        for i, name in enumerate(names):
            stream = common_pb2.StreamOpen(stream_id=f"hostile-{i}")
            req = talker_pb2.TalkRequest(open=talker_pb2.TalkOpen(stream=stream, voice=name))
            with pytest.raises(grpc.RpcError) as e:
                for _ in stub.Talk(iter([req]), timeout=30):
                    pass
            kind = dict(e.value.trailing_metadata() or ()).get(ERROR_KIND_KEY)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and kind == "bad_voice", (name, e.value)
    assert_nothing_leaked(stack, baseline)


def _chat(stack, **query):
    url = f"ws://{stack.gateway.host}:{stack.gateway.port}/api/chat?" + urllib.parse.urlencode(query)
    return sync_connect(url, max_size=None, open_timeout=60, legacy=True)


def test_api_chat_query_params_are_checked_too(stack, feeder, baseline):
    """`voice_prompt` / `text_prompt` on /api/chat: each hostile value is refused at the upgrade
    with HTTP 400 and a typed JSON error; nothing opened. A query over the HTTP request-line limit
    is refused at the upgrade (414)."""
    cases = [({"voice_prompt": v}, "invalid_voice") for v in HOSTILE_VOICES if len(v) < 1000]
    cases += [({"voice_prompt": "NATF2.pt\x00"}, "invalid_voice"),
              ({"text_prompt": "x" * (MAX_INSTRUCTIONS + 1)}, "bad_event"),
              ({"text_prompt": " ".join(["You are patient and kind."] * 150)[:MAX_INSTRUCTIONS]},
               "invalid_instructions"),
              ({"seed": "-1"}, "bad_event")]
    for query, code in cases:
        with pytest.raises(InvalidStatus) as e:
            _chat(stack, **query)
        assert e.value.response.status_code == 400, (query, e.value.response.status_code)
        assert json.loads(e.value.response.body)["error"]["code"] == code, (query, e.value.response.body[:200])
        COUNTS["chat_query"] = COUNTS.get("chat_query", 0) + 1
    # A request line over the HTTP limit never reaches a session: HTTP 414.
    with pytest.raises(InvalidStatus) as e:
        _chat(stack, voice_prompt="N" * 100_000)
    assert e.value.response.status_code == 414
    assert_nothing_leaked(stack, baseline)
    feeder.check_alive(1)
    report("chat_query")


# ---- /api/chat framing -----------------------------------------------------------------------------

native_bad = st.one_of(
    st.text(max_size=40).map(lambda t: (t, "bad_event")),  # text frames on a binary protocol
    st.just((b"", "bad_event")),
    st.tuples(st.integers(0, 255).filter(lambda k: k != 1), st.binary(max_size=40))
    .map(lambda t: (bytes([t[0]]) + t[1], "unknown_event")),
    st.binary(min_size=27, max_size=200).filter(lambda b: not b.startswith(b"OggS"))
    .map(lambda b: (b"\x01" + b, "bad_audio")),

)


@pytest.fixture(scope="module")
def chat(stack, feeder):
    ws = _chat(stack, voice_prompt="NATF2.pt", text_prompt="You are kind.")
    assert ws.recv(120) == b"\x00"
    yield ws
    ws.close()


@FUZZ
@given(case=native_bad)
def test_api_chat_fuzz_each_bad_message_gets_one_typed_error(stack, chat, case):
    """Text frames, empty frames, unknown kinds and non-Ogg audio on /api/chat: one typed
    error message (kind 5) each; the session stays open."""
    message, code = case
    chat.send(message)
    while True:
        msg = chat.recv(30)
        assert isinstance(msg, bytes) and msg[0] in (1, 2, 5), msg[:40]
        if msg[0] == 5:
            break
    assert msg[1:].decode().startswith(code + ":"), (message[:40], msg[:120])
    COUNTS["chat"] = COUNTS.get("chat", 0) + 1


def test_api_chat_still_works_after_fuzzing(stack, feeder, baseline, chat):
    report("chat")
    assert COUNTS.get("chat", 0) >= 150
    writer, reader = sphn.OpusStreamWriter(SR), sphn.OpusStreamReader(SR)
    x = tone(12, 250)
    pcm = []
    for off in range(0, x.size, FRAME):
        chat.send(b"\x01" + writer.append_pcm(x[off : off + FRAME]))
    while sum(p.size for p in pcm) < 4 * FRAME:
        msg = chat.recv(60)
        assert msg[0] in (1, 2), msg[:120]
        if msg[0] == 1:
            pcm.append(reader.append_bytes(msg[1:]))
    y = np.concatenate(pcm)
    assert np.isfinite(y).all() and float(np.sqrt(np.mean(y**2))) > 1e-3
    chat.close()
    feeder.check_alive(2)
    assert_nothing_leaked(stack, baseline)
