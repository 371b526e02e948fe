"""GPU check of the torch.compile'd elementwise kernels (services/talker/fused.py) against eager.

    python -m bench.compile_check [--out DIR]     # exits 1 when a check fails

1. Each fused function at the serving shapes (160 rows, full-size widths, bf16), compiled vs
   eager: relative error of the output (fp8 outputs compared after dequantization).
2. The tiny checkpoint on the GPU (fp32, fp8 KV, CUDA-graphed step and prefill), compiled vs
   eager, two sessions for 200 frames (one greedy, one sampled, with a voice and persona
   prefilling behind the first one's steps): the fraction of equal output tokens and codes.
   Compiled arithmetic may round differently (one rounding instead of two in the SiLU gate; an
   fp8 value on a rounding boundary), and a flipped token changes all later history, so this is
   agreement, not identity.
Writes compile_check.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from bench.prefill_graph_check import talk_while_prefilling
from services.common.checkpoint import CheckpointPaths
from services.talker import fused
from services.talker.decode_attention import dequantize_fp8, quantize_fp8
from services.talker.engine import TalkerEngine
from services.talker.fp8_weights import quantize_rows
from services.talker.layers import apply_rope, rms_norm, silu_gate
from tools.make_checkpoint import ensure_checkpoint

FUNCTION_TOLERANCE = 1e-2  # bf16 outputs differ by an ulp here and there; fp8 ones by a step of e4m3
# Agreement of sampled outputs is chaotic: one token flipped by a last-bit difference changes the
# history every later frame sees (fp8 against bf16 KV agree 90.6 % on this model over 500 frames).
# Broken kernels agree at chance, ~0 for 2048-way codes; measured compiled vs eager: 0.91.
AGREEMENT_REQUIRED = 0.8


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def function_errors() -> dict[str, float]:
    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(160, 1, 4096, device=dev, dtype=bf, generator=g)
    alpha = 1 + 0.1 * torch.randn(1, 1, 4096, device=dev, dtype=bf, generator=g)
    q = torch.randn(160, 32, 1, 128, device=dev, dtype=bf, generator=g)
    k = torch.randn(160, 32, 1, 128, device=dev, dtype=bf, generator=g)
    pos = torch.randint(0, 6000, (160, 1), device=dev, generator=g)
    h = torch.randn(160, 1, 2 * 11264, device=dev, dtype=bf, generator=g)
    kv = torch.randn(160, 1, 32, 128, device=dev, dtype=bf, generator=g) * 3
    out: dict[str, float] = {}
    cases = {
        "rms_norm": (rms_norm, (x, alpha, 1e-8), lambda r: r),
        "silu_gate": (silu_gate, (h,), lambda r: r),
        "apply_rope": (apply_rope, (q, k, pos, 10_000.0), lambda r: torch.cat([r[0], r[1]])),
        "quantize_rows": (quantize_rows, (x[:, 0],), lambda r: r[0].float() * r[1]),
        "quantize_fp8": (quantize_fp8, (kv,), lambda r: dequantize_fp8(r[0], r[1], torch.float32)),
    }
    for name, (fn, args, value) in cases.items():
        fused.enable(True)
        got = value(fn(*args))
        fused.enable(False)
        want = value(fn(*args))
        out[name] = rel(got, want)
        print(f"{name:14s} compiled vs eager: relative error {out[name]:.2e}", flush=True)
    return out


def run_engine(paths: CheckpointPaths, compiled: bool) -> list:
    fused.enable(compiled)
    eng = TalkerEngine.from_checkpoint(paths, slots=3, device="cuda", dtype=torch.float32, kv_fp8=True, cuda_graph=True)
    eng.prefill_graph_frames = 8
    eng.warmup(("NATF2.pt",))
    g = torch.Generator().manual_seed(0)
    frames = torch.randint(0, eng.card, (400, 3, 8), generator=g)
    results = talk_while_prefilling(eng, frames)
    outs, t = [x for r in results for x in (r.text_tokens[0].item(), *r.agent_codes[0].tolist())], len(results)
    both = torch.tensor([True, False, True])
    for _ in range(200):
        r = eng.step(frames[t], both)
        for s in (0, 2):
            outs += [r.text_tokens[s].item(), *r.agent_codes[s].tolist()]
        t += 1
    fused.enable(False)
    return outs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.compile_check needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    errors = function_errors()
    paths = CheckpointPaths.open(ensure_checkpoint("tiny", seed=0))
    eager = run_engine(paths, compiled=False)
    compiled = run_engine(paths, compiled=True)
    agreement = sum(a == b for a, b in zip(eager, compiled)) / len(eager)
    print(f"tiny engine, {len(eager)} outputs: compiled vs eager agreement {agreement:.4f}", flush=True)
    failed = [f"{n}: {e:.2e}" for n, e in errors.items() if not e < FUNCTION_TOLERANCE]
    if not agreement >= AGREEMENT_REQUIRED:
        failed.append(f"engine agreement {agreement:.4f} < {AGREEMENT_REQUIRED}")
    result = {"gpu": torch.cuda.get_device_name(), "function_rel_error": errors, "engine_outputs": len(eager),
              "engine_agreement": agreement, "failed": failed, "seconds": round(time.perf_counter() - t0, 1)}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "compile_check.json").write_text(json.dumps(result, indent=2))
    print("FAILED: " + "; ".join(failed) if failed else "compile check passed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
