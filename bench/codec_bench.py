"""Per-step time of the codec services under N concurrent real-time streams (CPU or GPU).

    python -m bench.codec_bench --streams 1 16 --frames 25 [--checkpoint DIR] [--device cpu]

Starts the encoder and decoder as real processes (tools/procs.py), runs N streams that each
send one frame every 80 ms (encoder: random audio; decoder: the codes the encoder returned),
and reads the services' own step metrics: mean step time, mean batch size, and the client's
round-trip per frame (p50 / p99). Then times the bare codec step in-process at each N, for reference.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time
import urllib.request

import grpc
import numpy as np

from duplex.v1 import common_pb2, decoder_pb2, decoder_pb2_grpc, encoder_pb2, encoder_pb2_grpc
from tools.procs import ServiceProcess
from services.common.frame import FRAME_SAMPLES as FRAME



def scrape(url: str, stage: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out = {}
    for name in ("duplex_stage_step_seconds_sum", "duplex_stage_step_seconds_count", "duplex_stage_batch_size_sum"):
        m = re.search(rf'^{name}{{stage="{stage}"}} (\S+)$', text, re.M)
        out[name] = float(m.group(1))
    return out


async def one_stream(enc, dec, sid: str, frames: int, rtts: dict) -> None:
    rng = np.random.default_rng(abs(hash(sid)) % 2**32)
    e, d = enc.Encode(), dec.Decode()
    await e.write(encoder_pb2.EncodeRequest(open=common_pb2.StreamOpen(stream_id=sid)))
    await d.write(decoder_pb2.DecodeRequest(open=common_pb2.StreamOpen(stream_id=sid)))
    await e.read()
    await d.read()
    start = time.perf_counter()
    for seq in range(frames):
        pcm = (rng.standard_normal(FRAME) * 0.3).astype("<f4").tobytes()
        t0 = time.perf_counter()
        await e.write(encoder_pb2.EncodeRequest(frame=common_pb2.PcmFrame(seq=seq, pcm_f32le=pcm)))
        codes = (await e.read()).codes.codes
        t1 = time.perf_counter()
        await d.write(decoder_pb2.DecodeRequest(frame=common_pb2.CodesFrame(seq=seq, codes=codes)))
        await d.read()
        t2 = time.perf_counter()
        rtts["encoder"].append(t1 - t0)
        rtts["decoder"].append(t2 - t1)
        await asyncio.sleep(max(0.0, start + (seq + 1) * 0.080 - time.perf_counter()))  # real-time pacing
    await e.done_writing()
    await d.done_writing()


async def run(enc_p, dec_p, streams: int, frames: int) -> None:
    before = {s: scrape(p.metrics_url, s) for s, p in (("encoder", enc_p), ("decoder", dec_p))}
    rtts = {"encoder": [], "decoder": []}
    async with grpc.aio.insecure_channel(enc_p.address) as ec, grpc.aio.insecure_channel(dec_p.address) as dc:
        enc, dec = encoder_pb2_grpc.EncoderStub(ec), decoder_pb2_grpc.DecoderStub(dc)
        await asyncio.gather(*(one_stream(enc, dec, f"bench-{streams}-{i}", frames, rtts) for i in range(streams)))
    for stage, p in (("encoder", enc_p), ("decoder", dec_p)):
        after = scrape(p.metrics_url, stage)
        d = {k: after[k] - before[stage][k] for k in after}
        steps = d["duplex_stage_step_seconds_count"]
        r = np.array(rtts[stage]) * 1000
        print(
            f"{stage:8s} streams={streams:3d} steps={steps:5.0f} "
            f"mean_step={1000 * d['duplex_stage_step_seconds_sum'] / steps:7.2f} ms "
            f"mean_batch={d['duplex_stage_batch_size_sum'] / steps:5.1f} rtt_p50={np.percentile(r, 50):6.2f} ms "
            f"rtt_p99={np.percentile(r, 99):6.2f} ms",
            flush=True,
        )


def raw_steps(checkpoint: str, device: str, streams: int, frames: int) -> None:
    """The codec alone, in this process, all `streams` slots active: the floor under the service's step."""
    import torch

    from services.codec.stage import CodecServiceConfig, load_mimi
    from services.codec.mimi import StreamingDecoder, StreamingEncoder

    model, cfg = load_mimi(CodecServiceConfig(checkpoint=checkpoint, device=device))
    enc, dec = StreamingEncoder(model, streams), StreamingDecoder(model, streams)
    active = torch.ones(streams, dtype=torch.bool, device=device)
    pcm = torch.randn(streams, cfg.frame_size, device=device) * 0.3
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    with torch.no_grad():
        for _ in range(3):
            dec.step(enc.step(pcm, active), active)
        times = {"encoder": 0.0, "decoder": 0.0}
        for _ in range(frames):
            sync()
            t0 = time.perf_counter()
            codes = enc.step(pcm, active)
            sync()
            t1 = time.perf_counter()
            dec.step(codes, active)
            sync()
            t2 = time.perf_counter()
            times["encoder"] += t1 - t0
            times["decoder"] += t2 - t1
    for stage, t in times.items():
        print(f"{stage:8s} streams={streams:3d} raw codec step (in-process, no gRPC) {1000 * t / frames:7.2f} ms",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default="")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--frames", type=int, default=25)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    checkpoint = args.checkpoint
    if not checkpoint:
        from tools.make_checkpoint import ensure_checkpoint

        checkpoint = str(ensure_checkpoint("tiny", seed=0))
    slots = str(max(args.streams))
    common = ["--checkpoint", checkpoint, "--slots", slots, "--device", args.device, "--threads", str(args.threads),
              "--host", "127.0.0.1", "--log-level", "WARNING"]
    enc_p = ServiceProcess("services.encoder", common, ready_timeout=300).spawn()
    dec_p = ServiceProcess("services.decoder", common, ready_timeout=300).spawn()
    with enc_p, dec_p:
        for n in args.streams:
            asyncio.run(run(enc_p, dec_p, n, args.frames))
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    for n in args.streams:
        raw_steps(checkpoint, args.device, n, args.frames)


if __name__ == "__main__":
    main()
