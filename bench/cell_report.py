"""bench/cell.py's report: one N's summary from the load records and metric scrapes, the
table, and the timeline plot.

Definitions (also written into cell.json):
- e2e latency: PCM frame i handed to the encoder stream -> the decoded PCM of the talker output
  whose input_seq is i (the output of the talker step that consumed frame i) received by the load
  process. The model's 1-frame delay shows in two ways that this number does not hide: the first
  input frame yields no output (frames_out = frames_in - output_delay_frames per session), and each
  output's semantic code was sampled one step earlier, so the agent reacts to the user one frame
  (80 ms) later than e2e says; e2e also leaves out the 80 ms it takes to capture a frame.
- stage step / talker tick quantiles: from each service's Prometheus histograms, the bucket deltas
  between the scrape before the shared start and the one after the last output; quantiles are
  interpolated inside a bucket (bucket resolution). The 80 ms pass line is a bucket bound, so
  "share of ticks <= 80 ms" is exact.
- probes (time to first audio at full load): K of the N slots are probe slots that open, talk for
  --probe-cycle-s and close again, over and over, while the other N-K ("steady") sessions run.
  open_ms is open call -> session ready; first_audio_ms is open call -> first decoded PCM frame.
  Every other figure and check of a run is about the steady sessions, except the service-side
  ones (stage/tick histograms and counters), which see all N.
- gpu_memory: each stage's CUDA allocator gauges, when the services export them (not on the CPU).
"""

from __future__ import annotations

import math

import numpy as np

from bench.cell_stats import (
    SessionRecord,
    backlog_series,
    backlog_trend,
    bucket_quantile,
    count_gt,
    counter_by_label,
    counter_delta,
    fraction_le,
    gpu_memory,
    has_metric,
    histogram_delta,
    histogram_summary_counts,
    histogram_summary_ms,
    ms_summary,
    output_rate_windows,
    per_second_latency,
)
from services.talker.metrics import STEP_PARTS

STAGES = ("encoder", "talker", "decoder")
PROMPTS_STARTED = "duplex_talker_prompts_started"
TICK_BUDGET_S = 0.080  # one frame: a talker tick over this is a late frame for every session

