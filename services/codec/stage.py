"""The batching and stream logic shared by the Mimi encoder and decoder services.

CodecBatcher: frames from many streams are stepped together. Each stream has at
most one frame pending (its handler waits for the answer before reading the
next frame), so a batch is simply "every slot with a pending frame". The loop
takes everything pending, pins those slots (slots.SlotPool), runs one
`step(x[slots, ...], active[slots])` in a single worker thread so the event loop
keeps serving reads, writes and health checks, unpins, and hands each stream its
row. Resets run on the same single worker thread, so a reset can never overlap
a step that touches the codec state.

Before serving, `CodecService.start()` runs `CodecBatcher.warmup()`: one step with every slot
inactive on the same worker thread, which changes no codec state (inactive slots keep their
state bit for bit) but captures the CUDA graph (cuda_graph) and does the lazy CUDA set-up
(cuBLAS handles, cached centroids) up front instead of in the first session's first frame;
then, on CUDA, synchronize and empty_cache hand back the cached blocks of the capture's eager
warm-up steps.

CodecStream.serve: one bidirectional stream, the same for both services:
open -> slot (reset) -> `opened`; then per frame: seq check, payload check,
batched step, one response with the same seq; end/cancel/error -> slot released
(confirmed free only once no in-flight step touches it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import grpc
import torch

from services.common.config import option
from services.common.errors import Internal, InvalidArgument, StageError
from services.common.link import serve_link
from services.common.process import configure_process
from services.common.stage_config import StageConfig
from services.common.stage_server import StageRpcs, StageRuntime, StageServer, freeze_startup_heap

StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x[slots,...], active[slots]) -> out[slots,...]


class CodecBatcher:
    def __init__(
        self,
        runtime: StageRuntime,
        step: StepFn,
        reset: Callable[[int], None],
        in_shape: tuple[int, ...],
        in_dtype: torch.dtype,
        batch_wait_s: float = 0.0,
    ):
        self.runtime = runtime
        self.pool = runtime.pool
        self.metrics = runtime.metrics
        self._step, self._reset = step, reset
        self.in_shape, self.in_dtype = in_shape, in_dtype
        self.batch_wait_s = batch_wait_s
        self._pending: dict[int, tuple[torch.Tensor, asyncio.Future]] = {}
        self._wake = asyncio.Event()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{runtime.stage}-step")
        self._task: asyncio.Task | None = None
        self.steps = 0

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._worker.shutdown(wait=True)

    async def reset(self, slot: int) -> None:
        """Reset a freshly acquired slot's codec state (on the worker, never during a step)."""
        self.pool.pin([slot])
        try:
            await asyncio.get_running_loop().run_in_executor(self._worker, self._reset, slot)
        finally:
            self.pool.unpin([slot])

    async def submit(self, slot: int, x: torch.Tensor) -> torch.Tensor:
        """Queue one frame of `slot` for the next batch; returns its output row."""
        if slot in self._pending:
            raise Internal(f"slot {slot} already has a frame pending")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._pending[slot] = (x, fut)
        self._wake.set()
        return await fut

    async def warmup(self, device: str | torch.device = "cpu") -> float:
        """One step with every slot inactive, on the worker thread (before `start`); returns its seconds.

        No slot's state changes. On CUDA it captures the step's graph when the codec uses one, then
        synchronizes and empties the allocator cache so that only what serving holds stays reserved."""
        dev = torch.device(device)

        def run() -> None:
            x = torch.zeros((self.pool.total, *self.in_shape), dtype=self.in_dtype)
            active = torch.zeros(self.pool.total, dtype=torch.bool)
            self._step(x, active)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
                torch.cuda.empty_cache()

        t0 = time.perf_counter()
        await asyncio.get_running_loop().run_in_executor(self._worker, run)
        return time.perf_counter() - t0

    def discard(self, slot: int) -> None:
        """Drop a pending (not yet stepped) frame of a stream that ended."""
        item = self._pending.pop(slot, None)
        if item is not None and not item[1].done():
            item[1].cancel()

    async def _wait_until(self, loop, at: float, done: Callable[[], bool]) -> None:
        """Until loop time `at`, or earlier once done() holds (checked whenever a frame comes)."""
        while not done():
            left = at - loop.time()
            if left <= 0:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except asyncio.TimeoutError:
                return

    async def _gather(self, loop) -> None:
        """Wait up to batch_wait_s for more frames, but not once every live stream has one pending.

        A codec step costs about the same for 1 or all slots (it runs the whole fixed-shape batch),
        so a short wait that lets streams of a different phase join saves whole steps. The wait
        counts from now, not from the oldest pending frame: that made more encoder steps beside the
        talker's and late ticks (bench/RESULTS.md, front door)."""
        await self._wait_until(loop, loop.time() + self.batch_wait_s,
                               lambda: len(self._pending) >= len(self.runtime.streams))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self.batch_wait_s > 0:
                await self._gather(loop)
            batch, self._pending = self._pending, {}
            batch = {s: item for s, item in batch.items() if not item[1].done()}
            if not batch:
                continue
            slots = sorted(batch)
            self.pool.pin(slots)
            t0 = time.perf_counter()
            try:
                x = torch.zeros((self.pool.total, *self.in_shape), dtype=self.in_dtype)
                active = torch.zeros(self.pool.total, dtype=torch.bool)
                index = torch.tensor(slots)
                # a few calls, not two per stream
                x[index] = torch.stack([batch[s][0] for s in slots]).to(self.in_dtype)
                active[index] = True
                out = await loop.run_in_executor(self._worker, self._step, x, active)
            except Exception as e:  # a failed step ends the streams in it, not the service
                self.runtime.log.exception("step failed for slots %s", slots)
                for s in slots:
                    if not batch[s][1].done():
                        batch[s][1].set_exception(Internal(
                            f"{self.runtime.stage} step failed: {type(e).__name__}: {e}", kind="step_failed"))
                continue
            finally:
                self.pool.unpin(slots)
            self.steps += 1
            self.metrics.observe_step(time.perf_counter() - t0, len(slots))
            for s in slots:
                if not batch[s][1].done():
                    batch[s][1].set_result(out[s])


