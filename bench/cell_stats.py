"""Pure numbers for bench/cell.py: Prometheus snapshots, bucket quantiles, per-frame stats.

Nothing here does I/O, so every rule the benchmark's verdict rests on is unit-tested on
hand-made data (tests/test_bench_cell.py).

    snap = parse_metrics(text)                                  # one /metrics scrape
    h = histogram_delta(before, after, "duplex_talker_tick_seconds")
    bucket_quantile(h, 0.99)                                     # Prometheus-style, bucket resolution
    fraction_le(h, 0.080)                                        # exact when 0.080 is a bucket bound
    gpu_memory({"talker": snap, ...})                            # the stages' CUDA memory gauges, MiB
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

# A sample is (name, labels as a sorted tuple of (key, value)).
SampleKey = tuple[str, tuple[tuple[str, str], ...]]
Snapshot = dict[SampleKey, float]


def parse_metrics(text: str) -> Snapshot:
    """Every sample of a Prometheus text exposition, keyed by (name, sorted labels)."""
    snap: Snapshot = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            snap[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return snap


def _counter_increases(before: Snapshot, after: Snapshot, name: str, labels: dict[str, str]):
    """(label set, increase) of each sample of counter `name` whose labels match `labels`, between two
    scrapes. prometheus_client exposes counter `x` as sample `x_total`; both spellings are accepted."""
    for (n, labs), v in after.items():
        d = dict(labs)
        if n in (name, name + "_total") and all(d.get(k) == v2 for k, v2 in labels.items()):
            yield d, v - before.get((n, labs), 0.0)


def counter_delta(before: Snapshot, after: Snapshot, name: str, **labels: str) -> float:
    """Increase of a counter (summed over label sets that match `labels`) between two scrapes."""
    return sum((inc for _, inc in _counter_increases(before, after, name, labels)), 0.0)


@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts of one histogram over an interval. bounds ascend, last is +inf."""

    bounds: tuple[float, ...]
    cumulative: tuple[float, ...]
    sum: float

    @property
    def count(self) -> float:
        return self.cumulative[-1] if self.cumulative else 0.0

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count else math.nan


def histogram_delta(before: Snapshot, after: Snapshot, name: str, **labels: str) -> Histogram:
    """The histogram `name` (its `_bucket`/`_sum` samples matching `labels`) observed between two scrapes."""
    buckets: dict[float, float] = {}
    total_sum = 0.0
    for (n, labs), v in after.items():
        d = dict(labs)
        if any(d.get(k) != v2 for k, v2 in labels.items()):
            continue
        if n == name + "_bucket":
            le = float(d["le"])  # "+Inf" parses to inf
            buckets[le] = buckets.get(le, 0.0) + v - before.get((n, labs), 0.0)
        elif n == name + "_sum":
            total_sum += v - before.get((n, labs), 0.0)
    bounds = tuple(sorted(buckets))
    return Histogram(bounds, tuple(buckets[b] for b in bounds), total_sum)


def bucket_quantile(h: Histogram, q: float) -> float:
    """Quantile q by linear interpolation inside the bucket that holds it (Prometheus'
    histogram_quantile). Resolution is the bucket width. A quantile in the +Inf bucket returns
    the largest finite bound (a lower bound of the truth). NaN without observations."""
    if not h.bounds or h.count <= 0:
        return math.nan
    rank = q * h.count
    prev_bound, prev_cum = 0.0, 0.0
    for bound, cum in zip(h.bounds, h.cumulative):
        if cum >= rank and cum > prev_cum:
            if math.isinf(bound):
                return prev_bound
            return prev_bound + (bound - prev_bound) * (rank - prev_cum) / (cum - prev_cum)
        prev_bound, prev_cum = bound, cum
    return prev_bound


def fraction_le(h: Histogram, bound: float) -> float:
    """Share of observations <= bound. Exact when `bound` is one of the bucket bounds."""
    if h.count <= 0:
        return math.nan
    if bound not in h.bounds:
        raise ValueError(f"{bound} is not a bucket bound of this histogram ({h.bounds}); the share would be a guess")
    return h.cumulative[h.bounds.index(bound)] / h.count