DEFINITIONS = {
    "e2e_ms": "PCM frame i sent to the encoder stream -> decoded PCM of the talker output with input_seq i "
              "(the talker step that consumed frame i) received. The model's 1-frame delay: the first input "
              "yields no output (frames_out = frames_in - output_delay_frames) and each output's semantic code "
              "was sampled one step earlier, so the agent reacts one frame (80 ms) later than e2e; e2e also "
              "excludes the 80 ms capture time of a frame",
    "stage quantiles": "Prometheus histogram bucket deltas over the run (before start -> after the last output), "
                       "interpolated inside a bucket: bucket resolution",
    "talker_tick": "one conversation-clock tick that stepped, from its deadline to its last step's outputs "
                   "(input wait, main batched step with the host work of a prefill piece riding it, catch-up steps; "
                   "the piece's GPU work and any pieces run alone come after it, in the slack)",
    "talker_prefill_piece": "one prefill piece (begin and/or a prompt chunk) run alone (in a period's slack or with no "
                            "session live), GPU time included; a piece riding a main step is counted in "
                            "prefill_pieces['step'] and its host time is the step part 'prefill'",
    "talker_step_device": "GPU time of one graphed talker step (CUDA events around the replay; none on the CPU); "
                          "the step's wall time minus this is host time and waiting",
    "pass": "talker ticks <= 80 ms for >= 99% (exact: 80 ms is a bucket bound), every session admitted, no "
            "session/stage error or backlog refusal, every owed output frame delivered, and no growing backlog "
            "(mean frames in flight grows less than backlog_growth_frames over the run)",
    "backlog_frames": "mean over sessions of input frames sent that owe an output minus outputs received",
    "client_send_lateness_ms": "how late a load process sent a frame against its session's absolute schedule",
    "gc_full_collections": "per stage: the process's full (generation 2) cyclic garbage collections over the run "
                           "(duplex_stage_gc_pause_seconds); stage_timeline's <stage>_gc_ms: all collections' time "
                           "per interval, to set against the tick spikes",
    "sessions": "N: steady_sessions (open together before the shared start, then the whole schedule; every "
                "client-side figure and check except probes_ok is about them) + probe_slots (see probes)",
    "slow_intervals": "stage_timeline intervals (about 1 s, from the shared start) whose talker tick p99 passed the "
                      "period; slow_with_probe_open: those with a probe open in them or 0.3 s before (its prefill "
                      "lands there); intervals_with_probe_open: the same count over all intervals, the base rate",
    "probes": "probe_slots sessions that open, talk for probe_cycle_s and close gracefully, then reopen at once, "
              "from the shared start until the steady schedule ends, so about N sessions are always live. "
              "open_ms: open call -> session ready (the prompt prefilled; the first input frame can be "
              "answered), measured while the other N-K sessions run. prefill_ms: the talker's own prefill "
              "figure for it. first_audio_ms: open call -> first decoded PCM frame received, sending input on "
              "the 80 ms schedule from the moment the open returned; it includes the model's one-frame output "
              "delay (first audio needs two input frames, so it comes at least 80 ms after the first frame is "
              "sent) plus one pass through the three stages. first_audio_after_open_ms: the same from the open's "
              "return. slot_wait_ms: before each open, the wait until every stage has a free slot again (a stage "
              "frees a slot just after it acknowledged the previous stream's end; opening in that gap would be "
              "refused), not part of open_ms. errors: failed or refused opens, no free slot within the cleanup "
              "timeout, session errors, unconfirmed cleanups, and cycles whose owed outputs did not all arrive; "
              "any makes probes_ok false",
    "gpu_memory": "per stage torch.cuda.memory_allocated / memory_reserved (MiB) and the device's free memory "
                  "(mem_get_info, the lowest any stage reported), from the stages' gauges; null on the CPU. "
                  "In a run: the scrape before the shared start and the one after the last output",
}


def _ms(x: float) -> float | None:
    return None if x is None or math.isnan(x) else round(x * 1000.0, 2)


def stage_block(before: dict, after: dict, stage: str) -> dict:
    step = histogram_delta(before, after, "duplex_stage_step_seconds", stage=stage)
    batch = histogram_delta(before, after, "duplex_stage_batch_size", stage=stage)
    gc_full = histogram_delta(before, after, "duplex_stage_gc_pause_seconds", stage=stage, generation="2")
    return {"step_ms": histogram_summary_ms(step), "batch_mean": None if batch.count == 0 else round(batch.mean, 2),
            "gc_full_collections": histogram_summary_ms(gc_full) | {"total_ms": round(gc_full.sum * 1000.0, 1)},
            "frames_in": int(counter_delta(before, after, "duplex_stage_frames_in", stage=stage)),
            "frames_out": int(counter_delta(before, after, "duplex_stage_frames_out", stage=stage)),
            "errors": counter_by_label(before, after, "duplex_stage_errors", "kind", stage=stage)}


