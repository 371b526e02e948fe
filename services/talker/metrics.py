"""The Talker's own Prometheus metrics, next to the common stage metrics in the same registry.

    duplex_talker_tick_seconds            histogram: one clock tick that stepped (main step + catch-up steps)
    duplex_talker_tick_lateness_seconds   histogram: how late a tick started after its deadline
    duplex_talker_prefill_seconds         histogram: open -> prompt in the slot (wall time)
    duplex_talker_prefill_pieces_total{where}  counter: prefill pieces, riding a main step or run alone (PIECE_PLACES)
    duplex_talker_input_wait_seconds      histogram: a tick's wait at its deadline for due frames (input_wait_ms)
    duplex_talker_frames_advanced_total   counter: session frames stepped (one per output, + the surplus step ahead)
    duplex_talker_frames_skipped_total    counter: live sessions left unstepped at a tick for want of input
    duplex_talker_catch_up_steps_total{rows}  counter: extra batched steps run for sessions with a backlog, by
                                          the rows the step ran (a compact bucket, or every slot)
    duplex_talker_catch_up_steps_forced_total  counter: ... of them run although they did not fit the period
    duplex_talker_sessions_behind         histogram: per tick, sessions with frames from before the main step
                                          still queued after it
    duplex_talker_slow_ticks_total{cause} counter: ticks over the period, by what they held (SLOW_CAUSES)
    duplex_talker_ticks_dropped_total     counter: periods with no tick (the clock was a whole period behind)
    duplex_talker_step_part_seconds{part} histogram: where a step's wall time goes (STEP_PARTS)
    duplex_talker_backlog_refusals_total  counter: streams ended because their queued input passed the bound
    duplex_talker_prompts_started_total{why}  counter: prompts whose prefill began (PROMPT_STARTS): one per
                                          open, plus one per re-prime
    duplex_talker_prefill_busy_refusals_total  counter: opens refused because the prompt would wait too long
    duplex_talker_prefill_wait_estimate_seconds  gauge: how long a prompt opened now would wait (prefill_queue.py)
    duplex_talker_voice_recordings        gauge: recordings of enrolled voices held in memory (recording_store.py)
    duplex_talker_voice_recording_bytes   gauge: their bytes (host embeddings + device KV prefix), within
                                          voice_memory_bytes
    duplex_talker_voice_evictions_total   counter: recordings evicted from memory to make room for another
    duplex_talker_voice_forgets_total{outcome}  counter: ForgetVoice calls, by outcome (FORGET_OUTCOMES)
    duplex_talker_voice_compute_seconds{part}  histogram: each piece of a voice recording's work on the compute
                                          thread, by part (VOICE_COMPUTE_PARTS)

Active streams and free slots are the common `duplex_stage_active_streams` /
`duplex_stage_free_slots` gauges; step time and batch size are `duplex_stage_step_seconds`
and `duplex_stage_batch_size` (services/common/metrics.py).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from services.common.metrics import StageMetrics
from services.talker.recording_store import ForgetOutcome

# Dense under the 80 ms period: the interesting question is how much of it a tick uses.
TICK_BUCKETS = (0.001, 0.002, 0.003, 0.005, 0.0075, 0.010, 0.015, 0.020, 0.025, 0.030, 0.040, 0.050, 0.060,
                0.070, 0.075, 0.080, 0.090, 0.100, 0.150, 0.250, 0.5, 1.0)
LATENESS_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.010, 0.020, 0.040, 0.080, 0.160, 0.320, 1.0)
PREFILL_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
SESSIONS_BUCKETS = (0, 1, 2, 5, 10, 20, 50, 100, 200, 500)
# What a tick over the period held, first match wins: a catch-up step; a start more than 10 ms
# after its deadline (the previous period's prefill piece or tick ran over); else its own input
# wait and main step were too long.
SLOW_CAUSES = ("catch_up", "late_start", "wait_and_step")
# Where a prefill piece ran: riding a main step (its host work during the step's GPU time) or
# alone, in a period's slack or while no session is live (clock.py, runner.py).
PIECE_PLACES = ("step", "alone")
# A step's wall time (duplex_stage_step_seconds), in the order it is spent: handing it to the
# compute thread; engine.step() up to the launch (checks, input copies, the graph launch, the
# outputs' copy queued); the host work of a prefill piece riding the step (0 without one); waiting
# for the GPU (the outputs on the host); turning outputs into lists and text pieces; and the
# event loop getting back to the tick once the compute thread is done (a loop busy with gRPC
# traffic delays it). When a step's wall time runs over its GPU time, this says which part it is.
# Why a prompt's prefill began: at the open; a held open's first prime, first frame or hold's end;
# a re-prime of a session that had begun one.
PROMPT_STARTS = ("open", "prime", "frame", "hold_ended", "reprime")
STEP_PARTS = ("dispatch", "launch", "prefill", "gpu_wait", "outputs", "loop_resume")
# What a ForgetVoice did: dropped the recording now, when its starting sessions are in their slots, or
# found none.
FORGET_OUTCOMES = tuple(o.value for o in ForgetOutcome)
# A voice recording's work on the compute thread (voice_recorder.py), each piece timed there: the
# embedding lookup (its launches; a worker thread waits for the copy), and a prefill piece that
# computed part of a new voice's KV prefix, riding a main step (host time: what it adds to the
# tick before its outputs) or alone in the slack (GPU time included). Buckets: TICK_BUCKETS.
VOICE_COMPUTE_PARTS = ("lookup", "prefix_step", "prefix_alone")


class TalkerMetrics:
    def __init__(self, stage: StageMetrics):
        self.stage = stage
        r = stage.registry
        self.tick_duration = Histogram("duplex_talker_tick_seconds",
                                       "From a tick's deadline to its last step's outputs (input wait, main and "
                                       "catch-up steps)",
                                       buckets=TICK_BUCKETS, registry=r)
        self.tick_lateness = Histogram("duplex_talker_tick_lateness_seconds",
                                       "How late a tick started after its deadline",
                                       buckets=LATENESS_BUCKETS, registry=r)
        self.prefill_duration = Histogram("duplex_talker_prefill_seconds", "Open to prompt-in-slot, wall time",
                                          buckets=PREFILL_BUCKETS, registry=r)
        self.step_device = Histogram("duplex_talker_step_device_seconds",
                                     "GPU time of one graphed step (CUDA events around the replay); the step's wall "
                                     "time (duplex_stage_step_seconds) minus this is host time and waiting",
                                     buckets=TICK_BUCKETS, registry=r)
        self.prefill_piece = Histogram("duplex_talker_prefill_piece_seconds",
                                       "One prefill piece (begin and/or a prompt chunk) run alone (in a period's slack "
                                       "or with no session live), GPU time included",
                                       buckets=TICK_BUCKETS, registry=r)
        self.prefill_pieces = Counter("duplex_talker_prefill_pieces", "Prefill pieces run, by where (riding a main "
                                      "step or alone)", ["where"], registry=r)
        for where in PIECE_PLACES:
            self.prefill_pieces.labels(where=where)
        self.input_wait = Histogram("duplex_talker_input_wait_seconds",
                                    "A tick's wait at its deadline for frames that are due but not here yet",
                                    buckets=LATENESS_BUCKETS, registry=r)
        self.frames_advanced = Counter("duplex_talker_frames_advanced", "Session frames stepped", registry=r)
        self.frames_skipped = Counter("duplex_talker_frames_skipped",
                                      "Live sessions not stepped at a tick for want of input", registry=r)
        self.catch_up_steps = Counter("duplex_talker_catch_up_steps",
                                      "Extra batched steps for sessions with a backlog, by the rows the step ran (a "
                                      "compact bucket of the sessions behind, or every slot)", ["rows"], registry=r)
        self.catch_up_forced = Counter("duplex_talker_catch_up_steps_forced",
                                       "Catch-up steps run although they did not fit before the deadline (a session "
                                       "catch_up_lag_frames or more behind)", registry=r)
        self.sessions_behind = Histogram("duplex_talker_sessions_behind",
                                         "Per tick: sessions with frames from before the main step still queued "
                                         "after it (a frame behind or more)",

                                         buckets=SESSIONS_BUCKETS, registry=r)
        self.slow_ticks = Counter("duplex_talker_slow_ticks", "Ticks longer than the period, by what they held",
                                  ["cause"], registry=r)
        for cause in SLOW_CAUSES:
            self.slow_ticks.labels(cause=cause)  # every series exported from the start, at 0
        self.ticks_dropped = Counter("duplex_talker_ticks_dropped",
                                     "Periods with no tick: the clock fell a whole period behind and ticked on the "
                                     "latest grid time instead of running a burst of late ticks", registry=r)
        self.step_part = Histogram("duplex_talker_step_part_seconds", "Where a step's wall time goes, by part",
                                   ["part"], buckets=TICK_BUCKETS, registry=r)
        self.backlog_refusals = Counter("duplex_talker_backlog_refusals",
                                        "Streams ended because queued input passed the backlog bound", registry=r)
        self.prompts_started = Counter("duplex_talker_prompts_started", "Prompts whose prefill began, by why",
                                       ["why"], registry=r)
        for why in PROMPT_STARTS:
            self.prompts_started.labels(why=why)
        self.prefill_busy_refusals = Counter("duplex_talker_prefill_busy_refusals",
                                             "Opens refused because their prompt would wait past the bound in the "
                                             "prefill queue", registry=r)
        self.prefill_wait_estimate = Gauge("duplex_talker_prefill_wait_estimate_seconds",
                                           "How long the prompt of a session opened now would wait in the prefill "
                                           "queue (estimate)", registry=r)

        self.voice_recordings = Gauge("duplex_talker_voice_recordings",
                                      "Recordings of enrolled voices held in memory", registry=r)
        self.voice_recording_bytes = Gauge("duplex_talker_voice_recording_bytes",
                                           "Bytes of the recordings of enrolled voices held in memory (host "
                                           "embeddings and device KV prefix)", registry=r)
        self.voice_evictions = Counter("duplex_talker_voice_evictions",
                                       "Recordings evicted from memory to make room for another", registry=r)
        self.voice_forgets = Counter("duplex_talker_voice_forgets", "ForgetVoice calls, by outcome", ["outcome"],
                                     registry=r)
        for outcome in FORGET_OUTCOMES:
            self.voice_forgets.labels(outcome=outcome)
        self.voice_compute = Histogram("duplex_talker_voice_compute_seconds",
                                       "Each piece of a voice recording's work on the compute thread, by part: the "
                                       "embedding lookup, a prefill piece computing a new voice's KV prefix riding "
                                       "a main step (host time) or alone (GPU time included)",
                                       ["part"], buckets=TICK_BUCKETS, registry=r)
        for part in VOICE_COMPUTE_PARTS:
            self.voice_compute.labels(part=part)

    def track_recordings(self, store) -> None:
        """Read the recording store's count and bytes at each scrape (recording_store.RecordingStore)."""
        self.voice_recordings.set_function(lambda: len(store))
        self.voice_recording_bytes.set_function(lambda: store.held_bytes)

    def observe_step(self, seconds: float, batch: int) -> None:
        self.stage.observe_step(seconds, batch)
