"""The talker's compute thread: every engine call runs on it, one at a time, in submission order.

Model state is never touched concurrently: the engine runs on ONE thread (a single-thread
executor), and the event loop only submits work to it. A session's fields are read on the loop,
when its work is submitted, never on the compute thread.

A prefill piece can ride a main step: the compute thread launches the step, queues the outputs'
copy to pinned host memory behind it, then does the piece's host work (begin(), the chunk's
launch) while the GPU runs the step, and waits only for the outputs. The piece's GPU work queues
behind the step, in the period's slack, and does not delay the tick's outputs; for its host work
to hide behind the step, begin() must not wait for the GPU (engine._reset_slot).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from services.talker.engine import NO_FORCE, NO_FRAME, StepResult, TextForcing
from services.talker.session import Session

IDLE_ROW = (0,) * 8  # the codes of a slot not stepped (masked out by `active`)
NO_FRAME_ROW = (NO_FRAME,) * 8  # a step-ahead engine's step 0: no user frame


@dataclass
class PieceResult:
    """One prefill piece of a session's prompt: begin() if it had no job yet, then one chunk."""

    job: object  # the session's engine PrefillJob (None if begin() refused)
    done: bool  # the whole prompt is in the slot
    error: BaseException | None  # the session's error: a refused begin() or a failed chunk
    total_s: float
    begin_s: float
    launch_s: float  # the chunk's launch
    device_wait_s: float  # waiting for the GPU (0 for a piece riding a step)
    voice_frames: int = 0  # positions of a new voice's KV prefix its chunk computed (engine._VoicePrefix)

    @property
    def ms(self) -> tuple[float, float, float, float]:
        return tuple(x * 1e3 for x in (self.total_s, self.begin_s, self.launch_s, self.device_wait_s))


@dataclass
class StepOutputs:
    """One batched step's outputs on the host, indexed by slot, and what the step took."""

    tokens: list[int]
    agent_codes: list[list[int]]
    has_output: list[bool]
    text: list[str]  # the text piece of each stepped slot's token ("" without an output)
    next_text: list[int]  # the text token each stepped slot's step wrote (-1: not stepped); say.py follows it
    device_s: float | None  # GPU time (None off a CUDA graph)
    parts: dict[str, float]  # seconds in each part on the compute thread (metrics.STEP_PARTS)
    piece: PieceResult | None  # the prefill piece that rode the step
    wall_s: float = 0.0  # from submission until the loop had the outputs