def talker_block(before: dict, after: dict) -> dict:
    tick = histogram_delta(before, after, "duplex_talker_tick_seconds")
    late = histogram_delta(before, after, "duplex_talker_tick_lateness_seconds")
    return {
        "tick_ms": histogram_summary_ms(tick),
        "tick_share_le_80ms": None if tick.count == 0 else round(fraction_le(tick, TICK_BUDGET_S), 5),
        "tick_lateness_ms": histogram_summary_ms(late),
        "ticks_started_late_gt_10ms": int(count_gt(late, 0.010)) if late.count else 0,
        "ticks_started_late_gt_80ms": int(count_gt(late, 0.080)) if late.count else 0,
        "frames_advanced": int(counter_delta(before, after, "duplex_talker_frames_advanced")),
        "frames_skipped": int(counter_delta(before, after, "duplex_talker_frames_skipped")),
        "catch_up_steps": int(counter_delta(before, after, "duplex_talker_catch_up_steps")),
        "catch_up_steps_by_rows": {k: int(v) for k, v in counter_by_label(before, after, "duplex_talker_catch_up_steps",
                                                                          "rows").items()},
        # What the late ticks held: forced catch-up steps (past the deadline for a session
        # catch_up_lag_frames behind), slow ticks by cause, periods dropped, sessions still behind.
        "catch_up_steps_forced": int(counter_delta(before, after, "duplex_talker_catch_up_steps_forced")),
        "slow_ticks_by_cause": {k: int(v)
                                for k, v in counter_by_label(before, after, "duplex_talker_slow_ticks",
                                                             "cause").items()},
        "ticks_dropped": int(counter_delta(before, after, "duplex_talker_ticks_dropped")),
        "sessions_behind": histogram_summary_counts(histogram_delta(before, after, "duplex_talker_sessions_behind")),
        # Where a step's wall time goes (services/talker/metrics.py STEP_PARTS).
        "step_parts_ms": {p: histogram_summary_ms(histogram_delta(before, after, "duplex_talker_step_part_seconds",
                                                                  part=p))
                          for p in STEP_PARTS},
        "backlog_refusals": int(counter_delta(before, after, "duplex_talker_backlog_refusals")),
        "prefill_piece_ms": histogram_summary_ms(histogram_delta(before, after, "duplex_talker_prefill_piece_seconds")),
        "prefill_pieces": {k: int(v)
                           for k, v in counter_by_label(before, after, "duplex_talker_prefill_pieces",
                                                        "where").items()},
        "step_device_ms": histogram_summary_ms(histogram_delta(before, after, "duplex_talker_step_device_seconds")),
        # Prompts the talker began to prefill (an open that prefills twice counts 2); None when it does not export it.
        "prompts_started": (int(counter_delta(before, after, PROMPTS_STARTED))
                            if has_metric(after, PROMPTS_STARTED) else None),
    }


def stage_timeline(snapshots: list[tuple[float, dict]]) -> list[dict]:
    """Per scrape interval (about 1 s): talker tick p99 and each stage's step p99, in ms; the
    talker's catch-up steps (forced ones apart) and slow ticks by cause, where there were any."""
    rows = []
    for (t0, a), (t, b) in zip(snapshots, snapshots[1:]):
        row = {"t0": t0, "t": t}
        if a.get("talker") is not None and b.get("talker") is not None:
            row["talker_tick_p99_ms"] = _ms(bucket_quantile(histogram_delta(a["talker"], b["talker"],
                                                                            "duplex_talker_tick_seconds"), 0.99))
            for key, name in (("talker_catch_ups", "duplex_talker_catch_up_steps"),
                              ("talker_catch_ups_forced", "duplex_talker_catch_up_steps_forced"),
                              ("talker_ticks_dropped", "duplex_talker_ticks_dropped")):
                if n := int(counter_delta(a["talker"], b["talker"], name)):
                    row[key] = n
            for cause, n in counter_by_label(a["talker"], b["talker"], "duplex_talker_slow_ticks", "cause").items():
                if int(n):
                    row[f"talker_slow_{cause}"] = int(n)
        for s in STAGES:
            if a.get(s) is not None and b.get(s) is not None:
                row[f"{s}_step_p99_ms"] = _ms(bucket_quantile(histogram_delta(a[s], b[s], "duplex_stage_step_seconds",
                                                                              stage=s), 0.99))
                gc_pause = histogram_delta(a[s], b[s], "duplex_stage_gc_pause_seconds", stage=s).sum
                if gc_pause:  # time the stage's process stood still collecting garbage in this interval
                    row[f"{s}_gc_ms"] = round(gc_pause * 1000.0, 2)
        rows.append(row)
    return rows


