"""GPU profile of one prefill piece beside a full batch: where its time goes, host and device.

    python -m bench.prefill_profile --checkpoint DIR [--slots 160] [--pieces 8] [--out DIR]

The talker as served at the headline (fp8 weights and KV, CUDA-graphed step and prefill chunk,
torch.compile'd elementwise kernels, every slot at full context): all slots but one go live and
step; between steps, the last slot's session is opened again and again (begin, then its prompt in
one piece), as a probe session does in bench.cell. Reported per piece: the host time of each
part (begin; voice KV copy, prompt chunk, go-live inside the chunk launch) and the GPU wait after
it; and, for the last piece, the CUDA runtime calls the host made, from torch.profiler (a call that
blocks, e.g. cudaStreamSynchronize or cudaMalloc, shows as a long one) and the lines of ours that
synchronized with the GPU (torch.cuda.set_sync_debug_mode). Then what a step costs
with 1, 4, 16 and all rows active (a catch-up step runs only the sessions still behind), and the
kernels of each captured prefill chunk (one per ring window it reads: engine.PREFILL_GRAPH_WINDOWS),
run eagerly once (a graph replay hides them). Writes prefill_profile.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
import warnings
from pathlib import Path

import torch

from services.common.checkpoint import CheckpointPaths
from services.talker import fused
from services.talker.engine import SamplingParams, TalkerEngine

PERSONA = "You are a helpful assistant who answers briefly."


def timed(eng: TalkerEngine, name: str, into: dict) -> None:
    """Wrap eng.<name> so its host time per call adds into into[name] (ms)."""
    fn = getattr(eng, name)

    @functools.wraps(fn)
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            into[name] = into.get(name, 0.0) + (time.perf_counter() - t0) * 1e3

    setattr(eng, name, wrapper)


@torch.no_grad()
def profile_chunk_kernels(eng: TalkerEngine, slot: int, window: int | None, frames: int, top: int = 20) -> dict:
    """A captured prefill chunk's function (`frames` frames reading `window` ring entries, None: all),
    run eagerly once into `slot` under the profiler: its GPU time and its kernels by GPU time (a
    graph replay hides them). Leaves `slot` garbled."""
    slot_t = eng.kv.slot_index(slot)
    tokens = torch.full((1, frames, eng.cfg.num_streams), -1, dtype=torch.long, device=eng.device)

    def forward() -> None:
        eng.kv.length[slot] = 0  # a fresh slot: the window holds its history
        eng.model.temporal(eng.model.embed(tokens, check=False), eng.kv, slot_t, window, prompt=True)

    forward()  # warm
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    forward()
    end.record()
    torch.cuda.synchronize()
    eager_ms = start.elapsed_time(end)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        forward()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if getattr(e, "device_time_total", 0) > 0]
    events.sort(key=lambda e: -e.device_time_total)
    kernels = [{"name": e.key, "calls": e.count, "device_ms": e.device_time_total / 1e3} for e in events[:top]]
    total = sum(e.device_time_total for e in events) / 1e3
    print(f"\neager prefill chunk ({frames} frames, one slot, reading {window or 'all'} ring entries): "
          f"{eager_ms:.2f} ms GPU by events, {total:.2f} ms in kernels; by kernel:")
    for k in kernels[:top if window is None else 6]:
        print(f"  {k['device_ms']:8.3f} ms  {k['calls']:4d}x  {k['name'][:100]}")
    return {"frames": frames, "window": window, "eager_ms": eager_ms, "kernel_ms": total, "top_kernels": kernels}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--slots", type=int, default=160)
    ap.add_argument("--pieces", type=int, default=8)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (no graphs, no compile)")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("no CUDA GPU here (--device cpu runs a smoke test of the script)", file=sys.stderr)
        return 2
    if cuda:
        fused.enable()
    t0 = time.perf_counter()
    eng = TalkerEngine.from_checkpoint(CheckpointPaths.open(args.checkpoint), args.slots, device=args.device,
                                       dtype=torch.bfloat16 if cuda else torch.float32, kv_fp8=True,
                                       cuda_graph=cuda, weights_fp8=cuda)
    eng.bench_full_context = True
    eng.warmup(("NATF2.pt",))
    print(f"engine ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    S, probe = eng.num_slots, eng.num_slots - 1
    for slot in range(S - 1):
        job = eng.begin(slot, "NATF2.pt", PERSONA, SamplingParams(seed=slot))
        while not job.run(eng.prefill_graph_frames):
            pass
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    print(f"{S - 1} sessions live after {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    active = torch.ones(S, dtype=torch.bool)
    active[probe] = False
    codes = torch.zeros(S, 8, dtype=torch.long)
    parts: dict = {}
    for name in ("_copy_voice_kv", "_prefill_chunk", "_go_live"):
        timed(eng, name, parts)
    rows, trace, syncs = [], [], []
    for i in range(args.pieces):
        r = eng.step(codes, active)
        r.text_tokens.cpu()  # the tick's outputs on the host: the piece runs in the slack after it
        step_device_ms = (eng.last_step_device_s() or 0.0) * 1e3
        last = i == args.pieces - 1
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                  torch.profiler.ProfilerActivity.CUDA][:1 + cuda]) if last else None
        if prof:
            prof.__enter__()
            # Which lines of ours synchronize with the GPU: torch warns at each, from the calling line.
            caught = warnings.catch_warnings(record=True)
            sync_warnings = caught.__enter__()
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
        parts.clear()
        t0 = time.perf_counter()
        eng.release(probe)
        job = eng.begin(probe, "NATF2.pt", PERSONA, SamplingParams(seed=1000 + i))
        t1 = time.perf_counter()
        done = job.run(eng.prefill_graph_frames)
        t2 = time.perf_counter()
        sync()
        t3 = time.perf_counter()
        if prof:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
            caught.__exit__(None, None, None)
            syncs = sorted({f"{Path(w.filename).name}:{w.lineno}" for w in sync_warnings
                            if "synchroniz" in str(w.message)})
            prof.__exit__(None, None, None)
            trace = [{"name": e.key, "calls": e.count, "cpu_total_ms": e.cpu_time_total / 1e3,
                      "device_total_ms": getattr(e, "device_time_total", 0.0) / 1e3}
                     for e in sorted(prof.key_averages(), key=lambda e: -e.cpu_time_total)[:25]]
        row = {"piece": i, "done": done, "step_device_ms": step_device_ms, "begin_ms": (t1 - t0) * 1e3,
               "launch_ms": (t2 - t1) * 1e3, "device_wait_ms": (t3 - t2) * 1e3,
               **{k.strip("_") + "_ms": v for k, v in parts.items()}}
        rows.append(row)
        print("  ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    # What a catch-up step costs: the same graph with only a few rows active (the others attend over
    # one KV entry each), against a main step of every live session.
    catch_up = {}
    for rows_active in sorted({min(r, S - 1) for r in (1, 4, 16, S - 1)}):
        act = torch.zeros(S, dtype=torch.bool)
        act[:rows_active] = True
        walls, devs = [], []
        for _ in range(5):
            t0 = time.perf_counter()
            eng.step(codes, act).text_tokens.cpu()
            walls.append((time.perf_counter() - t0) * 1e3)
            devs.append((eng.last_step_device_s() or 0.0) * 1e3)
        catch_up[rows_active] = {"wall_ms": sorted(walls)[2], "device_ms": sorted(devs)[2]}
        print(f"step with {rows_active:3d} active rows: wall {sorted(walls)[2]:.2f} ms, GPU {sorted(devs)[2]:.2f} ms "
              "(median of 5)")
    # Every captured chunk's kernels, by the ring entries it reads (the probe's prompt runs the smallest).
    n, first = job._cols.inputs.shape[0], job._cols.first
    g = eng.prefill_graph_for(min(n, eng.prefill_graph_frames), first)
    ran = "eagerly" if g is None else f"as the graph reading {g.window or 'all'} ring entries"
    print(f"\nthe probe's prompt: {n} frames from position {first}, its first chunk ran {ran}")
    chunk_kernels = [profile_chunk_kernels(eng, probe, g.window, g.frames) for g in eng._prefill_graphs]
    print(f"\nlast piece, lines that synchronized with the GPU: {', '.join(syncs) or 'none'}")
    print("last piece, CUDA runtime and torch calls by host time (profiled, so slower):")
    for e in trace:
        print(f"  {e['cpu_total_ms']:8.2f} ms host  {e['device_total_ms']:8.2f} ms GPU  {e['calls']:5d}x  "
              f"{e['name'][:90]}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"slots": S, "rows": rows, "step_by_active_rows": catch_up, "sync_lines": syncs,
              "eager_chunk": chunk_kernels, "last_piece_calls": trace}
    (out / "prefill_profile.json").write_text(json.dumps(result, indent=1) + "\n")

    print(f"wrote {out / 'prefill_profile.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
