"""GPU check of the compact catch-up steps (TalkerEngine.step_rows): the full step's tokens and state,
bit for bit, and what each bucket costs beside the full step.

    python -m bench.catch_up_check [--slots 160] [--buckets 8,32] [--kv-bits 8|4] [--reps 20] [--out DIR]  # one H200
    python -m bench.catch_up_check --smoke [--out DIR]     # the tiny model on the CPU: checks the script

The talker as served at the headline: PersonaPlex-7B shapes with random weights made on the GPU, fp8
weights and KV, torch.compile'd elementwise kernels, CUDA-graphed steps, every slot at full context
(bench_full_context), the personaplex alignment stepping ahead; odd slots greedy, even ones sampled;
slot 0 left in the middle of its prompt.

1. Equality. For each bucket and 1, half and all of its rows active (random live slots in a random row
   order; about a third of them with a forced text token, gated or not: a say, engine.TextForcing),
   the state a step changes (every slot's token history, offset, ring length and the KV entry
   at the ring index it writes) is saved; the eager full step (what step() runs without a graph) runs
   those slots; the state is put back and the graphed full step runs them; put back again, the graphed
   compact step. Compared with the eager full step: the outputs of every slot (bit for bit, the text
   each wrote included: where forced, the forced token or, gated, the model's word start) and that
   state (byte for byte), padding rows and the prefilling slot included. The compact step's state is
   kept, so the sessions move on from trial to trial. Apart from rounding, each of the three must write
   what the forcing says (`forcing_ok`): the forced token where it does not wait, and where it waits the
   forced token, EPAD or PAD (engine._force_text).
2. Cost. Each bucket's graphed step with 1 and with all its rows active, and the full step with every
   slot active: wall time to the outputs on the host and GPU time (CUDA events), medians of --reps.
   Beside them the idle warm-up time of each (engine.warm_step_s), the clock's prior for a bucket not
   yet measured (TickPolicy.catch_up_cost with the measured full step: idle time plus the rows' share of
   the full step's rest) and, to compare, the full step scaled by the two idle times ("ratio prior").
Prints a table and writes catch_up_check.json under --out; exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import sys
import time
from pathlib import Path

import torch

from services.common.checkpoint import CheckpointPaths
from services.talker import fused
from services.talker.engine import (
    AGENT_CODEBOOKS, NO_FORCE, NO_FRAME, SamplingParams, StepResult, TalkerEngine, TextForcing)
from services.talker.model import LMConfig, LMModel
from services.talker.text import EPAD_ID, PAD_ID, TextTokenizer
from services.talker.tick_policy import TickPolicy
from tools.make_checkpoint import ensure_checkpoint


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def full_size_model(device: str) -> LMModel:
    """PersonaPlex-7B shapes, random weights drawn on the GPU (seconds), temporal matrices in fp8."""
    model = LMModel(LMConfig.full(), dep_steps=AGENT_CODEBOOKS, device=device, dtype=torch.bfloat16)
    model.init_random_(0)
    model.quantize_weights_fp8_()
    return model


def build(args) -> TalkerEngine:
    tiny = CheckpointPaths.open(ensure_checkpoint("tiny", seed=0))
    buckets = tuple(int(b) for b in args.buckets.split(",") if b)
    kw = dict(kv_bits=args.kv_bits, alignment="personaplex", step_ahead=True, catch_up_buckets=buckets)
    if args.smoke:
        return TalkerEngine.from_checkpoint(tiny, args.slots, device="cpu", **kw)
    fused.enable()
    return TalkerEngine(full_size_model("cuda"), TextTokenizer.load(tiny.tokenizer), args.slots, cuda_graph=True, **kw)


def start_sessions(eng: TalkerEngine) -> list[int]:
    """Every slot but 0 live at full context (odd greedy, even sampled), each stepped once (its step 0
    has no user frame); slot 0 halfway through its prompt. Returns the live slots."""
    eng.bench_full_context = True
    live = list(range(1, eng.num_slots))
    for slot in live:
        sampling = SamplingParams(greedy=True) if slot % 2 else SamplingParams(seed=slot)
        job = eng.begin(slot, None, "", sampling)
        while not job.run(64):
            pass
    assert not eng.begin(0, None, "You are a calm assistant.", SamplingParams(seed=0)).run(4)
    codes = torch.full((eng.num_slots, AGENT_CODEBOOKS), NO_FRAME, dtype=torch.long)
    eng.step(codes, torch.arange(eng.num_slots) > 0)
    return live


# ---- 1. equality ------------------------------------------------------------------------------------

def saved_state(eng: TalkerEngine):
    """What a step can change, of every slot: (ring index it writes, copies of history/offset/length,
    the KV entries at that index)."""
    idx = eng.kv.length % eng.kv.context
    small = {"hist": eng.hist.clone(), "offset": eng.offset.clone(), "length": eng.kv.length.clone()}
    return idx, small, eng.kv.save_entries(idx)


def put_back(eng: TalkerEngine, saved) -> None:
    idx, small, entries = saved
    eng.hist.copy_(small["hist"])
    eng.offset.copy_(small["offset"])
    eng.kv.length.copy_(small["length"])
    eng.kv.restore_entries(idx, entries, keep=torch.ones(eng.num_slots, dtype=torch.bool, device=eng.device))


def after(eng: TalkerEngine, r: StepResult, idx: torch.Tensor) -> dict[str, torch.Tensor]:
    """A step's outputs and the state it changed (KV entries at the step's ring index, as bytes)."""
    out = {"text_tokens": r.text_tokens, "agent_codes": r.agent_codes, "has_output": r.has_output,
           "next_text": r.next_text, "hist": eng.hist, "offset": eng.offset, "length": eng.kv.length}
    for i, t in enumerate(eng.kv.save_entries(idx)):
        out[f"kv_store_{i}"] = t.contiguous().view(torch.uint8)
    return {k: v.clone() for k, v in out.items()}


def differences(a: dict, b: dict) -> dict[str, float]:
    """What differs between two steps' `after`: the share of elements that differ, by name."""
    return {k: (a[k] != b[k]).float().mean().item() for k in a if not torch.equal(a[k], b[k])}


