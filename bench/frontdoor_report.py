"""bench/frontdoor.py's verdict and report: each traffic pattern's pass rule, the table, the plot.

Pass rules (issue 28's targets; every bound is a flag of bench.frontdoor):
- realistic: the load driver's client kept up (verdict not INVALID); every admitted caller passed (none
  failed, none killed); every caller was served, a refused one within --served-within-s; in the steady
  window: >= --min-ticks-pct (99.5) of the talker's ticks within 80 ms, tick p99 <= --max-tick-p99-ms
  (75), frame latency p50 <= --max-frame-latency-p50-ms (120) and p99 <= --max-frame-latency-p99-ms
  (250), sessions behind per tick p50 <= --max-sessions-behind-p50 (2); over every caller: first audio
  p99 <= --max-first-audio-p99-ms (400; first frame sent -> first audio delta).
- burst: the client kept up; zero kills and zero server_error events; every caller served, a refused
  one within --served-within-s; every refusal up front (before session.created: none lost a slot it
  had been given). Its first audio p99 is reported, not judged.
- together (the comparison): the driver's verdict PASS (every session passed, frame latency p99
  within its bound), every probe cycle got audio, probe first audio p99 <= --max-first-audio-p99-ms,
  the ticks and tick p99 as above, over the whole run.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

STAGES = ("encoder", "talker", "decoder")
# What each pattern is, in frontdoor.json and above the table.
TRAFFIC_NOTES = {
    "realistic": "the headline: callers arrive over time, open as the SDKs do, talk and hang up (churn)",
    "burst": "a failover: every caller dials within a few seconds; refused ones retry",
    "together": "a comparison, not the headline: every session opens first, then all stream from one start",
}


def _at_most(value, bound: float) -> bool:
    return value is not None and value <= bound


def checks(row: dict, cfg) -> dict[str, bool]:
    """The pass rule of the row's traffic (see the module docstring); cfg is bench.frontdoor's config."""
    talker = row["talker"]
    ticks = {"ticks_within_80ms": row["ticks_within_80ms_pct"] is not None
                                  and row["ticks_within_80ms_pct"] >= cfg.min_ticks_pct,
             "tick_p99": _at_most(talker["tick_ms"].get("p99"), cfg.max_tick_p99_ms)}
    first_audio_p99 = (row["first_audio_ms"] or {}).get("p99")
    if row["traffic"] == "together":
        probes = row["probes"]
        return {"driver_pass": row["driver"].get("verdict") == "PASS",
                "probes_got_audio": (probes["cycles"] > 0 and probes["with_audio"] == probes["opened"]
                                     and not probes["errors"]),
                **ticks, "first_audio": _at_most(first_audio_p99, cfg.max_first_audio_p99_ms)}
    calls = row["callers"]
    served = (calls["served"] == calls["callers"] > 0) and calls["all_refused_served_in_time"]
    client = {"client_valid": row["driver"].get("verdict") in ("PASS", "FAIL")}
    if row["traffic"] == "burst":
        return {**client, "no_kills": calls["status"]["killed"] == 0,
                "no_server_error": calls["server_error_events"] == 0, "callers_served": served,
                "refusals_up_front": calls["refusals"]["after_created"] == 0}
    e2e = row["e2e_ms"] or {}
    return {**client, "admitted_pass": calls["admitted_passed"] == calls["admitted"], "callers_served": served,
            **ticks, "frame_latency_p50": _at_most(e2e.get("p50"), cfg.max_frame_latency_p50_ms),
            "frame_latency_p99": _at_most(e2e.get("p99"), cfg.max_frame_latency_p99_ms),
            "first_audio": _at_most(first_audio_p99, cfg.max_first_audio_p99_ms),
            "sessions_behind": _at_most(row["sessions_behind"].get("p50"), cfg.max_sessions_behind_p50)}


def _q(d: dict | None, k: str) -> str:
    return "-" if not d or d.get(k) is None else f"{d[k]:.0f}"


def _pair(d: dict | None, a: str = "p50", b: str = "p99") -> str:
    return f"{_q(d, a)}/{_q(d, b)}"


def print_table(result: dict) -> None:
    print(f"\nfront door: {result['mode']}, gateway workers {result['config']['gateway_workers'] or 'default'}")
    for traffic in dict.fromkeys(r.get("traffic") for r in result["runs"] if r.get("traffic")):
        print(f"  {traffic}: {TRAFFIC_NOTES[traffic]}")
    print(f"{'N':>4} {'traffic':>9} {'pass':>5} {'ticks<=80':>9} {'tick p99':>8} {'e2e p50/p99':>12} "
          f"{'1st audio p50/p99':>18} {'behind p50':>10} {'refused/killed':>14} {'verdict':>8} {'gw cores':>9}")
    for r in result["runs"]:
        if "failed" in r:
            print(f"{r['sessions']:>4} {r.get('traffic', '-'):>9} {'FAIL':>5}  {r['failed'][:100]}")
            continue
        gw = sum(v for k, v in r["cpu_cores"].items() if k.startswith("gateway"))
        calls = r.get("callers")
        fates = "-" if calls is None else f"{calls['refusals']['callers_refused']}/{calls['status']['killed']}"
        print(f"{r['sessions']:>4} {r['traffic']:>9} {'yes' if r['passed'] else 'no':>5} "
              f"{r['ticks_within_80ms_pct'] or '-':>8}% {_q(r['talker']['tick_ms'], 'p99'):>8} "
              f"{_pair(r['e2e_ms']):>12} {_pair(r['first_audio_ms']):>18} {_q(r['sessions_behind'], 'p50'):>10} "
              f"{fates:>14} {str(r['driver'].get('verdict')):>8} {gw:>9.2f}")
        if r["traffic"] != "together":
            print(f"     window {r['window']['length_s']:.0f} s; session latency p50 across sessions p10/p50/p90 "
                  f"{_q(r['session_latency_p50_ms'], 'p10')}/{_q(r['session_latency_p50_ms'], 'p50')}/"
                  f"{_q(r['session_latency_p50_ms'], 'p90')} ms; first audio from connect "
                  f"{_pair(r['first_audio_after_connect_ms'])} ms; prompts per open {r['prompts_per_open'] or '-'}; "
                  f"catch-up steps {r['talker']['catch_up_steps']}; callers {calls['status']}; refusals "
                  f"{calls['refusals']['by_type']}")


def plot(result: dict, path: Path) -> Path | None:
    runs = [r for r in result["runs"] if "failed" not in r]
    if not runs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for i, traffic in enumerate(dict.fromkeys(r["traffic"] for r in runs)):
        mine = [r for r in runs if r["traffic"] == traffic]
        ns = [r["sessions"] for r in mine]
        for key, label in (("e2e_ms", "frame latency"), ("first_audio_ms", "first audio")):
            for q, style in (("p50", "-o"), ("p99", "--o")):
                ys = [(r[key] or {}).get(q) for r in mine]
                axes[0].plot(ns, [y if y is not None else np.nan for y in ys], style,
                             color=f"C{2 * i + (key != 'e2e_ms')}", label=f"{traffic}: {label} {q}")
        axes[1].plot(ns, [r["ticks_within_80ms_pct"] or np.nan for r in mine], "-o", label=traffic)
        for name in sorted({k for r in mine for k in r["cpu_cores"]}):
            axes[2].plot(ns, [r["cpu_cores"].get(name, np.nan) for r in mine], "-o", label=f"{traffic}: {name}")
    for y, c in ((120, "grey"), (250, "grey"), (400, "tab:red")):
        axes[0].axhline(y, color=c, lw=0.8, ls=":")
    axes[0].set(xlabel="sessions", ylabel="ms", title="client-measured latency")
    axes[1].axhline(99.5, color="tab:red", lw=0.8, ls=":")
    axes[1].set(xlabel="sessions", ylabel="% of talker ticks <= 80 ms", title="talker ticks on time")
    axes[2].set(xlabel="sessions", ylabel="CPU cores", title="CPU per process")
    for ax in axes:
        ax.legend(fontsize=6)
    fig.suptitle(f"PersonaPlex through the real gateway: {result['mode']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
