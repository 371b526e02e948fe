"""The conversation clock: every tick, one batched model step for every session with input.

Threads: the asyncio loop owns every Session and makes every decision (tick_policy.py); the
engine runs on one compute thread (runner.py). A step's inputs are gathered and the step
submitted with no `await` in between, so a session closed by the loop is either in a step's
batch (its slot stays pinned until that step returns) or in none.

One period (tick_s, 80 ms; deadlines on the cell's frame grid, services/common/frame_grid.py,
so other processes can place their work around them):

    deadline ──▶ wait for due frames, never past the step's share of the period
                 main step: every live session with a queued frame, one frame each,
                   + one piece of the oldest waiting prompt riding it (runner.py)
                 catch-up steps for the sessions still behind (or skipped by the main step
                   and whose frame has come since), most behind first, each a compact step
                   sized to them and to the time left (engine.step_rows)
                 (the tick ends here: its outputs are out)
                 prefill pieces alone in the period's slack, while one fits
                 sleep until the next deadline (woken early by new work)

Sharing the slack: sessions already talking come first, so the time after the main step goes to
catch-up steps until nobody is behind or none fits (tick_policy.py sizes them), and only what is
left to prefill pieces alone. First audio still advances every tick whatever the catch-ups: one
piece of the oldest waiting prompt rides every main step, and a catch-up step carries none.

With no session live, prompts run piece after piece while the clock sleeps. A live session
without input for a tick is not stepped (no invented audio) and costs the others nothing: the
batch has a fixed shape [slots, 8] and an active mask. Queued input over the backlog bound is
refused (BacklogFull) on that session only.

Step ahead (the personaplex alignment): step k reads user frame k-1 at the latest, so its entry
is queued when frame k-1 arrives (step 0's at open, with no frame) and it runs one period before
frame k arrives. Output k still leaves only after input k came in, so the stream pairs inputs and
outputs as before (N in, N out); the step that took the last input is surplus and is dropped. The
session's OutputPairing (services/common/pairing.py) owns that rule. A session opened with
early_outputs (the gateway's) gets output k at its step's end instead: a tick's outputs leave
together, so the decoder steps once per tick, right after the talker, rather than once per late
input through the next talker step; the caller pairs them with its own OutputPairing. Early outputs
still wait for the session's first frame: until then its prompt may be re-primed.

A session's life is its SessionStatus (session.py: held -> prefilling -> live -> ended, failed or
closed), changed only through Session.move, which refuses a move its table does not allow.

Prompts (prefill_queue.py): a session may open on hold (its slot taken, no prefill) and start its
prompt at its first prime, its first frame or the hold's end; before its first frame it may be
re-primed in place (the unfinished prefill dropped, the same slot). An open whose prompt would
wait longer than max_prefill_wait_s in the queue is refused up front (`admit`, "prefill_busy"
with a retry hint): a burst of callers is told to come back rather than admitted and starved.
"""

from __future__ import annotations

import asyncio
import logging
import time

from services.common.errors import FailedPrecondition, Internal, ResourceExhausted, retry_hint
from services.common.frame_grid import last_grid_time, next_grid_time
from services.common.pairing import PairingError
from services.common.slots import SlotPool
from services.talker.prefill_queue import PrefillQueue
from services.talker.runner import PieceResult, StepOutputs, StepRunner
from services.talker.session import END, Output, Ready, Session, SessionStatus
from services.talker.tick_policy import LAG_FRAMES, CatchUp, TickPolicy

log = logging.getLogger("talker.clock")

MIN_RETRY_S = 1.0  # the shortest retry hint of a prefill_busy refusal
PRELIVE_BACKLOG_FACTOR = 4  # max_prelive_frames = this x the backlog bound
LATE_START_S = 0.010  # a slow tick that started this late after its deadline counts as "late_start"
LOG_EVERY_S = 10.0  # at most one warning of each kind per this long, with a count


def slow_tick_cause(steps: int, late_start_s: float) -> str:
    """What a tick over the period held (metrics.SLOW_CAUSES)."""
    return "catch_up" if steps > 1 else "late_start" if late_start_s > LATE_START_S else "wait_and_step"


class BacklogFull(ResourceExhausted):
    """A session queued more input than the backlog bound: the client is too far ahead of the clock."""

    kind = "backlog_full"