OPEN_LEAD_S = 0.3  # an open this long before an interval still lands its prefill in it (two periods + a piece)


def slow_intervals(timeline: list[dict], cycles: list[dict], tick_s: float = 0.08) -> dict:
    """Which scrape intervals had a talker tick p99 over the period, and how many of them (and of
    all intervals, the base rate) saw a probe open in them or OPEN_LEAD_S before: whether late
    ticks follow the new sessions' prefill or not."""
    opens = sorted(c["t_open"] for c in cycles if c.get("t_open") is not None)

    def with_open(row: dict) -> bool:
        return any(row["t0"] - OPEN_LEAD_S <= t < row["t"] for t in opens)

    rows = [r for r in timeline if r.get("talker_tick_p99_ms") is not None and r["t0"] >= 0]
    slow = [r for r in rows if r["talker_tick_p99_ms"] > tick_s * 1000.0]
    return {"intervals": len(rows), "slow": len(slow), "slow_at": [round(r["t0"], 1) for r in slow][:60],
            "slow_with_probe_open": sum(with_open(r) for r in slow),
            "intervals_with_probe_open": sum(with_open(r) for r in rows)}


def _probe_errors(cycles: list[dict]) -> list[dict]:
    """Every probe cycle that went wrong, one entry each: its own error, an unconfirmed cleanup,
    or outputs that never arrived although the graceful close owed them."""
    errors = []
    for c in cycles:
        if c["error"]:
            errors.append({"stream_id": c["stream_id"], **c["error"]})
        elif c["cleanup_confirmed"] is False:
            errors.append({"stream_id": c["stream_id"], "code": "cleanup_unconfirmed", "stage": None, "message": ""})
        elif c["frames_out"] != max(0, c["frames_sent"] - (c["output_delay_frames"] or 0)):
            errors.append({"stream_id": c["stream_id"], "code": "outputs_missing", "stage": None,
                           "message": f"{c['frames_out']} outputs for {c['frames_sent']} frames sent"})
    return errors


def probe_summary(cycles: list[dict], slots: int, cycle_s: float) -> dict | None:
    """The probe cycles of one run (cell_load's records); None without probe slots."""
    if slots == 0:
        return None
    opened = [c for c in cycles if c["open_s"] is not None]
    firsts = [c for c in opened if c["first_output_s"] is not None]
    errors = _probe_errors(cycles)
    return {
        "slots": slots,
        "cycle_s": cycle_s,
        "cycles": len(cycles),
        "errors": errors[:20],
        "errors_total": len(errors),
        "open_ms": ms_summary([c["open_s"] for c in opened]),
        "prefill_ms": ms_summary([c["prefill_ms"] / 1000.0 for c in opened if c["prefill_ms"] is not None]),
        "first_audio_ms": ms_summary([c["first_output_s"] for c in firsts]),
        "first_audio_after_open_ms": ms_summary([c["first_output_s"] - c["open_s"] for c in firsts]),
        "no_first_audio": len(opened) - len(firsts),
        "slot_wait_ms": ms_summary([c["slot_wait_s"] for c in cycles]),
        "frames_in": sum(c["frames_sent"] for c in cycles),
        "frames_out": sum(c["frames_out"] for c in cycles),
    }


