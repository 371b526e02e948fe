"""What a codec step costs by the rows it runs: every slot (the full step) against compact steps.

    python -m bench.codec_steps --slots 160 --active 8,40,80,120,160 --buckets 32,64,96,128 --device cuda
    python -m bench.codec_steps --slots 16 --active 2,8,16 --buckets 4,8,12      # the mechanism, on a CPU

The full-size Mimi (--preset full; random weights: the cost does not depend on them), one StreamingEncoder and one
StreamingDecoder of --slots slots each, CUDA graphs on a GPU; per N active slots, the mean and p99
time of one step with and without --buckets (mimi/streaming.py, compact steps), after a warm-up.
Prints a table and writes codec_steps.json under --out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from services.codec.mimi import MimiConfig, MimiModel, StreamingDecoder, StreamingEncoder
from services.codec.stage import parse_buckets


def time_steps(streamer, make_input, active: torch.Tensor, steps: int, sync) -> list[float]:
    x = make_input()
    for _ in range(3):
        streamer.step(x, active)
    out = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        streamer.step(x, active)
        sync()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=160)
    ap.add_argument("--active", default="8,40,80,120,160", help="active slot counts to time")
    ap.add_argument("--buckets", type=parse_buckets, default=(32, 64, 96, 128))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--preset", choices=("full", "tiny"), default="full", help="tiny: the test model (smoke test)")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    mimi_cfg = MimiConfig.full() if args.preset == "full" else MimiConfig.tiny()
    model = MimiModel.random(mimi_cfg, seed=0, device=args.device).eval()
    g = torch.Generator().manual_seed(0)
    inputs = {"encoder": lambda: 0.3 * torch.randn(args.slots, 1920, generator=g),
              "decoder": lambda: torch.randint(0, 2048, (args.slots, 8), generator=g)}
    rows = []
    with torch.no_grad():
        for stage, cls in (("encoder", StreamingEncoder), ("decoder", StreamingDecoder)):
            variants = {"full": cls(model, args.slots, cuda_graph=cuda),
                        "compact": cls(model, args.slots, cuda_graph=cuda, buckets=args.buckets)}
            for n in sorted({int(a) for a in args.active.split(",")}):
                active = torch.zeros(args.slots, dtype=torch.bool)
                active[:n] = True
                row = {"stage": stage, "active": n}
                for name, streamer in variants.items():
                    ms = np.array(time_steps(streamer, inputs[stage], active, args.steps, sync)) * 1e3
                    row[name] = {"mean_ms": round(float(ms.mean()), 3),
                                 "p99_ms": round(float(np.percentile(ms, 99)), 3)}
                rows.append(row)
                print(f"{stage:8s} active {n:4d}/{args.slots}: full {row['full']['mean_ms']:8.2f} ms "
                      f"(p99 {row['full']['p99_ms']:8.2f}), compact {row['compact']['mean_ms']:8.2f} ms "
                      f"(p99 {row['compact']['p99_ms']:8.2f})", flush=True)
            del variants
    device = torch.cuda.get_device_name() if cuda else "cpu"
    result = {"preset": args.preset, "slots": args.slots, "buckets": list(args.buckets), "device": device,
              "cuda_graph": cuda, "steps": args.steps, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "codec_steps.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
