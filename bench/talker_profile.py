"""Where the talker's frame time goes on the GPU: a kernel-level profile of the step.

    python -m bench.talker_profile --tokenizer T [--batches 1,160] [--weights-fp8] [--compile] [--out DIR]

Full-size random weights (bf16) on the GPU, fp8 KV, every slot at full context, like
bench/talker.py. For each batch size: the graphed step's wall time, then a few eager steps under
torch.profiler, with the GPU time summed per kernel and per kind (decode attention, matmul,
sampling, the rest). The gap between the kernels' sum and the graphed step is time the GPU spends
between kernels (a graph removes launch cost, not the dependency bubbles of small kernels).
Prints a table per batch size and writes talker_profile.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from bench.talker import full_context_step, random_model, timed
from services.talker.text import TextTokenizer
from services.talker import decode_attention, fused
from services.talker.engine import AGENT_CODEBOOKS
from services.talker.model import LMConfig

KINDS = (  # first match wins; the names are those of the CUDA kernels torch and Triton launch
    ("decode attention", ("_decode_kernel",)),
    ("matmul", ("gemm", "gemv", "cutlass", "sm90_xmma", "nvjet", "cublas")),
    ("sampling (topk/sort/softmax/rng)", ("topk", "sort", "softmax", "philox", "radix", "bitonic", "gatherTopK")),
    ("attention (sdpa)", ("flash", "fmha", "attention")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k.lower() in low for k in keys):
            return kind
    return "other (elementwise, norms, copies)"


def profile_batch(model, tok, B: int, steps: int) -> dict:
    row: dict = {"batch": B}
    for graphed in (True, False):
        engine, one = full_context_step(model, tok, B, kv_bits=8, cuda_graph=graphed)
        timed(one, 5)
        ms = sorted(timed(one, 20))
        row["graphed_ms" if graphed else "eager_ms"] = round(ms[len(ms) // 2], 3)
        if not graphed:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    one()
                torch.cuda.synchronize()
            per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
            for ev in prof.events():
                if ev.device_type == torch.autograd.DeviceType.CUDA:
                    k = per_kernel[ev.name]
                    k[0] += ev.device_time_total / 1000.0 / steps  # ms per step
                    k[1] += 1
            kinds: dict[str, float] = defaultdict(float)
            for name, (t, _) in per_kernel.items():
                kinds[kind_of(name)] += t
            row["kernel_ms_per_step"] = round(sum(kinds.values()), 3)
            row["kernel_launches_per_step"] = sum(n for _, n in per_kernel.values()) // steps
            row["by_kind_ms"] = {k: round(v, 3) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])}
            top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:25]
            row["top_kernels"] = [{"name": n[:120], "ms": round(t, 4), "calls": c // steps} for n, (t, c) in top]
        del engine, one  # the step closure holds the engine too; its rings must go before the next
        gc.collect()
        torch.cuda.empty_cache()
    row["between_kernels_ms"] = round(row["graphed_ms"] - row["kernel_ms_per_step"], 3)
    return row


def print_row(row: dict) -> None:
    print(f"\nB={row['batch']}: graphed {row['graphed_ms']} ms, eager {row['eager_ms']} ms, kernels "
          f"{row['kernel_ms_per_step']} ms in {row['kernel_launches_per_step']} launches, "
          f"graphed - kernels = {row['between_kernels_ms']} ms")
    for k, v in row["by_kind_ms"].items():
        print(f"  {v:8.3f} ms  {k}")
    print("  top kernels:")
    for k in row["top_kernels"][:15]:
        print(f"  {k['ms']:8.3f} ms  x{k['calls']:<4} {k['name'][:100]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,160")
    ap.add_argument("--steps", type=int, default=3, help="eager steps under the profiler")
    ap.add_argument("--tokenizer", required=True, help="a SentencePiece model")
    ap.add_argument("--weights-fp8", action="store_true", help="the temporal matrices in fp8 (the serving config)")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile'd elementwise kernels (services/talker/fused.py)")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.talker_profile needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.compile:
        fused.enable()
    t0 = time.perf_counter()
    model = random_model(LMConfig.full(), dep_steps=AGENT_CODEBOOKS)
    if args.weights_fp8:
        model.quantize_weights_fp8_()
    tok = TextTokenizer.load(args.tokenizer)
    print(f"model built in {time.perf_counter() - t0:.1f} s", flush=True)
    rows = []
    for b in (int(x) for x in args.batches.split(",") if x):
        rows.append(profile_batch(model, tok, b, args.steps))
        print_row(rows[-1])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "talker_profile" + ("_fp8w" if args.weights_fp8 else "") + ("_compiled" if args.compile else "") + ".json"
    (out / name).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "weights_fp8": args.weights_fp8,
                                        "compile": args.compile,
                                        "attention_launch": [decode_attention.BLOCK_N, decode_attention.NUM_WARPS,
                                                             decode_attention.NUM_STAGES],
                                        "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