def summarize_run(n: int, results: list[dict], refused: list[dict], snapshots: list[tuple[float, dict]], *,
                  duration_s: float, frames: int, window_s: float, backlog_growth_frames: float,
                  probe_slots: int = 0, probe_cycle_s: float = 0.0) -> dict:
    """One N's summary. n counts every session slot; the first n - probe_slots are the steady
    sessions in `results[...]["sessions"]`, the probe cycles are in `results[...]["probes"]`."""
    sessions = [s for r in results for s in r["sessions"]]
    live = [s for s in sessions if s["admitted"]]
    records = [SessionRecord(s["send_t"], [(int(q), float(t)) for q, t in s["recv"]], int(s["output_delay_frames"]))
               for s in live]
    errors = [{"stream_id": s["stream_id"], **s["error"]} for s in live if s["error"]]
    errors += [{"stream_id": r.get("stream_id"), "code": r.get("code"), "stage": r.get("stage"),
                "message": r.get("message")} for r in refused]
    unconfirmed = [s["stream_id"] for s in live if s["cleanup_confirmed"] is False]
    delay = max((r.output_delay_frames for r in records), default=0)

    f_in = [len(r.send_t) for r in records]
    f_out = [len(r.recv) for r in records]
    owed = [max(0, len(r.send_t) - r.output_delay_frames) for r in records]
    latencies = [lat for r in records for _, lat in r.latencies()]
    lateness = [x for s in live for x in s["late_s"]]

    before, after = snapshots[0][1], snapshots[-1][1]
    stages = {s: (stage_block(before[s], after[s], s) if before.get(s) is not None and after.get(s) is not None
                  else None)
              for s in STAGES}
    talker = talker_block(before["talker"], after["talker"]) if stages["talker"] is not None else None

    grid = np.arange(0.0, duration_s, 0.5)
    backlog = backlog_series(records, grid)
    trend = backlog_trend(grid, backlog, skip_s=min(5.0, duration_s / 4), max_growth_frames=backlog_growth_frames)
    trend["per_second"] = [{"t": float(t), "frames": round(float(b), 3)} for t, b in zip(grid, backlog)
                           if float(t).is_integer()]

    cycles = [c for r in results for c in r.get("probes", [])]
    probes = probe_summary(cycles, probe_slots, probe_cycle_s)
    timeline = stage_timeline(snapshots)

    stage_errors = sum(sum(b["errors"].values()) for b in stages.values() if b is not None)
    checks = {
        "all_admitted": len(live) == n - probe_slots,
        "no_errors": not errors and not unconfirmed and stage_errors == 0 and None not in stages.values()
                     and (talker is None or talker["backlog_refusals"] == 0),
        "talker_tick_p99_under_80ms": talker is not None and talker["tick_share_le_80ms"] is not None
                                      and talker["tick_share_le_80ms"] >= 0.99,
        "no_growing_backlog": trend["growing"] is False,
        "all_outputs_delivered": bool(records) and f_out == owed,
        "probes_ok": probes is None or (probes["cycles"] > 0 and probes["errors_total"] == 0),
    }
    return {
        "sessions": n,
        "steady_sessions": n - probe_slots,
        "probe_slots": probe_slots,
        "admitted": len(live),
        "duration_s": duration_s,
        "frames_per_session": frames,
        "output_delay_frames": delay,
        "prefill_ms": ms_summary([s["prefill_ms"] / 1000.0 for s in live if s["prefill_ms"] is not None]),
        "open_ms": ms_summary([s["open_s"] for s in live]),
        "frames": {"in_total": sum(f_in), "out_total": sum(f_out), "owed_out_total": sum(owed),
                   "missing_out_total": sum(owed) - sum(f_out),
                   "in_per_session_min": min(f_in, default=0), "in_per_session_max": max(f_in, default=0),
                   "out_per_session_min": min(f_out, default=0), "out_per_session_max": max(f_out, default=0)},
        "e2e_ms": ms_summary(latencies),
        "client_send_lateness_ms": ms_summary(lateness),
        "client_reanchors": sum(s["reanchors"] for s in live),
        "output_fps_per_session": output_rate_windows(records, duration_s, window_s),
        "backlog_frames": trend,
        "stages": stages,
        "talker": talker,
        "latency_per_second": per_second_latency(records, int(math.ceil(duration_s)) + 2),
        "stage_timeline": timeline,
        "slow_intervals": slow_intervals(timeline, cycles),
        "probes": probes,
        "gpu_memory": {"before": gpu_memory(before), "after": gpu_memory(after)},
        "errors": errors[:50],
        "errors_total": len(errors),
        "cleanup_unconfirmed": unconfirmed[:50],
        "checks": checks,
        "pass": all(checks.values()),
        "definitions": DEFINITIONS,
    }