def count_gt(h: Histogram, bound: float) -> float:
    """Observations above `bound` (a bucket bound)."""
    return h.count - fraction_le(h, bound) * h.count if h.count > 0 else 0.0


def ms_summary(seconds: list[float] | np.ndarray) -> dict:
    """p50/p99/max in milliseconds of raw samples (exact, not bucketed)."""
    a = np.asarray(seconds, dtype=np.float64)
    if a.size == 0:
        return {"count": 0, "p50": None, "p99": None, "max": None}
    ms = a * 1000.0
    return {"count": int(a.size), "p50": round(float(np.percentile(ms, 50)), 2),
            "p99": round(float(np.percentile(ms, 99)), 2), "max": round(float(ms.max()), 2)}


def histogram_summary_ms(h: Histogram) -> dict:
    """Bucket-resolution p50/p99 (ms) of a seconds histogram, with its count and mean."""
    def ms(x: float):
        return None if math.isnan(x) else round(x * 1000.0, 2)
    return {"count": int(h.count), "p50": ms(bucket_quantile(h, 0.5)), "p99": ms(bucket_quantile(h, 0.99)),
            "mean": ms(h.mean)}


def histogram_summary_counts(h: Histogram) -> dict:
    """Bucket-resolution p50/p90/p99 and mean of a histogram of counts (not seconds), with its count."""
    if h.count == 0:
        return {"count": 0}
    return {"count": int(h.count), "mean": round(h.mean, 2), "p50": round(bucket_quantile(h, 0.5), 1),
            "p90": round(bucket_quantile(h, 0.9), 1), "p99": round(bucket_quantile(h, 0.99), 1)}


def has_metric(snap: Snapshot, name: str) -> bool:
    """Whether a scrape exports `name` at all (a counter also as `name`_total): absent is not zero."""
    return any(n in (name, name + "_total") for n, _ in snap)


# ---- per-frame client records ------------------------------------------------------------------

@dataclass
class SessionRecord:
    """One load session's frames, times in seconds relative to the shared start."""

    send_t: list[float]  # send time of input frame i (index = input seq)
    recv: list[tuple[int, float]]  # (input_seq, receive time) of each decoded output frame
    output_delay_frames: int

    def latencies(self) -> list[tuple[float, float]]:
        """(receive time, latency) of every output whose input frame was sent."""
        out = []
        for seq, t in self.recv:
            if 0 <= seq < len(self.send_t):
                out.append((t, t - self.send_t[seq]))
        return out


def backlog_series(records: list[SessionRecord], grid: np.ndarray) -> np.ndarray:
    """Mean over sessions of frames in flight at each time of `grid`: input frames sent that owe an
    output (seq >= the model's delay) minus outputs received. Flat when the cell keeps up."""
    if not records:
        return np.zeros_like(grid)
    total = np.zeros(len(grid))
    for r in records:
        owed = np.sort(np.asarray(r.send_t[r.output_delay_frames:], dtype=np.float64))
        got = np.sort(np.asarray([t for _, t in r.recv], dtype=np.float64))
        total += np.searchsorted(owed, grid, side="right") - np.searchsorted(got, grid, side="right")
    return total / len(records)


def backlog_trend(grid: np.ndarray, backlog: np.ndarray, *, skip_s: float, max_growth_frames: float) -> dict:
    """Least-squares slope of the mean backlog after the first `skip_s` (start-up), and whether it
    grows: growth over the observed span above `max_growth_frames` means the cell falls behind."""
    keep = grid >= skip_s
    x, y = grid[keep], backlog[keep]
    if x.size < 2:
        return {"slope_frames_per_s": None, "growth_frames": None, "start": None, "end": None, "max": None,
                "growing": None}
    slope = float(np.polyfit(x, y, 1)[0])
    growth = slope * float(x[-1] - x[0])
    return {"slope_frames_per_s": round(slope, 4), "growth_frames": round(growth, 3), "start": round(float(y[0]), 3),
            "end": round(float(y[-1]), 3), "max": round(float(y.max()), 3), "growing": bool(growth > max_growth_frames)}


