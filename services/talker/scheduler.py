"""The conversation clock: every tick, one batched model step for every session with input.

Threads: the asyncio loop owns every Session and all scheduling decisions; the
engine runs on ONE compute thread (a single-thread executor), so model state is
never touched concurrently. A step's inputs are gathered and the call submitted
with no `await` in between, so a session closed by the loop is either in a
step's batch (and its slot stays pinned until that step returns) or in none.

One period of the clock (tick_s, 80 ms; deadlines on the cell's frame grid,
services/common/frame_grid.py, so other processes can place their work around them):

    deadline ──▶ wait for due frames: up to input_wait_s for sessions whose frame is
                   due but not here yet (below), never past the step's slack
                 main step: every live session with a queued frame, one frame each
                   (+ one prefill piece riding it: host work during the step, GPU work after it)
                 catch-up steps: sessions that still have queued frames, while the
                   measured catch-up step time (plus a tenth of the period) still fits
                   before the next deadline
                 (the tick ends here: its outputs are out)
                 prefill: pieces of the oldest waiting prompt in the period's slack (below)
                 sleep until the next deadline (woken early by new work)

A new session's prompt runs in pieces: begin() and up to prefill_chunk_frames prompt frames of
the oldest waiting session. With prefill_in_step (the default) one piece rides each main step:
the compute thread launches the step's graph, queues the outputs' copy to the host, and then, while
the GPU runs the step, does the piece's host work (begin(), the chunk's launch) and queues the
chunk behind the step; it waits only for the outputs. The tick's outputs are not delayed by the
chunk's GPU time (about 10 ms at full size), which runs in the period's slack, and the piece's host
time (0.5 ms p50, 2.5 ms p99 at 144-160 full-context sessions on the H200) hides behind the step's
45-55 ms of GPU time. begin() must not wait for the GPU for this to hold (engine._reset_slot). Run
alone in the slack, a piece took 34-43 ms (begin() with its host syncs 15-24, the chunk 16-22)
against 15-20 ms of slack, so every opening session made a tick late (bench/results, 2026-11-30,
runs 19-21). (Pieces once rode the step with the outputs waiting for the chunk too: at
128 sessions that stretched the tick each piece rode from 45 to about 80 ms.)

After the tick's outputs, more pieces run in the slack before the next deadline while the
measured piece time (an EMA, plus a tenth of the period) fits. Without prefill_in_step one piece
per period runs even when it does not fit: if the prompt has made no progress for two periods (so
a full clock delays a new session instead of starving it), and at once if the slack the ticks have
been leaving (an EMA) is shorter than a piece.
When no session is live, prefill runs in whole chunks while the clock sleeps.

Frames arrive with jitter. A session whose frames reach the talker near the deadline would
otherwise alternate between no frame at a tick (skipped) and two at the next (one of them a
catch-up step that stretches the tick); on the H200 at 96 full-context sessions 40 % of the
session-ticks were skipped that way (bench/results). So at the deadline the clock waits, up to
input_wait_s, for live sessions that sent a frame within the last 1.5 periods and have none
queued, but only while the step would still end before the next deadline.

A live session without input for a tick is not stepped (no invented audio) and
costs the others nothing: the batch has a fixed shape [slots, 8] and an active mask.
Queued input over the backlog bound is refused (BacklogFull) on that session only.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from services.common.errors import ResourceExhausted
from services.common.frame_grid import last_grid_time, next_grid_time
from services.common.slots import SlotPool

log = logging.getLogger("talker.clock")

LAG_FRAMES = 2  # default catch_up_lag_frames: frames behind from which a tick catches up past its deadline
LATE_START_S = 0.010  # a slow tick that started this late after its deadline counts as "late_start"
# Share of the period kept free beyond the measured step (an EMA) when the clock decides whether
# waiting for input or a catch-up step still ends before the next deadline: a step above its
# average must end in time too. (At 96 sessions on the H200, catch-up steps that "fitted" by the
# bare average ended 1-4 ms past the deadline, tick after tick.)
STEP_HEADROOM = 0.1
_IDLE_ROW = (0,) * 8  # the codes of a slot not stepped this tick (masked out by `active`)


def _ema(average: float | None, sample: float) -> float:
    """The clock's running averages of measured times: the first sample (average None), then 80/20."""
    return sample if average is None else 0.8 * average + 0.2 * sample