def print_table(result: dict) -> None:
    cols = ("N", "adm", "e2e p50", "e2e p99", "tick p99", "tick<=80", "enc p99", "talk p99", "dec p99",
            "late>10", "skipped", "refused", "backlog+", "min fps", "cli p99", "pass")
    print()
    print(" ".join(f"{c:>8}" for c in cols))
    for r in result["runs"]:
        if "checks" not in r:
            print(f"{r['sessions']:>8} run failed: {r.get('failed', '')[:200]}")
            continue
        t, st = r["talker"] or {}, r["stages"]

        def step(s):
            return (st.get(s) or {}).get("step_ms", {}).get("p99")

        fps = [w["min_fps"] for w in r["output_fps_per_session"]]
        vals = (r["sessions"], r["admitted"], r["e2e_ms"]["p50"], r["e2e_ms"]["p99"], t.get("tick_ms", {}).get("p99"),
                None if t.get("tick_share_le_80ms") is None else 100 * t["tick_share_le_80ms"], step("encoder"),
                step("talker"), step("decoder"), t.get("ticks_started_late_gt_10ms"), t.get("frames_skipped"),
                t.get("backlog_refusals"), r["backlog_frames"]["growth_frames"], min(fps) if fps else None,
                r["client_send_lateness_ms"]["p99"], "PASS" if r["pass"] else "FAIL")
        print(" ".join(f"{v:>8.1f}" if isinstance(v, float) else f"{'-' if v is None else v:>8}" for v in vals))
    print("(ms; tick<=80 in %; quantiles of stage/tick times at Prometheus bucket resolution; "
          "backlog+ = growth of frames in flight over the run; min fps = slowest session's output rate in any window)")
    for r in result["runs"]:
        if r.get("probes"):
            print(probe_line(r))
        dev = ((r.get("talker") or {}).get("step_device_ms")) or {}
        if dev.get("count"):
            wall = (r["stages"].get("talker") or {}).get("step_ms", {})
            print(f"N={r['sessions']} talker step p50/p99: wall {wall.get('p50')}/{wall.get('p99')} ms, "
                  f"GPU (events around the graph) {dev['p50']}/{dev['p99']} ms")
        if r.get("talker"):
            print(late_tick_line(r))
    print(f"largest passing N: {result['largest_passing_sessions']}")
    print()


def late_tick_line(run: dict) -> str:
    """What one run's ticks over the period held, for the console."""
    t = run["talker"]
    causes = ", ".join(f"{k} {v}" for k, v in sorted((t.get("slow_ticks_by_cause") or {}).items())) or "none"
    behind = t.get("sessions_behind") or {}
    by_rows = ", ".join(f"{k} rows {v}" for k, v in sorted((t.get("catch_up_steps_by_rows") or {}).items(),
                                                             key=lambda kv: int(kv[0])))
    return (f"N={run['sessions']} slow ticks by cause: {causes}; catch-up steps {t.get('catch_up_steps')} "
            f"({by_rows + '; ' if by_rows else ''}{t.get('catch_up_steps_forced')} forced past the deadline); "
            f"periods dropped {t.get('ticks_dropped')}; "
            f"sessions a frame or more behind per tick mean/p99 {behind.get('mean', '-')}/{behind.get('p99', '-')}"
            + "; step parts p50/p99 (ms): " + ", ".join(
                f"{p} {s.get('p50')}/{s.get('p99')}" for p, s in (t.get("step_parts_ms") or {}).items()
                if s.get("count")))