def output_rate_windows(records: list[SessionRecord], duration_s: float, window_s: float) -> list[dict]:
    """Output frames per second per session in consecutive windows of the send period (12.5 when
    every session keeps up): mean over sessions and the slowest session."""
    if not records or window_s <= 0:
        return []
    rows = []
    t0 = 0.0
    while t0 + window_s <= duration_s + 1e-9:
        rates = [sum(1 for _, t in r.recv if t0 <= t < t0 + window_s) / window_s for r in records]
        rows.append({"t0": round(t0, 3), "t1": round(t0 + window_s, 3), "mean_fps": round(float(np.mean(rates)), 3),
                     "min_fps": round(float(np.min(rates)), 3)})
        t0 += window_s
    return rows


def per_second_latency(records: list[SessionRecord], seconds: int) -> list[dict]:
    """e2e latency p50/p99 (ms) of the outputs received in each whole second of the run."""
    pairs = [p for r in records for p in r.latencies()]
    if not pairs:
        return [{"t": s, "count": 0, "p50_ms": None, "p99_ms": None} for s in range(seconds)]
    t = np.asarray([p[0] for p in pairs])
    lat = np.asarray([p[1] for p in pairs]) * 1000.0
    rows = []
    for s in range(seconds):
        sel = lat[(t >= s) & (t < s + 1)]
        rows.append({"t": s, "count": int(sel.size),
                     "p50_ms": round(float(np.percentile(sel, 50)), 2) if sel.size else None,
                     "p99_ms": round(float(np.percentile(sel, 99)), 2) if sel.size else None})
    return rows


def counter_by_label(before: Snapshot, after: Snapshot, name: str, label: str, **labels: str) -> dict[str, float]:
    """Increase of a counter between two scrapes, split by one label (e.g. errors by `kind`); zeros left out."""
    out: dict[str, float] = {}
    for d, inc in _counter_increases(before, after, name, labels):
        if inc:
            out[d.get(label, "")] = out.get(d.get(label, ""), 0.0) + inc
    return out


# ---- GPU memory gauges ------------------------------------------------------------------------

MIB = 1024 * 1024
# What each stage exports on CUDA only (services/common/metrics.py); absent on the CPU.
GPU_MEMORY_GAUGES = {"allocated_mib": "duplex_stage_gpu_memory_allocated_bytes",  # torch.cuda.memory_allocated()
                     "reserved_mib": "duplex_stage_gpu_memory_reserved_bytes"}  # torch.cuda.memory_reserved()
GPU_FREE_GAUGE = "duplex_stage_gpu_memory_free_bytes"  # torch.cuda.mem_get_info()[0]: device-wide free


def gauge_value(snap: Snapshot, name: str, stage: str) -> float | None:
    """A gauge's value in one stage's scrape (samples labelled with another stage left out), or
    None when the stage does not export it."""
    values = [v for (n, labs), v in snap.items() if n == name and dict(labs).get("stage", stage) == stage]
    return sum(values) if values else None


def gpu_memory(snaps: dict[str, Snapshot | None]) -> dict | None:
    """Per stage {"allocated_mib", "reserved_mib"} (None for a stage without the gauges or without
    a scrape) and "device_free_mib": the lowest free figure any stage reported (they share one GPU;
    the scrapes are a moment apart, so the lowest is the most recent squeeze). None when no stage
    exports the gauges at all, as on the CPU."""
    stages: dict[str, dict | None] = {}
    free: list[float] = []
    for stage, snap in snaps.items():
        vals = {k: gauge_value(snap, name, stage) for k, name in GPU_MEMORY_GAUGES.items()} if snap else {}
        stages[stage] = {k: round(v / MIB, 1) for k, v in vals.items()} if vals and None not in vals.values() else None
        f = gauge_value(snap, GPU_FREE_GAUGE, stage) if snap else None
        if f is not None:
            free.append(f)
    if all(v is None for v in stages.values()) and not free:
        return None
    return {"stages": stages, "device_free_mib": round(min(free) / MIB, 1) if free else None}
