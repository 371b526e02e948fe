"""GPU check: the CUDA-graphed talker (graphed step, graphed prefill chunks, prefill queued behind
a running step) gives exactly what the eager engine gives. CPU tests cannot run CUDA graphs.

    python -m bench.prefill_graph_check [--kv-bits 32,8,4]       # exits 1 on any difference
    python -m bench.prefill_graph_check --smoke                  # the CPU, eager against eager: checks the script

The tiny checkpoint in fp32 on the GPU, both alignments, fp32, fp8 and 4-bit KV, and two voices: a session in slot 0
is live and steps while a session with a voice and a persona prefills in slot 2, three frames per step (so prompt
chunks run between steps, each padded to the graph's 4-frame chunk, reading 8, 16, then all ring
entries as the prompt grows). The voice is NATF2.pt, preloaded (its KV prefix copied), or a voice recorded for the
run and never used before (its KV prefix computed by those pieces too, as the captured chunks of voice embeddings,
engine._VoicePrefix). Then both talk for 30 frames, slot 0 saying a sentence (its text tokens
forced by services/talker/say.py's queue, gated and not: a forced token is data to the graph).
Compared: every output token and
code of both sessions, the written part of slot 2's KV ring (as `read` gives it: every layer's keys
and values, dequantized) and its length after the prompt. The
graphed run also checks that slot 2's begin() and chunks never wait for the GPU (they ride a
running step in the service): any host sync raises there.
"""

from __future__ import annotations

import argparse
import sys

import torch

from services.common.checkpoint import CheckpointPaths
from services.talker import prompt
from services.talker.engine import SamplingParams, TalkerEngine, TextForcing
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


def run(paths: CheckpointPaths, kv_bits: int | None, graphed: bool, alignment: str,
        device: str = "cuda", voice: str = "NATF2.pt") -> tuple[list, torch.Tensor, int]:
    eng = TalkerEngine.from_checkpoint(paths, slots=3, device=device, dtype=torch.float32, kv_bits=kv_bits,
                                       cuda_graph=graphed, alignment=alignment)
    eng.prefill_graph_frames = 4  # several padded chunks per prompt ...
    eng.prefill_graph_windows = (8, 16)  # ... run by each captured window in turn, then the whole-ring one
    eng.warmup(("NATF2.pt",))
    add_recorded_voice(eng)
    g = torch.Generator().manual_seed(0)
    frames = torch.randint(0, eng.card, (60, 3, 8), generator=g)
    results = talk_while_prefilling(eng, frames, no_sync=graphed and device == "cuda", voice=voice)
    outs, t = [r.agent_codes[0].tolist() for r in results], len(results)
    length = int(eng.kv.length[2])
    # The written positions only: past them a graphed chunk leaves its padding (never read).
    slot2 = eng.kv.slot_index(2)
    kv2 = torch.cat([t.flatten() for layer in range(eng.kv.num_layers)
                     for t in eng.kv.read(layer, slot2, torch.float32, entries=length)]).cpu()
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
    return outs, kv2, length


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-bits", default="32,8,4", help="the rings to check: 32 (the fp32 compute dtype), 8, 4")
    ap.add_argument("--smoke", action="store_true", help="on the CPU, eager against eager (checks the script)")
    args = ap.parse_args(argv)
    rings = [None if b == "32" else int(b) for b in args.kv_bits.split(",")]
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        torch.set_num_threads(1)
        rings = [r for r in rings if r != 4][:1]  # one ring: the script, not the kernels
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
                                             device=device, voice=voice)
        same_out = eager_out == graph_out
        kv_err = float((graph_kv - eager_kv).abs().max())
        good = same_out and eager_len == graph_len and kv_err <= 1e-4
        ok &= good
        first_diff = next((i for i, (a, b) in enumerate(zip(eager_out, graph_out)) if a != b), None)
        print(f"{alignment} kv_bits={kv_bits or 32} voice {voice}: outputs identical {same_out} (first difference at "
              f"step {first_diff}), slot length {graph_len} vs {eager_len}, KV max abs diff {kv_err:.2e}: "
              f"{'PASS' if good else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
