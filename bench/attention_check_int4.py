"""The 4-bit ring's decode kernels (services/talker/kv_int4.py) against their torch reference, and their speed at
serving shapes: the int4 half of `python -m bench.attention_check --formats int4 [--smoke] [--out DIR]`.

1. Correctness, for every launch of the sweep (the three kernels): fresh random rings whose vectors range over two
   orders of magnitude (peaked and flat softmaxes; a zero and a constant vector among them), valid lengths at
   and around every block boundary up to the whole ring, rows naming a random permutation of slots, the output
   poisoned with NaN before the launch. The query in bf16 (as served; tolerance 1e-2, as before) and in fp32 (the
   kernel's arithmetic alone; tolerance 1e-4). A launch that does not compile is listed as unavailable; one that
   disagrees fails the run. Also: whether the tile kernel's exact_bits changes a single output bit.
2. Speed: one layer at 288 full-context slots (3000 positions) for every launch that agrees, then 64 slots full and
   both at a quarter full with the default launch and each kernel's fastest. Bytes per position: 128 code bytes
   and 16 bytes of scales and minimums.

Writes attention_check_int4.json under --out after every measurement (a run cut short keeps what it measured):
per launch its errors, and per shape its ms per layer and GB/s; `best_at_288_full` and `best_launch` (the
fastest launch that agrees, what bench/kv4.sh passes to bench.talker --kv4-launch) and `best_by_kernel`.
--smoke: the same on the CPU under TRITON_INTERPRET=1 at small shapes: checks the script and the kernels'
arithmetic, times nothing real."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from services.talker import kv_int4
from services.talker.decode_attention import decode_attention_reference
from services.talker.kv_int4 import (Kernel, Launch, decode_attention_int4_reference, launch_int4,
                                     quantize_int4)

INT4_SLOTS = 288  # the 4-bit ring's target: full-context sessions beside the codecs on one H200
TOLERANCE_BF16 = 1e-2  # relative L2 against the reference, bf16 output (the tile kernel measured 3.8e-5)
TOLERANCE_FP32 = 1e-4  # the same with an fp32 query and output: only the kernel's own rounding remains


def launches() -> list[Launch]:
    """Every launch to check and time: 20, each compiled twice (a bf16 and an fp32 query), about 1-2 s each. The
    planes and mma kernels at the same settings, the likeliest first, so that a run cut short by its deadline has
    them: 3 stages (two blocks in flight), 2 and 1 (no pipelining); 8 warps with blocks of 256 only (at 128 and
    64 a thread holds one or two rows: about 4.5-5.2 instructions per code, tools/kernel_sass.py). The tile
    kernel at 4 warps and blocks of 128 and 256: at 8 warps or blocks of 64 it measured 1.6-2x slower, and its
    num_stages made no difference (bench/results/kv4-2026-12-02/attention_check_int4.json; Triton pipelines a
    loop without tl.dot only when tl.range asks, which the tile kernel does not)."""
    settings = [(128, 4, 3), (256, 4, 3), (128, 4, 2), (256, 4, 2), (128, 4, 1), (256, 4, 1), (256, 8, 3), (256, 8, 1)]
    fast = [Launch(k, bn, w, st, True) for bn, w, st in settings for k in (Kernel.MMA, Kernel.PLANES)]
    tile = [Launch(Kernel.TILE, bn, 4, 2, exact) for exact in (False, True) for bn in (256, 128)]
    return fast + tile


class Shapes:
    """What the run does: the serving shapes on the GPU; on the CPU (the interpreter runs every program in Python)
    small ones, no bf16 query (the interpreter rounds fp32 to bf16 by truncation, half the elements one bf16 step
    off the reference's rounding), and one launch per kernel timed."""

    def __init__(self, smoke: bool):
        self.smoke = smoke
        self.device = "cpu" if smoke else "cuda"
        self.heads, self.head_dim = (1, 128) if smoke else (32, 128)
        self.context = 320 if smoke else 3000
        self.sweep_slots = (2, 4) if smoke else (64, INT4_SLOTS)
        self.iters = 1 if smoke else 20


def bench(fn, shapes: Shapes) -> float:
    cuda = shapes.device == "cuda"
    for _ in range(1 if not cuda else 3):
        fn()
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(shapes.iters):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / shapes.iters


def rel(a: torch.Tensor, b: torch.Tensor, dim=None) -> torch.Tensor:
    diff, ref = (a.float() - b.float()), b.float()
    if dim is None:
        return diff.norm() / ref.norm()
    return diff.flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)


