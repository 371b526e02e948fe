"""The quality gate of the serving shortcuts: the fp8 KV ring, the 4-bit ring, and each with fp8 temporal weights
(what the GPU deployment runs), against the ring in the compute dtype, teacher-forced over many frames.

    python -m bench.quality [--frames 1000] [--prefill 2500] [--out bench/results]    # full size, on a GPU
    python -m bench.quality --tiny                                                    # the tiny model, on the CPU

Random weights at the real shapes in bf16 (the GPU), or the tiny model in fp32 (the CPU). Each of --batch rows gets
a random token history of --prefill frames, prefilled in chunks; then --frames live frames, teacher-forced: a
frame's input is the reference's own greedy tokens of the frame before (text and the 8 agent codebooks) and
random user codes, the same for every configuration. One early disagreement then does not change every later
input, so the numbers measure the storage, not the chaos of a random model. The ring wraps during the live frames
(prefill + frames > context). Per configuration, against the reference (the model's weights and a ring in the
compute dtype), over the live frames:
- token agreement: each configuration's greedy text token and 8 agent codes (from its own depformer run on its
  own text token) equal to the reference's; text alone too;
- the relative error ||x - ref|| / ||ref|| of every layer's attention output, averaged over the frames;
- KL(ref || ours) of the text logits and of the first agent codebook's, averaged over frames and rows.
Random weights have no outlier structure and flat logits: a stress test of the storage, not a prediction of the
trained model's quality. Writes quality.json (GPU) or quality_tiny_cpu.json (--tiny) under --out.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from bench.talker import log, random_model
from services.talker.engine import AGENT_CODEBOOKS
from services.talker.model import LMConfig, LMModel

# name, fp8 temporal weights, KV bits
CONFIGS = (("fp8_kv", False, 8), ("int4_kv", False, 4), ("fp8_weights_fp8_kv", True, 8),
           ("fp8_weights_int4_kv", True, 4))


class Config:
    """One configuration: a model, its own ring for the rows, and what it has scored against the reference."""

    def __init__(self, name: str, model: LMModel, bits: int | None, batch: int):
        self.name, self.model, self.bits = name, model, bits
        self.kv = model.new_kv_cache(batch, bits=bits)
        self.attn: list[torch.Tensor] = []  # this frame's attention outputs, one per layer, while capturing
        self.capture = False
        for layer in model.transformer.layers:
            layer.self_attn.register_forward_hook(self._seen)
        self.tokens_agree = self.text_agree = self.tokens = self.rows = 0
        self.attn_err = [0.0] * model.cfg.num_layers
        self.kl_text = self.kl_audio0 = 0.0
        self.frames = 0

    def _seen(self, module, inputs, output) -> None:
        if self.capture:
            self.attn.append(output.detach())

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, chunk: int) -> None:
        for s in range(0, tokens.shape[1], chunk):
            self.model.temporal(self.model.embed(tokens[:, s : s + chunk], check=False), self.kv, self.kv.all_slots)

    @torch.no_grad()
    def frame(self, tokens: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
        """One live frame: (attention outputs per layer, text logits, first agent codebook's logits, greedy tokens
        [B, 9])."""
        self.attn = []
        self.capture = True
        try:
            h = self.model.temporal(self.model.embed(tokens, check=False), self.kv, self.kv.all_slots)[:, 0]
        finally:
            self.capture = False
        text_logits = self.model.text_logits(h).float()
        text = text_logits.argmax(-1)
        first = []

        def greedy(cb: int, logits: torch.Tensor) -> torch.Tensor:
            if cb == 0:
                first.append(logits.float())
            return logits.argmax(-1)

        audio = self.model.depformer(h, text, greedy, steps=AGENT_CODEBOOKS)
        return self.attn, text_logits, first[0], torch.cat([text[:, None], audio], dim=1)

    def score(self, ours: tuple, ref: tuple) -> None:
        attn, text_logits, audio0, tokens = ours
        attn_r, text_r, audio0_r, tokens_r = ref
        for i, (a, r) in enumerate(zip(attn, attn_r, strict=True)):
            self.attn_err[i] += float((a.float() - r.float()).norm() / r.float().norm())
        self.kl_text += kl(text_r, text_logits)
        self.kl_audio0 += kl(audio0_r, audio0)
        self.tokens_agree += int((tokens == tokens_r).sum())
        self.text_agree += int((tokens[:, 0] == tokens_r[:, 0]).sum())
        self.tokens += tokens.numel()
        self.rows += tokens.shape[0]
        self.frames += 1

    def result(self) -> dict:
        errs = [e / self.frames for e in self.attn_err]
        return {"kv_bits": self.bits, "token_agreement": self.tokens_agree / self.tokens,
                "text_agreement": self.text_agree / self.rows, "attn_rel_err_per_layer": errs,
                "attn_rel_err_mean": sum(errs) / len(errs), "attn_rel_err_max": max(errs),
                "text_logits_kl": self.kl_text / self.frames, "audio0_logits_kl": self.kl_audio0 / self.frames}


def kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(ref || ours) in nats, the mean over rows."""
    return float(F.kl_div(logits.log_softmax(-1), ref_logits.log_softmax(-1), log_target=True,
                          reduction="batchmean"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=1000, help="teacher-forced live frames")
    ap.add_argument("--prefill", type=int, default=None, help="random history frames first (default: 2500 at "
                                                                "full size, 200 with --tiny)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=500, help="prefill chunk frames")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tiny", action="store_true", help="the tiny model on the CPU")
    args = ap.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        print("bench.quality needs a CUDA GPU (or --tiny)", file=sys.stderr)
        return 2
    cfg = LMConfig.tiny() if args.tiny else LMConfig.full()
    device = "cpu" if args.tiny else "cuda"
    prefill = args.prefill if args.prefill is not None else (200 if args.tiny else 2500)
    t0 = time.perf_counter()
    model = random_model(cfg, dep_steps=AGENT_CODEBOOKS, seed=1, device=device)
    model_w8 = copy.deepcopy(model)
    model_w8.quantize_weights_fp8_()
    reference = Config("reference", model, None, args.batch)
    configs = [Config(name, model_w8 if w8 else model, bits, args.batch) for name, w8, bits in CONFIGS]
    g = torch.Generator().manual_seed(0)
    history = torch.cat([torch.randint(0, cfg.text_card, (args.batch, prefill, 1), generator=g),
                         torch.randint(0, cfg.card, (args.batch, prefill, cfg.n_q), generator=g)], dim=-1).to(device)
    for c in (reference, *configs):
        c.prefill(history, args.chunk)
    user = torch.randint(0, cfg.card, (args.frames, args.batch, AGENT_CODEBOOKS), generator=g).to(device)
    prev = torch.full((args.batch, 1 + AGENT_CODEBOOKS), cfg.card, device=device)  # the initial tokens
    prev[:, 0] = cfg.text_card
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("quality_tiny_cpu.json" if args.tiny else "quality.json")

    def save() -> dict:  # after every 250 frames too: a run cut short keeps what it measured
        rows = {c.name: c.result() for c in configs}
        path.write_text(json.dumps({
            "gpu": "cpu (tiny model)" if args.tiny else torch.cuda.get_device_name(), "torch": torch.__version__,
            "model": "tiny" if args.tiny else "full", "compute_dtype": str(model.dtype), "context": cfg.context,
            "batch": args.batch, "prefill_frames": prefill, "live_frames": configs[0].frames,
            "reference": f"{model.dtype} weights and KV ring", "seconds": round(time.perf_counter() - t0, 1),
            "configs": rows}, indent=2))
        return rows

    for t in range(args.frames):
        tokens = torch.cat([prev, user[t]], dim=1)[:, None]  # [B, 1, 17]
        ref = reference.frame(tokens)
        for c in configs:
            c.score(c.frame(tokens), ref)
        prev = ref[3]
        if (t + 1) % 250 == 0:
            save()
            log(f"frame {t + 1}/{args.frames}: " + ", ".join(f"{c.name} {c.tokens_agree / c.tokens:.4f}"
                                                              for c in configs))
    rows = save()
    print(f"\n{'configuration':>22} {'tokens':>8} {'text':>7} {'attn err mean/max':>18} {'KL text':>9} "
          f"{'KL audio0':>9}")
    for name, r in rows.items():
        print(f"{name:>22} {r['token_agreement']:8.2%} {r['text_agreement']:7.2%} "
              f"{r['attn_rel_err_mean']:8.3f} / {r['attn_rel_err_max']:.3f} {r['text_logits_kl']:9.2e} "
              f"{r['audio0_logits_kl']:9.2e}")
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
