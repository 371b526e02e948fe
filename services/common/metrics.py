"""The standard Prometheus metrics of a stage service (encoder, talker, decoder).

Every stage exports the same names with a `stage` label, so one dashboard
covers all three:

    duplex_stage_step_seconds{stage}            histogram: wall time of one batched step
    duplex_stage_batch_size{stage}              histogram: streams stepped together
    duplex_stage_active_streams{stage}          gauge: streams open now
    duplex_stage_free_slots{stage}              gauge: slots a new stream could take
    duplex_stage_frames_in_total{stage}         counter: frames accepted from clients
    duplex_stage_frames_out_total{stage}        counter: frames sent to clients
    duplex_stage_streams_opened_total{stage}    counter
    duplex_stage_streams_closed_total{stage,reason}  counter: ok | cancelled | error | drained
    duplex_stage_errors_total{stage,kind}       counter: kind = StageError.kind
    duplex_stage_links_opened_total{stage}      counter: Link RPCs (common.proto: many sessions on one stream)
    duplex_stage_link_messages_total{stage,direction}  counter: link messages, in | out
    duplex_stage_link_entries_total{stage,direction}   counter: session entries in those messages

and, once a CUDA stage calls `track_gpu(device)` (absent on CPU), read at scrape time:

    duplex_stage_gpu_memory_allocated_bytes{stage}  gauge: torch.cuda.memory_allocated(device) (live tensors)
    duplex_stage_gpu_memory_reserved_bytes{stage}   gauge: torch.cuda.memory_reserved(device) (held by the
                                                    caching allocator)
    duplex_stage_gpu_memory_free_bytes{stage}       gauge: torch.cuda.mem_get_info(device)[0] (free on the whole
                                                    device, as this process sees it)

A scrape never initializes CUDA (NaN until the process has) and never raises (NaN on any error).

and, in a service process (its entry point calls `track_gc()`):

    duplex_stage_gc_pause_seconds{stage,generation}  histogram: one cyclic garbage collection

Each StageMetrics owns its own CollectorRegistry (several services can live in
one test process without name clashes); `serve_http` exposes it at /metrics.
A service adds its own metrics with `registry=metrics.registry`.
"""

from __future__ import annotations

import gc
import math
import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# Dense under one 80 ms frame period: a stage step must fit well inside it.
STEP_BUCKETS = (0.001, 0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.030, 0.040, 0.050, 0.060, 0.070, 0.080,
                0.100, 0.150, 0.250, 0.5, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
GC_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.010, 0.020, 0.050, 0.100, 0.250, 1.0)