def check_inputs(shapes: Shapes, seed: int):
    """Rings of S slots and the query rows of one check: (q fp32, ring tensors..., slots, n_valid, exact keys,
    exact values)."""
    dev, H, D, C = shapes.device, shapes.heads, shapes.head_dim, shapes.context
    g = torch.Generator(device=dev).manual_seed(seed)
    # Valid lengths at and around every block size the sweep uses, and the whole ring.
    lengths = sorted({n for b in (64, 128, 256) for n in (b - 1, b, b + 1) if n < C} | {1, 2, C // 3, C - 1, C})
    S = len(lengths) + 2
    magnitude = 10 ** (torch.rand(S, 1, C, 1, device=dev, generator=g) * 2 - 1)  # 0.1 .. 10 per position
    keys = torch.randn(S, H, C, D, device=dev, generator=g) * magnitude
    values = (torch.randn(S, H, C, D, device=dev, generator=g) * 2 + 0.5) * magnitude.flip(2)
    keys[:, :, 0] = 0.0  # a zero key and a constant value at the first position of every slot
    values[:, :, 1] = 2.5
    q = torch.randn(len(lengths), H, D, device=dev, generator=g)
    q *= torch.tensor([1.0, 3.0, 0.3, 10.0], device=dev).repeat(len(lengths))[: len(lengths), None, None]
    slots = torch.randperm(S, device=dev, generator=g)[: len(lengths)]
    ring = (*quantize_int4(keys), *quantize_int4(values))  # codes, scale, zero of the keys, then of the values
    ring = (ring[0], ring[3], ring[1], ring[2], ring[4], ring[5])  # the kernels' order: K, V, KS, KZ, VS, VZ
    return q, ring, slots, torch.tensor(lengths, device=dev), keys, values


def run_launch(q, ring, slots, n_valid, sm, launch: Launch) -> torch.Tensor:
    out = torch.full_like(q, float("nan"))  # poisoned: an element the kernel does not write stays NaN
    return launch_int4(q, *ring, slots, n_valid, sm, launch, out=out)


def check(results: dict, shapes: Shapes, save) -> list[str]:
    """Every launch against the reference; returns what failed. results['launches'][str(launch)] gets its errors
    (or why it is unavailable)."""
    seed = int(time.time())  # fresh inputs every run
    results["check_seed"] = seed
    q32, ring, slots, n_valid, keys, values = check_inputs(shapes, seed)
    sm = shapes.head_dim ** -0.5
    q16 = q32.to(torch.bfloat16)
    ref32 = decode_attention_int4_reference(q32, *ring, slots, n_valid, sm)
    ref16 = None if shapes.smoke else decode_attention_int4_reference(q16, *ring, slots, n_valid, sm)
    results["rows_valid_lengths"] = n_valid.tolist()
    failed, outputs = [], {}
    for launch in launches():
        row = results["launches"].setdefault(str(launch), {**launch._asdict()})
        try:
            out32 = run_launch(q32, ring, slots, n_valid, sm, launch)
            out16 = None if ref16 is None else run_launch(q16, ring, slots, n_valid, sm, launch)
        except Exception as e:  # e.g. a setting this Triton cannot compile, or more shared memory than an SM has
            row.update(ok=False, unavailable=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])
            print(f"int4 {launch}: unavailable ({row['unavailable']})")
            continue
        outputs[launch] = out32
        inf = float("inf")
        finite = bool(torch.isfinite(out32).all())
        e32 = float(rel(out32, ref32)) if finite else inf
        worst_row = float(rel(out32, ref32, dim=0).max()) if finite else inf
        e16 = None if out16 is None else float(rel(out16, ref16)) if torch.isfinite(out16).all() else inf
        ok = e32 < TOLERANCE_FP32 and worst_row < 10 * TOLERANCE_FP32 and (e16 is None or e16 < TOLERANCE_BF16)
        row.update(ok=ok, rel_err_bf16=e16, rel_err_fp32=e32, worst_row_rel_err_fp32=worst_row)
        bf16 = "" if e16 is None else f"bf16 {e16:.2e}, "
        print(f"int4 {launch}: relative error {bf16}fp32 {e32:.2e} (worst row {worst_row:.2e})"
              + ("" if ok else "  DISAGREES"))
        if not ok:
            failed.append(f"int4 {launch}: {bf16}fp32 {e32:.2e}, worst row {worst_row:.2e}")
        save()
    # exact_bits only changes how a code becomes a float, and both ways are exact: the outputs should be identical.
    differ = [str(a) for a in outputs for b in outputs
              if a.kernel is Kernel.TILE and a.exact_bits and b == a._replace(exact_bits=False)
              and not torch.equal(outputs[a], outputs[b])]
    results["tile_exact_bits_changes_output_at"] = differ
    print(f"int4 tile kernel: exact_bits changes the output at {differ or 'no launch'}")
    if kv_int4.LAUNCH not in outputs:
        failed.append(f"the default launch {kv_int4.LAUNCH} is unavailable")
    exact = decode_attention_reference(q32, keys, values, None, None, slots, n_valid, sm)
    results["rel_err_int4_vs_exact_random"] = float(rel(ref32, exact))
    print(f"int4 vs exact attention on these random vectors (no rotation needed): {float(rel(ref32, exact)):.3f}")
    return failed


def sweep(results: dict, shapes: Shapes, save) -> None:
    """ms per layer and GB/s: every agreeing launch at the largest batch full, then the default and each kernel's
    fastest at the other shapes."""
    dev, H, D, C = shapes.device, shapes.heads, shapes.head_dim, shapes.context
    agreeing = [Launch.parse(k) for k, r in results["launches"].items() if r.get("ok")]
    small, large = shapes.sweep_slots
    for S, fill in ((large, C), (large, C // 4), (small, C), (small, C // 4)):
        if (S, fill) == (large, C):
            todo = agreeing
            if shapes.smoke:  # one launch per kernel
                todo = list({x.kernel: x for x in reversed(agreeing)}.values())
        elif shapes.smoke and (S, fill) != (small, C // 4):
            continue
        else:
            todo = [x for x in dict.fromkeys([kv_int4.LAUNCH, *results["best_by_kernel_launches"]]) if x in agreeing]
        g = torch.Generator(device=dev).manual_seed(S)
        codes = [torch.randint(0, 256, (S, H, C, D // 2), dtype=torch.uint8, device=dev, generator=g)
                 for _ in range(2)]
        meta = [torch.rand(S, H, C, 2, device=dev, dtype=torch.float16, generator=g) for _ in range(4)]
        q = torch.randn(S, H, D, device=dev, dtype=torch.bfloat16, generator=g)
        slots = torch.arange(S, device=dev)
        n_valid = torch.full((S,), fill, device=dev)
        gb = S * H * fill * (2 * D // 2 + 4 * 2 * 2) / 1e9
        ring = (*codes, *meta)
        for launch in todo:
            try:
                t = bench(lambda launch=launch: launch_int4(q, *ring, slots, n_valid, D ** -0.5, launch), shapes)
            except Exception as e:  # e.g. out of memory at this shape
                print(f"int4 S={S} fill={fill} {launch}: failed: {type(e).__name__}")
                continue
            results["sweep"].append({"slots": S, "fill": fill, "launch": str(launch), **launch._asdict(),
                                     "ms_per_layer": round(t * 1e3, 4), "gb_per_s": round(gb / t)})
            print(f"int4 S={S} fill={fill} {launch}: {t * 1e3:.3f} ms/layer, {gb / t:.0f} GB/s")
            save()
        if (S, fill) == (large, C):
            pick_best(results, large, C)
            save()
        codes = meta = ring = None  # free this shape's rings before the next allocates its own
        if dev == "cuda":
            torch.cuda.empty_cache()


def pick_best(results: dict, slots: int, fill: int) -> None:
    full = [r for r in results["sweep"] if r["slots"] == slots and r["fill"] == fill]
    if not full:
        results["best_by_kernel_launches"] = []
        return
    best = {k.value: min((r for r in full if r["kernel"] == k), key=lambda r: r["ms_per_layer"], default=None)
            for k in Kernel}
    results["best_by_kernel"] = best
    results["best_by_kernel_launches"] = [Launch.parse(r["launch"]) for r in best.values() if r]
    overall = min(full, key=lambda r: r["ms_per_layer"])
    results["best_at_288_full"] = overall
    results["best_launch"] = overall["launch"]
    print(f"int4 fastest launch that agrees at {slots} slots, full ring: {overall['launch']} "
          f"({overall['ms_per_layer']:.3f} ms/layer, {overall['gb_per_s']} GB/s)")
    print("int4 by setting (ms/layer at the full shape):   block_n warps stages      mma   planes     tile"
          "  tile(exact_bits)")
    by = {(r["kernel"], r["block_n"], r["num_warps"], r["num_stages"], r["exact_bits"]): r["ms_per_layer"]
          for r in full}
    fmt = lambda x: f"{x:8.3f}" if x is not None else "       -"  # noqa: E731
    for bn, w, st in sorted({(r["block_n"], r["num_warps"], r["num_stages"]) for r in full}):
        print(f"{'':48}{bn:8d} {w:5d} {st:6d} {fmt(by.get(('mma', bn, w, st, True)))} "
              f"{fmt(by.get(('planes', bn, w, st, True)))} {fmt(by.get(('tile', bn, w, st, False)))} "
              f"{fmt(by.get(('tile', bn, w, st, True)))}")


def main_int4(out: Path, smoke: bool = False) -> list[str]:
    shapes = Shapes(smoke)
    results: dict = {"device": "cpu (TRITON_INTERPRET=1)" if smoke else torch.cuda.get_device_name(),
                     "smoke": smoke, "heads": shapes.heads, "head_dim": shapes.head_dim, "context": shapes.context,
                     "default": str(kv_int4.LAUNCH), "tolerance_bf16": TOLERANCE_BF16,
                     "tolerance_fp32": TOLERANCE_FP32, "launches": {}, "sweep": [], "best_by_kernel_launches": []}
    path = out / "attention_check_int4.json"

    def save() -> None:
        path.write_text(json.dumps({k: v for k, v in results.items() if k != "best_by_kernel_launches"}, indent=2))

    failed = check(results, shapes, save)
    sweep(results, shapes, save)
    results["failed"] = failed
    save()
    return failed
