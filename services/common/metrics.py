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

Each StageMetrics owns its own CollectorRegistry (several services can live in
one test process without name clashes); `serve_http` exposes it at /metrics.
A service adds its own metrics with `registry=metrics.registry`.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# Dense under one 80 ms frame period: a stage step must fit well inside it.
STEP_BUCKETS = (0.001, 0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.030, 0.040, 0.050, 0.060, 0.070, 0.080,
                0.100, 0.150, 0.250, 0.5, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class StageMetrics:
    def __init__(self, stage: str, registry: CollectorRegistry | None = None):
        self.stage = stage
        self.registry = registry or CollectorRegistry()
        r, lab = self.registry, ["stage"]
        self._step = Histogram("duplex_stage_step_seconds", "Wall time of one batched step", lab, buckets=STEP_BUCKETS, registry=r)
        self._batch = Histogram("duplex_stage_batch_size", "Streams stepped together in one batch", lab, buckets=BATCH_BUCKETS, registry=r)
        self._active = Gauge("duplex_stage_active_streams", "Streams open now", lab, registry=r)
        self._free = Gauge("duplex_stage_free_slots", "Slots a new stream could take now", lab, registry=r)
        self._fin = Counter("duplex_stage_frames_in", "Frames accepted from clients", lab, registry=r)
        self._fout = Counter("duplex_stage_frames_out", "Frames sent to clients", lab, registry=r)
        self._opened = Counter("duplex_stage_streams_opened", "Streams opened", lab, registry=r)
        self._closed = Counter("duplex_stage_streams_closed", "Streams closed, by reason", lab + ["reason"], registry=r)
        self._errors = Counter("duplex_stage_errors", "Errors that ended a stream or refused one, by kind", lab + ["kind"], registry=r)
        self.step_seconds = self._step.labels(stage)
        self.batch_size = self._batch.labels(stage)
        self.frames_in = self._fin.labels(stage)
        self.frames_out = self._fout.labels(stage)
        self.streams_opened = self._opened.labels(stage)

    def track(self, active: Callable[[], float], free: Callable[[], float]) -> None:
        """Read the two gauges live from the service's state at scrape time."""
        self._active.labels(self.stage).set_function(active)
        self._free.labels(self.stage).set_function(free)

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
