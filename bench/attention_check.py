"""GPU check of the decode-attention kernels: correctness against the torch reference and
achieved bandwidth at serving shapes, for the fp8 ring and the 4-bit one.

    python -m bench.attention_check [--formats fp8,int4] [--out DIR]
    python -m bench.attention_check --formats int4 --smoke [--out DIR]   # the CPU, TRITON_INTERPRET=1

Correctness: fresh random rings and queries, valid lengths from 1 to the whole ring, rows naming
a random permutation of slots, every output element poisoned before the launch. Bandwidth: one
layer at serving shapes, a sweep of launch settings at the full shape (fp8: 160 slots; int4: 288).
Writes attention_check.json (fp8) and attention_check_int4.json (int4, bench/attention_check_int4.py: both
4-bit kernels at every launch setting) under --out."""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # Triton picks its interpreter when it decorates a kernel, i.e. at the imports below
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from bench.attention_check_int4 import main_int4  # noqa: E402
from services.talker.decode_attention import (BLOCK_N, NUM_STAGES, NUM_WARPS, decode_attention,  # noqa: E402
                                              decode_attention_reference, quantize_fp8)


def launch_configs(slots: int, fill: int, context: int) -> list[tuple[int, int, int]]:
    """(block_n, num_warps, num_stages) to time: the whole grid at the serving shape (160 slots,
    full ring), the default elsewhere."""
    if slots == 160 and fill == context:
        return [(bn, w, st) for bn in (64, 128, 256) for w in (4, 8) for st in (2, 3, 4)]
    return [(BLOCK_N, NUM_WARPS, NUM_STAGES)]


def bench(fn, iters=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--formats", default="fp8,int4", help="which rings to check: fp8 (with bf16), int4")
    ap.add_argument("--smoke", action="store_true", help="int4 only, on the CPU under TRITON_INTERPRET=1 at small "
                    "shapes: checks the script and the kernels' arithmetic, times nothing real")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    formats = set(args.formats.split(","))
    if args.smoke and formats != {"int4"}:
        raise SystemExit("--smoke checks the int4 kernels only: pass --formats int4")
    failed = main_int4(out, smoke=args.smoke) if "int4" in formats else []
    if "fp8" in formats:
        failed += main_fp8(out)
    if failed:
        raise SystemExit(f"kernel(s) disagree with the reference: {failed}")


def main_fp8(out: Path) -> list:
    dev = "cuda"
    H, D, C = 32, 128, 3000
    results, sweep = {}, []
    torch.manual_seed(0)
    # correctness, small
    S, B = 12, 8
    ring_k = torch.randn(S, H, C, D, device=dev, dtype=torch.bfloat16)
    ring_v = torch.randn(S, H, C, D, device=dev, dtype=torch.bfloat16)
    q = torch.randn(B, H, D, device=dev, dtype=torch.bfloat16)
    slots = torch.randperm(S, device=dev)[:B]
    n_valid = torch.tensor([1, 2, 63, 64, 65, 1000, 2999, 3000], device=dev)
    sm = D ** -0.5
    failed = []
    for kind in ("bf16", "fp8"):
        if kind == "fp8":
            kq, ks = quantize_fp8(ring_k)
            vq, vs = quantize_fp8(ring_v)
            args_ = (kq, vq, ks, vs)
        else:
            args_ = (ring_k, ring_v, None, None)
        ref = decode_attention_reference(q, *args_, slots, n_valid, sm)
        out = decode_attention(q, *args_, slots, n_valid, sm)
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        results[f"rel_err_kernel_vs_ref_{kind}"] = err
        print(f"{kind}: kernel vs reference relative error {err:.2e}")
        if not err < 2e-2:
            failed.append(f"{kind}: {err:.2e}")
    # fp8 vs bf16 attention output error
    kq, ks = quantize_fp8(ring_k)
    vq, vs = quantize_fp8(ring_v)
    o8 = decode_attention(q, kq, vq, ks, vs, slots, n_valid, sm)
    o16 = decode_attention(q, ring_k, ring_v, None, None, slots, n_valid, sm)
    results["rel_err_fp8_vs_bf16_random"] = ((o8.float() - o16.float()).norm() / o16.float().norm()).item()
    del ring_k, ring_v, kq, vq
    # bandwidth at serving shapes: one layer, S slots full
    for S in (32, 160):
        kq = torch.randn(S, H, C, D, device=dev, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
        vq = torch.randn(S, H, C, D, device=dev, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
        ks = torch.rand(S, H, C, device=dev, dtype=torch.float16)
        vs = torch.rand(S, H, C, device=dev, dtype=torch.float16)
        q = torch.randn(S, H, D, device=dev, dtype=torch.bfloat16)
        slots = torch.arange(S, device=dev)
        for fill in (C, C // 4):
            n_valid = torch.full((S,), fill, device=dev)
            gb = S * H * fill * (2 * D + 4) / 1e9
            for bn, warps, stages in launch_configs(S, fill, C):
                try:
                    t = bench(lambda: decode_attention(q, kq, vq, ks, vs, slots, n_valid, sm, block_n=bn,
                                                       num_warps=warps, num_stages=stages))
                except Exception as e:  # e.g. a config that needs more shared memory than an SM has
                    print(f"S={S} fill={fill} block={bn} warps={warps} stages={stages}: failed: {type(e).__name__}")
                    continue
                key = f"S{S}_fill{fill}_bn{bn}_w{warps}_s{stages}"
                results[f"{key}_ms"] = t * 1e3
                sweep.append({"slots": S, "fill": fill, "block_n": bn, "num_warps": warps, "num_stages": stages,
                              "ms_per_layer": round(t * 1e3, 4), "gb_per_s": round(gb / t)})
                print(f"{key}: {t*1e3:.3f} ms/layer, {gb/t:.0f} GB/s")
        kq = vq = None  # free this size's rings before the next size allocates its own
    full = [r for r in sweep if r["slots"] == 160 and r["fill"] == C]
    if full:
        best = min(full, key=lambda r: r["ms_per_layer"])
        results["best_at_160_full"] = best
        print(f"best at 160 slots, full ring: {best}")
    results["default"] = {"block_n": BLOCK_N, "num_warps": NUM_WARPS, "num_stages": NUM_STAGES}
    results["sweep"] = sweep
    results["failed"] = failed
    (out / "attention_check.json").write_text(json.dumps(results, indent=2))
    return failed


if __name__ == "__main__":
    main()