class CodecStream:
    """Serves Encode or Decode streams; the service supplies how to read and write its messages."""

    def __init__(
        self,
        runtime: StageRuntime,
        batcher: CodecBatcher,
        *,
        frame_field: str,
        parse_frame: Callable[[Any], torch.Tensor],
        opened: Callable[[int], Any],
        answer: Callable[[int, torch.Tensor], Any],
    ):
        self.runtime = runtime
        self.batcher = batcher
        self.frame_field = frame_field  # "frame" in both EncodeRequest and DecodeRequest
        self.parse_frame = parse_frame  # frame message -> input tensor; raises InvalidArgument
        self.opened = opened  # slot -> response
        self.answer = answer  # (seq, output row) -> response

    async def serve(self, context: grpc.aio.ServicerContext) -> None:
        runtime, handle, reason, stream_id = self.runtime, None, "error", "-"
        try:
            first = await runtime.first_message(context)
            if first is grpc.aio.EOF:
                return
            if first.WhichOneof("kind") != "open":
                raise InvalidArgument("the first message of a stream must be `open` (with the stream id)",
                                      kind="not_open")
            stream_id = first.open.stream_id
            handle = runtime.open_stream(stream_id)
            await self.batcher.reset(handle.slot)
            await context.write(self.opened(handle.slot))
            while True:
                req = await handle.read(context)
                if req is None:
                    reason = "ok"
                    return
                if req.WhichOneof("kind") != self.frame_field:
                    raise InvalidArgument(f"stream {stream_id!r} is already open; expected a `{self.frame_field}`",
                                          kind="not_frame")
                frame = getattr(req, self.frame_field)
                handle.seq.check(frame.seq)  # refused frames never reach the codec
                x = self.parse_frame(frame)
                handle.seq.advance()
                runtime.metrics.frames_in.inc()
                out = await self.batcher.submit(handle.slot, x)
                await context.write(self.answer(frame.seq, out))
                runtime.metrics.frames_out.inc()
                handle.frames += 1
        except asyncio.CancelledError:
            reason = "cancelled"
            raise
        except StageError as e:
            reason = "drained" if e.kind == "drained" else "error"
            self._close(handle, reason)  # free the slot before telling the client
            await runtime.fail(context, e, stream_id)
        except grpc.aio.BaseError:  # an abort in flight, or the RPC is already gone: nothing to tell
            raise
        except Exception as e:  # a bug: this stream gets INTERNAL, the service goes on
            runtime.log.exception("stream=%s failed", stream_id)
            self._close(handle, "error")
            await runtime.fail(context, Internal(f"{runtime.stage} failed: {type(e).__name__}: {e}"), stream_id)
        finally:
            self._close(handle, reason)

    def _close(self, handle, reason: str) -> None:
        if handle is not None:
            self.batcher.discard(handle.slot)
            self.runtime.close_stream(handle, reason)


@dataclass(frozen=True)
class CodecServiceConfig(StageConfig):
    """What both codec services take (each service's config.py sets its ports and prefix)."""

    # Never waits once every live stream has a frame pending: fewer, fuller steps for a little latency.
    batch_wait_ms: float = option(5.0, help="after the first pending frame, wait up to this long for other "
                                            "streams' frames")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.batch_wait_ms < 0:
            raise ValueError(f"batch_wait_ms must be >= 0, got {self.batch_wait_ms}")


