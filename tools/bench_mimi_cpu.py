"""Mimi streaming step time: encoder and decoder separately, per config and slot count.

    .venv/bin/python -m tools.bench_mimi_cpu [--configs tiny full] [--slots 1 16] [--steps 20] [--device cpu]
    python3 -m tools.bench_mimi_cpu --device cuda --configs full --slots 1 16 160 --cuda-graph

With --cuda-graph the graphed streamers are first checked against eager ones (same codes, audio
within 1e-4 over steps with idle slots and a reset), then timed.

Random weights (timing does not depend on them). Every slot active. Prints the median wall time of
a step and, on CPU, the median process CPU time (with --threads 1 that is the single-core cost, a
fairer number than wall time on a machine shared with other work).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from services.codec.mimi import MimiConfig, MimiModel, StreamingDecoder, StreamingEncoder


def _median_ms(fn, steps: int, warmup: int, sync) -> tuple[float, float]:
    """(median wall ms, median process-CPU ms) of one call."""
    for _ in range(warmup):
        fn()
    wall, cpu = [], []
    for _ in range(steps):
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        sync()
        wall.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
    return statistics.median(wall), statistics.median(cpu)


def check_cuda_graph(model: MimiModel, slots: int, steps: int = 6) -> None:
    """Graphed and eager streamers must agree, with idle slots and a mid-stream reset."""
    cfg, dev = model.cfg, model.device
    g = torch.Generator().manual_seed(0)
    pairs = [(StreamingEncoder(model, slots), StreamingEncoder(model, slots, cuda_graph=True)),
             (StreamingDecoder(model, slots), StreamingDecoder(model, slots, cuda_graph=True))]
    for t in range(steps):
        active = (torch.rand(slots, generator=g) > 0.3).to(dev)
        if t == 3:
            for pair in pairs:
                for s in pair:
                    s.reset(0)
        pcm = (0.1 * torch.randn(slots, cfg.frame_size, generator=g)).to(dev)
        codes = torch.randint(0, cfg.bins, (slots, cfg.num_codebooks), generator=g).to(dev)
        (e0, e1), (d0, d1) = pairs
        c0, c1 = e0.step(pcm, active), e1.step(pcm, active)
        y0, y1 = d0.step(codes, active), d1.step(codes, active)
        assert torch.equal(c0[active], c1[active]), f"graphed encoder differs at step {t}"
        err = (y0[active] - y1[active]).abs().max().item() if active.any() else 0.0
        assert err < 1e-4, f"graphed decoder differs at step {t}: {err}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["tiny", "full"], choices=["tiny", "full"])
    p.add_argument("--slots", nargs="+", type=int, default=[1, 16])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--cuda-graph", action="store_true", help="capture each step in a CUDA graph (after a check)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    print(f"device={device} threads={torch.get_num_threads()} torch={torch.__version__} cuda_graph={args.cuda_graph}")
    print(f"{'config':6} {'slots':>5} {'enc wall ms':>11} {'enc cpu ms':>10} {'dec wall ms':>11} {'dec cpu ms':>10}")
    for name in args.configs:
        cfg = getattr(MimiConfig, name)()
        model = MimiModel.random(cfg, seed=0, device=device)
        for slots in args.slots:
            if args.cuda_graph:
                check_cuda_graph(model, slots)
            enc = StreamingEncoder(model, slots, cuda_graph=args.cuda_graph)
            dec = StreamingDecoder(model, slots, cuda_graph=args.cuda_graph)
            active = torch.ones(slots, dtype=torch.bool, device=device)
            pcm = 0.1 * torch.randn(slots, cfg.frame_size, device=device)
            codes = torch.randint(0, cfg.bins, (slots, cfg.num_codebooks), device=device)
            e = _median_ms(lambda: enc.step(pcm, active), args.steps, args.warmup, sync)
            d = _median_ms(lambda: dec.step(codes, active), args.steps, args.warmup, sync)
            print(f"{name:6} {slots:5d} {e[0]:11.2f} {e[1]:10.2f} {d[0]:11.2f} {d[1]:10.2f}", flush=True)


if __name__ == "__main__":
    main()