def said(diff: dict[str, float] | None) -> str:
    return "equal" if not diff else "DIFFERS in " + ", ".join(f"{k} ({share:.2%})" for k, share in diff.items())


def forcing_ok(eng: TalkerEngine, result: dict, full: TextForcing) -> bool:
    """Whether a step wrote what `full` forces (engine._force_text), whatever its rounding."""
    written, tokens, gated = result["next_text"].cpu(), full.tokens, full.gated
    forced = tokens != NO_FORCE
    plain = forced & ~gated
    waited = forced & gated
    allowed = (written == tokens) | (written == EPAD_ID) | (written == PAD_ID)
    return bool((written[plain] == tokens[plain]).all() and allowed[waited].all())


def forcing(eng: TalkerEngine, slots: list[int], rng: random.Random) -> tuple[TextForcing, TextForcing]:
    """A say's forcing for about a third of `slots` (random text ids, half of them waiting for the
    model's word start): per row of `slots`, and per slot for the full step."""
    tokens = [rng.randrange(4, eng.text_card) if rng.random() < 1 / 3 else NO_FORCE for _ in slots]
    gated = [t != NO_FORCE and rng.random() < 0.5 for t in tokens]
    rows = TextForcing(torch.tensor(tokens, dtype=torch.long), torch.tensor(gated, dtype=torch.bool))
    full = TextForcing.none(eng.num_slots)
    full.tokens[slots], full.gated[slots] = rows.tokens, rows.gated
    return rows, full