def load_mimi(cfg: CodecServiceConfig, keep: str | None = None):
    """The checkpoint's Mimi model (eval mode, on cfg.device) and its MimiConfig.

    keep="encode" | "decode": the whole file is still checked strictly, then only that half is
    kept (MimiModel.keep_only) before the model moves to the device."""
    from services.common.checkpoint import CheckpointPaths
    from services.codec.mimi import MimiConfig, MimiModel

    if not cfg.checkpoint:
        raise ValueError("a codec service needs a checkpoint directory (--checkpoint)")
    paths = CheckpointPaths.open(cfg.checkpoint, require=("mimi",))
    section = paths.serve_config().get("mimi")
    mimi_cfg = MimiConfig.from_dict(section) if section else MimiConfig.full()
    model = MimiModel.load(paths.mimi, mimi_cfg, device=cfg.device, dtype=torch.float32, keep=keep)
    return model, mimi_cfg


class CodecServicer(StageRpcs):
    """Base of the Encoder/Decoder servicers: GetCapacity, Drain, and the bodies of the stream RPC
    (`stream.serve`) and of the Link RPC (`serve_link`)."""

    def __init__(self, runtime: StageRuntime, stream: "CodecStream"):
        self.runtime = runtime
        self.stream = stream

    async def serve_link(self, context, response_cls) -> None:
        await serve_link(self.runtime, context, response_cls, self.stream.serve)


class CodecService:
    """One codec service: runtime + batcher + stream logic + stage server. `await start()`, `await stop()`."""

    def __init__(
        self,
        stage: str,
        cfg: CodecServiceConfig,
        *,
        step: StepFn,
        reset: Callable[[int], None],
        in_shape: tuple[int, ...],
        in_dtype: torch.dtype,
        parse_frame: Callable[[Any], torch.Tensor],
        opened: Callable[[int], Any],
        answer: Callable[[int, torch.Tensor], Any],
        servicer_cls: type[CodecServicer],
        add_servicer: Callable[[Any, grpc.aio.Server], None],
        service_name: str,
        codec: Any = None,
    ):
        self.cfg = cfg
        self.codec = codec  # the streamer behind `step` (for tests and debugging), if given
        self.runtime = StageRuntime(stage, cfg.slots, stream_idle_timeout_s=cfg.stream_idle_timeout_s,
                                    first_message_timeout_s=cfg.first_message_timeout_s)
        self.runtime.metrics.track_gpu(cfg.device)  # the duplex_stage_gpu_memory_* gauges (CUDA only)
        self.warmup_s: float | None = None
        self.batcher = CodecBatcher(self.runtime, step, reset, in_shape, in_dtype,
                                    batch_wait_s=cfg.batch_wait_ms / 1000)
        self.stream = CodecStream(self.runtime, self.batcher, frame_field="frame", parse_frame=parse_frame,
                                  opened=opened, answer=answer)
        servicer = servicer_cls(self.runtime, self.stream)
        self.server = StageServer(
            self.runtime, register=lambda server: add_servicer(servicer, server), service_names=[service_name],
            host=cfg.host, port=cfg.port, metrics_port=None if cfg.metrics_port < 0 else cfg.metrics_port,
            drain_deadline_s=cfg.drain_deadline_s,
        )

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def metrics_port(self) -> int | None:
        return self.server.metrics_port

    async def start(self) -> "CodecService":
        if self.warmup_s is None:  # before the port opens: no session waits for a graph capture
            self.warmup_s = await self.batcher.warmup(self.cfg.device)
            self.runtime.log.info("warmed up in %.1f ms (device=%s, cuda_graph=%s%s)", 1000 * self.warmup_s,
                                  self.cfg.device, self.cfg.cuda_graph, _cuda_memory(self.cfg.device))
        self.batcher.start()
        await self.server.start()
        return self

    async def stop(self) -> None:
        await self.server.stop(grace=0.5)
        await self.batcher.stop()

    async def serve_until_signal(self) -> None:
        """The process's life: start, serve until SIGTERM/SIGINT (then drain), stop."""
        await self.start()
        freeze_startup_heap()
        self.runtime.metrics.track_gc()
        try:
            await self.server.serve_until_signal()
        finally:
            await self.batcher.stop()


def _cuda_memory(device: str) -> str:
    dev = torch.device(device)
    if dev.type != "cuda":
        return ""
    return (f", allocated {torch.cuda.memory_allocated(dev) / 2**30:.2f} GiB,"
            f" reserved {torch.cuda.memory_reserved(dev) / 2**30:.2f} GiB,"
            f" device free {torch.cuda.mem_get_info(dev)[0] / 2**30:.2f} GiB")


def inference_step(step: StepFn, device: str) -> StepFn:
    """Wrap a codec's batched step for the worker thread: inputs to `device`, no autograd, output back on CPU."""

    @torch.no_grad()
    def run(x: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        return step(x.to(device), active.to(device)).cpu()

    return run


def run_main(service_factory, cfg: CodecServiceConfig) -> None:
    """Process entry point shared by `python -m services.encoder` / `services.decoder` (cfg from its load())."""
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    configure_process(cfg.threads, cfg.gil_switch_ms)

    async def main() -> None:
        service = service_factory(cfg)
        await service.serve_until_signal()

    asyncio.run(main())
