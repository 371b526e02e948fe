"""What the GIL's switch interval costs a stage's compute thread beside a busy asyncio loop.

    python -m bench.gil_switch [--ops 20] [--repeats 40] [--out bench/results]

A stage's compute thread makes a dozen or so torch calls per step; each releases the GIL and takes
it back (modelled by 192x192 matmuls, long enough for the other thread to take the GIL). The loop
thread serving the gRPC streams is modelled by a thread running pure Python. For each switch
interval: the time of `--ops` small torch calls on the compute thread (p50, p99), and how much
Python work the busy thread got done meanwhile (relative to the 5 ms default), which is what a
shorter interval costs the loop. Prints a table, writes gil_switch.json. CPU only.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import torch

INTERVALS_MS = (5.0, 1.0, 0.5, 0.2, 0.1)


def measure(interval_ms: float, ops: int, repeats: int, busy_thread: bool = True) -> dict:
    old = sys.getswitchinterval()
    sys.setswitchinterval(interval_ms / 1e3)
    stop, count = threading.Event(), [0]

    def busy() -> None:  # the loop thread: Python work that never blocks
        n = 0
        while not stop.is_set():
            for _ in range(1000):
                n += 1
            count[0] += 1

    thread = threading.Thread(target=busy, daemon=True)
    a = torch.randn(192, 192)  # a call of ~0.1-0.3 ms: long enough for the busy thread to take the GIL
    try:
        if busy_thread:
            thread.start()
        times, t_start = [], time.perf_counter()
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(ops):
                torch.mm(a, a)
            times.append(time.perf_counter() - t0)
        elapsed = time.perf_counter() - t_start
    finally:
        stop.set()
        if busy_thread:
            thread.join()
        sys.setswitchinterval(old)
    times.sort()
    q = lambda p: times[min(len(times) - 1, int(p * len(times)))] * 1e3  # noqa: E731
    return {"interval_ms": interval_ms, "ops_p50_ms": q(0.5), "ops_p99_ms": q(0.99),
            "busy_thread_work_per_s": count[0] * 1000 / elapsed}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for ms in INTERVALS_MS:
        rows.append(measure(ms, args.ops, args.repeats))
        print(f"  switch interval {ms:4.1f} ms measured", file=sys.stderr)
    alone = measure(5.0, args.ops, args.repeats, busy_thread=False)
    print(f"alone (no busy thread): {args.ops} ops p50 {alone['ops_p50_ms']:.2f} ms, p99 {alone['ops_p99_ms']:.2f} ms")
    base = rows[0]["busy_thread_work_per_s"]
    print(f"{'switch ms':>10} {f'{args.ops} ops p50':>14} {'p99':>9} {'busy thread work':>17}")
    for r in rows:
        r["busy_thread_work_rel"] = r["busy_thread_work_per_s"] / base
        print(f"{r['interval_ms']:>10.1f} {r['ops_p50_ms']:>11.2f} ms {r['ops_p99_ms']:>6.2f} ms "
              f"{r['busy_thread_work_rel']:>16.2f}x")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"ops": args.ops, "repeats": args.repeats, "alone": alone, "rows": rows}
    (out / "gil_switch.json").write_text(json.dumps(result, indent=1) + "\n")

    print(f"wrote {out / 'gil_switch.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
