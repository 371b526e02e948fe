"""Talker frame time on one GPU: ours against moshi 0.2.13's LMGen and the bandwidth floor.

    python -m bench.talker [--batches 1,8,32,64,96,128,160] [--ref-batches 1,8,32,64] [--out bench/results]
    python -m bench.talker --kv-bits 4 --batches 1,64,160,288 --extra-batches 304,320 --reserve-gb 5.7 --name talker_kv4

Random weights at the real PersonaPlex-7B shapes, bf16, created directly on the GPU.
Every slot is live and at full context (3000 frames in its KV ring), which is the worst
case for a frame: attention reads every valid ring entry.

* ours: `TalkerEngine` with fp8 KV (per-vector scales; --kv-bits 4: the 4-bit ring), the in-place
  decode-attention kernel, 8 depformer steps, the whole frame captured as one CUDA graph (embedding,
  32 layers, text sampling, 8 depformer steps with sampling, token-history update).
* reference: moshi 0.2.13 `LMGen` (its own CUDA graphs, bf16 KV, 16 depformer steps), at
  the batch sizes that fit, in the same process on the same weights.
* floor: bytes a frame must read (resident weights + every valid KV entry) / measured copy
  bandwidth.

--reserve-gb holds that much GPU memory while ours runs, a stand-in for the codecs beside the talker in
the cell: the largest batch that fits is then the largest that fits beside them.
Prints a table and writes `<name>.json` and `<name>.png` under --out (name: talker).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("NO_TORCH_COMPILE", "1")

from services.talker.text import TextTokenizer  # noqa: E402
from services.talker import fused  # noqa: E402
from services.talker.engine import AGENT_CODEBOOKS, SamplingParams, TalkerEngine  # noqa: E402
from services.talker import kv_int4  # noqa: E402
from services.talker.model import LMConfig, LMModel  # noqa: E402

GB = 1e9


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def random_model(cfg: LMConfig, dep_steps: int, seed: int = 0, device: str = "cuda") -> LMModel:
    """Full-size random weights made on the GPU (seconds, not the minutes a CPU init takes)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = LMModel(cfg, dep_steps=dep_steps, device=device, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("alpha"):
            p.fill_(1.0)
        else:
            std = 1.0 if "emb" in name else p.shape[-1] ** -0.5
            p.normal_(0.0, std, generator=gen)
    return model


def copy_bandwidth() -> float:
    x = torch.empty(int(4 * GB), dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    bw = 2 * x.numel() * 10 / (time.perf_counter() - t)
    del x, y
    return bw


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, steps: int) -> list[float]:
    """Wall time of each call in ms, synchronised (what a tick sees)."""
    out = []
    for _ in range(steps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def weights_bytes(model: LMModel, dep_steps: int) -> int:
    """Bytes of weights one frame reads: everything resident except the embedding tables
    (a frame reads 17 rows of them) — the temporal layers, text_linear, the depformer."""
    total = 0
    for name, p in (*model.named_parameters(), *model.named_buffers()):  # fp8 matrices are buffers
        if "emb" in name:
            continue
        total += p.numel() * p.element_size()
    return total


KV_NAMES = {16: "bf16", 8: "fp8", 4: "int4"}


def kv_bytes_per_position(cfg: LMConfig, bits: int) -> float:
    """Bytes of one position's keys and values in every layer: bf16; fp8 payload + an fp16 scale per vector; or
    4-bit codes + an fp16 scale and minimum per half vector (services/talker/kv_int4.py)."""
    per_vec = {16: 2 * cfg.head_dim, 8: cfg.head_dim + 2, 4: cfg.head_dim // 2 + 2 * 2 * 2}[bits]
    return 2 * cfg.num_layers * cfg.num_heads * per_vec


def full_context_step(model: LMModel, tok: TextTokenizer, B: int, kv_bits: int, cuda_graph: bool):
    """An engine with every one of B slots live at full context (a ring of kv_bits per value: 16 is the
    compute dtype), and a function that runs one step of all of them on random user codes. Returns (engine, step)."""
    cfg = model.cfg
    engine = TalkerEngine(model, tok, slots=B, kv_bits=None if kv_bits == 16 else kv_bits, cuda_graph=cuda_graph)
    # The ring's contents do not change the cost, its valid length does: mark every position written.
    for s in range(B):
        engine.begin(s, None, None, SamplingParams(seed=s + 1)).run(0)
    engine.kv.length.fill_(cfg.context)
    engine.offset.fill_(cfg.context)
    g = torch.Generator().manual_seed(0)
    active = torch.ones(B, dtype=torch.bool)

    def one():
        engine.step(torch.randint(0, cfg.card, (B, AGENT_CODEBOOKS), generator=g), active)

    return engine, one


def bench_ours(model: LMModel, tok: TextTokenizer, B: int, steps: int, kv_bits: int) -> dict:
    cuda = model.device.type == "cuda"
    engine, one = full_context_step(model, tok, B, kv_bits, cuda_graph=cuda)

    timed(one, 5)
    ms = timed(one, steps)
    mem = torch.cuda.max_memory_allocated() / GB if cuda else 0.0
    del engine, one  # the step closure holds the engine too; its rings must go before the next batch
    return {"median_ms": pct(ms, 0.5), "p99_ms": pct(ms, 0.99), "max_ms": max(ms), "peak_mem_gb": mem}


def moshi_reference(model16: LMModel):
    from tools.moshi_reference import moshi_lm_model

    return moshi_lm_model(model16.cfg, model16.state_dict(), model16.dtype, model16.device)


def bench_reference(ref, B: int, steps: int) -> dict:
    from moshi.models.lm import LMGen

    gen = LMGen(ref, temp=0.8, temp_text=0.7, top_k=250, top_k_text=25)
    with torch.no_grad(), gen.streaming(B):
        # With dep_q = n_q = 16 (as published) the depformer generates all 16 streams and LMGen
        # takes no user input: the 16-step configuration Kyutai's code runs for this checkpoint.
        no_input = torch.zeros(B, 0, 1, dtype=torch.long, device=ref.device)

        def one():
            gen.step(no_input)

        timed(one, 5)
        ms = timed(one, steps)
    mem = torch.cuda.max_memory_allocated() / GB if torch.cuda.is_available() else 0.0
    return {"median_ms": pct(ms, 0.5), "p99_ms": pct(ms, 0.99), "max_ms": max(ms), "peak_mem_gb": mem}


def plot(rows: list[dict], path: Path, kv: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label, style in (("ours_p99", "ours p99", "o-"), ("ours_median", "ours median", "o--"),
                              ("ref_p99", "moshi LMGen p99", "s-"), ("floor_ms", "bandwidth floor", ":")):
        pts = [(r["batch"], r[key]) for r in rows if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), style, label=label)
    ax.axhline(80, color="red", lw=0.8, label="80 ms frame budget")
    ax.set_xlabel("concurrent sessions (batch), full 3000-frame context")
    ax.set_ylabel("talker frame time (ms)")
    ax.set_title(f"PersonaPlex-7B talker on one H200, {kv} KV")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32,64,96,128,160")
    ap.add_argument("--extra-batches", default="168,176", help="tried after --batches to find the largest that fits")
    ap.add_argument("--ref-batches", default="1,8,32,64")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--kv-bits", type=int, default=8, choices=sorted(KV_NAMES), help="bits per KV value: 8 fp8, "
                    "4 the 4-bit ring, 16 bf16")
    ap.add_argument("--reserve-gb", type=float, default=0.0, help="GPU memory held while ours runs, for the codecs "
                    "beside the talker (5.7 GB in the front door, bench/RESULTS.md)")
    ap.add_argument("--kv4-launch", default=None, metavar="KERNEL,BLOCK_N,WARPS,STAGES,EXACT_BITS",
                    help="the 4-bit decode kernel and its launch (default: services/talker/kv_int4.py's), e.g. "
                         "bench.attention_check's best_launch: planes,128,4,3,1")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--name", default="talker", help="the result files' name (<name>.json, <name>.png)")
    ap.add_argument("--tokenizer", default=None, help="a SentencePiece model (default: the tiny checkpoint's)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny model on the CPU: checks the script, measures nothing real")
    ap.add_argument("--weights-fp8", action="store_true",
                    help="ours with the temporal matrices in fp8 (the serving config)")
    ap.add_argument("--compile", action="store_true",
                    help="ours with torch.compile'd elementwise kernels (the serving config)")
    args = ap.parse_args(argv)
    if args.kv4_launch:
        try:
            kv_int4.LAUNCH = kv_int4.Launch.parse(args.kv4_launch)
        except ValueError as e:
            ap.error(f"--kv4-launch: {e}")
    if not args.smoke and not torch.cuda.is_available():
        print("bench.talker needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = LMConfig.tiny() if args.smoke else LMConfig.full()
    device = "cpu" if args.smoke else "cuda"
    if args.tokenizer is None:
        from tools.make_checkpoint import ensure_checkpoint

        args.tokenizer = str(ensure_checkpoint("tiny", seed=0) / "tokenizer_spm_32k_3.model")
    tok = TextTokenizer.load(args.tokenizer)
    bw = 1e12 if args.smoke else copy_bandwidth()
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    rows: dict[int, dict] = {}

    ref_batches = [int(b) for b in args.ref_batches.split(",") if b]
    if ref_batches:
        log("reference: building moshi LMModel (16 depformer steps, bf16)")
        model16 = random_model(cfg, dep_steps=16, device=device)
        ref = moshi_reference(model16)
        del model16
        gc.collect()
        if not args.smoke:
            torch.cuda.empty_cache()
        for B in ref_batches:
            if not args.smoke:
                torch.cuda.reset_peak_memory_stats()
            try:
                r = bench_reference(ref, B, args.steps)
            except torch.OutOfMemoryError:
                log(f"reference B={B}: out of memory")
                rows.setdefault(B, {"batch": B})["ref_oom"] = True
                break
            log(f"reference B={B}: median {r['median_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms, peak "
                f"{r['peak_mem_gb']:.1f} GB")
            rows.setdefault(B, {"batch": B}).update({f"ref_{k.replace('_ms', '')}": v for k, v in r.items()})
            gc.collect()
            if not args.smoke:
                torch.cuda.empty_cache()
        del ref
        gc.collect()
        if not args.smoke:
            torch.cuda.empty_cache()

    model = random_model(cfg, dep_steps=AGENT_CODEBOOKS, device=device)
    if args.weights_fp8:
        model.quantize_weights_fp8_()
    if args.compile and not args.smoke:
        fused.enable()  # after the reference: it is moshi's code, never ours
    w_bytes = weights_bytes(model, AGENT_CODEBOOKS)
    kv_pos = kv_bytes_per_position(cfg, args.kv_bits)
    reserve = None
    if args.reserve_gb > 0 and not args.smoke:  # allocated after the reference: it runs alone
        reserve = torch.empty(int(args.reserve_gb * GB), dtype=torch.uint8, device="cuda")
    batches = [int(b) for b in args.batches.split(",") if b] + [int(b) for b in args.extra_batches.split(",") if b]
    largest = None

    def save() -> list[dict]:  # after every batch too: a run cut short keeps what it measured
        table = sorted(rows.values(), key=lambda r: r["batch"])
        (out / f"{args.name}.json").write_text(json.dumps({
            "gpu": "smoke (cpu)" if args.smoke else torch.cuda.get_device_name(), "torch": torch.__version__,
            "kv": KV_NAMES[args.kv_bits], "kv4_launch": kv_int4.LAUNCH._asdict() if args.kv_bits == 4 else None,
            "reserve_gb": args.reserve_gb, "gpu_memory_gb": 0.0 if args.smoke else torch.cuda.mem_get_info()[1] / GB,
            "weights_fp8": args.weights_fp8, "compile": args.compile and not args.smoke,
            "context": cfg.context, "steps_per_point": args.steps, "copy_bandwidth_tbs": bw / 1e12,
            "weights_read_gb": w_bytes / GB, "kv_bytes_per_position": kv_pos, "largest_batch_that_fits": largest,
            "rows": table,
        }, indent=2))
        return table

    for B in batches:
        gc.collect()
        if not args.smoke:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            r = bench_ours(model, tok, B, args.steps, args.kv_bits)
        except torch.OutOfMemoryError:
            log(f"ours B={B}: out of memory")
            rows.setdefault(B, {"batch": B})["ours_oom"] = True
            break
        largest = B
        floor = (w_bytes + B * cfg.context * kv_pos) / bw * 1e3
        log(f"ours B={B}: median {r['median_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms, floor {floor:.1f} ms, "
            f"peak {r['peak_mem_gb']:.1f} GB")
        row = rows.setdefault(B, {"batch": B})
        row.update({f"ours_{k.replace('_ms', '')}": v for k, v in r.items()})
        row["floor_ms"] = floor
        save()

    del reserve
    table = save()
    print()
    print(f"{'B':>5} {'ours med':>9} {'ours p99':>9} {'ref med':>8} {'ref p99':>8} {'floor':>7} "
          f"{'ours/floor':>10} {'ref/ours':>8} {'mem GB':>7}")
    for r in table:
        def f(k, w=8):
            v = r.get(k)
            if isinstance(v, float):
                return f"{v:{w}.1f}"
            return f"{'oom' if r.get(k.split('_')[0] + '_oom') else '-':>{w}}"

        ratio = f"{r['ours_p99'] / r['floor_ms']:10.2f}" if r.get("ours_p99") and r.get("floor_ms") else f"{'-':>10}"
        vs = f"{r['ref_p99'] / r['ours_p99']:8.2f}" if r.get("ref_p99") and r.get("ours_p99") else f"{'-':>8}"
        print(f"{r['batch']:>5} {f('ours_median', 9)} {f('ours_p99', 9)} {f('ref_median')} {f('ref_p99')} "
              f"{f('floor_ms', 7)} {ratio} {vs} {f('ours_peak_mem_gb', 7)}")
    plot(table, out / f"{args.name}.png", KV_NAMES[args.kv_bits])
    log(f"wrote {out / args.name}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
