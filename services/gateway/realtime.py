"""The Realtime duplex wire (vLLM-Omni `/v1/realtime?duplex=1`, OpenAI Realtime GA names).

One WebSocket = one session = one continuous stream of model output, shown to the client as
responses (conversation.py): one open from the first accepted audio on; response.cancel or a
truncate of its item ends it early (its unsent audio dropped) and the next opens at once.
"Say this" (say.py): an assistant item's text, or a response.create's instructions, is spoken by the
model in its voice; a barge-in drops what is not said yet.
`RealtimeSession` is the wire's adapter on the shared session (session.py) and its row in
server.WS_ROUTES: it reads client events (parsed and validated by realtime_wire.py), keeps the
settings and the conversation record, and renders output frames and endings as events.

Opening the way SDKs do: connecting with `?model=` takes a slot at once (session.created) but holds
the prompt until the first session.update, the first audio or autostart_hold_ms; a session.update
before audio re-primes the same slot in place (never released, so a full cell cannot refuse it),
and session.updated answers it once that prompt is live, so a client that streams after its
session.updated starts on time. One prompt per open, one prefill in flight per connection.

Resume (resume.py): session.created carries `resume_token`; a connection lost without a close frame
pauses the session, and a reconnect with `?session_id=` and the token (X-Resume-Token) is served by
`ResumedConnection`: `session.resumed` first, then the stream goes on. Its checks are made before the
101, so a refusal is an HTTP answer with a typed error (resume.ResumeRefused).

Ordering rules kept here:
- every server event gets `event_id` and a per-connection increasing `server_event_seq` as it is sent;
- `rate_limit_error`/`resource_exhausted` comes before any `session.created`;
- a response's opening events come before its first delta; then per output frame exactly one
  audio delta and one transcript delta (GA names, or legacy names if asked, never both);
- `session.close` -> the open response's `.done` events -> `session.closed`.
"""

from __future__ import annotations

import asyncio
import collections
import json
import secrets
import time
from dataclasses import replace

from websockets.asyncio.server import ServerConnection
from websockets.http11 import Response

from services.gateway.admission import RETRY_LATER
from services.gateway.bounded import RecentIds, brief
from services.gateway.context import GatewayContext
from services.gateway.conversation import Conversation
from services.gateway.http_requests import error_response
from services.gateway.realtime_wire import (
    FALSE, MAX_OPERATION_ID_CHARS, TRUE, ClientError, SessionSettings, append_operation_id, capabilities,
    client_event_id, decode_append, error_event, heartbeat_ack, output_deltas, parse_connect_query, parse_event,
    parse_item_create, parse_session_update, refusal, response_metadata, session_closed_event, session_object,
    settle_update_after_audio, truncate_end_ms)
from services.gateway.relay import OutputFrame, Relay, RelayError
from services.gateway.resume import ResumeRefused, offered_token
from services.gateway.say import SayRequests, item_say_text, response_say_text
from services.gateway.session import ClientSession

REPRIME_WINDOW_S = 10.0  # the window of GatewayConfig.max_reprimes_per_10s
MAX_WAITING_UPDATES = 16  # unchanged session.updates answered at go-live, at most this many waiting


# One interruption, two events: the Agents SDK sends conversation.item.truncate and then a
# response.cancel that names no response. The truncate ended the playing response; the cancel means
# that one, not the response the truncate started, as long as that has carried at most this many
# frames (less than the client could have heard before it sent the cancel).
BARGE_IN_GRACE_FRAMES = 1