class BacklogFull(ResourceExhausted):
    """A session queued more input than the backlog bound: the client is too far ahead of the clock."""

    kind = "backlog_full"


@dataclass
class Ready:
    slot: int
    prefill_frames: int
    prefill_ms: float
    output_delay_frames: int
    seed: int


@dataclass
class Output:
    seq: int
    input_seq: int
    text_token: int
    text_piece: str
    agent_codes: list[int]


END = None  # outbox sentinel: the session ended normally (input closed, all queued frames stepped)


@dataclass(eq=False)
class Session:
    """One stream's place on the clock. Touched only from the event loop."""

    stream_id: str
    slot: int
    voice: str | None
    persona: str
    sampling: object  # engine SamplingParams
    seed: int
    # Ready, then Output..., then END or an exception (the stream's error). Unbounded:
    # at most one Output per accepted input frame, and input is bounded by the backlog.
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    inputs: collections.deque = field(default_factory=collections.deque)  # (seq, codes[8])
    job: object = None  # engine PrefillJob while prefilling
    live: bool = False  # prefill done, Ready sent: the clock steps it
    closed: bool = False  # no more engine work for it
    input_done: bool = False  # the client half-closed: end once the queue is drained
    stepping: bool = False  # a frame of it is in the step running now (its output is still to come)
    failed: bool = False  # an error went to its outbox: no more engine work
    out_seq: int = 0
    prefill_started: float = 0.0
    last_input_at: float = float("-inf")  # loop time of its latest input frame
    pieces_ms: list = field(default_factory=list)  # per prefill piece: (total, begin, launch, device wait) ms