class StepRunner:
    def __init__(self, engine, prefill_chunk_frames: int):
        self.engine = engine
        self.prefill_chunk_frames = prefill_chunk_frames
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="talker-compute")
        self._host_out: torch.Tensor | None = None  # pinned buffer the step's outputs are copied into (CUDA)

    async def call(self, fn, *args):
        """fn(*args) on the compute thread, behind any work already submitted."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def release(self, slot: int) -> asyncio.Future:
        """engine.release(slot), behind any step still in flight with the slot."""
        return asyncio.get_running_loop().run_in_executor(self._executor, self.engine.release, slot)

    async def shutdown(self) -> None:
        """Let the work already submitted finish, then stop the thread."""
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown, True)

    async def step(self, frames: list[tuple[int, list[int]]], rider: Session | None = None,
                   rows: int | None = None, forced: dict | None = None) -> StepOutputs:
        """One engine step over (slot, codes) pairs: a step of every slot, the others idle, or with
        `rows` a step of that many rows (engine.step_rows: a catch-up); with `rider`, one piece of its
        prompt rides the step; `forced`: slot -> say.Force, the text forced for stepped slots.
        Submitted before the first await."""
        # Plain lists, then one tensor each: a torch call per session costs milliseconds per tick.
        if rows is None:
            n = self.engine.num_slots
            codes, act = [IDLE_ROW] * n, [False] * n
            for slot, c in frames:
                codes[slot], act[slot] = NO_FRAME_ROW if c is None else c, True
            codes_t, active = torch.tensor(codes, dtype=torch.long), torch.tensor(act, dtype=torch.bool)
            run = functools.partial(self.engine.step, codes_t, active, **_forcing(forced, range(n)))
        else:
            slots = [slot for slot, _ in frames]
            codes_t = torch.tensor([NO_FRAME_ROW if c is None else c for _, c in frames], dtype=torch.long)
            run = functools.partial(self.engine.step_rows, slots, codes_t, rows, **_forcing(forced, slots))
        piece = (rider.job, rider.begin_args()) if rider is not None else None
        t0 = time.perf_counter()
        out = await self.call(self._step, run, t0, piece)
        out.wall_s = time.perf_counter() - t0
        return out

    async def prefill(self, s: Session) -> PieceResult:
        """One piece of s's prompt alone, waited for on the GPU: its time is what a slack must hold."""
        return await self.call(self._piece, s.job, s.begin_args(), True)

    # ---- on the compute thread ---------------------------------------------------------------

    def _step(self, run: Callable[[], StepResult], submitted: float, piece: tuple | None) -> StepOutputs:
        t0 = time.perf_counter()
        r = run()
        packed = torch.cat([r.text_tokens[:, None], r.agent_codes, r.next_text[:, None],
                            r.has_output[:, None].long()], dim=1)
        host, copied = self._queue_to_host(packed)
        t1 = time.perf_counter()
        ridden = self._piece(*piece, wait=False) if piece is not None else None
        t_piece = time.perf_counter()
        if copied is not None:
            copied.synchronize()
        t2 = time.perf_counter()
        device_s = self.engine.last_step_device_s()
        rows = host.tolist()
        tokens = [row[0] for row in rows]
        has_out = [bool(row[-1]) for row in rows]  # only a stepped slot has an output
        text = [self.engine.text_piece(t) if has_out[i] else "" for i, t in enumerate(tokens)]
        parts = {"dispatch": t0 - submitted, "launch": t1 - t0, "prefill": t_piece - t1, "gpu_wait": t2 - t_piece,
                 "outputs": time.perf_counter() - t2}
        return StepOutputs(tokens, [row[1:-2] for row in rows], has_out, text, [row[-2] for row in rows], device_s,
                           parts, ridden)

    def _queue_to_host(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
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

    def _piece(self, job, begin_args: tuple, wait: bool) -> PieceResult:
        """begin() if there is no job yet, then one chunk of up to prefill_chunk_frames, waited for
        on the GPU if `wait`. Errors are the session's, not the clock's."""
        t0 = time.perf_counter()
        t_begin = t_launch = t0
        voice_frames = 0
        try:
            if job is None:
                job = self.engine.begin(*begin_args)
            t_begin = time.perf_counter()
            done = job.done
            if not done:
                done, voice_frames = job.run(self.prefill_chunk_frames), job.voice_frames_run
            t_launch = time.perf_counter()
            if wait and self.engine.device.type == "cuda":
                torch.cuda.current_stream(self.engine.device).synchronize()
            error = None
        except Exception as e:  # a refused begin (bad voice, persona, sampling) or a failed chunk
            done, error = False, e
        t = time.perf_counter()
        return PieceResult(job, done, error, t - t0, t_begin - t0, max(0.0, t_launch - t_begin),
                           max(0.0, t - max(t_launch, t_begin)), voice_frames)


def _forcing(forced: dict | None, slots) -> dict:
    """The engine call's `forced` argument for rows `slots` (slot -> say.Force), or no argument when
    nothing is forced: an engine wrapper that predates forcing (the tests' shaped engines) still steps."""
    if not forced:
        return {}
    tokens, gated = [NO_FORCE] * len(slots), [False] * len(slots)
    for i, slot in enumerate(slots):
        if (f := forced.get(slot)) is not None:
            tokens[i], gated[i] = f.token, f.gated
    return {"forced": TextForcing(torch.tensor(tokens, dtype=torch.long), torch.tensor(gated, dtype=torch.bool))}