class ConversationClock:
    def __init__(self, engine, pool: SlotPool, *, tick_s: float, max_backlog_frames: int,
                 prefill_chunk_frames: int, input_wait_s: float = 0.0, tick_phase_s: float = 0.0,
                 catch_up_lag_frames: int = LAG_FRAMES, max_prefill_wait_s: float = 0.0, metrics=None):
        self.policy = TickPolicy(tick_s, input_wait_s, catch_up_lag_frames)
        self.prefill_queue = PrefillQueue(tick_s, prefill_chunk_frames)
        self.max_prefill_wait_s = max_prefill_wait_s
        self.runner = StepRunner(engine, prefill_chunk_frames)
        self.engine = engine
        self.step_ahead = engine.step_ahead  # step k queued when input k-1 arrives (module doc)
        self.pool = pool
        self.tick_s = tick_s
        self.tick_phase_s = tick_phase_s  # deadlines at k * tick_s + tick_phase_s
        self.max_backlog_frames = max_backlog_frames
        # Frames a session may queue before its prompt is live (a caller that streams before its
        # `ready`): a safety bound only; the gateway holds a client's audio until go-live.
        self.max_prelive_frames = PRELIVE_BACKLOG_FACTOR * max_backlog_frames
        self.metrics = metrics
        self.sessions: dict[int, Session] = {}  # slot -> session, in arrival order
        self._wake = asyncio.Event()  # new work: end the sleep before the deadline
        self._arrived = asyncio.Event()  # a frame arrived (for the input wait)
        self._task: asyncio.Task | None = None
        self._overruns, self._overrun_logged = 0, float("-inf")
        self._slow_ticks, self._slow_logged = 0, float("-inf")
        self._unfit, self._unfit_logged = 0, float("-inf")  # ticks whose sessions behind got no catch-up
        self.ticks = 0
        self.steps = 0  # batched engine steps, main + catch-up

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="talker-clock")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self.runner.shutdown()

    async def compute(self, fn, *args):
        """Run fn(*args) on the compute thread (FIFO behind any step in flight)."""
        return await self.runner.call(fn, *args)

    # ---- sessions (called by the servicer) ----------------------------------------------------

    def open(self, stream_id: str, slot: int, voice: str | None, persona: str, sampling, seed: int,
             early_outputs: bool = False, hold: bool = False, prime: int = 0, why: str = "open") -> Session:
        """Register a session on an acquired slot; its prompt runs in pieces behind the next steps,
        or, with `hold`, once start_prompt() is called (a prime, the first frame, the hold's end).

        Its outbox gets Ready when the prompt sits in the slot, or the engine's typed
        error (InvalidVoice, InvalidPersona, InvalidSampling) if begin() refuses it.
        """
        s = Session(stream_id=stream_id, slot=slot, voice=voice, persona=persona, sampling=sampling, seed=seed,
                    early_outputs=early_outputs, prime=prime)
        if self.step_ahead:
            s.inputs.append((0, None))
        self.sessions[slot] = s
        if not hold:
            self.start_prompt(s, why)
        return s

    def start_prompt(self, s: Session, why: str) -> None:
        """Queue the prompt of a session on hold (metrics.PROMPT_STARTS says why now)."""
        if s.status is not SessionStatus.HELD:
            return
        s.move(SessionStatus.PREFILLING)
        s.prefill_started = time.perf_counter()
        self.prefill_queue.queue_became_busy(asyncio.get_running_loop().time())
        if self.metrics:
            self.metrics.prompts_started.labels(why=why).inc()
        self._wake.set()

    def reprime(self, s: Session, prime: int, voice: str | None, persona: str, sampling, seed: int) -> Session:
        """New prompt settings for a session that has sent no frame: its unfinished prefill (or its
        prompt already live) is dropped and the new prompt runs in the same slot, which stays this
        stream's throughout. Returns the session that replaces `s` (the caller reads its outbox)."""
        if s.received:
            raise FailedPrecondition("the prompt can be changed only before the first frame", kind="prime_after_audio")
        if s.status.over:
            raise FailedPrecondition("the session is over", kind="closed")
        why = "prime" if s.status is SessionStatus.HELD else "reprime"
        self.close(s)  # the engine releases the slot behind any step in flight with it; the pool keeps it ours
        return self.open(s.stream_id, s.slot, voice, persona, sampling, seed, s.early_outputs, prime=prime, why=why)

    def prefill_wait_s(self) -> float:
        """How long the prompt of a session opened now would wait (prefill_queue.py)."""
        wait = self.prefill_queue.wait_s(self.sessions.values())
        if self.metrics:
            self.metrics.prefill_wait_estimate.set(wait)
        return wait

    def admit(self) -> None:
        """Refuse an open whose prompt would wait longer than max_prefill_wait_s (0: never). The retry hint
        is the whole estimated wait (the queue ahead drained), at least MIN_RETRY_S: the excess over the
        bound alone (a tenth of a second) sent a failover's refused callers back all together, each
        refused again, 20 times in a few seconds (front door run 21)."""
        if self.max_prefill_wait_s <= 0:
            return
        wait = self.prefill_wait_s()
        if wait > self.max_prefill_wait_s:
            if self.metrics:
                self.metrics.prefill_busy_refusals.inc()
            raise ResourceExhausted(
                f"the prefill queue is busy: a prompt opened now would wait about {wait:.1f} s (bound "
                f"{self.max_prefill_wait_s:.1f} s); {retry_hint(max(MIN_RETRY_S, wait))}", kind="prefill_busy")

    def push(self, s: Session, seq: int, codes: list[int]) -> None:
        """Queue one input frame (already validated and seq-checked by the caller). A session on
        hold starts its prompt. Frames that arrive before go-live queue up to max_prelive_frames
        and do not count against the backlog bound, which applies from go-live."""
        if s.status is SessionStatus.CLOSED:
            return
        self.start_prompt(s, "frame")
        live = s.status is SessionStatus.LIVE
        s.backlog_allowance = min(s.backlog_allowance, len(s.inputs))  # shrinks as catch-ups drain it
        queued = len(s.inputs) - (s.backlog_allowance if live else 0)
        limit = self.max_backlog_frames if live else self.max_prelive_frames
        if queued >= limit:
            self._count_refusal()
            raise BacklogFull(
                f"input backlog over its bound: {queued} frames queued "
                f"(max {limit} = {limit * self.tick_s:.2f} s{'' if live else ' before the prompt is live'}); "
                f"send one frame per {self.tick_s * 1000:.0f} ms"
            )
        if s.outbox.qsize() > self.max_backlog_frames:
            self._count_refusal()
            raise BacklogFull(
                f"output backlog over its bound: {s.outbox.qsize()} frames not read by the client "
                f"(max {self.max_backlog_frames}); read the responses as they come"
            )
        s.inputs.append((seq + 1, codes) if self.step_ahead else (seq, codes))
        s.received = seq + 1
        s.last_input_at = asyncio.get_running_loop().time()
        if (paired := s.pairing.release(s.received)) is not None:
            s.outbox.put_nowait(paired)  # output `seq`, computed before its input came
        self._arrived.set()

    def input_done(self, s: Session) -> None:
        """The client sent its last frame: end the stream once its queue is stepped."""
        s.input_done = True
        s.pairing.end_input()  # step ahead: an output waiting for an input that never comes is dropped
        while s.inputs and s.inputs[-1][0] >= s.received:
            s.inputs.pop()  # step ahead: its output would have no input to answer
        self._maybe_end(s)

    def close(self, s: Session) -> asyncio.Future | None:
        """Take the session off the clock; its slot stays pinned until the engine released it.

        The caller then releases the slot in the pool (StageRuntime.close_stream); the pool
        hands it out again only at the unpin, i.e. once engine.release has run on the compute
        thread, which is after any step still in flight with this slot (FIFO). Idempotent;
        returns the future of the engine release.
        """
        if s.status is SessionStatus.CLOSED:
            return None
        s.move(SessionStatus.CLOSED)
        s.inputs.clear()
        if self.sessions.get(s.slot) is s:
            del self.sessions[s.slot]
        self.pool.pin([s.slot])
        fut = self.runner.release(s.slot)
        fut.add_done_callback(lambda f, slot=s.slot: self._released(f, slot))
        return fut

    def _released(self, fut: asyncio.Future, slot: int) -> None:
        self.pool.unpin([slot])
        if not fut.cancelled() and fut.exception() is not None:
            log.error("engine.release(slot %d) failed: %r", slot, fut.exception())

    def fail(self, s: Session, e: BaseException) -> None:
        if not s.status.over:
            s.move(SessionStatus.FAILED)
            s.outbox.put_nowait(e)

    # ---- the loop ----------------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = next_grid_time(loop.time(), self.tick_s, self.tick_phase_s)
        while True:
            try:
                await self._idle_until(deadline)
                started = loop.time()
                steps = await self.tick(deadline + self.tick_s)
                self._observe_tick(deadline, started, steps)
                await self.prefill_in_slack(deadline + self.tick_s)
                self.ticks += 1
                deadline = self._next_deadline(deadline + self.tick_s)
            except asyncio.CancelledError:
                raise
            except Exception:
                # A failed step is a bug or a device error: its sessions are failed, the clock ticks on.
                log.exception("clock tick failed")
                deadline = next_grid_time(loop.time() + 1e-6, self.tick_s, self.tick_phase_s)

    async def tick(self, period_end: float) -> int:
        """The main step and the catch-up steps of one period ending at period_end; returns the
        number of steps run."""
        loop = asyncio.get_running_loop()
        live = [s for s in self.sessions.values() if s.status is SessionStatus.LIVE]
        await self._wait_for_due_frames(live, period_end)
        batch = self.policy.batch(live)  # one may have ended while we waited
        skipped = [s for s in live if s.status is SessionStatus.LIVE and not s.inputs]
        if self.metrics:
            self.metrics.frames_skipped.inc(len(skipped))
        if not batch:
            return 0
        lags = self.policy.lags(batch)
        await self._step(batch)
        if self.metrics:
            self.metrics.sessions_behind.observe(sum(1 for lag in lags.values() if lag > 0))
        self._know_steps()
        steps = 1
        owed = self.policy.owed(lags, skipped)
        while behind := self.policy.batch(s for s, n in owed.items() if n > 0):
            catch_up = self.policy.catch_up(loop.time(), period_end, behind, lags, steps)
            if catch_up is None:
                if steps == 1:
                    self._log_unfit(len(behind), period_end - loop.time())
                break
            if catch_up.kind is CatchUp.FORCED and self.metrics:
                self.metrics.catch_up_forced.inc()
            await self._step(catch_up.sessions, catch_up.rows)
            for s in catch_up.sessions:
                owed[s] -= 1
            steps += 1
        return steps

    def _know_steps(self) -> None:
        """Tell the policy the engine's step sizes and their warm-up times, at the first tick (the
        engine is warmed up before the clock starts: server.py)."""
        if not self.policy.row_buckets:
            self.policy.steps_known(self.engine.row_buckets, self.engine.warm_step_s)

    async def prefill_in_slack(self, period_end: float) -> None:
        """Prefill pieces alone after a tick, while one fits before period_end."""
        loop = asyncio.get_running_loop()
        self.policy.slack_measured(period_end - loop.time())
        while self.policy.piece_fits(loop.time(), period_end) and await self._prefill_alone():
            pass

    async def _idle_until(self, deadline: float) -> None:
        """Until `deadline`: sleep (woken by new work); with no live session, whose tick a piece
        could make late, prefill meanwhile."""
        loop = asyncio.get_running_loop()
        while True:
            left = deadline - loop.time()
            if left <= 0:
                return
            if not self._any_live() and await self._prefill_alone():
                continue
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=left)
            except TimeoutError:
                return

    async def _wait_for_due_frames(self, live: list[Session], period_end: float) -> None:
        """While a talking session's frame is due and the policy's wait has not run out, wait for arrivals."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        behind = any(len(s.inputs) > 1 for s in live)
        until = self.policy.input_wait_end(start, period_end, behind)
        if until is None:
            return
        waited = False
        while any(self.policy.frame_due(s, start) for s in live) and (left := until - loop.time()) > 0:
            self._arrived.clear()
            waited = True
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except TimeoutError:
                break
        if waited and self.metrics:
            self.metrics.input_wait.observe(loop.time() - start)

    async def _step(self, batch: list[Session], catch_up_rows: int | None = None) -> None:
        """The main step (catch_up_rows None) or a catch-up step of that many rows."""
        taken = []
        for s in batch:
            seq, codes = s.inputs.popleft()
            s.stepping = True
            taken.append((s, seq, codes))
        # A waiting prompt's next piece rides the main step. No await between picking it and
        # submitting the step: a close() can only queue its release behind this step.
        rider = None if catch_up_rows is not None else self.policy.next_prompt(self.sessions.values())
        slots = [s.slot for s in batch]
        forced = {s.slot: f for s in batch if s.say is not None and (f := s.say.next_force()) is not None}  # say.py
        self.pool.pin(slots)
        try:
            out = await self.runner.step([(s.slot, codes) for s, _, codes in taken], rider, catch_up_rows, forced)
        except Exception as e:
            for s in batch:
                self.fail(s, e)
            raise
        finally:
            self.pool.unpin(slots)
            for s in batch:
                s.stepping = False
        self.policy.step_measured(out.wall_s, catch_up_rows, asyncio.get_running_loop().time())
        self.steps += 1
        self._observe_step(out, len(batch), catch_up_rows)
        if rider is not None:
            self._record_piece(rider, out.piece, "step")
        for s, seq, _ in taken:
            if s.status is not SessionStatus.LIVE:
                continue  # closed or failed while its step ran: the output has nowhere to go
            for done in s.say.stepped(out.next_text[s.slot]) if s.say is not None else ():
                s.outbox.put_nowait(done)
            if out.has_output[s.slot]:
                i = s.slot
                output = Output(s.out_seq, seq, out.tokens[i], out.text[i], out.agent_codes[i])
                s.out_seq += 1
                # Early outputs wait for the session's first frame: before it the prompt may still be
                # re-primed, and the caller has nothing to pair output 0 with.
                if s.early_outputs and s.received > 0 and not s.input_done:
                    s.outbox.put_nowait(output)  # the caller pairs it
                else:
                    try:
                        paired = s.pairing.pair(seq, output, s.received)  # None: waits for input `seq` (push)
                    except PairingError as e:
                        self.fail(s, Internal(f"stream {s.stream_id}: {e}", kind="pairing"))
                        continue
                    if paired is not None:
                        s.outbox.put_nowait(paired)
            self._maybe_end(s)

    # ---- prompts -----------------------------------------------------------------------------

    async def _prefill_alone(self) -> bool:
        """One prefill piece on its own; False if nobody waits for one."""
        s = self.policy.next_prompt(self.sessions.values())
        if s is None:
            return False
        self._record_piece(s, await self.runner.prefill(s), "alone")
        return True

    def _record_piece(self, s: Session, piece: PieceResult, where: str) -> None:
        """Account for one piece of s's prompt, run alone (its time, GPU included, is what a slack
        must hold) or riding a step (its host time only), then act on its outcome."""
        s.pieces_ms.append(piece.ms)
        if self.metrics:
            self.metrics.prefill_pieces.labels(where=where).inc()
            if where == "alone":
                self.metrics.prefill_piece.observe(piece.total_s)
        if where == "alone":
            self.policy.piece_measured(piece.total_s)
        if piece.voice_frames and self.metrics:  # part of a new voice's KV prefix: a recording's cost to the tick
            self.metrics.voice_compute.labels(part=f"prefix_{where}").observe(piece.total_s)
        self.prefill_queue.piece_done(asyncio.get_running_loop().time(),
                                      self.policy.next_prompt(self.sessions.values()) is not None)
        if piece.error is not None:
            self.fail(s, piece.error)
            return
        s.job = piece.job
        if piece.done and s.status is SessionStatus.PREFILLING:
            self._go_live(s)

    def _go_live(self, s: Session) -> None:
        s.move(SessionStatus.LIVE)
        ms = (time.perf_counter() - s.prefill_started) * 1e3
        if self.metrics:
            self.metrics.prefill_duration.observe(ms / 1e3)
        log.info("session %s live in slot %d: %d prompt frames prefilled in %.1f ms (pieces, ms: %s)",
                 s.stream_id, s.slot, s.job.total_frames, ms,
                 " + ".join(f"{t:.1f} [begin {b:.1f}, launch {c:.1f}, device wait {w:.1f}]"
                            for t, b, c, w in s.pieces_ms))
        self.prefill_queue.prompt_done(len(s.pieces_ms))
        s.backlog_allowance = len(s.inputs)  # the backlog bound counts from go-live
        s.outbox.put_nowait(Ready(s.slot, s.job.total_frames, ms, s.job.output_delay_frames, s.seed, s.prime))
        s.job = None
        self._maybe_end(s)

    def _maybe_end(self, s: Session) -> None:
        if s.input_done and s.status is SessionStatus.LIVE and not s.inputs and not s.stepping:
            s.outbox.put_nowait(END)
            s.move(SessionStatus.ENDED)  # nothing more to step; the servicer closes it

    def _any_live(self) -> bool:
        return any(s.status is SessionStatus.LIVE for s in self.sessions.values())

    # ---- metrics and logs --------------------------------------------------------------------

    def _log_unfit(self, behind: int, left_s: float) -> None:
        """At most every LOG_EVERY_S: ticks whose sessions behind got no catch-up, with the time left
        after the main step against the smallest catch-up's predicted cost (what decides it)."""
        self._unfit += 1
        now = time.monotonic()
        if now - self._unfit_logged < LOG_EVERY_S:
            return
        p, rows = self.policy, self.policy.row_buckets[0]
        log.info("no catch-up fitted in %d tick(s) since the last report: now %d session(s) behind, %.1f ms left "
                 "after the main step (EMA %.1f ms), the %d-row catch-up predicted at %.1f ms + %.1f ms headroom",
                 self._unfit, behind, left_s * 1e3, p.step_s * 1e3, rows,
                 p.catch_up_cost(rows, asyncio.get_running_loop().time()) * 1e3,
                 p.catch_up_headroom_s * 1e3)
        self._unfit, self._unfit_logged = 0, now

    def _count_refusal(self) -> None:
        if self.metrics:
            self.metrics.backlog_refusals.inc()

    def _observe_step(self, out: StepOutputs, batch: int, catch_up_rows: int | None) -> None:
        if not self.metrics:
            return
        m = self.metrics
        m.observe_step(out.wall_s, batch)
        m.frames_advanced.inc(batch)
        if catch_up_rows is not None:
            m.catch_up_steps.labels(rows=str(catch_up_rows)).inc()
        if out.device_s is not None:
            m.step_device.observe(out.device_s)
        for part, seconds in out.parts.items():
            m.step_part.labels(part=part).observe(seconds)
        # The compute thread finished at parts' end; the loop resumed this coroutine only later.
        m.step_part.labels(part="loop_resume").observe(max(0.0, out.wall_s - sum(out.parts.values())))

    def _observe_tick(self, deadline: float, started: float, steps: int) -> None:
        """A tick's lateness and, if it stepped, its length from the deadline (a tick that started
        late is that much later); a tick over the period is counted by cause and logged."""
        took = asyncio.get_running_loop().time() - deadline
        if self.metrics:
            self.metrics.tick_lateness.observe(max(0.0, started - deadline))
            if steps:
                self.metrics.tick_duration.observe(took)
        if not steps or took <= self.tick_s:
            return
        if self.metrics:
            self.metrics.slow_ticks.labels(cause=slow_tick_cause(steps, started - deadline)).inc()
        self._slow_ticks += 1
        now = time.monotonic()
        if now - self._slow_logged < LOG_EVERY_S:
            return
        p = self.policy
        log.warning("slow tick: %.1f ms for %d step(s) from its deadline (step EMA %.1f ms, prefill piece EMA "
                    "%.1f ms, slack after a tick EMA %.1f ms, %d live sessions); %d slow tick(s) since the last "
                    "report", took * 1e3, steps, p.step_s * 1e3, p.piece_s * 1e3, (p.slack_s or 0.0) * 1e3,
                    sum(s.status is SessionStatus.LIVE for s in self.sessions.values()), self._slow_ticks)
        self._slow_ticks, self._slow_logged = 0, now

    def _next_deadline(self, deadline: float) -> float:
        """`deadline`, or when the clock is over a period behind it (a step longer than a period),
        the latest grid time: tick now rather than fire a burst of late ticks (queued input is
        caught up by catch-up steps). The periods skipped are counted, the overrun logged."""
        now = asyncio.get_running_loop().time()
        if now <= deadline + self.tick_s:
            return deadline
        self._overruns += 1
        if now - self._overrun_logged > LOG_EVERY_S:
            log.warning("clock overrun: %d late tick(s) since the last report; a step takes %.1f ms, "
                        "the period is %.1f ms", self._overruns, self.policy.step_s * 1e3, self.tick_s * 1e3)
            self._overruns, self._overrun_logged = 0, now
        latest = last_grid_time(now, self.tick_s, self.tick_phase_s)
        if self.metrics:
            self.metrics.ticks_dropped.inc(max(0, round((latest - deadline) / self.tick_s)))
        return latest