def probe_line(run: dict) -> str:
    """One run's time to first audio at full load, for the console."""
    p = run["probes"]

    def ms(x):
        return "-" if x is None else f"{x:.1f}"

    piece = (run.get("talker") or {}).get("prefill_piece_ms") or {}
    where = (run.get("talker") or {}).get("prefill_pieces") or {}
    pieces = (f"; talker prefill pieces riding a step {where.get('step', 0)}, alone {where.get('alone', 0)}"
              if where else "")
    pieces += (f" (alone p50/p99 {ms(piece.get('p50'))}/{ms(piece.get('p99'))} ms)" if piece.get("count") else "")
    return (f"N={run['sessions']} probes ({p['slots']} of N, {p['cycles']} opens beside {run['steady_sessions']} "
            "steady): "
            f"open p50/p99 {ms(p['open_ms']['p50'])}/{ms(p['open_ms']['p99'])} ms, "
            f"first audio p50/p99 {ms(p['first_audio_ms']['p50'])}/{ms(p['first_audio_ms']['p99'])} ms, "
            f"errors {p['errors_total']}" + pieces + slow_line(run))


def slow_line(run: dict) -> str:
    """Whether the slow seconds come with the probes' opens (their prefill) or not."""
    w = run.get("slow_intervals")
    if not w or not w["intervals"]:
        return ""
    return (f"; intervals with talker tick p99 > 80 ms: {w['slow']} of {w['intervals']}, "
            f"{w['slow_with_probe_open']} of them with a probe open (base rate "
            f"{w['intervals_with_probe_open']} of {w['intervals']})")


def gpu_memory_lines(mem: dict | None) -> list[str]:
    """gpu_memory() for the console: one line per stage, or one saying there is nothing to show."""
    if mem is None:
        return ["gpu memory: the stages export no GPU memory gauges (not on CUDA)"]
    free = mem["device_free_mib"]
    lines = []
    for stage, m in mem["stages"].items():
        what = ("no gauges" if m is None
                else f"allocated {m['allocated_mib']:.0f} MiB, reserved {m['reserved_mib']:.0f} MiB")
        lines.append(f"gpu memory: {stage:<8} {what}")
    lines.append(f"gpu memory: device free {'-' if free is None else f'{free:.0f}'} MiB")
    return lines


def plot(result: dict, path) -> object | None:
    """Per-second e2e p50/p99 and talker tick p99 for every N; None (and a note) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no cell.png (cell.json has the same timelines)")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in result["runs"] if "latency_per_second" in r]
    if not runs:
        return None
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for i, r in enumerate(runs):
        color = f"C{i}"
        lat = [x for x in r["latency_per_second"] if x["p99_ms"] is not None]
        # Each point at the middle of the interval it summarizes.
        ax1.plot([x["t"] + 0.5 for x in lat], [x["p99_ms"] for x in lat], "-", color=color,
                 label=f"N={r['sessions']} p99")
        ax1.plot([x["t"] + 0.5 for x in lat], [x["p50_ms"] for x in lat], "--", color=color,
                 label=f"N={r['sessions']} p50")
        tl = [x for x in r["stage_timeline"] if x.get("talker_tick_p99_ms") is not None]
        ax2.plot([(x["t0"] + x["t"]) / 2 for x in tl], [x["talker_tick_p99_ms"] for x in tl], "-", color=color,
                 label=f"N={r['sessions']}")
    ax1.set_ylim(bottom=0)
    ax2.set_ylim(bottom=0)
    ax1.set_ylabel("e2e frame latency (ms)")
    ax1.set_title(f"PersonaPlex cell, {result['mode']}: encoder + talker + decoder"
                  + (" under MPS" if result["mps"]["enabled"] else ""))
    ax1.legend(fontsize=8, ncol=2)
    ax1.grid(alpha=0.3)
    ax2.axhline(80, color="red", lw=0.8, label="80 ms frame")
    ax2.set_ylabel("talker tick p99 per ~1 s (ms)")
    ax2.set_xlabel("seconds since the shared start")
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
