"""Quality guard for the serving shortcuts at the real shapes (random full-size weights, one GPU):
the fp8 KV ring, and the fp8 temporal weights on top of it (what the GPU deployment runs).

    python -m bench.quality [--fills 64,512,3000] [--out bench/results]

For each context fill, the same random token history is run into a slot three times: bf16
weights with the bf16 ring (the reference), bf16 weights with the fp8 ring, and fp8 temporal
weights with the fp8 ring (prefill in chunks, then one live step). Reported against the
reference: the relative error (||x - ref|| / ||ref||) of every layer's attention output on the
live step (mean and max over layers) and of the text logits, and whether greedy text agrees.
Writes `quality.json` under --out.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

from bench.talker import log, random_model
from services.talker.model import LMConfig


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@torch.no_grad()
def run(model, fp8: bool, tokens: torch.Tensor, chunk: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Prefill tokens[:, :-1] then step tokens[:, -1]; returns the live step's attention outputs
    per layer and its text logits."""
    B = tokens.shape[0]
    kv = model.new_kv_cache(B, fp8=fp8)
    for s in range(0, tokens.shape[1] - 1, chunk):
        part = tokens[:, s:min(s + chunk, tokens.shape[1] - 1)]
        model.temporal(model.embed(part, check=False), kv, kv.all_slots)
    seen: list[torch.Tensor] = []
    hooks = [layer.self_attn.register_forward_hook(lambda m, i, o: seen.append(o.detach()))
             for layer in model.transformer.layers]
    try:
        h = model.temporal(model.embed(tokens[:, -1:], check=False), kv, kv.all_slots)
    finally:
        for hk in hooks:
            hk.remove()
    return seen, model.text_logits(h)[:, 0]


def compare(attn: list[torch.Tensor], logits: torch.Tensor, attn_ref: list[torch.Tensor],
            logits_ref: torch.Tensor) -> dict:
    errs = [rel(a, r) for a, r in zip(attn, attn_ref)]
    return {"attn_rel_err_mean": sum(errs) / len(errs), "attn_rel_err_max": max(errs),
            "text_logits_rel_err": rel(logits, logits_ref),
            "greedy_text_agreement": float((logits.argmax(-1) == logits_ref.argmax(-1)).float().mean())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fills", default="64,512,3000")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=500)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU: checks the script only")
    args = ap.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("bench.quality needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    cfg = LMConfig.tiny() if args.smoke else LMConfig.full()
    device = "cpu" if args.smoke else "cuda"
    model = random_model(cfg, dep_steps=8, seed=1, device=device)
    model_w8 = copy.deepcopy(model)
    model_w8.quantize_weights_fp8_()
    g = torch.Generator().manual_seed(0)
    rows = []
    for fill in (int(f) for f in args.fills.split(",")):
        text = torch.randint(0, cfg.text_card, (args.batch, fill, 1), generator=g)
        audio = torch.randint(0, cfg.card, (args.batch, fill, cfg.n_q), generator=g)
        tokens = torch.cat([text, audio], dim=-1).to(device)
        attn16, logits16 = run(model, False, tokens, args.chunk)
        row = {"fill": fill, **compare(*run(model, True, tokens, args.chunk), attn16, logits16)}
        row["fp8_weights_and_kv"] = compare(*run(model_w8, True, tokens, args.chunk), attn16, logits16)
        for name, r in (("fp8 KV", row), ("fp8 weights + KV", row["fp8_weights_and_kv"])):
            log(f"fill {fill}, {name}: attention rel err mean {r['attn_rel_err_mean']:.2e} max "
                f"{r['attn_rel_err_max']:.2e}, "
                f"text logits rel err {r['text_logits_rel_err']:.2e}, greedy text agreement "
                f"{r['greedy_text_agreement']:.2f}")
        rows.append(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = "smoke (cpu)" if args.smoke else torch.cuda.get_device_name()
    (out / "quality.json").write_text(json.dumps({"gpu": gpu, "batch": args.batch,
                                                   "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
