"""The Talker's wire surface: the Talk stream, GetCapacity, Drain, ListVoices and ForgetVoice (talker.proto).

One Talk stream = one session:

    client                                  server
    open(stream_id, voice, persona, sampling) ─▶ validate all (INVALID_ARGUMENT), take a slot
                                                 (RESOURCE_EXHAUSTED / ALREADY_EXISTS / UNAVAILABLE),
                                                 prefill the prompt behind the clock's steps
                                            ◀─ ready(slot, prefill_frames, prefill_ms, delay, seed)
    frame(seq, 8 codes) every 80 ms        ─▶ seq-checked, range-checked, queued on the clock
                                            ◀─ output(seq, input_seq, text, 8 agent codes) per step
    say(id, text) / say_cancel(id)         ─▶ text forced into the model's text stream (say.py)
                                            ◀─ say_done(id, said | cancelled) or say_refused(id, kind)
    half-close                             ─▶ remaining queued frames are stepped, then OK

Frames may be sent before `ready`; they queue and count against the backlog bound
(config.max_backlog_s). More queued input than that ends the stream with
RESOURCE_EXHAUSTED ("backlog"), as does a client that leaves that many outputs unread:
the talker buffers a bounded amount per session, never an unbounded one.

Two tasks per stream: a reader that validates frames and queues them on the clock,
and this handler, which writes what the clock puts in the session's outbox. The
reader's errors travel through the same outbox, so a stream ends exactly once, with
the first error. However it ends, the session leaves the clock and its slot comes
back only after its last engine work finished (clock.ConversationClock.close).

A voice recorded from shipped audio is leased from the open until the session's `ready`
(its prompt is in the slot) or its end, so a ForgetVoice or an eviction meanwhile never
takes it from under the prompt (voice_recorder.py, recording_store.py).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass

import grpc
import numpy as np

from duplex.v1 import talker_pb2, talker_pb2_grpc
from services.common import voice_audio, voice_names
from services.common.checkpoint import CheckpointPaths, InvalidVoice
from services.common.errors import FailedPrecondition, Internal, InvalidArgument, StageError, Unavailable
from services.common.link import serve_link
from services.common.stage_server import StageRpcs, StageRuntime, StageServer, freeze_startup_heap, validate_stream_id
from services.talker.config import TalkerConfig
from services.talker.metrics import TalkerMetrics
from services.talker.clock import ConversationClock
from services.talker.say import SayDone, SayEnd, SayError, SayQueue, SayRefused, say_words
from services.talker.session import END, Output, PrimeRefused, Ready, Session
from services.talker.recording_store import ForgetOutcome
from services.talker.voice_recorder import VoiceRecorder
from services.common.frame import CARD, CODEBOOKS

log = logging.getLogger("talker")



def engine_api():
    """The engine module (imported late so this file's validation helpers load without it)."""
    from services.talker import engine

    return engine


# ---- validation (everything is checked before a slot is taken) ------------------------------

def parse_sampling(msg: talker_pb2.Sampling, text_card: int, card: int):
    """Sampling message -> (engine SamplingParams, seed). Zero fields mean the model defaults."""
    eng = engine_api()
    d = eng.SamplingParams()
    seed = msg.seed or (secrets.randbits(63) or 1)
    params = eng.SamplingParams(
        greedy=msg.greedy,
        text_temperature=msg.text_temperature or d.text_temperature,
        text_top_k=msg.text_top_k or d.text_top_k,
        audio_temperature=msg.audio_temperature or d.audio_temperature,
        audio_top_k=msg.audio_top_k or d.audio_top_k,
        seed=seed,
    )
    try:
        params.validate(text_card, card)
    except eng.InvalidSampling as e:
        raise InvalidArgument(f"sampling: {e}", kind="bad_sampling") from None
    return params, seed


def parse_persona(text: str, max_chars: int) -> str:
    if len(text) > max_chars:
        raise InvalidArgument(f"persona has {len(text)} characters, at most {max_chars} allowed", kind="bad_persona")
    bad = next((c for c in text if (ord(c) < 32 and c not in "\n\t\r") or c == "\x7f"), None)
    if bad is not None:
        raise InvalidArgument(f"persona contains the control character {bad!r}", kind="bad_persona")
    return text


def parse_voice(name: str, audio: bytes, paths: CheckpointPaths, max_seconds: float):
    """None, a bundled basename, or (enrolled name, float32 samples) for audio shipped with the open."""
    if audio:
        if not voice_names.is_enrolled(name):
            raise InvalidArgument(f"voice_audio needs an enrolled voice name ([A-Za-z0-9_-]{{1,64}}), got "
                                  f"{name[:80]!r}", kind="bad_voice")
        if len(audio) % 4 or len(audio) > max_seconds * voice_audio.SAMPLE_RATE * 4:
            raise InvalidArgument(f"voice_audio must be float32 samples of at most {max_seconds:g} s at 24 kHz, "
                                  f"got {len(audio)} bytes", kind="bad_voice")
        pcm = np.frombuffer(audio, dtype="<f4").astype(np.float32)
        if not np.isfinite(pcm).all():
            raise InvalidArgument("voice_audio holds non-finite samples", kind="bad_voice")
        return name, pcm
    if not name:
        return None
    try:
        paths.resolve_voice(name)
    except InvalidVoice as e:
        raise InvalidArgument(str(e), kind="bad_voice") from None
    return name


def parse_codes(frame) -> list[int]:
    codes = list(frame.codes)
    if len(codes) != CODEBOOKS:
        raise InvalidArgument(f"frame seq {frame.seq} has {len(codes)} codes, expected {CODEBOOKS}", kind="bad_codes")
    bad = next((c for c in codes if c >= CARD), None)
    if bad is not None:
        raise InvalidArgument(f"frame seq {frame.seq} has code {bad}, codes must be in [0, {CARD})", kind="bad_codes")
    return codes


def as_stage_error(e: BaseException) -> StageError:
    """An engine or clock failure -> the typed error that ends the stream."""
    if isinstance(e, StageError):
        return e
    eng = engine_api()
    typed = {InvalidVoice: "bad_voice", eng.InvalidPersona: "bad_persona", eng.InvalidSampling: "bad_sampling"}
    for cls, kind in typed.items():
        if isinstance(e, cls):
            return InvalidArgument(str(e), kind=kind)
    return Internal(f"talker engine failed: {type(e).__name__}: {e}", kind="engine")


_SAY_ENDS = {SayEnd.SAID: talker_pb2.SAY_END_SAID, SayEnd.CANCELLED: talker_pb2.SAY_END_CANCELLED}


def to_response(item: Ready | Output | PrimeRefused | SayDone | SayRefused) -> talker_pb2.TalkResponse:
    if isinstance(item, SayDone):
        return talker_pb2.TalkResponse(say_done=talker_pb2.TalkSayDone(
            id=item.id, end=_SAY_ENDS[item.end], tokens_said=item.tokens_said, tokens_dropped=item.tokens_dropped))
    if isinstance(item, SayRefused):
        return talker_pb2.TalkResponse(say_refused=talker_pb2.TalkSayRefused(id=item.id, kind=item.kind,
                                                                              details=item.details))
    if isinstance(item, PrimeRefused):
        return talker_pb2.TalkResponse(prime_refused=talker_pb2.TalkPrimeRefused(
            prime=item.prime, kind=item.kind, details=item.details))
    if isinstance(item, Ready):
        return talker_pb2.TalkResponse(ready=talker_pb2.TalkReady(
            slot=item.slot, prefill_frames=item.prefill_frames, prefill_ms=item.prefill_ms,
            output_delay_frames=item.output_delay_frames, seed=item.seed, prime=item.prime))
    return talker_pb2.TalkResponse(output=talker_pb2.TalkOutput(
        seq=item.seq, input_seq=item.input_seq, text_token=item.text_token, text_piece=item.text_piece,
        agent_codes=item.agent_codes))


# ---- the servicer ---------------------------------------------------------------------------

FORGET_OUTCOMES = {ForgetOutcome.FORGOTTEN: talker_pb2.FORGET_OUTCOME_FORGOTTEN,
                   ForgetOutcome.DEFERRED: talker_pb2.FORGET_OUTCOME_DEFERRED,
                   ForgetOutcome.NOT_HELD: talker_pb2.FORGET_OUTCOME_NOT_HELD}

# The longest a held open waits for its prime or first frame before its prompt starts anyway.
MAX_HOLD_S = 10.0
REPRIMED = object()  # put in a replaced session's outbox: the stream reads its new session's from here on


@dataclass
class PromptSettings:
    voice: object  # None, a bundled basename, or (enrolled name, samples) until recorded
    persona: str
    sampling: object  # engine SamplingParams
    seed: int


class TalkStream:
    """What one Talk stream is serving now: its session on the clock, replaced at each prime, and the
    lease on that session's voice (voice_recorder.VoiceLease), held until its prompt is in the slot."""

    def __init__(self, session: Session, lease):
        self.session, self.lease = session, lease


class TalkerServicer(StageRpcs, talker_pb2_grpc.TalkerServicer):
    def __init__(self, runtime: StageRuntime, clock: ConversationClock, paths: CheckpointPaths, config: TalkerConfig,
                 text_card: int, card: int, recorder):
        self.runtime = runtime
        self.recorder = recorder
        self.clock = clock
        self.paths = paths
        self.config = config
        self.text_card = text_card
        self.card = card

    def _parse_open(self, req) -> tuple[str, "PromptSettings"]:
        if req is grpc.aio.EOF or req is None:
            raise InvalidArgument("the stream ended before its open message", kind="no_open")
        if req.WhichOneof("kind") != "open":
            raise InvalidArgument("the first message of a Talk stream must be `open`", kind="no_open")
        o = req.open
        validate_stream_id(o.stream.stream_id)
        return o.stream.stream_id, self._parse_prompt(o)

    def _parse_prompt(self, msg) -> "PromptSettings":
        """A TalkOpen's or TalkPrime's prompt settings, validated (the voice not yet recorded)."""
        voice = parse_voice(msg.voice, msg.voice_audio, self.paths, self.config.max_voice_seconds)
        persona = parse_persona(msg.persona, self.config.max_persona_chars)
        sampling, seed = parse_sampling(msg.sampling, self.text_card, self.card)
        return PromptSettings(voice, persona, sampling, seed)

    async def Talk(self, request_iterator, context):
        async with self.runtime.guard(context):
            stream_id, prompt = self._parse_open(req := await self.runtime.first_message(context))
            lease = await self._record_voice(prompt.voice)
            o = req.open
        handle = stream = reader = hold_timer = None
        reason = "error"
        async with self.runtime.guard(context, stream_id):
            try:
                self.clock.admit()  # RESOURCE_EXHAUSTED prefill_busy, before a slot is taken
                handle = self.runtime.open_stream(stream_id)
                hold_s = o.hold_prompt_ms / 1000.0
                stream = TalkStream(self.clock.open(stream_id, handle.slot, lease.key, prompt.persona,
                                                    prompt.sampling, prompt.seed, o.early_outputs, hold=hold_s > 0),
                                    lease)
                if hold_s > 0:
                    await context.write(talker_pb2.TalkResponse(held=talker_pb2.TalkHeld(slot=handle.slot)))
                    hold_timer = asyncio.get_running_loop().call_later(
                        min(hold_s, MAX_HOLD_S), lambda: self.clock.start_prompt(stream.session, "hold_ended"))
                reader = asyncio.create_task(self._read_frames(handle, stream, context), name=f"talk-read-{stream_id}")
                while True:
                    session = stream.session
                    item = await session.outbox.get()
                    if item is REPRIMED:
                        continue  # the stream's session was replaced: read the new one's outbox
                    if isinstance(item, Ready) and session is stream.session:
                        stream.lease.release()  # the prompt is in the slot: the voice's recording is not read again
                    if item is END:
                        reason = "ok"
                        return
                    if isinstance(item, BaseException):
                        err = as_stage_error(item)
                        if isinstance(err, Unavailable) and err.kind == "drained":
                            reason = "drained"
                        raise err
                    await context.write(to_response(item))
                    if isinstance(item, Output):
                        handle.frames += 1
                        self.runtime.metrics.frames_out.inc()
            except asyncio.CancelledError:
                reason = "cancelled"
                raise
            finally:
                lease.release()  # idempotent: a session that went live, or was re-primed, released it already
                if stream is not None:
                    stream.lease.release()
                if hold_timer is not None:
                    hold_timer.cancel()
                if reader is not None:
                    reader.cancel()
                if stream is not None:
                    self.clock.close(stream.session)
                if handle is not None:
                    self.runtime.close_stream(handle, reason)

    async def _record_voice(self, voice):
        """A lease on the engine's key for the open's voice, recorded first if it is audio (voice_recorder.py)."""
        name, pcm = voice if isinstance(voice, tuple) else (voice, None)
        try:
            return await self.recorder.resolve(name, pcm)
        except InvalidVoice as e:
            raise InvalidArgument(f"voice {name[:64]!r}: {e}", kind="bad_voice") from None

    async def ListVoices(self, request, context):
        voices = await asyncio.to_thread(self.recorder.bundled)
        return talker_pb2.VoiceList(voices=[talker_pb2.VoiceInfo(name=n, seconds=s) for n, s in voices])

    async def ForgetVoice(self, request, context):
        async with self.runtime.guard(context):
            outcome = await self.recorder.forget(request.audio_sha256)
            return talker_pb2.ForgetVoiceResponse(outcome=FORGET_OUTCOMES[outcome])

    async def TalkLink(self, request_iterator, context):
        await serve_link(self.runtime, context, talker_pb2.TalkLinkResponse, lambda port: self.Talk(None, port))

    async def _read_frames(self, handle, stream: "TalkStream", context) -> None:
        """Validate and queue the client's frames and primes; any error ends the stream through the outbox."""
        try:
            while True:
                req = await handle.read(context)
                if req is None:
                    self.clock.input_done(stream.session)
                    return
                kind = req.WhichOneof("kind")
                if kind == "prime":
                    await self._reprime(stream, req.prime)
                    continue
                if kind in ("say", "say_cancel"):
                    self._say(stream.session, req)
                    continue
                if kind != "frame":
                    raise InvalidArgument("after `open`, every message of a Talk stream must be a `frame`, a "
                                          "`prime`, a `say` or a `say_cancel`", kind="bad_message")
                handle.seq.check(req.frame.seq)
                codes = parse_codes(req.frame)
                self.clock.push(stream.session, req.frame.seq, codes)
                handle.seq.advance()
                self.runtime.metrics.frames_in.inc()
        except asyncio.CancelledError:
            raise
        except StageError as e:
            self.clock.fail(stream.session, e)
        except Exception as e:  # a dropped connection surfaces here as an RpcError / aio error
            log.debug("stream %s: reader ended: %r", handle.stream_id, e)
            self.clock.fail(stream.session, Internal(f"reading the stream failed: {e!r}", kind="read"))

    def _say(self, s: Session, req) -> None:
        """A say queued on the session (or refused, the session going on), or a say_cancel (say.py)."""
        if s.say is None:
            s.say = SayQueue(self.config.max_say_tokens, self.config.say_max_wait_frames)
        if req.WhichOneof("kind") == "say_cancel":
            for done in s.say.cancel(req.say_cancel.id):
                s.outbox.put_nowait(done)
            return
        msg = req.say
        try:
            s.say.add(msg.id, say_words(self.clock.engine.tokenizer, msg.text, self.config.max_say_chars))
        except SayError as e:
            s.outbox.put_nowait(SayRefused(msg.id, e.kind, str(e)))

    async def _reprime(self, stream: "TalkStream", msg) -> None:
        """A prime: the prompt redone in the same slot with new settings (clock.reprime). What the
        old session's outbox still holds (its Ready at most: no frame was sent) is dropped, but for
        answers to says, which move to the new session's with its say queue."""
        if stream.session.received:  # checked before a voice is recorded for nothing
            raise FailedPrecondition("a prime must come before the first frame", kind="prime_after_audio")
        try:
            prompt = self._parse_prompt(msg)
            lease = await self._record_voice(prompt.voice)
        except InvalidArgument as e:  # the session keeps the prompt it had
            stream.session.outbox.put_nowait(PrimeRefused(msg.prime, e.kind, str(e)))
            return
        old = stream.session
        try:
            stream.session = self.clock.reprime(old, msg.prime, lease.key, prompt.persona, prompt.sampling,
                                                prompt.seed)
        except BaseException:
            lease.release()
            raise
        stream.session.say = old.say  # queued says outlive the prompt they were sent under (none said yet)
        stream.lease.release()  # the old prompt's, whose session is closed: it never begins now
        stream.lease = lease
        while not old.outbox.empty():
            item = old.outbox.get_nowait()
            if isinstance(item, (SayDone, SayRefused)):  # a say's answer is the stream's, not the prompt's
                stream.session.outbox.put_nowait(item)
        old.outbox.put_nowait(REPRIMED)


# ---- the process ---------------------------------------------------------------------------

class TalkerService:
    """Engine, clock, admission and the gRPC server of one Talker.

        svc = TalkerService(TalkerConfig(checkpoint=..., port=0, metrics_port=-1))
        await svc.start();  ... svc.address ...;  await svc.stop()
    """

    def __init__(self, config: TalkerConfig, engine=None):
        """`engine`: an already loaded TalkerEngine with config.slots slots to serve (tests reuse one);
        by default it is loaded from config.checkpoint."""
        self.config = config
        self.engine = engine
        self.clock: ConversationClock | None = None
        self.recorder: VoiceRecorder | None = None
        self.server: StageServer | None = None

    async def start(self) -> "TalkerService":
        cfg = self.config
        eng = engine_api()
        paths = CheckpointPaths.open(cfg.checkpoint, require=("lm", "tokenizer"))
        t0 = time.perf_counter()
        if cfg.compile:
            from services.talker import fused  # torch: imported with the engine, not with this module
            fused.enable()  # before the first forward: the warm-up below compiles every shape
        if self.engine is None:
            # Loading is heavy; keep the loop free (nothing else runs yet, but signals still work).
            self.engine = await asyncio.to_thread(
                eng.TalkerEngine.from_checkpoint, paths, cfg.slots, device=cfg.device, dtype=cfg.torch_dtype,
                context=cfg.context or None, kv_bits=cfg.kv_storage_bits, cuda_graph=cfg.cuda_graph,
                weights_fp8=cfg.weights_fp8, alignment=cfg.alignment,
                step_ahead=cfg.alignment == "personaplex")  # clock.py: step k runs once input k-1 is in
        elif self.engine.num_slots != cfg.slots:
            raise ValueError(f"the given engine has {self.engine.num_slots} slots, the config says {cfg.slots}")
        elif self.engine.alignment != cfg.alignment:
            raise ValueError(f"the given engine has alignment {self.engine.alignment}, the config says {cfg.alignment}")
        log.info("engine loaded from %s in %.1f s: %d slots on %s (%s), %s alignment (attention window %d frames, "
                 "output delay %d frames)", paths.root, time.perf_counter() - t0, self.engine.num_slots, cfg.device,
                 cfg.torch_dtype, self.engine.alignment, self.engine.context, self.engine.output_delay_frames)
        runtime = StageRuntime("talker", cfg.slots, frame_ms=round(cfg.tick_ms),
                               stream_idle_timeout_s=cfg.stream_idle_timeout_s,
                               first_message_timeout_s=cfg.first_message_timeout_s)
        metrics = TalkerMetrics(runtime.metrics)
        runtime.metrics.track_gpu(cfg.device)
        self.clock = ConversationClock(
            self.engine, runtime.pool, tick_s=cfg.tick_ms / 1000.0, max_backlog_frames=cfg.max_backlog_frames,
            prefill_chunk_frames=cfg.prefill_chunk_frames, input_wait_s=cfg.input_wait_ms / 1000.0,
            tick_phase_s=cfg.tick_phase_ms / 1000.0,
            catch_up_lag_frames=cfg.catch_up_lag_frames, max_prefill_wait_s=cfg.max_prefill_wait_s, metrics=metrics)
        # On the compute thread, before serving: the CUDA graph capture and the first prefill's
        # allocations (cuBLAS handle and workspace are per thread) happen now, not on a live tick,
        # and a GPU too full for them fails the start instead of the first session.
        t1 = time.perf_counter()
        self.engine.prefill_graph_frames = cfg.prefill_chunk_frames  # the chunk the graph is captured for
        if cfg.bench_full_context:
            log.warning("BENCHMARK MODE (bench_full_context): every session attends over a full ring of %d "
                        "frames from its first frame; what the model says is meaningless", self.engine.context)
            self.engine.bench_full_context = True
        voices = cfg.voices_to_preload
        try:
            recorder = self.recorder = VoiceRecorder(paths, self.engine, self.clock.compute, cfg.voice_cache_path,
                                                     cfg.max_voice_seconds, memory_bytes=cfg.voice_memory_bytes,
                                                     disk_bytes=cfg.voice_cache_bytes, metrics=metrics)
        except ValueError as e:
            raise ValueError(f"talker config: {e}") from None
        metrics.track_recordings(recorder.store)
        try:
            for name in voices:
                await recorder.resolve(name)  # audio voices are recorded (or read from the cache) first
            await self.clock.compute(lambda: self.engine.warmup(voices))
        except InvalidVoice as e:
            raise ValueError(f"talker config: preload_voices: {e}") from None
        log.info("engine warmed up in %.1f s%s", time.perf_counter() - t1,
                 f" (voices preloaded: {', '.join(voices)})" if voices else "")
        servicer = TalkerServicer(runtime, self.clock, paths, cfg,
                                  text_card=getattr(self.engine, "text_card", 32000),
                                  card=getattr(self.engine, "card", CARD), recorder=recorder)
        self.server = StageServer(
            runtime,
            register=lambda s: talker_pb2_grpc.add_TalkerServicer_to_server(servicer, s),
            service_names=[talker_pb2.DESCRIPTOR.services_by_name["Talker"].full_name],
            host=cfg.host, port=cfg.port, metrics_port=cfg.metrics_port, drain_deadline_s=cfg.drain_deadline_s)
        self.clock.start()
        await self.server.start()
        return self

    @property
    def runtime(self) -> StageRuntime:
        return self.server.runtime

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.server.port}"

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=0.5)
        if self.clock is not None:
            await self.clock.stop()
        if self.recorder is not None:
            await asyncio.to_thread(self.recorder.close)  # its process, if a recording started one

    async def serve_until_signal(self) -> None:
        """The process's life after start(): serve until SIGTERM/SIGINT (then drain), stop the clock."""
        freeze_startup_heap()
        self.server.runtime.metrics.track_gc()
        try:
            await self.server.serve_until_signal()
        finally:
            if self.clock is not None:
                await self.clock.stop()
            if self.recorder is not None:
                await asyncio.to_thread(self.recorder.close)