@torch.no_grad()
def equality_trials(eng: TalkerEngine, live: list[int], rng: random.Random, trials_per_size: int) -> list[dict]:
    S, dev = eng.num_slots, eng.device
    rows_out = []
    for rows in eng.row_buckets[:-1]:
        for n in sorted({1, rows // 2 + 1, rows}):
            for _ in range(trials_per_size):
                slots = rng.sample(live, n)  # random slots in a random row order
                codes = torch.randint(0, eng.card, (n, AGENT_CODEBOOKS), generator=torch.Generator().manual_seed(
                    rng.randrange(1 << 30)))
                full_codes, active = torch.zeros(S, AGENT_CODEBOOKS, dtype=torch.long), torch.zeros(S, dtype=torch.bool)
                full_codes[slots], active[slots] = codes, True
                forced, forced_full = forcing(eng, slots, rng)
                saved = saved_state(eng)
                idx = saved[0]
                eager = after(eng, eng._advance(full_codes.to(dev), active.to(dev), forced_full.to(dev)),
                              idx)  # step() without a graph
                put_back(eng, saved)
                graphed_full = None
                ok = forcing_ok(eng, eager, forced_full)
                if eng.cuda_graph:
                    graphed = after(eng, eng.step(full_codes, active, forced_full), idx)
                    graphed_full, ok = differences(eager, graphed), ok and forcing_ok(eng, graphed, forced_full)
                    put_back(eng, saved)
                stepped = after(eng, eng.step_rows(slots, codes, rows, forced), idx)
                compact, ok = differences(eager, stepped), ok and forcing_ok(eng, stepped, forced_full)
                outputs, n_forced = int(eager["has_output"].sum()), int((forced.tokens != NO_FORCE).sum())
                rows_out.append({"rows": rows, "active": n, "outputs": outputs, "forced": n_forced, "forcing_ok": ok,
                                 "compact_differs": compact, "graphed_full_differs": graphed_full})
                log(f"rows {rows:3d}, {n:3d} active ({outputs} outputs, {n_forced} forced): compact {said(compact)}"
                    + ("" if graphed_full is None else f"; graphed full {said(graphed_full)}"))
    return rows_out


# ---- 2. cost ----------------------------------------------------------------------------------------

@torch.no_grad()
def timed(eng: TalkerEngine, run, reps: int) -> dict:
    walls, devices = [], []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        run().text_tokens.cpu()  # the outputs on the host, as the clock waits for them
        wall = time.perf_counter() - t0
        walls.append(wall * 1e3)
        devices.append((eng.last_step_device_s() or float("nan")) * 1e3)
    walls, devices = walls[1:], devices[1:]  # the first may still be warming
    return {"wall_ms": sorted(walls)[len(walls) // 2], "device_ms": sorted(devices)[len(devices) // 2]}


def costs(eng: TalkerEngine, live: list[int], reps: int) -> list[dict]:
    S, g = eng.num_slots, torch.Generator().manual_seed(1)
    codes = lambda n: torch.randint(0, eng.card, (n, AGENT_CODEBOOKS), generator=g)  # noqa: E731
    every = torch.zeros(S, dtype=torch.bool)
    every[live] = True
    rows_out = [{"rows": S, "active": len(live), **timed(eng, lambda: eng.step(codes(S), every), reps)}]
    for rows in eng.row_buckets[:-1]:
        for n in (1, rows):
            run = functools.partial(lambda slots, rows: eng.step_rows(slots, codes(len(slots)), rows), live[:n], rows)
            rows_out.append({"rows": rows, "active": n, **timed(eng, run, reps)})
    policy = TickPolicy(0.08, row_buckets=eng.row_buckets, warm_s=eng.warm_step_s, step_s=rows_out[0]["wall_ms"] / 1e3)
    for r in rows_out:
        r["warm_idle_ms"] = eng.warm_step_s[r["rows"]] * 1e3
        r["prior_ms"] = policy.catch_up_cost(r["rows"]) * 1e3
        # the other prior one could take: the full step scaled by the two idle times
        r["ratio_prior_ms"] = rows_out[0]["wall_ms"] * eng.warm_step_s[r["rows"]] / eng.warm_step_s[S]
    return rows_out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=160)
    ap.add_argument("--buckets", default="8,32", help="compact step sizes (engine.CATCH_UP_BUCKETS)")
    ap.add_argument("--kv-bits", type=int, default=8, choices=(8, 4), help="the KV ring: fp8 (the headline) or int4")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--trials", type=int, default=2, help="equality trials per bucket and active count")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--smoke", action="store_true", help="the tiny model on the CPU, 40 slots: checks the script")
    args = ap.parse_args(argv)
    if args.smoke:
        args.slots, args.reps = min(args.slots, 40), min(args.reps, 3)
        torch.set_num_threads(1)  # tiny steps: more threads only contend for the cores
    elif not torch.cuda.is_available():
        print("bench.catch_up_check needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    eng = build(args)
    eng.warmup()
    log(f"engine of {eng.num_slots} slots, steps of {eng.row_buckets} rows, warmed up in "
        f"{time.perf_counter() - t0:.0f} s; idle steps (ms): "
        + ", ".join(f"{r}: {s * 1e3:.2f}" for r, s in eng.warm_step_s.items()))
    live = start_sessions(eng)
    log(f"{len(live)} sessions live at full context")
    trials = equality_trials(eng, live, random.Random(0), args.trials)
    table = costs(eng, live, args.reps)
    equal = all(not t["compact_differs"] for t in trials)
    graphs_equal = all(not t["graphed_full_differs"] for t in trials if t["graphed_full_differs"] is not None)
    forced_right = all(t["forcing_ok"] for t in trials)
    print(f"\ncompact steps equal to the eager full step: {equal} ({len(trials)} trials); graphed full step "
          f"equal to the eager one: {graphs_equal if eng.cuda_graph else 'n/a (no graphs)'}; every step wrote "
          f"what its forcing says: {forced_right}")
    print(f"\n{'rows':>5} {'active':>6} {'wall p50 ms':>12} {'GPU p50 ms':>11} {'idle warm-up ms':>16} "
          f"{'prior ms':>9} {'ratio prior ms':>15}")
    for r in table:
        print(f"{r['rows']:5d} {r['active']:6d} {r['wall_ms']:12.2f} {r['device_ms']:11.2f} "
              f"{r['warm_idle_ms']:16.2f} {r['prior_ms']:9.2f} {r['ratio_prior_ms']:15.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if eng.device.type == "cuda" else "cpu"
    result = {"device": device, "slots": eng.num_slots, "row_buckets": list(eng.row_buckets), "smoke": args.smoke,
              "kv_bits": args.kv_bits,
              "compact_equal": equal, "graphed_full_equal": graphs_equal if eng.cuda_graph else None,
              "forcing_ok": forced_right,
              "trials": trials, "costs": table, "warm_step_ms": {r: s * 1e3 for r, s in eng.warm_step_s.items()}}
    (out / "catch_up_check.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out / 'catch_up_check.json'}")
    return 0 if equal and graphs_equal and forced_right else 1


if __name__ == "__main__":
    sys.exit(main())
