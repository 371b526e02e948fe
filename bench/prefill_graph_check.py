"""GPU check: the CUDA-graphed talker (graphed step, graphed prefill chunks, prefill queued behind
a running step) gives what the eager engine gives. CPU tests cannot run CUDA graphs.

    python -m bench.prefill_graph_check [--kv-bits 32,8,4]       # exits 1 on any difference
    python -m bench.prefill_graph_check --smoke                  # the CPU: checks the script (below)

The tiny checkpoint in fp32 on the GPU, both alignments, fp32, fp8 and 4-bit KV, and two voices: a session in slot 0
is live and steps while a session with a voice and a persona prefills in slot 2, three frames per step (so prompt
chunks run between steps, each padded to the graph's 4-frame chunk, reading 8, 16, then all ring
entries as the prompt grows). The voice is NATF2.pt, preloaded (its KV prefix copied), or a voice recorded for the
run and never used before (its KV prefix computed by those pieces too, as the captured chunks of voice embeddings,
engine._VoicePrefix). Then both talk for 30 frames, slot 0 saying a sentence (its text tokens
forced by services/talker/say.py's queue, gated and not: a forced token is data to the graph).

Compared, for each ring:
1. Every output token and code of both sessions: identical.
2. Slot 2's length after the prompt, and its ring's valid entries (indices 0..length-1, every layer, keys and
   values) in the ring's own stores and units (bench/ring_compare.py): the values of a plain ring within 1e-4; the
   codes and fp16 scales (4-bit: and minimums) of a quantized one bit-identical, or within one step in at most
   1 % of them (ROUNDING). Why a tolerance at all: the graph's chunk has fixed shapes (4 query rows where the
   chunk has 3; 8, 16 or all keys where the slot has `start`), so its fp32 sums round differently by about 1e-6,
   which a quantizer turns into the neighbouring code or scale if a value lies on a rounding boundary (rarely:
   on the CPU none of 15k quantized elements did).
3. The ring's writer on one input, eagerly and replayed from a captured CUDA graph (a 4-position chunk, then a
   1-position step): every stored byte IDENTICAL. This is the exact half of 2: the same quantizer, one owner,
   whatever runs it.
The graphed run also checks that slot 2's begin() and chunks never wait for the GPU (they ride a
running step in the service): any host sync raises there.

--smoke runs the same on the CPU, where nothing is graphed: the second run is the eager engine with each prompt
chunk shaped as the captured one (padded to 4 frames, through the 8, 16 or whole-ring window; `GraphShapedChunk`),
so the comparison meets the rounding those shapes cause, and the write check compares two eager writes.
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch

from bench.ring_compare import RingDiff, Verdict, compare_rings
from services.common.checkpoint import CheckpointPaths
from services.talker import prompt
from services.talker.engine import SamplingParams, TalkerEngine, TextForcing
from services.talker.kv_cache import KVCache, kv_cache_type
from services.talker.say import SayQueue, say_words
from services.talker.voice_recorder import published
from tools.make_checkpoint import ensure_checkpoint


def talk_while_prefilling(eng: TalkerEngine, frames: torch.Tensor, no_sync: bool, voice: str) -> list:
    """Slot 0 goes live (no prompt) and talks while slot 2's prompt (a voice and a persona) runs
    behind its steps, three frames per step, begun behind the first step as a piece riding it
    would be (services/talker/runner.py). Returns slot 0's step results
    meanwhile; frames[i] is step i's input. no_sync: begin() and the chunks run with CUDA's sync
    debug mode at "error", so any wait for the GPU (which would make the piece wait for the
    step it rides) raises."""
    job0 = eng.begin(0, None, "", SamplingParams(greedy=True))
    while not job0.run(64):
        pass
    job2, results, active = None, [], torch.tensor([True, False, False])
    while job2 is None or not job2.done:
        results.append(eng.step(frames[len(results)], active))  # slot 0 talks ...
        if no_sync:
            torch.cuda.set_sync_debug_mode("error")
        try:  # ... while slot 2's prompt runs behind its step
            if job2 is None:
                job2 = eng.begin(2, voice, "You are a calm assistant.", SamplingParams(seed=5))
            job2.run(3)
        finally:
            if no_sync:
                torch.cuda.set_sync_debug_mode(0)
    return results


SAY = "Thank you for your order, it will arrive on Monday."
RECORDED = "recorded"  # a voice of 20 frames made for the run: its 19 KV prefix positions take 7 pieces of 3


def add_recorded_voice(eng: TalkerEngine) -> None:
    """A voice as the talker records one (voice_recorder.published: bf16 embeddings on the host), added unused."""
    codes = torch.randint(0, eng.card, (20, 8), generator=torch.Generator().manual_seed(7))
    eng.add_voice(RECORDED, published(prompt.make_voice(eng.model.embed, codes, torch.tensor(eng.cfg.delays),
                                                        prompt.initial_tokens(eng.text_card, eng.card,
                                                                              eng.cfg.num_streams), eng.device)))


class GraphShapedChunk:
    """--smoke's stand-in for a captured prefill chunk (services/talker/engine.py's _PrefillGraph): the same
    arithmetic run eagerly, the chunk padded to `frames` (tokens with -1, a voice's embeddings with zeros) and
    attention over ring indices 0..window-1 (None: the whole ring), then the slot's length set to the real frames.
    On the CPU it gives the rounding the graph's fixed shapes give on the GPU."""

    def __init__(self, frames: int, window: int | None, embedded: bool = False):
        self.frames, self.window, self.embedded = frames, window, embedded

    def fits(self, n: int, start: int, context: int) -> bool:  # as _PrefillGraph.fits
        return n <= self.frames and start + self.frames <= context and (self.window is None or start <= self.window)

    def run(self, eng: TalkerEngine, slot: int, slot_t: torch.Tensor, rows: torch.Tensor, start: int) -> None:
        dtype = eng.model.dtype if self.embedded else torch.long
        padded = torch.full((1, self.frames, rows.shape[1]), 0.0 if self.embedded else -1, dtype=dtype)
        padded[0, : rows.shape[0]] = rows
        x = padded.to(eng.device)
        eng.model.temporal(x if self.embedded else eng.model.embed(x, check=False), eng.kv, slot_t, self.window,
                           prompt=True)
        eng.kv.length[slot].fill_(start + rows.shape[0])


def run(paths: CheckpointPaths, kv_bits: int | None, graphed: bool, alignment: str,
        device: str = "cuda", voice: str = "NATF2.pt", graph_shaped: bool = False) -> tuple[list, KVCache, int]:
    """The scenario (module doc) with `voice`: the outputs, a copy of the ring after slot 2's prompt, and slot 2's
    length then. graph_shaped (eager only): prompt chunks shaped as the captured ones (GraphShapedChunk)."""
    eng = TalkerEngine.from_checkpoint(paths, slots=3, device=device, dtype=torch.float32, kv_bits=kv_bits,
                                       cuda_graph=graphed, alignment=alignment)
    eng.prefill_graph_frames = 4  # several padded chunks per prompt ...
    eng.prefill_graph_windows = (8, 16)  # ... run by each captured window in turn, then the whole-ring one
    eng.warmup(("NATF2.pt",))
    add_recorded_voice(eng)
    if graph_shaped and not graphed:
        # the engine's list of captured chunks, which an eager engine leaves empty
        eng._prefill_graphs = [GraphShapedChunk(eng.prefill_graph_frames, w, embedded)
                               for embedded in (False, True) for w in (*eng.prefill_graph_windows, None)]
    g = torch.Generator().manual_seed(0)
    frames = torch.randint(0, eng.card, (60, 3, 8), generator=g)
    results = talk_while_prefilling(eng, frames, no_sync=graphed and device == "cuda", voice=voice)
    outs, t = [r.agent_codes[0].tolist() for r in results], len(results)
    length = int(eng.kv.length[2])
    ring = copy.deepcopy(eng.kv)  # as the prompt left it: the talk below writes on
    both = torch.tensor([True, False, True])
    say = SayQueue(max_wait_frames=2)  # slot 0 says SAY
    say.add(1, say_words(eng.tokenizer, SAY, 1000))
    said = []
    for _ in range(30):
        offer, forced = say.next_force(), TextForcing.none(3)
        if offer is not None:
            forced.tokens[0], forced.gated[0] = offer.token, offer.gated
        r = eng.step(frames[t], both, forced)
        said += say.stepped(int(r.next_text[0]))
        outs.append((r.text_tokens.tolist(), r.agent_codes.tolist(), r.next_text.tolist()))
        t += 1
    outs.append([d.tokens_said for d in said])  # the say went through (and the same way in both runs)
    return outs, ring, length


def write_check(kv_bits: int | None, device: str, graphed: bool) -> RingDiff:
    """The ring's writer on one input (a 4-position chunk, then a 1-position step, into slot 1 of fresh rings),
    eagerly and, graphed, replayed from a captured CUDA graph (eagerly again on the CPU). Heads of magnitudes 1e-3
    to 1e2, so scales of every size are written."""
    g = torch.Generator().manual_seed(1)
    heads, context, head_dim = 4, 16, 16
    size = torch.logspace(-3, 2, heads)[None, :, None, None]
    chunk_k, chunk_v, step_k, step_v = ((torch.randn(1, heads, t, head_dim, generator=g) * size).to(device)
                                        for t in (4, 4, 1, 1))
    ring_type = kv_cache_type(kv_bits)
    eager, replayed = (ring_type(1, 2, heads, context, head_dim, device=device, dtype=torch.float32)
                       for _ in range(2))

    def writes(kv: KVCache) -> None:
        slot = kv.slot_index(1)
        kv.write(0, slot, torch.arange(4, device=device)[None], chunk_k, chunk_v)
        kv.write(0, slot, torch.full((1, 1), 4, device=device), step_k, step_v)

    writes(eager)
    if graphed:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            writes(replayed)  # warm-up outside the capture, then undone: what is compared is the replay's
        torch.cuda.current_stream(device).wait_stream(side)
        replayed.reset(1)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            writes(replayed)
        graph.replay()
        torch.cuda.synchronize(device)
    else:
        writes(replayed)
    return compare_rings(eager, replayed, slot=1, entries=5)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-bits", default="32,8,4", help="the rings to check: 32 (the fp32 compute dtype), 8, 4")
    ap.add_argument("--smoke", action="store_true", help="on the CPU, eager against eager with the graph's chunk "
                                                         "shapes (checks the script)")
    args = ap.parse_args(argv)
    rings = [None if b == "32" else int(b) for b in args.kv_bits.split(",")]
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        torch.set_num_threads(1)
    elif not torch.cuda.is_available():
        print("bench.prefill_graph_check needs a CUDA GPU", file=sys.stderr)
        return 2
    paths = CheckpointPaths.open(ensure_checkpoint("tiny", seed=0))
    ok = True
    for alignment, kv_bits, voice in ((a, b, v) for a in ("personaplex", "moshi") for b in rings
                                      for v in ("NATF2.pt", RECORDED)):
        eager_out, eager_kv, eager_len = run(paths, kv_bits, graphed=False, alignment=alignment, device=device,
                                             voice=voice)
        graph_out, graph_kv, graph_len = run(paths, kv_bits, graphed=not args.smoke, alignment=alignment,
                                             device=device, voice=voice, graph_shaped=args.smoke)
        same_out = eager_out == graph_out
        ring = compare_rings(eager_kv, graph_kv, slot=2, entries=min(eager_len, eager_kv.context))
        written = write_check(kv_bits, device, graphed=not args.smoke)
        good = (same_out and eager_len == graph_len and ring.verdict is not Verdict.DIFFERENT
                and written.verdict is Verdict.IDENTICAL)
        ok &= good
        first_diff = next((i for i, (a, b) in enumerate(zip(eager_out, graph_out)) if a != b), None)
        print(f"{alignment} kv_bits={kv_bits or 32} voice {voice}: outputs identical {same_out} (first difference at "
              f"step {first_diff}), slot length {graph_len} vs {eager_len}; slot 2's {ring}; the writer on one input, "
              f"{'graphed' if not args.smoke else 'eager'} vs eager: {written.verdict.value.upper()}: "
              f"{'PASS' if good else 'FAIL'}")
        if written.verdict is not Verdict.IDENTICAL:
            print(f"  the writer on one input: {written}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
