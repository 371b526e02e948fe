"""The gateway's Prometheus metrics (served at /metrics on the gateway's own port).

    gateway_sessions_active{protocol}               gauge: sessions open now (the HPA signal)
    gateway_sessions_opened_total{protocol}         counter
    gateway_sessions_refused_total{protocol,code}   counter: resource_exhausted, runtime_open_failed, ...
    gateway_frames_in_total                         counter: 1920-sample frames handed to encoders
    gateway_frames_out_total                        counter: 1920-sample frames sent to clients
    gateway_frame_latency_seconds                   histogram: input frame handed to the encoder -> its output PCM back
    gateway_errors_total{type,code}                 counter: every error event/close reason sent to a client
    gateway_cleanup_unconfirmed_total               counter: sessions whose streams were not acknowledged closed in time
    gateway_slow_client_cutoffs_total               counter
    gateway_client_aborts_total{reason}             counter: sockets aborted (send_timeout, write_buffer, ...)
    gateway_cell_free_slots{cell} / gateway_cell_serving{cell}   gauges from the last capacity poll
    gateway_worker_websockets_open{worker}          gauge: WebSocket connections a worker holds now
    gateway_worker_websockets_total{worker}         counter: WebSocket connections a worker took
    gateway_sessions_paused                         gauge: sessions whose connection dropped, waiting for a resume
    gateway_resumes_total{outcome}                  counter: resume attempts: resumed, invalid_resume_token,
                                                    session_not_found, session_expired, session_in_use,
                                                    resume_wrong_worker (resume.py)
    gateway_resume_grace_expired_total              counter: paused sessions ended by their grace period
    gateway_resume_dropped_frames_total             counter: output frames produced while a session was paused
                                                    (not delivered: a resume does not replay them)
    gateway_resume_relays_total{outcome}            counter: resumes that landed on another worker than their
                                                    session's (resume_relay.py): relayed, owner_unreachable,
                                                    no_such_worker
    gateway_resume_relays_open                      gauge: relayed resume connections piped now
    gateway_voice_forgets_total{outcome}            counter: talkers asked to forget a deleted or replaced voice's
                                                    recording, by outcome (recordings.Pruned)

With `--workers N` (N > 1) every worker writes its values to files in one directory
(prometheus_client's multiprocess mode, PROMETHEUS_MULTIPROC_DIR set by the supervisor) and
/metrics, from whichever worker answers, reads them all: counters and histograms add up over
every worker that ever ran, `gateway_sessions_active` is the sum over live workers (a dead
worker's part is dropped when the supervisor marks it dead), and the cell gauges are the most
recent poll of any live worker. `worker` is the worker's index (0..N-1), kept by its restarts.
A new gauge states how workers combine (multiprocess_mode); without one each worker's value
is a separate series labelled by pid.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from services.gateway.recordings import Pruned

RESUME_OUTCOMES = ("resumed", "invalid_resume_token", "session_not_found", "session_expired", "session_in_use",
                   "resume_wrong_worker")
RELAY_OUTCOMES = ("relayed", "owner_unreachable", "no_such_worker")
LATENCY_BUCKETS = (0.05, 0.08, 0.1, 0.12, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0)


class GatewayMetrics:
    def __init__(self, worker: int = 0, multiprocess_dir: str | None = None) -> None:
        """`multiprocess_dir`: render every worker's values from there (the supervisor's directory,
        which must also be this process's PROMETHEUS_MULTIPROC_DIR); None: this process only."""
        self.multiprocess_dir = multiprocess_dir
        r = self.registry = CollectorRegistry()
        self.sessions_active = Gauge("gateway_sessions_active", "Sessions open now", ["protocol"], registry=r,
                                     multiprocess_mode="livesum")
        self.sessions_opened = Counter("gateway_sessions_opened_total", "Sessions admitted", ["protocol"], registry=r)
        self.sessions_refused = Counter("gateway_sessions_refused_total", "Sessions refused at open",
                                        ["protocol", "code"], registry=r)
        self.frames_in = Counter("gateway_frames_in_total",
                                 "Input frames handed to an encoder (or held for it until the prompt is live)",
                                 registry=r)
        self.frames_out = Counter("gateway_frames_out_total", "Output frames sent to clients", registry=r)
        self.frame_latency = Histogram(
            "gateway_frame_latency_seconds", "Input frame to encoder -> its output PCM at the gateway",
            buckets=LATENCY_BUCKETS, registry=r)
        self.errors = Counter("gateway_errors_total", "Errors reported to clients", ["type", "code"], registry=r)
        self.cleanup_unconfirmed = Counter("gateway_cleanup_unconfirmed_total",
                                           "Sessions whose stream ends were not acknowledged in time", registry=r)
        self.prelive_dropped = Counter("gateway_prelive_frames_dropped_total",
                                       "Client frames dropped while their session's prompt was not live yet (the "
                                       "newest relay.PRELIVE_FRAMES are kept)", registry=r)
        self.slow_client_cutoffs = Counter("gateway_slow_client_cutoffs_total", "Clients cut off for not reading",
                                           registry=r)
        self.client_aborts = Counter("gateway_client_aborts_total", "Client sockets aborted (client_connection.py)",
                                     ["reason"], registry=r)
        self.voice_forgets = Counter("gateway_voice_forgets_total", "Talkers asked to forget a deleted or replaced "
                                     "voice's recording, by outcome", ["outcome"], registry=r)
        self.sessions_paused = Gauge("gateway_sessions_paused", "Sessions whose connection dropped, waiting for a "
                                     "resume (resume.py)", registry=r, multiprocess_mode="livesum")
        self.resumes = Counter("gateway_resumes_total", "Resume attempts by outcome", ["outcome"], registry=r)
        for outcome in RESUME_OUTCOMES:
            self.resumes.labels(outcome)
        self.resume_grace_expired = Counter("gateway_resume_grace_expired_total",
                                            "Paused sessions ended by their resume grace period", registry=r)
        self.resume_dropped_frames = Counter("gateway_resume_dropped_frames_total",
                                             "Output frames produced while their session was paused (dropped)",
                                             registry=r)
        self.resume_relays = Counter("gateway_resume_relays_total", "Resumes that landed on another worker than "
                                     "their session's, by outcome (resume_relay.py)", ["outcome"], registry=r)
        for outcome in RELAY_OUTCOMES:
            self.resume_relays.labels(outcome)
        self.resume_relays_open = Gauge("gateway_resume_relays_open", "Relayed resume connections piped now",
                                        registry=r, multiprocess_mode="livesum")
        for outcome in Pruned:
            self.voice_forgets.labels(outcome.value)
        recent = "livemostrecent"
        self.cell_free = Gauge("gateway_cell_free_slots", "Free session slots per cell (last poll)", ["cell"],
                               registry=r, multiprocess_mode=recent)
        self.cell_serving = Gauge("gateway_cell_serving", "1 when all three stages of the cell answer", ["cell"],
                                  registry=r, multiprocess_mode=recent)
        w = str(worker)
        self.websockets_open = Gauge("gateway_worker_websockets_open", "WebSocket connections this worker holds now",
                                     ["worker"], registry=r, multiprocess_mode="livesum").labels(w)
        self.websockets_taken = Counter("gateway_worker_websockets_total", "WebSocket connections this worker took",
                                        ["worker"], registry=r).labels(w)

    def observe_cells(self, pool) -> None:
        for cell in pool.cells.values():
            self.cell_free.labels(cell.name).set(cell.free_slots)
            self.cell_serving.labels(cell.name).set(1 if cell.serving else 0)

    def render(self) -> bytes:
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        merged = CollectorRegistry()
        MultiProcessCollector(merged, path=self.multiprocess_dir)
        return generate_latest(merged)