class StageMetrics:
    def __init__(self, stage: str, registry: CollectorRegistry | None = None):
        self.stage = stage
        self.registry = registry or CollectorRegistry()
        r, lab = self.registry, ["stage"]
        self._step = Histogram("duplex_stage_step_seconds", "Wall time of one batched step", lab, buckets=STEP_BUCKETS,
                               registry=r)
        self._batch = Histogram("duplex_stage_batch_size", "Streams stepped together in one batch", lab,
                                buckets=BATCH_BUCKETS, registry=r)
        self._active = Gauge("duplex_stage_active_streams", "Streams open now", lab, registry=r)
        self._free = Gauge("duplex_stage_free_slots", "Slots a new stream could take now", lab, registry=r)
        self._fin = Counter("duplex_stage_frames_in", "Frames accepted from clients", lab, registry=r)
        self._fout = Counter("duplex_stage_frames_out", "Frames sent to clients", lab, registry=r)
        self._opened = Counter("duplex_stage_streams_opened", "Streams opened", lab, registry=r)
        self._closed = Counter("duplex_stage_streams_closed", "Streams closed, by reason", lab + ["reason"], registry=r)
        self._errors = Counter("duplex_stage_errors", "Errors that ended a stream or refused one, by kind",
                               lab + ["kind"], registry=r)
        self.step_seconds = self._step.labels(stage)
        self.batch_size = self._batch.labels(stage)
        self.frames_in = self._fin.labels(stage)
        self.frames_out = self._fout.labels(stage)
        self.streams_opened = self._opened.labels(stage)
        links = Counter("duplex_stage_links_opened", "Link RPCs opened", lab, registry=r)
        messages = Counter("duplex_stage_link_messages", "Link messages", lab + ["direction"], registry=r)
        entries = Counter("duplex_stage_link_entries", "Session entries in link messages", lab + ["direction"],
                          registry=r)
        self.links_opened = links.labels(stage)
        self.link_messages_in, self.link_messages_out = messages.labels(stage, "in"), messages.labels(stage, "out")
        self.link_entries_in, self.link_entries_out = entries.labels(stage, "in"), entries.labels(stage, "out")

    def track(self, active: Callable[[], float], free: Callable[[], float]) -> None:
        """Read the two gauges live from the service's state at scrape time."""
        self._active.labels(self.stage).set_function(active)
        self._free.labels(self.stage).set_function(free)

    def track_gpu(self, device) -> bool:
        """Export the three duplex_stage_gpu_memory_*_bytes gauges for `device` if it is a CUDA device.

        On any other device nothing is registered (the gauges are absent) and this returns False.
        Values are read at scrape time, from the /metrics thread; calling it again is harmless."""
        import torch

        dev = torch.device(device)
        if dev.type != "cuda":
            return False
        if not hasattr(self, "_gpu_gauges"):
            r, lab = self.registry, ["stage"]
            self._gpu_gauges = (
                Gauge("duplex_stage_gpu_memory_allocated_bytes", "torch.cuda.memory_allocated: bytes in live tensors",
                      lab, registry=r),
                Gauge("duplex_stage_gpu_memory_reserved_bytes",
                      "torch.cuda.memory_reserved: bytes held by the caching allocator", lab, registry=r),
                Gauge("duplex_stage_gpu_memory_free_bytes", "torch.cuda.mem_get_info()[0]: free bytes on the device",
                      lab, registry=r),
            )
        readers = (
            lambda: torch.cuda.memory_allocated(dev),
            lambda: torch.cuda.memory_reserved(dev),
            lambda: torch.cuda.mem_get_info(dev)[0],
        )
        for gauge, read in zip(self._gpu_gauges, readers):
            gauge.labels(self.stage).set_function(_cuda_reading(read))
        return True

    def track_gc(self) -> Callable:
        """Time every cyclic garbage collection of this process into
        duplex_stage_gc_pause_seconds{stage,generation}: the thread that triggers one stands still
        meanwhile, so a long one is a late step. gc.callbacks is process-wide: call this once per
        process, from its entry point (not from services sharing a test process)."""
        hist = Histogram("duplex_stage_gc_pause_seconds", "Wall time of one cyclic garbage collection",
                         ["stage", "generation"], buckets=GC_BUCKETS, registry=self.registry)
        started: list[float] = []

        def on_gc(phase: str, info: dict) -> None:  # runs under the GIL; collections never nest
            if phase == "start":
                started[:] = [time.perf_counter()]
            elif started:
                hist.labels(self.stage, str(info.get("generation"))).observe(time.perf_counter() - started.pop())

        gc.callbacks.append(on_gc)
        return on_gc  # gc.callbacks.remove(it) stops the timing

    def observe_step(self, seconds: float, batch: int) -> None:
        self.step_seconds.observe(seconds)
        self.batch_size.observe(batch)

    def error(self, kind: str) -> None:
        self._errors.labels(self.stage, kind).inc()

    def stream_closed(self, reason: str) -> None:
        self._closed.labels(self.stage, reason).inc()

    def serve_http(self, port: int, host: str = "0.0.0.0"):
        """Start the /metrics HTTP endpoint in a daemon thread; returns the server (`.server_port`, `.shutdown()`)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server


def _cuda_reading(read: Callable[[], float]) -> Callable[[], float]:
    """`read` guarded for a scrape: NaN (and no CUDA call) before the process has initialized CUDA,
    NaN on any error."""

    def value() -> float:
        try:
            import torch

            if not torch.cuda.is_initialized():
                return math.nan
            return float(read())
        except Exception:
            return math.nan

    return value