class ConversationClock:
    def __init__(self, engine, pool: SlotPool, *, tick_s: float, max_backlog_frames: int,
                 prefill_chunk_frames: int = 64, input_wait_s: float = 0.0,
                 tick_phase_s: float = 0.0, catch_up_lag_frames: int = LAG_FRAMES, prefill_in_step: bool = True,
                 metrics=None):
        if catch_up_lag_frames < 1:
            raise ValueError(f"catch_up_lag_frames must be >= 1, got {catch_up_lag_frames}")
        self.engine = engine
        self.catch_up_lag_frames = catch_up_lag_frames
        self.tick_phase_s = tick_phase_s  # deadlines at k * tick_s + tick_phase_s (services/common/frame_grid.py)
        self.input_wait_s = input_wait_s
        self.pool = pool
        self.tick_s = tick_s
        self.max_backlog_frames = max_backlog_frames
        self.prefill_chunk_frames = prefill_chunk_frames
        self.prefill_in_step = prefill_in_step  # a prefill piece rides each main step (module doc)
        self.metrics = metrics
        self.sessions: dict[int, Session] = {}  # slot -> session
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="talker-compute")
        self._wake = asyncio.Event()
        self._arrived = asyncio.Event()  # set by push(): a frame arrived (for the input wait)
        self._task: asyncio.Task | None = None
        # Measured step times (EMAs, seconds): the main step (every session with input), which bounds
        # the input wait and a prefill's overrun, and the catch-up step (only the sessions still
        # behind, usually a few: idle rows attend over one KV entry, so it costs a fraction of a
        # main step: 18.6 against 47.6 ms for 4 against 159 rows at 160 full-context slots on the
        # H200, bench/results/prefill-profile-2026-11-29), which decides whether another one fits
        # before the deadline. Until a catch-up step is measured it is assumed to cost a main step.
        self._step_s = 0.0
        self._catch_up_s: float | None = None
        self._prefill_progress = 0.0  # loop time of the last prefill work (starvation guard)
        self._piece_s = 0.0  # measured prefill piece time (EMA, seconds): does one fit in the slack?
        self._slack_s: float | None = None  # time left in the period after a tick (EMA, seconds)
        self._host_out: torch.Tensor | None = None  # pinned buffer the step's outputs are copied into (CUDA)
        self._overruns = 0
        self._overrun_logged = float("-inf")
        self._slow_ticks = 0
        self._slow_logged = float("-inf")
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
        # Let whatever is queued on the compute thread finish, then stop it.
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown, True)

    async def compute(self, fn, *args):
        """Run fn(*args) on the compute thread (FIFO behind any step in flight)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # ---- sessions (called by the servicer) ----------------------------------------------------

    def open(self, stream_id: str, slot: int, voice: str | None, persona: str, sampling, seed: int) -> Session:
        """Register a session on an acquired slot; its prefill runs in the next periods' slack.

        Its outbox gets Ready when the prompt sits in the slot, or the engine's typed
        error (InvalidVoice, InvalidPersona, InvalidSampling) if begin() refuses it.
        """
        s = Session(stream_id=stream_id, slot=slot, voice=voice, persona=persona, sampling=sampling, seed=seed)
        s.prefill_started = time.perf_counter()
        if not self._prefill_waiting():
            self._prefill_progress = asyncio.get_running_loop().time()  # its wait starts now
        self.sessions[slot] = s
        self._wake.set()
        return s

    def push(self, s: Session, seq: int, codes: list[int]) -> None:
        """Queue one input frame (already validated and seq-checked by the caller)."""
        if s.closed:
            return
        if len(s.inputs) >= self.max_backlog_frames:
            if self.metrics:
                self.metrics.backlog_refusals.inc()
            raise BacklogFull(
                f"input backlog over its bound: {len(s.inputs)} frames queued "
                f"(max {self.max_backlog_frames} = {self.max_backlog_frames * self.tick_s:.2f} s); "
                f"send one frame per {self.tick_s * 1000:.0f} ms"
            )
        if s.outbox.qsize() > self.max_backlog_frames:
            if self.metrics:
                self.metrics.backlog_refusals.inc()
            raise BacklogFull(
                f"output backlog over its bound: {s.outbox.qsize()} frames not read by the client "
                f"(max {self.max_backlog_frames}); read the responses as they come"
            )
        s.inputs.append((seq, codes))
        s.last_input_at = asyncio.get_running_loop().time()
        self._arrived.set()

    def input_done(self, s: Session) -> None:
        """The client sent its last frame: end the stream once its queue is stepped."""
        s.input_done = True
        self._maybe_end(s)

    def close(self, s: Session) -> asyncio.Future | None:
        """Take the session off the clock; its slot stays pinned until the engine released it.

        The caller then releases the slot in the pool (StageRuntime.close_stream); the pool
        hands it out again only at the unpin, i.e. once engine.release has run on the compute
        thread, which is after any step still in flight with this slot (FIFO). Idempotent;
        returns the future of the engine release.
        """
        if s.closed:
            return None
        s.closed = True
        s.live = False
        s.inputs.clear()
        if self.sessions.get(s.slot) is s:
            del self.sessions[s.slot]
        self.pool.pin([s.slot])
        fut = asyncio.get_running_loop().run_in_executor(self._executor, self.engine.release, s.slot)
        fut.add_done_callback(lambda f, slot=s.slot: self._released(f, slot))
        return fut

    def _released(self, fut: asyncio.Future, slot: int) -> None:
        self.pool.unpin([slot])
        if not fut.cancelled() and fut.exception() is not None:
            log.error("engine.release(slot %d) failed: %r", slot, fut.exception())

    # ---- the clock --------------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = next_grid_time(loop.time(), self.tick_s, self.tick_phase_s)
        while True:
            try:
                await self._idle_until(deadline)
                started = loop.time()
                if self.metrics:
                    self.metrics.tick_lateness.observe(max(0.0, started - deadline))
                next_deadline = deadline + self.tick_s
                stepped = await self._tick(next_deadline)
                took = loop.time() - deadline  # from the deadline: a tick that started late is that much later
                if self.metrics and stepped:
                    self.metrics.tick_duration.observe(took)
                if stepped and took > self.tick_s:
                    self._note_slow_tick(took, stepped, started - deadline)
                await self._prefill_in_slack(next_deadline)
                self.ticks += 1
                deadline = next_deadline
                if loop.time() > deadline + self.tick_s:
                    # Overloaded (a step longer than a period): tick now, on the latest grid time,
                    # rather than fire a burst of late ticks; queued input is caught up by the backlog logic.
                    self._overruns += 1
                    if loop.time() - self._overrun_logged > 10.0:  # a readable log, not one line per tick
                        log.warning("clock overrun: %d late tick(s) since the last report; a step takes %.1f ms, "
                                    "the period is %.1f ms", self._overruns, self._step_s * 1e3, self.tick_s * 1e3)
                        self._overruns, self._overrun_logged = 0, loop.time()
                    latest = last_grid_time(loop.time(), self.tick_s, self.tick_phase_s)
                    if self.metrics:
                        self.metrics.ticks_dropped.inc(max(0, round((latest - deadline) / self.tick_s)))
                    deadline = latest
            except asyncio.CancelledError:
                raise
            except Exception:
                # A failed step is a bug or a device error: fail the sessions in the batch, keep ticking.
                log.exception("clock tick failed")
                deadline = next_grid_time(loop.time() + 1e-6, self.tick_s, self.tick_phase_s)

    def _note_slow_tick(self, took: float, steps: int, late_start: float) -> None:
        """A tick longer than the period: count it by what it held (metrics.SLOW_CAUSES) and say so
        (at most one line per 10 s, with a count)."""
        if self.metrics:
            cause = "catch_up" if steps > 1 else "late_start" if late_start > LATE_START_S else "wait_and_step"
            self.metrics.slow_ticks.labels(cause=cause).inc()
        self._slow_ticks += 1
        now = time.monotonic()
        if now - self._slow_logged < 10.0:
            return
        log.warning("slow tick: %.1f ms for %d step(s) from its deadline (step EMA %.1f ms, prefill piece EMA "
                    "%.1f ms, slack after a tick EMA %.1f ms, %d live sessions); %d slow tick(s) since the last "
                    "report", took * 1e3, steps, self._step_s * 1e3, self._piece_s * 1e3, (self._slack_s or 0.0) * 1e3,
                    sum(s.live for s in self.sessions.values()), self._slow_ticks)
        self._slow_ticks, self._slow_logged = 0, now

    async def _idle_until(self, deadline: float) -> None:
        """Until `deadline`: sleep (woken by new work); with no live session, whose tick a chunk
        could make late, prefill in whole chunks meanwhile."""
        loop = asyncio.get_running_loop()
        while True:
            left = deadline - loop.time()
            if left <= 0:
                return
            if not any(s.live for s in self.sessions.values()) and await self._prefill_idle():
                continue
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=left)
            except TimeoutError:
                return

    async def _tick(self, period_end: float) -> int:
        """The main step and the catch-up steps of one period; returns the number of steps run."""
        loop = asyncio.get_running_loop()
        live = [s for s in self.sessions.values() if s.live]
        await self._wait_for_due_frames(live, period_end)
        live = [s for s in live if s.live]  # one may have ended while we waited
        if self.metrics:
            self.metrics.frames_skipped.inc(sum(1 for s in live if not s.inputs))
        batch = [s for s in live if s.inputs]
        if not batch:
            return 0
        # How far behind each session is: the frames already here besides the one the main step
        # takes. Not frames that arrive during the main step: those are the next tick's, on time.
        lag = max(len(s.inputs) for s in batch) - 1
        behind_before = sum(1 for s in batch if len(s.inputs) > 1)
        await self._step(batch, catch_up=False)
        steps = 1
        if self.metrics:
            self.metrics.sessions_behind.observe(behind_before)
        # Catch-up: sessions that still have queued frames (a late client, a burst, a late tick)
        # get more batched steps while the measured step time fits in the period. When a step
        # takes more than half the period none would ever fit, and every late tick would leave
        # its sessions a frame further behind for good: so a session catch_up_lag_frames or more
        # behind (TalkerConfig: the trade between latency and late ticks) gets one catch-up step
        # per tick even past the deadline (the next tick starts that much late, and the backlog
        # shrinks by a frame per tick instead of never). A frame that arrived during the main step
        # does not make its session lag: counting it made every session one frame behind (its
        # frames reaching the talker at a jittery place in the period) force a catch-up step as
        # soon as its next frame came in mid-step. (At 144-160 full-context sessions on the H200
        # most late ticks were such forced catch-ups, 105-150 ms long: 47-121 per 120 s before
        # this rule, 0-10 after it; bench/results 2026-11-30, runs 15-19.)
        while True:
            behind = [s for s in self.sessions.values() if s.live and s.inputs]
            if not behind:
                return steps
            catch_up_s = self._step_s if self._catch_up_s is None else self._catch_up_s
            fits = loop.time() + catch_up_s + STEP_HEADROOM * self.tick_s <= period_end
            lagging = steps == 1 and lag >= self.catch_up_lag_frames
            if not (fits or lagging):
                return steps
            if not fits and self.metrics:
                self.metrics.catch_up_forced.inc()
            await self._step(behind, catch_up=True)
            steps += 1

    async def _wait_for_due_frames(self, live: list[Session], period_end: float) -> float:
        """Up to input_wait_s for the frames of sessions that are talking (a frame within the last
        1.5 periods) but have none queued; never past the point where the step (its measured time
        plus a tenth of the period) would end after period_end. Returns the seconds waited (module doc: why)."""
        if self.input_wait_s <= 0:
            return 0.0
        loop = asyncio.get_running_loop()
        start = loop.time()
        limit = min(start + self.input_wait_s, period_end - self._step_s - STEP_HEADROOM * self.tick_s)
        talking_since = start - 1.5 * self.tick_s
        waited = False
        while True:
            due = any(s.live and not s.inputs and not s.input_done and s.last_input_at >= talking_since for s in live)
            left = limit - loop.time()
            if not due or left <= 0:
                break
            self._arrived.clear()
            waited = True
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except TimeoutError:
                break
        if not waited:
            return 0.0
        seconds = loop.time() - start
        if self.metrics:
            self.metrics.input_wait.observe(seconds)
        return seconds

    async def _step(self, batch: list[Session], catch_up: bool) -> None:
        n = self.engine.num_slots
        # Plain lists, then one tensor each: a torch call per session cost 3 ms per tick at 160.
        rows, act = [_IDLE_ROW] * n, [False] * n
        taken: list[tuple[Session, int]] = []
        for s in batch:
            seq, frame = s.inputs.popleft()
            rows[s.slot], act[s.slot] = frame, True
            s.stepping = True
            taken.append((s, seq))
        codes, active = torch.tensor(rows, dtype=torch.long), torch.tensor(act, dtype=torch.bool)
        slots = [s.slot for s, _ in taken]
        # A waiting prompt's next piece rides the main step (module doc). No await between picking
        # it and submitting the step: a close() can only queue its release behind this step.
        rider = None if catch_up or not self.prefill_in_step else self._prefill_candidate()
        piece = (rider.job, self._begin_args(rider)) if rider is not None else None
        self.pool.pin(slots)
        t0 = time.perf_counter()
        try:
            result = await self.compute(self._step_on_compute_thread, codes, active, t0, piece)
        except Exception as e:
            for s, _ in taken:
                self.fail(s, e)
            raise
        finally:
            self.pool.unpin(slots)
            for s, _ in taken:
                s.stepping = False
        dt = time.perf_counter() - t0
        if catch_up:
            self._catch_up_s = _ema(self._catch_up_s, dt)
        else:
            self._step_s = _ema(self._step_s or None, dt)
        self.steps += 1
        if self.metrics:
            self.metrics.observe_step(dt, len(taken))
            self.metrics.frames_advanced.inc(len(taken))
            if catch_up:
                self.metrics.catch_up_steps.inc()
        tokens, agent, has_out, pieces, device_s, parts, ridden = result
        if rider is not None:
            self._record_piece(rider, ridden, "step")
        if self.metrics:
            if device_s is not None:
                self.metrics.step_device.observe(device_s)
            for part, seconds in parts.items():
                self.metrics.step_part.labels(part=part).observe(seconds)
            # The compute thread finished at parts' end; the loop resumed this coroutine only now.
            self.metrics.step_part.labels(part="loop_resume").observe(max(0.0, time.perf_counter() - t0 - sum(parts.values())))
        for s, seq in taken:
            if s.closed:
                continue  # closed while its step ran: the output has nowhere to go
            i = s.slot
            if has_out[i]:
                s.outbox.put_nowait(Output(s.out_seq, seq, tokens[i], pieces[i], agent[i]))
                s.out_seq += 1
            self._maybe_end(s)

    def _step_on_compute_thread(self, codes: torch.Tensor, active: torch.Tensor, submitted: float,
                                piece: tuple | None = None):
        """One engine step: its outputs as host lists, its GPU time (None off a CUDA graph), the
        seconds spent in each part of it since `submitted` (metrics.STEP_PARTS) and, with `piece`
        (job, begin args), that prefill piece's _prefill_piece result: its host work runs while
        the GPU runs the step, its GPU work queues behind the step's, and only the step's outputs
        are waited for (module doc)."""
        t0 = time.perf_counter()
        r = self.engine.step(codes, active)
        packed = torch.cat([r.text_tokens[:, None], r.agent_codes, r.has_output[:, None].long()], dim=1)
        host, copied = self._queue_to_host(packed)
        t1 = time.perf_counter()
        ridden = self._prefill_piece(*piece, wait=False) if piece is not None else None
        t_piece = time.perf_counter()
        if copied is not None:
            copied.synchronize()
        t2 = time.perf_counter()
        device_s = self.engine.last_step_device_s()
        rows = host.tolist()
        tokens = [row[0] for row in rows]
        agent = [row[1:-1] for row in rows]
        has_out = [bool(row[-1]) for row in rows]
        act = active.tolist()
        pieces = [self.engine.text_piece(t) if act[i] and has_out[i] else "" for i, t in enumerate(tokens)]
        parts = {"dispatch": t0 - submitted, "launch": t1 - t0, "prefill": t_piece - t1, "gpu_wait": t2 - t_piece,
                 "outputs": time.perf_counter() - t2}
        return tokens, agent, has_out, pieces, device_s, parts, ridden

    def _queue_to_host(self, t: torch.Tensor) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
        """t's copy into host memory, queued behind the GPU's work, and the event that marks it
        done (None: t is already on the host). Work queued after it does not delay it."""
        if t.device.type != "cuda":
            return t, None
        if self._host_out is None or self._host_out.shape != t.shape or self._host_out.dtype != t.dtype:
            self._host_out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self._host_out.copy_(t, non_blocking=True)  # read only after the event, before the next step's copy
        done = torch.cuda.Event()
        done.record()
        return self._host_out, done

    # ---- prefill ----------------------------------------------------------------------------

    def _prefill_waiting(self) -> bool:
        return any(not s.live and not s.closed and not s.failed for s in self.sessions.values())

    def _prefill_candidate(self) -> Session | None:
        """The oldest session still waiting for its prompt (sessions are kept in arrival order)."""
        return next((s for s in self.sessions.values() if not s.live and not s.closed and not s.failed), None)

    @staticmethod
    def _begin_args(s: Session) -> tuple:
        return s.slot, s.voice, s.persona, s.sampling

    async def _prefill_in_slack(self, period_end: float) -> None:
        """Prefill pieces after a tick, while one fits before period_end. Without prefill_in_step
        one that does not fit runs anyway, one per period, when the waiting prompt has made no
        progress for two periods or when the slack the ticks have been leaving would not hold a
        piece (module doc)."""
        loop = asyncio.get_running_loop()
        slack = period_end - loop.time()
        self._slack_s = _ema(self._slack_s, slack)
        forced = False
        while self._prefill_waiting():
            if not self._piece_fits(loop.time(), period_end):
                # Riding the main step, a prompt makes progress every tick: no piece is forced here.
                starving = loop.time() - self._prefill_progress > 2 * self.tick_s
                if forced or self.prefill_in_step or not (starving or self._slack_too_short()):
                    return
                forced = True
            await self._prefill_idle()

    def _slack_too_short(self) -> bool:
        """Whether the slack after a tick (its EMA) is too short for a piece: waiting for one that
        fits would only delay the new session, and the tick after the piece is late either way."""
        if self._piece_s == 0.0 or self._slack_s is None:
            return False
        return self._slack_s < self._piece_s + STEP_HEADROOM * self.tick_s

    def _piece_fits(self, now: float, period_end: float) -> bool:
        """Whether a piece started now (its measured time plus the headroom) ends before period_end."""
        return now + self._piece_s + STEP_HEADROOM * self.tick_s <= period_end

    def _prefill_piece(self, job, begin_args: tuple, wait: bool = True):
        """On the compute thread: begin() if the session has no job yet, then one chunk of up to
        prefill_chunk_frames, waited for on the GPU if `wait` (its time is what the slack must
        hold; a piece riding a step is not waited for). Returns (job, done, error, seconds) with
        seconds = (total, begin, chunk launch, device wait): what a piece costs, split where the
        host and the GPU each spend it. Errors are the session's, not the clock's."""
        t0 = time.perf_counter()
        t_begin = t_launch = t0
        try:
            if job is None:
                job = self.engine.begin(*begin_args)
            t_begin = time.perf_counter()
            done = job.done or job.run(self.prefill_chunk_frames)
            t_launch = time.perf_counter()
            if wait and self.engine.device.type == "cuda":
                torch.cuda.current_stream(self.engine.device).synchronize()
            error = None
        except Exception as e:  # a refused begin (bad voice, persona, sampling) or a failed chunk
            done, error = False, e
        t = time.perf_counter()
        return job, done, error, (t - t0, t_begin - t0, max(0.0, t_launch - t_begin), max(0.0, t - max(t_launch, t_begin)))

    async def _prefill_idle(self) -> bool:
        """One prefill piece on its own; False if nobody waits for one."""
        s = self._prefill_candidate()
        if s is None:
            return False
        self._record_piece(s, await self.compute(self._prefill_piece, s.job, self._begin_args(s)), "alone")
        return True

    def _record_piece(self, s: Session, result: tuple, where: str) -> None:
        """Account for one piece of s's prompt (_prefill_piece's result), run on its own in the slack
        or while no session is live ("alone": its time, GPU included, is what a slack must hold) or
        riding a step ("step": its host time only), then act on its outcome."""
        job, done, error, split = result
        s.pieces_ms.append(tuple(x * 1e3 for x in split))
        if self.metrics:
            self.metrics.prefill_pieces.labels(where=where).inc()
            if where == "alone":
                self.metrics.prefill_piece.observe(split[0])
        if where == "alone":
            self._piece_s = _ema(self._piece_s or None, split[0])
        self._after_prefill(s, job, done, error)

    def _after_prefill(self, s: Session, job, done: bool, error: BaseException | None) -> None:
        self._prefill_progress = asyncio.get_running_loop().time()
        if error is not None:
            self.fail(s, error)
            return
        s.job = job
        if done and not s.closed and not s.failed:
            self._go_live(s)

    def _go_live(self, s: Session) -> None:
        s.live = True
        ms = (time.perf_counter() - s.prefill_started) * 1e3
        if self.metrics:
            self.metrics.prefill_duration.observe(ms / 1e3)
        log.info("session %s live in slot %d: %d prompt frames prefilled in %.1f ms (pieces, ms: %s)",
                 s.stream_id, s.slot, s.job.total_frames, ms,
                 " + ".join(f"{t:.1f} [begin {b:.1f}, launch {c:.1f}, device wait {w:.1f}]" for t, b, c, w in s.pieces_ms))
        s.outbox.put_nowait(Ready(s.slot, s.job.total_frames, ms, s.job.output_delay_frames, s.seed))
        s.job = None
        self._maybe_end(s)

    # ---- endings ----------------------------------------------------------------------------

    def _maybe_end(self, s: Session) -> None:
        if s.input_done and s.live and not s.inputs and not s.stepping and not s.closed:
            s.outbox.put_nowait(END)
            s.live = False  # nothing more to step; the servicer closes it

    def fail(self, s: Session, e: BaseException) -> None:
        if not s.closed and not s.failed:
            s.failed = True
            s.live = False
            s.outbox.put_nowait(e)