class RealtimeSession(ClientSession):
    protocol = "realtime"
    log_tag = "session"
    resumable = True

    def __init__(self, ws: ServerConnection, ctx: GatewayContext, query: dict[str, str]):
        connect = parse_connect_query(query, ctx.config.model)
        super().__init__(ws, ctx, connect.session_id)
        self.model = connect.model
        self.autostart = connect.autostart
        self.settings = SessionSettings(voice=self.cfg.default_voice, instructions=self.cfg.default_instructions,
                                        legacy_event_names=connect.legacy_event_names)
        self.voice_aliases = dict(self.cfg.voice_aliases)
        self.audio_started = False
        self.recent_ops = RecentIds(max_len=MAX_OPERATION_ID_CHARS)
        self.conv: Conversation | None = None  # from the first accepted audio on
        self._next_metadata: dict | None = None  # a response.create's metadata, for the first response
        self._after_barge_in: str | None = None  # the response a barge-in started (see _on_cancel)
        self.says: SayRequests | None = None  # with the relay: what the model is asked to say (say.py)
        self._seq = 0  # server_event_seq of the last event sent
        # session.updates before audio not yet answered, (the prime whose prompt answers it, event_id)
        self._waiting: list[tuple[int, str | None]] = []
        self._prime_settings: dict[int, SessionSettings] = {}  # the settings of each prime not refused (0: the open)
        self._announced = False  # a session.updated went out for a live prompt
        self._refused_key: tuple | None = None  # the runtime settings the talker last refused
        self._last_refusal: tuple[str, str] | None = None  # (code, message) of the last prime refusal sent
        self._reprimes: collections.deque[float] = collections.deque()  # when recent prompt changes came
        self._handlers = {
            "session.update": self._on_session_update,
            "input_audio_buffer.append": self._on_append,
            "input_audio_buffer.clear": self._on_clear,
            "session.close": self._on_close,
            "session.heartbeat": self._on_heartbeat,
            "response.cancel": self._on_cancel,
            "conversation.item.truncate": self._on_truncate,
            "conversation.item.create": self._on_item_create,
            "conversation.item.delete": self._on_item_delete,
            "conversation.item.retrieve": self._on_item_retrieve,
            # Input is continuous and the response never stops: a turn's commit and a new
            # response's create have nothing to do (SDKs send them in client-side turn mode).
            "input_audio_buffer.commit": self._on_no_op,
            "response.create": self._on_response_create,
        }

    @classmethod
    async def at_upgrade(cls, ctx: GatewayContext, conn: ServerConnection, query: dict[str, str]) -> Response | None:
        duplex = query.get("duplex", "1").lower()
        if duplex not in TRUE:
            why = ("this server only speaks the duplex wire (duplex=1)" if duplex in FALSE
                   else f"duplex={duplex!r} is not 1|true|on")
            return error_response(400, "bad_request", why)
        token = offered_token(conn.request.headers)
        if token is not None:  # a resume: the paused session is claimed now, or the answer says why not
            try:
                ctx.resumes.claim(query.get("session_id", ""), token, conn)
            except ResumeRefused as e:
                ctx.metrics.resumes.labels(e.code).inc()
                ctx.metrics.errors.labels("invalid_request_error", e.code).inc()
                return error_response(e.status, e.code, e.message)
        return None

    @classmethod
    def for_connection(cls, ws: ServerConnection, ctx: GatewayContext,
                       query: dict[str, str]) -> "RealtimeSession | ResumedConnection":
        claimed = ctx.resumes.take_claim(ws)
        if claimed is not None:
            return ResumedConnection(claimed, ws)
        return cls(ws, ctx, query)

    # ---- outbound -------------------------------------------------------------

    def emit(self, event: dict, response_id: str | None = None) -> None:
        """Queue an event; a response's deltas carry its id, so a cancel can drop them unsent."""
        self.send(json.dumps(event, separators=(",", ":")), tag=response_id)

    def wire_message(self, message: str) -> str:
        # The envelope is added as each event goes out, so events a cancel dropped leave no gap.
        self._seq += 1
        return f'{{"event_id":"event_{secrets.token_hex(6)}","server_event_seq":{self._seq},{message[1:]}'

    def send_error(self, type_: str, code: str, message: str, client_event_id: str | None = None,
                   param: str | None = None) -> None:
        self.count_error(type_, code, message)
        self.emit(error_event(type_, code, message, client_event_id, param))

    # ---- client events ------------------------------------------------------------

    async def start(self) -> None:
        if self.autostart:  # an SDK's connect: the slot now, the prompt at its session.update (module doc)
            await self._open(self.settings, hold=True)

    async def on_message(self, message: str | bytes) -> None:
        event_id = None
        try:
            if isinstance(message, bytes):
                raise ClientError("invalid_json", "binary messages are not part of this protocol; send JSON text")
            event = parse_event(message)
            event_id = client_event_id(event)
            handler = self._handlers.get(event["type"])
            if handler is None:
                raise refusal(event["type"])
            await handler(event)
        except ClientError as e:
            self.send_error(e.type, e.code, e.message, event_id, e.param)

    # ---- session lifecycle --------------------------------------------------

    def _session_object(self) -> dict:
        caps = capabilities(self.ctx.pool.capacity_summary(), self.relay.output_delay_frames if self.relay else None,
                            self.cfg.resume_grace_s if self.ctx.resumes.enabled else 0.0)
        return session_object(self.session_id, self.model, self.settings, caps)

    async def _open(self, settings: SessionSettings, event_id: str | None = None, hold: bool = False) -> bool:
        """Admit the session on a cell. On refusal the error goes out before any session.created
        (naming the session.update that asked, if it carried an event_id). `hold`: the prompt waits
        for the first session.update or audio (or autostart_hold_ms); session.updated follows it."""
        if settings.requested_id:
            self.session_id = settings.requested_id
        try:
            relay = await self._open_relay(settings, hold_ms=self.cfg.autostart_hold_ms if hold else 0)
        except RelayError as e:
            self.ctx.metrics.sessions_refused.labels(self.protocol, e.code).inc()
            self.send_error(e.error_type, e.code, e.message, event_id, param="session" if e.client_fault else None)
            if not e.client_fault:
                self._end_refused(e)
            return False
        self.settings = self._prime_settings[0] = settings
        self.adopt(relay)
        self.says = SayRequests(relay.talk)
        self.count_opened()
        created = {"type": "session.created", "session": self._session_object()}
        if (token := self.offer_resume()) is not None:
            created["resume_token"] = token
        self.emit(created)
        if relay.live:
            self.emit({"type": "session.updated", "session": self._session_object()})
            self._announced = True
        return True

    async def _open_relay(self, settings: SessionSettings, hold_ms: int = 0) -> Relay:
        return await self.open_relay(settings.voice, settings.instructions, settings.sampling(),
                                     hold_prompt_ms=hold_ms)

    def _end_refused(self, e: RelayError) -> None:
        """No session after a refusal that is not the client's fault: close (1013 = retry later)."""
        if e.code in RETRY_LATER:
            self.end(1013, "try again later")
        else:
            self.end(1011, "runtime open failed")

    async def _on_session_update(self, event: dict) -> None:
        if self.closing:
            raise ClientError("bad_event", "the session is closing")
        new = parse_session_update(event.get("session"), self.settings, self.cfg.max_instructions_chars,
                                   self.voice_aliases, self.ctx.voices.is_enrolled)
        event_id = client_event_id(event)
        if self.relay is None:
            await self._open(new, event_id)
            return
        if self.audio_started:
            self._settle_after_audio(event["session"], new)
            return
        if new.runtime_key() == self._refused_key:
            # The talker just refused these settings and said so once; a repeat is answered with the
            # settings in effect (the session object shows them), not with a second refusal.
            if self.relay.live:
                self.emit({"type": "session.updated", "session": self._session_object()})
            else:
                self._wait_for_live(self.relay.primes, event_id)
            return
        if new.runtime_key() != self.settings.runtime_key():
            self._wait_for_live(await self._reprime(new), event_id)
            return
        if not self.relay.live:
            self._wait_for_live(self.relay.primes, event_id)
            self.settings = new
            return
        self.settings = new
        self.emit({"type": "session.updated", "session": self._session_object()})

    def _wait_for_live(self, prime: int, event_id: str | None) -> None:
        """Answer this update once prompt `prime` is live (on_prompt_live); at most MAX_WAITING_UPDATES wait."""
        if len(self._waiting) >= MAX_WAITING_UPDATES:
            raise ClientError("rate_limit_exceeded", f"{MAX_WAITING_UPDATES} session.updates already wait for the "
                              "prompt to go live", "session", type_="rate_limit_error")
        self._waiting.append((prime, event_id))

    async def _reprime(self, new: SessionSettings) -> int:
        """Nothing was said yet: the prompt is redone with the new settings in the same slot (the
        talker cancels an unfinished prefill; the slot is never given up, so a full cell cannot
        refuse it). At most max_reprimes_per_10s a connection. Returns the prime's number."""
        now = time.monotonic()
        while self._reprimes and now - self._reprimes[0] > REPRIME_WINDOW_S:
            self._reprimes.popleft()
        if len(self._reprimes) >= self.cfg.max_reprimes_per_10s:
            raise ClientError("rate_limit_exceeded", f"at most {self.cfg.max_reprimes_per_10s} prompt changes per "
                              f"{REPRIME_WINDOW_S:g} s before audio: each one re-runs the prompt on the model",
                              "session", type_="rate_limit_error")
        self._reprimes.append(now)
        voice, voice_audio = await asyncio.to_thread(self.ctx.voices.for_open, new.voice)
        if self.closing or self.relay is None:
            raise ClientError("bad_event", "the session is closing")
        n = self.relay.prime(voice, new.instructions, new.sampling(), voice_audio)
        self._prime_settings[n] = self.settings = new
        return n

    def _settle_after_audio(self, session: dict, new: SessionSettings) -> None:
        """The model has been primed: persona and voice stay; what was asked and is not in effect is listed."""
        settled = settle_update_after_audio(session, self.settings, new)
        noted = sorted(set(settled.not_in_effect) - set(self.settings.not_in_effect))
        if noted:
            self.log.info("session %s: session.update after audio: %s not in effect", self.session_id,
                          ", ".join(key for key, _ in noted))
        self.settings = settled
        self.emit({"type": "session.updated", "session": self._session_object()})

    def on_prompt_live(self) -> None:
        """The latest prompt is in the slot: each session.update that waited for it is answered now
        (an autostarted session that got none announces its default prompt once)."""
        if self.closing:
            return
        live = self.relay.ready.prime
        self._prime_settings = {n: v for n, v in self._prime_settings.items() if n >= live}  # older ones are done
        answered = [e for e in self._waiting if e[0] <= live]
        self._waiting = [e for e in self._waiting if e[0] > live]
        n = len(answered) or (0 if self._announced else 1)
        self._announced = True
        for _ in range(n):
            self.emit({"type": "session.updated", "session": self._session_object()})

    def on_prime_refused(self, prime: int, err: RelayError) -> None:
        """The talker refused an update's settings (an unknown voice, say): that update gets the typed
        error, and the session goes on with the settings it had."""
        refused = self._prime_settings.pop(prime, None)
        if refused is not None:
            self._refused_key = refused.runtime_key()
        kept = max(self._prime_settings)
        asked = [e for e in self._waiting if e[0] == prime]
        # The update that asked for it gets the error (once per distinct refusal: an update sent before the
        # first refusal came back carries the same refused voice); the others wait for the kept prompt.
        first = 1 if asked and (err.code, err.message) != self._last_refusal else 0
        if first:
            self.send_error(err.error_type, err.code, err.message, asked[0][1], param="session")
        self._last_refusal = (err.code, err.message)
        self._waiting = [e for e in self._waiting if e[0] != prime] + [(kept, ev) for _, ev in asked[first:]]
        self.settings = self._prime_settings[kept]

    async def _on_heartbeat(self, event: dict) -> None:
        self.emit(heartbeat_ack(event))

    # ---- input ------------------------------------------------------------------

    async def _on_append(self, event: dict) -> None:
        self.heard_from_client()  # a live client, even if this packet is refused
        if self.relay is None:
            raise ClientError("session_not_started", "send session.update (or connect with ?model=) before "
                              "appending audio", "type")
        if self.closing:
            raise ClientError("bad_event", "the session is closing")
        op = append_operation_id(event)
        if op is not None and op in self.recent_ops:
            self.log.debug("session %s: append with repeated operation_id %s ignored", self.session_id, brief(op))
            return
        fmt, samples = decode_append(event, self.settings, self.audio_started, self.cfg.max_packet_samples)
        # Accepted whole: from here on the packet is committed.
        if op is not None:
            self.recent_ops.add(op)
        if not self.audio_started:
            self.audio_started = True
            if fmt != self.settings.input_format:
                self.settings = replace(self.settings, input_format=fmt)
            self.conv = Conversation(self.session_id, legacy=self.settings.legacy_event_names)
            self._start_response()
        await self.push_audio(samples)

    async def _on_clear(self, event: dict) -> None:
        self.emit({"type": "input_audio_buffer.cleared", "dropped_samples": self.clear_audio()})

    # ---- responses and barge-in ------------------------------------------------

    def _start_response(self) -> None:
        metadata, self._next_metadata = self._next_metadata, None
        for ev in self.conv.start(metadata):
            self.emit(ev)

    def _finish_response(self, status: str, error: dict | None = None) -> None:
        for ev in self.conv.finish(status, error=error):
            self.emit(ev)

    def _barge_in(self, why: str) -> None:
        """End the current response now: its audio not yet sent is dropped, the next response starts
        at once (the model, its context and the slot go on)."""
        if self.says is not None:
            self.says.cancel_all()  # what the model was asked to say and has not said yet goes too
        dropped = self.drop_queued(self.conv.current.id)
        self.log.info("session %s: %s: response %s cancelled, %d queued events dropped", self.session_id, why,
                      self.conv.current.id, dropped)
        self._finish_response("cancelled")
        self._start_response()
        self._after_barge_in = self.conv.current.id

    async def _on_cancel(self, event: dict) -> None:
        wanted = event.get("response_id")
        if self.conv is None or self.closing or (wanted is not None and wanted != self.conv.current.id):
            self.log.info("session %s: response.cancel with no such response in progress: nothing to do",
                          self.session_id)
            return
        current = self.conv.current
        if wanted is None and current.id == self._after_barge_in and current.item.frames <= BARGE_IN_GRACE_FRAMES:
            self.log.info("session %s: response.cancel right after a barge-in: that response has ended already",
                          self.session_id)
            return
        self._barge_in("response.cancel")

    async def _on_truncate(self, event: dict) -> None:
        item_id = event.get("item_id")
        if self.conv is None or not self.conv.has(item_id):
            raise ClientError("invalid_item_id", f"item_id {brief(item_id)} is not an assistant item of this session",
                              "item_id")
        end_ms = truncate_end_ms(event)
        if self.conv.items[item_id].role != "assistant":
            raise ClientError("invalid_item_id", "only assistant audio items can be truncated", "item_id")
        self.emit(self.conv.truncate(item_id, end_ms))
        if not self.closing and item_id == self.conv.current.item.id:
            self._barge_in("conversation.item.truncate")

    async def _on_item_retrieve(self, event: dict) -> None:
        item_id = event.get("item_id")
        if self.conv is None or not self.conv.has(item_id):
            raise ClientError("item_retrieve_invalid_item_id",  # OpenAI's code, which SDKs match
                              f"Error retrieving item: the item with id {brief(item_id)} does not exist.", "item_id")
        self.emit(self.conv.retrieved(item_id))

    async def _on_response_create(self, event: dict) -> None:
        text = response_say_text(event)
        metadata = response_metadata(event)
        if text is not None:
            self._say(text, client_event_id(event), "response.instructions")
            if self.conv is not None and self.conv.current is not None:
                # What is said is a new response, answering this create (LiveKit's generate_reply waits for
                # the response.created carrying its metadata): the one playing completes, the next opens.
                self._next_metadata = metadata
                self._finish_response("completed")
                self._start_response()
                return
        if self.conv is None and metadata is not None:
            self._next_metadata = metadata  # the first response (at the first audio) carries it
        self.log.info("session %s: response.create: the continuous response is (or will be) running%s",
                      self.session_id, " (its instructions are said)" if text is not None else "")

    async def _on_no_op(self, event: dict) -> None:
        self.log.debug("session %s: %s: nothing to do (continuous input)", self.session_id, event["type"])

    async def _on_item_create(self, event: dict) -> None:
        """Context items frameworks send (history, system notes) are recorded and acknowledged. The
        model reads only audio, its persona is `instructions`; an assistant message's text is said
        (say.py)."""
        item_id, role, content = parse_item_create(event)
        if self.conv is None:
            self.conv = Conversation(self.session_id, legacy=self.settings.legacy_event_names)
        if self.conv.has(item_id):
            raise ClientError("item_create_duplicate_item_id", f"item {item_id!r} already exists", "item.id")
        text = item_say_text(role, content)
        if text is not None:
            self._say(text, client_event_id(event), "item.content")  # refused here: the item is not recorded
        self.log.info("session %s: %s item %s recorded%s", self.session_id, role, item_id,
                      " (its text is said)" if text is not None else " (text does not reach the model)")
        for ev in self.conv.add_client_item(item_id, role, content):
            self.emit(ev)

    def _say(self, text: str, event_id: str | None, param: str) -> None:
        if self.relay is None or self.says is None:
            raise ClientError("session_not_started", "send session.update (or connect with ?model=) before "
                              "asking the model to say something", param)
        if self.closing:
            raise ClientError("bad_event", "the session is closing")
        try:
            self.says.say(text, event_id, param)
        except RelayError as e:  # the session's stages failed: its end follows
            raise ClientError(e.code, e.message, type_=e.error_type) from None

    def on_say_answer(self, resp) -> None:
        """The talker's answer to a say: a refusal becomes an error naming the event that asked."""
        refused = self.says.answered(resp)
        if refused is not None and not self.closing:
            err, event_id = refused
            self.send_error(err.type, err.code, err.message, event_id)

    async def _on_item_delete(self, event: dict) -> None:
        item_id = event.get("item_id")
        if self.conv is None or not self.conv.has(item_id):
            raise ClientError("invalid_item_id", f"item_id {brief(item_id)} is not an item of this session", "item_id")
        if self.conv.current is not None and item_id == self.conv.current.item.id:
            self._barge_in("conversation.item.delete")
        self.emit(self.conv.delete(item_id))

    # ---- output and endings -----------------------------------------------------

    def render_output(self, f: OutputFrame) -> bool:
        if self.conv is None or self.conv.current is None:
            return False  # output before any input cannot happen; after the end of the response nothing is sent
        where = self.conv.delta_fields(f.text)
        for ev in output_deltas(where, f.pcm, f.text, self.settings.legacy_event_names):
            self.emit(ev, where["response_id"])
        return True

    def on_resumed(self, dropped: int) -> None:
        """The resumed connection's first event: the session as it is, and what the pause cost."""
        relay = self.relay
        self.send(json.dumps({"type": "session.resumed", "session": self._session_object(),
                              "frames_in": relay.frames_in if relay else 0, "frames_out": self.frames_out,
                              "frames_undelivered": dropped}, separators=(",", ":")), first=True)

    async def on_relay_failure(self, err: RelayError) -> None:
        self._emit_done_and_closed("failed", {"type": err.error_type, "code": err.code})
        self.end(1011, "stage failure")

    async def on_idle(self, limit: float) -> None:
        what = "no session was opened" if self.relay is None else "no audio was appended"
        self.send_error("invalid_request_error", "idle_timeout", f"{what} for {limit:g} s: the connection is closed")
        if self.relay is not None:
            await self.release(graceful=False)
            self._emit_done_and_closed("cancelled")

    async def _on_close(self, event: dict) -> None:
        if not self.start_closing():
            return
        relay = self.relay
        await self.flush_audio()
        await self.release(graceful=True)
        if relay is not None and relay.failed is not None:
            err = relay.failed
            self.send_error(err.error_type, err.code, err.message)
            self._emit_done_and_closed("failed", {"type": err.error_type, "code": err.code})
        else:
            self._emit_done_and_closed("completed")
        self.end(1000, "session closed")

    def _emit_done_and_closed(self, status: str, error: dict | None = None) -> None:
        if self.relay is not None and self.conv is None:  # opened, no audio yet: an empty response
            self.conv = Conversation(self.session_id, legacy=self.settings.legacy_event_names)
            self._start_response()
        if self.conv is not None and self.conv.current is not None:
            self._finish_response(status, error)
        relay = self.relay
        self.emit(session_closed_event(self.session_id, relay.frames_in if relay else 0, self.frames_out,
                                       self.cleanup_confirmed, relay.latency_summary() if relay else {"frames": 0},
                                       relay.prelive_dropped if relay else 0))


class ResumedConnection:
    """A resume's connection (server.WS_ROUTES' handler runs it): it hands itself to the paused
    session it claimed at the handshake and lasts as long as the session serves it."""

    def __init__(self, session: RealtimeSession, ws: ServerConnection):
        self.session, self.ws = session, ws
        self.session_id = session.session_id

    async def run(self) -> None:
        if await self.session.serve_resumed(self.ws):
            return
        # The session ended (idle, a stage failure) or the claim lapsed between the handshake and now.
        code, message = "session_expired", f"session {self.session_id} ended before this connection took it over"
        self.session.ctx.metrics.errors.labels("invalid_request_error", code).inc()
        try:
            await self.ws.send(json.dumps({"event_id": f"event_{secrets.token_hex(6)}", "server_event_seq": 1,
                                           **error_event("invalid_request_error", code, message)}))
        finally:
            await self.ws.close(1008, code)
