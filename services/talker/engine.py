"""All model work of the Talker for a fixed batch of slots, called from ONE compute thread.

    engine = TalkerEngine.from_checkpoint(paths, slots=8)
    job = engine.begin(slot, voice="NATF2.pt", persona="You are kind.", sampling=SamplingParams(seed=7))
    while not job.run(64): ...                        # prompt prefill, interleavable with steps
    r = engine.step(user_codes[S, 8], active[S])      # one 80 ms frame for the active slots
    r.text_tokens[S], r.agent_codes[S, 8], r.has_output[S]
    r = engine.step_rows([3, 5], user_codes[2, 8], rows=8)  # the same for slots 3 and 5 alone (a catch-up)
    r = engine.step(codes, active, forced=TextForcing(tokens[S], gated[S]))  # text tokens forced (a say)

Per slot the engine keeps: the temporal KV ring (in the LM's KVCache), a token-history ring
of 4 columns (`hist`, column c at index c % 4, see prompt.py for columns), the column the next
step reads (`offset`), the first frame that is the model's own (`start`) and the sampling
parameters. Every step runs all S rows (static shapes, no per-slot Python loop); inactive
slots are computed and thrown away, and their state is left exactly as it was.

Compact steps (`step_rows`, the clock's catch-up steps): a step of a few slots costs what a step of
every slot costs, less only the active rows' attention (every weight is read and every kernel
launched either way: 18 of 48 ms at 160 slots, bench/RESULTS.md). A compact step runs b rows
instead, b one of `row_buckets` (CATCH_UP_BUCKETS below every slot, then every slot): the slots
behind, padded with other slots as inactive rows. Their per-slot state is gathered into the b rows
and written back; the KV ring is read and written in place (the attention takes a slot per row).
A row's arithmetic does not depend on which or how many other rows share its step (per-row
activation scales, per-row sampling noise keyed by (seed, frame)), so a compact step gives the
tokens and state the full step gives, bit for bit where the GEMMs give a row the same bits at
both batch sizes: on the CPU at 8 rows or more (tests/test_compact_step.py); on the GPU
bench/catch_up_check.py measures it.

Timing: two alignments (`alignment`), fixed per engine. Column c, stream k holds frame
c - delay[k]. A live step at offset o reads column o and:
  1. writes the user codes into column o + lag (q0, delay 0) and o + lag + 1 (q1..q7, delay 1),
  2. runs the transformer on column o: text, agent q0 and user q0 of frame o, agent and user
     q1..q7 of frame o-1 (the initial token for frames <= 0),
  3. samples the text token and agent q0 of frame o+1 and agent q1..q7 of frame o, stored
     in column o+1 (entries of prompt frames are teacher-forced and kept),
  4. returns frame o+1-max_delay = o: text/q0 sampled by the previous step, q1..q7 by this one.
With a prompt of F frames (frame 0 is the start frame), prefill runs columns 0..F-2 and live
step j runs at o = F-1+j, so both alignments emit agent frame F-1+j at step j.
- "personaplex" (NVIDIA's fork, `LMGen.prepare_step_input`; the default), lag 1: user frame j
  goes into column F+j and is read at step j+1. Step 0 reads the prompt's last column (user
  SINE) and returns the prompt's last frame (text PAD, agent SILENCE): N inputs, N outputs.
  Attention covers C-1 frames (the fork's RingKVCache masks its oldest entry), so the KV ring
  is C-1 long. A bare session (F = 1) has no prompt frame to return: its step 0 outputs nothing.
- "moshi" (upstream moshi 0.2.13), lag 0: user frame j goes into column F-1+j and is read in
  the same step; the first live frame replaces the user part of the last prompt frame, whose
  output is not returned: N inputs, N-1 outputs. Attention covers C frames.
`PrefillJob.output_delay_frames` is the number of leading live steps that return nothing.

Step ahead (`step_ahead`, personaplex only): since step j reads user frame j-1 at the latest, it
need not wait for frame j. Such an engine is given frame j-1 at step j (written where the
personaplex step j-1 would have written it, the same columns) and, at step 0, a row of -1: no
user frame. Same tokens, same window; the caller can run step j as soon as frame j-1 is in,
one frame period before frame j arrives. The engine only reads the frame it is given: holding output
j until frame j is in is the caller's (services/common/pairing.py).

Forced text (`TextForcing`, services/talker/say.py decides what): a step may force a slot's text
token, the one it samples for column o+1 and conditions the depformer's agent codes on, so the model
speaks it. The token is data, like the user codes (a per-row token, NO_FORCE for none, and a mask),
so the full step, the compact steps and their CUDA graphs run it unchanged. A gated force waits for
the model's word start: where the model samples EPAD it is kept (the word starts next frame), a
word-starting piece is replaced by the forced token, and anything else by PAD (the model may pad
before the word, not run on with a word of its own).
`StepResult.next_text` is the text token each step wrote, for the caller to follow its forcing.

Prompt prefill runs the temporal transformer on whole chunks of prompt columns (parallel,
T frames per call) instead of frame by frame. The voice part is the same for every session of
a voice: its KV is computed once per voice (`_VoicePrefix`) and copied into the slot.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from services.common import voice_names
from services.common.checkpoint import CheckpointPaths, InvalidVoice
from services.talker.text import EPAD_ID, PAD_ID, InvalidText, TextTokenizer
from services.talker import prompt
from services.talker.model import LMConfig, LMModel
from services.talker.sampling import InvalidSampling, RowParams, SamplingParams, noise_key, sample
from services.talker.voices import RING, VoicePrompt, load_voice
from services.common.frame import CODEBOOKS as AGENT_CODEBOOKS

__all__ = ["TalkerEngine", "SamplingParams", "PrefillJob", "StepResult", "TextForcing", "VoiceLookup", "InvalidPersona",
           "InvalidSampling", "InvalidVoice", "ALIGNMENTS", "NO_FRAME", "NO_FORCE"]

log = logging.getLogger("talker.engine")

NO_FRAME = -1  # a step_ahead engine's user code row for step 0, which has no user frame to write
NO_FORCE = -1  # a TextForcing token: the row's text is the model's own
ALIGNMENTS = ("personaplex", "moshi")  # the live-step timings (module doc); TalkerConfig.alignment
GRAPH_TEXT_TOP_K = 1024  # text top-k width a CUDA-graphed step is captured for (audio: the whole card)


class InvalidPersona(ValueError):
    """A persona that cannot be a prompt: not text, not encodable, or too long for the attention window."""


@dataclass
class StepResult:
    text_tokens: torch.Tensor  # LongTensor[S]; -1 where has_output is False
    agent_codes: torch.Tensor  # LongTensor[S, 8]; -1 where has_output is False
    has_output: torch.Tensor  # BoolTensor[S]
    next_text: torch.Tensor  # LongTensor[S]: the text token the step wrote (returned a step later); -1 if not stepped


class TextForcing(NamedTuple):
    """Text a step forces, per row (module doc): the token or NO_FORCE, and whether it waits for the
    model's word start."""

    tokens: torch.Tensor  # LongTensor[B]
    gated: torch.Tensor  # BoolTensor[B]

    @classmethod
    def none(cls, rows: int, device: torch.device | str = "cpu") -> "TextForcing":
        return cls(torch.full((rows,), NO_FORCE, dtype=torch.long, device=device),
                   torch.zeros(rows, dtype=torch.bool, device=device))

    def to(self, device: torch.device) -> "TextForcing":
        return TextForcing(to_device(self.tokens, device), to_device(self.gated, device))


class VoiceLookup(NamedTuple):
    """A recorded voice's embeddings on their way to the host (TalkerEngine.embed_voice)."""

    embeddings: torch.Tensor  # bf16 [N-1, dim] on the host (pinned on CUDA), complete once `done` is
    done: "torch.cuda.Event | None"  # marks the copy complete (None: a CPU engine, complete already)

    def wait(self) -> torch.Tensor:
        """The embeddings in plain host memory, once copied. Off the engine's thread: it waits for the GPU."""
        if self.done is None:
            return self.embeddings
        self.done.synchronize()
        # Pageable: the pinned buffer goes back to torch's cache, so held voices pin no memory.
        return torch.empty(self.embeddings.shape, dtype=self.embeddings.dtype).copy_(self.embeddings)


class _VoicePrefix:
    """The KV of one voice's embeddings (prompt columns 0..N-2), computed once, copied into slots.

    Computed in the prefill pieces of the first sessions that begin with it, like any prompt: a
    piece runs one chunk of the voice (at most its budget, the clock's prefill_chunk_frames) in its
    session's own slot, as a prompt chunk runs there (with cuda_graph the captured graph of voice
    embeddings, warmed up at start: eagerly a 64-frame chunk of the 7B is a few thousand kernel
    launches, tens of ms of host time on the compute thread that a riding piece adds to its tick,
    and every new voice length a set of shapes never run before), then copies the chunk's positions
    out into this prefix's ring. So what is done survives its session (closed or not) and the next
    piece of any session continues from it.

    Its ring holds exactly the voice's positions, not a whole context: a full-context ring per
    voice would cost as much as a session (0.8 GB at full size), and at 160 sessions on one GPU
    there is no session's worth of memory to spare. With no wrap, positions 0..n-1 sit at ring
    indices 0..n-1 in both rings, so the copies are prefix copies (KVCache.copy_slot, copy_positions)."""

    def __init__(self, engine: "TalkerEngine", name: str, voice: VoicePrompt):
        self.name, self.voice = name, voice
        self.total = voice.frames - 1
        # Same storage format as the engine's ring (copyable); at least one position.
        self.kv = engine.model.new_kv_cache(1, context=max(1, min(self.total, engine.context)), **engine._kv_format)
        self.done = 0
        self.pieces_ms: list[float] = []  # each piece's time on the compute thread (logged once complete)

    @property
    def complete(self) -> bool:
        return self.done >= self.total

    def advance(self, eng: "TalkerEngine", slot: int, slot_t: torch.Tensor, held: int, budget: int) -> int:
        """Compute up to `budget` more of the voice's positions in `slot`, which holds its first `held`
        (those this slot computed or copied; a reset slot 0), and keep them here. Returns how many."""
        n = min(budget, self.total - self.done)
        if n <= 0:
            return 0
        t0 = time.perf_counter()
        if held < self.done:  # another session's pieces got further: continue from theirs
            eng.kv.copy_positions(self.kv, 0, slot, held, self.done)
        eng._prefill_chunk(slot, slot_t, self.voice.embeddings[self.done : self.done + n], self.done, embedded=True)
        self.kv.copy_positions(eng.kv, slot, 0, self.done, self.done + n)
        self.done += n
        self.pieces_ms.append((time.perf_counter() - t0) * 1e3)
        if self.complete:
            log.info("voice %s: KV prefix of %d frames computed in %d piece(s), on the compute thread (ms): %s",
                     self.name, self.total, len(self.pieces_ms), " + ".join(f"{t:.2f}" for t in self.pieces_ms))
        return n


class PrefillJob:
    """The prompt of one session, run into its slot in chunks: `run(max_frames)` until done."""

    def __init__(self, engine: "TalkerEngine", slot: int, cols: prompt.PromptColumns, voice: _VoicePrefix | None):
        self.slot = slot
        self.total_frames = cols.transformer_frames  # temporal positions the prompt fills
        self.frames_done = 0
        self.prompt_frames = cols.frames
        self.first_output = engine.first_output_frame(cols.frames)
        # Live steps that return nothing: step j returns frame F-1+j (module doc).
        self.output_delay_frames = self.first_output - (cols.frames - 1)
        self._engine, self._cols, self._voice = engine, cols, voice
        self._voice_in_slot = voice is None
        self._voice_held = 0  # positions of the voice's KV prefix this slot holds while it is being computed
        self.voice_frames_run = 0  # positions of the voice's KV prefix the last run() computed (not copied)
        self._next = 0  # next row of cols.inputs
        self._done = False
        self.cancelled = False
        self._slot_t = engine.kv.slot_index(slot)  # checked once: the chunks below never sync with the GPU

    @property
    def done(self) -> bool:
        return self._done

    @torch.no_grad()
    def run(self, max_frames: int) -> bool:
        """Run up to max_frames more prompt frames (one parallel forward per part); True when done.
        Frames of a voice whose KV is already cached cost nothing (they are copied)."""
        if self.cancelled:
            raise RuntimeError(f"prefill job of slot {self.slot} was cancelled (slot released or restarted)")
        if self._done:
            return True
        budget = max(0, int(max_frames))
        eng = self._engine
        self.voice_frames_run = 0
        if not self._voice_in_slot:
            self.voice_frames_run = self._voice.advance(eng, self.slot, self._slot_t, self._voice_held, budget)
            if self.voice_frames_run:
                self._voice_held = self._voice.done
            budget -= self.voice_frames_run
            if not self._voice.complete:
                self.frames_done = self._voice.done
                return False
            if self._voice_held < self._voice.total:  # computed before this slot's pieces (or by others'): copied
                eng._copy_voice_kv(self.slot, self._voice)
            self._voice_in_slot = True
            self.frames_done = self._cols.first
        inputs = self._cols.inputs
        if budget > 0 and self._next < inputs.shape[0]:
            n = min(budget, inputs.shape[0] - self._next)
            eng._prefill_chunk(self.slot, self._slot_t, inputs[self._next : self._next + n],
                               start=self._cols.first + self._next)
            self._next += n
            self.frames_done += n
        if self._next >= inputs.shape[0]:
            eng._go_live(self.slot, self._cols)
            self._done = True
        return self._done


# Row counts of the compact steps (module doc; each its own CUDA graph and depformer cache). A
# compact step's cost is mostly fixed (weights, kernel launches), plus each active row's attention.
# 8 holds the usual catch-up (a few sessions whose frame came after the deadline) at that fixed
# cost, and is the smallest batch whose rows get the full step's bits from the CPU's GEMMs; 32 a
# burst (a group of arrivals, a codec hiccup) at about 24 rows' attention more. More than 32
# sessions behind run the full step.
CATCH_UP_BUCKETS = (8, 32)
PREFILL_GRAPH_FRAMES = 64  # the captured prefill chunk: shorter chunks are padded to it
# A prefill chunk reads only the ring indices the slot's history can occupy (KVCache.attend's
# window). A graph has fixed shapes, so one is captured per window below the context (plus one that
# reads the whole ring): a chunk runs the smallest that holds its slot's history. A prompt starts
# after a voice of a few seconds (about 60-250 frames), so its chunks mostly run the 256 graph.
PREFILL_GRAPH_WINDOWS = (256, 1024)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the GPU: a plain copy to CUDA synchronizes
    the stream (it would wait for a running step); one from pinned memory is only queued."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class _PrefillGraph:
    """One prefill chunk of `frames` prompt columns for any slot whose history lies in ring
    indices 0..window-1 (None: anywhere), as a captured CUDA graph; `embedded`: a chunk of a
    voice's embeddings (its KV prefix, _VoicePrefix) instead of prompt tokens.

    Inputs are static buffers: the tokens (a shorter chunk is padded with -1, which embeds to
    zero) or the embeddings (padded with zeros: the same input), and the slot index. The padded
    positions past the chunk are written into the ring too; they lie beyond what the slot has
    written (its length is set back to start + n afterwards), so attention never reads them
    before a later frame overwrites them. The caller keeps start + frames within the ring, so the
    padding never overwrites a real entry.
    """

    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: torch.Tensor, slot: torch.Tensor, frames: int,
                 window: int | None, embedded: bool):
        self.graph, self.inputs, self.slot, self.frames, self.window = graph, inputs, slot, frames, window
        self.embedded = embedded
        self.padding = 0.0 if embedded else -1

    def fits(self, n: int, start: int, context: int) -> bool:
        """Whether a chunk of n frames at positions start.. of a slot that has written `start`
        positions can run as this graph: its padding stays inside the ring, and the slot's history
        (unwrapped while start <= context) inside the window."""
        return n <= self.frames and start + self.frames <= context and (self.window is None or start <= self.window)

    @classmethod
    def capture(cls, eng: "TalkerEngine", frames: int, window: int | None = None,
                pool=None, embedded: bool = False) -> "_PrefillGraph":
        """Capture into memory `pool` (another prefill graph's: they never run at once)."""
        dev = eng.device
        if embedded:
            inputs = torch.zeros((1, frames, eng.cfg.dim), dtype=eng.model.dtype, device=dev)
        else:
            inputs = torch.full((1, frames, eng.cfg.num_streams), -1, dtype=torch.long, device=dev)
        slot = eng.kv.slot_index(0).clone()
        eng.kv.trust(slot)  # its value is only ever set from a checked host slot (run below)

        def forward() -> None:
            x = inputs if embedded else eng.model.embed(inputs, check=False)
            eng.model.temporal(x, eng.kv, slot, window, prompt=True)

        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            forward()  # warm-up outside the capture (lazy inits); writes slot 0, reset by the caller
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            forward()
        log.info("captured a prefill chunk of %d %s reading %s ring entries as a CUDA graph", frames,
                 "voice embeddings" if embedded else "frames", window or "all")
        return cls(graph, inputs, slot, frames, window, embedded)

    def run(self, eng: "TalkerEngine", slot: int, slot_t: torch.Tensor, rows: torch.Tensor, start: int) -> None:
        n = rows.shape[0]
        self.inputs.fill_(self.padding)
        self.inputs[0, :n].copy_(to_device(rows, eng.device))
        self.slot.copy_(slot_t)
        self.graph.replay()
        eng.kv.length[slot].fill_(start + n)  # not start + frames: the padding is not part of the prompt


class _CompactStep:
    """The step of `rows` rows for a subset of slots (TalkerEngine.step_rows): static inputs (the
    rows' slots, their user codes, which rows are active), a depformer cache of its batch and, with
    cuda_graph, its captured graph. Inputs are copied in from pinned memory: no wait for the GPU,
    so it queues behind a prefill chunk still running."""

    def __init__(self, eng: "TalkerEngine", rows: int):
        dev = eng.device
        self.slots = torch.arange(rows, device=dev)  # distinct slots (captured as all-idle rows)
        eng.kv.trust(self.slots)  # only ever set from distinct host slots checked by step_rows
        self.codes = torch.zeros(rows, AGENT_CODEBOOKS, dtype=torch.long, device=dev)
        self.active = torch.zeros(rows, dtype=torch.bool, device=dev)
        self.forced = TextForcing.none(rows, dev)
        self.dep_kv = eng.model.new_depformer_cache(rows, AGENT_CODEBOOKS)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: StepResult | None = None  # the graph's static outputs

    def forward(self, eng: "TalkerEngine") -> StepResult:
        return eng._by_slot(eng._advance(self.codes, self.active, self.forced, self.slots, self.dep_kv), self.slots)

    def capture(self, eng: "TalkerEngine", pool=None) -> None:
        """Capture with every row idle (no state changes), into memory `pool` (the full step's:
        steps never run at once); the warm-up run before it compiles its shapes (fused)."""
        self.active.zero_()
        self.forced.tokens.fill_(NO_FORCE)
        side = torch.cuda.Stream(eng.device)
        side.wait_stream(torch.cuda.current_stream(eng.device))
        with torch.cuda.stream(side):
            self.forward(eng)
        torch.cuda.current_stream(eng.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = self.forward(eng)
        log.info("captured the compact step of %d rows as a CUDA graph", self.slots.shape[0])

    def run(self, eng: "TalkerEngine", slots: torch.Tensor, codes: torch.Tensor, active: torch.Tensor,
            forced: TextForcing) -> StepResult:
        for buf, host in ((self.slots, slots), (self.codes, codes), (self.active, active),
                          (self.forced.tokens, forced.tokens), (self.forced.gated, forced.gated)):
            buf.copy_(to_device(host, eng.device))
        if self.graph is None:
            return self.forward(eng)
        eng._timed_replay(self.graph)
        return _copy(self.out)


def _copy(r: StepResult) -> StepResult:
    """A graph's static outputs, copied before the next replay overwrites them."""
    return StepResult(r.text_tokens.clone(), r.agent_codes.clone(), r.has_output.clone(), r.next_text.clone())


class TalkerEngine:
    def __init__(self, model: LMModel, tokenizer: TextTokenizer, slots: int, paths: CheckpointPaths | None = None,
                 context: int | None = None, kv_dtype: torch.dtype | None = None, kv_fp8: bool = False,
                 voices: dict[str, VoicePrompt] | None = None, cuda_graph: bool = False,
                 alignment: str = "personaplex", step_ahead: bool = False, kv_bits: int | None = None,
                 catch_up_buckets: tuple[int, ...] = CATCH_UP_BUCKETS):
        """context: the model's context C (default: the checkpoint's); the attention window and KV ring are
        C-1 frames with alignment "personaplex", C with "moshi" (module doc). kv_fp8: store the ring as fp8
        with per-vector scales. cuda_graph: replay the device part of step() as a captured CUDA graph (one
        per distinct top-k bound, captured on first use) instead of launching it eagerly. `voices` adds
        in-memory voices by name ("NATF2.pt"), e.g. from tools.make_checkpoint.build_random_checkpoint on a
        GPU; others come from paths.voices_dir. step_ahead: step j takes user frame j-1 (module doc).
        kv_bits: 8 (as kv_fp8) or 4 (int4 codes, services/talker/kv_int4.py); None: kv_fp8 decides.
        catch_up_buckets: the row counts of compact steps (step_rows); those not below `slots` are dropped."""
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be a positive int, got {slots!r}")
        if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in catch_up_buckets):
            raise ValueError(f"catch_up_buckets must be positive ints, got {catch_up_buckets!r}")
        if model.dep_steps < AGENT_CODEBOOKS:
            raise ValueError(f"the LM needs {AGENT_CODEBOOKS} resident depformer steps, has {model.dep_steps}")
        if alignment not in ALIGNMENTS:
            raise ValueError(f"alignment must be one of {', '.join(ALIGNMENTS)}, got {alignment!r}")
        cfg: LMConfig = model.cfg
        # the lag of the user column behind moshi's (module doc)
        self.alignment, self._lag = alignment, 1 if alignment == "personaplex" else 0
        if step_ahead and alignment != "personaplex":
            raise ValueError("step_ahead needs alignment 'personaplex' (its step j reads user frame j-1)")
        self.step_ahead = step_ahead
        self._write_lag = 0 if step_ahead else self._lag  # frame j-1 at step j goes where step j-1 put it
        model_context = cfg.context if context is None else context
        if not isinstance(model_context, int) or model_context < 1 + self._lag:
            raise ValueError(f"context must be an int >= {1 + self._lag} with alignment {alignment!r}, got {context!r}")
        self.model, self.cfg, self.tokenizer, self.paths = model, cfg, tokenizer, paths
        self.num_slots = slots
        self.text_card, self.card = cfg.text_card, cfg.card
        self.device = model.device
        self._kv_format = dict(dtype=kv_dtype, fp8=kv_fp8, bits=kv_bits)
        self.kv = model.new_kv_cache(slots, context=model_context - self._lag, **self._kv_format)
        self.context = self.kv.context  # the attention window: frames a live step attends over
        if RING < cfg.max_delay + 3 or RING < 2 * cfg.max_delay + self._lag:
            raise ValueError(f"token ring of {RING} columns is too short for max delay {cfg.max_delay}")
        # Live steps without output for a session with a prompt (PrefillJob has each session's).
        self.output_delay_frames = 1 - self._lag
        K, dev = cfg.num_streams, self.device
        # Host copies too: begin() must not read device tensors back (a sync behind a running step).
        self._delays_host = torch.tensor(cfg.delays, dtype=torch.long)
        self._initial_host = prompt.initial_tokens(cfg.text_card, cfg.card, K)
        self.delays = self._delays_host.to(dev)
        self.initial = self._initial_host.to(dev)
        self.hist = torch.full((slots, K, RING), prompt.UNKNOWN, dtype=torch.long, device=dev)
        self.offset = torch.zeros(slots, dtype=torch.long, device=dev)  # column the next step reads
        self.start = torch.ones(slots, dtype=torch.long, device=dev)  # first frame the model generates
        self.first_output = torch.ones(slots, dtype=torch.long, device=dev)  # first frame a step returns
        self.dep_kv = model.new_depformer_cache(slots, AGENT_CODEBOOKS)
        # Per text id: whether the model begins a word with it (a gated TextForcing waits for one).
        starts = tokenizer.word_starts()[: self.text_card]
        self.word_start = torch.tensor(starts + [False] * (self.text_card - len(starts)), dtype=torch.bool,
                                       device=dev)
        # Sampling parameters per slot (device tensors) + top-k on the host (bounds topk without a sync).
        d = SamplingParams()
        self.seed = torch.zeros(slots, dtype=torch.long, device=dev)
        self._text = RowParams(torch.zeros(slots, dtype=torch.bool, device=dev),
                               torch.full((slots,), d.text_temperature, device=dev),
                               torch.full((slots,), d.text_top_k, dtype=torch.long, device=dev), d.text_top_k)
        self._audio = RowParams(self._text.greedy, torch.full((slots,), d.audio_temperature, device=dev),
                                torch.full((slots,), d.audio_top_k, dtype=torch.long, device=dev), d.audio_top_k)
        self._text_k = [d.text_top_k] * slots
        self._audio_k = [d.audio_top_k] * slots
        self._live = [False] * slots
        self._jobs: list[PrefillJob | None] = [None] * slots
        # Voices by name: bundled files once loaded, and voices recorded from audio (add_voice), which stay
        # until forget_voice (their bound in bytes is the recorder's: services/talker/recording_store.py).
        self._voice_files: dict[str, VoicePrompt] = dict(voices or {})
        if cuda_graph and self.device.type != "cuda":
            raise ValueError("cuda_graph needs the model on a CUDA device")
        self.cuda_graph = cuda_graph
        # Under a CUDA graph the top-k width is baked into the capture, so it is fixed up front:
        # one graph, captured by warmup() at load, never mid-conversation. A session asking for a
        # wider top-k (or none, 0) is refused at begin(); the defaults (25 / 250) are well inside.
        self.graph_top_k = (min(GRAPH_TEXT_TOP_K, self.text_card), self.card) if cuda_graph else None
        self._graphs: dict[tuple[int, int], tuple] = {}  # (text max_k, audio max_k) -> graph, inputs, outputs
        # Events around each step replay: the step's GPU time, apart from the host's (last_step_device_s).
        self._replay_events = (torch.cuda.Event(enable_timing=True),
                               torch.cuda.Event(enable_timing=True)) if cuda_graph else None
        self._replayed = False  # whether the last step() ran the graph (an all-idle step does not)
        # With cuda_graph, a prefill chunk too is one graph replay (captured by warmup): eagerly it is
        # a few thousand kernel launches, tens of ms of host time.
        self.prefill_graph_frames = PREFILL_GRAPH_FRAMES
        self.prefill_graph_windows = PREFILL_GRAPH_WINDOWS
        self._prefill_graphs: list[_PrefillGraph] = []  # by window, smallest first; the last reads all
        self._voice_kv: dict[str, _VoicePrefix] = {}
        # The row counts a step can run (step_rows): the compact buckets, then every slot.
        self.row_buckets = (*sorted({b for b in catch_up_buckets if b < slots}), slots)
        self._compact = {b: _CompactStep(self, b) for b in self.row_buckets[:-1]}
        # Seconds of one step of each row count with every row idle, timed by warmup(): the fixed part
        # of a catch-up step of that size, the clock's prior until it has measured one (tick_policy.py).
        self.warm_step_s: dict[int, float] = {}
        # Benchmark only (TalkerConfig.bench_full_context): a session goes live as if it had already
        # filled its ring, so every step costs what the steady state costs.
        self.bench_full_context = False

    @classmethod
    def from_checkpoint(cls, paths: CheckpointPaths, slots: int, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32, context: int | None = None,
                        kv_fp8: bool = False, cuda_graph: bool = False, weights_fp8: bool = False,
                        alignment: str = "personaplex", step_ahead: bool = False,
                        kv_bits: int | None = None,
                        catch_up_buckets: tuple[int, ...] = CATCH_UP_BUCKETS) -> "TalkerEngine":
        """weights_fp8: the temporal layers' matrices in fp8 (services/talker/fp8_weights.py)."""
        section = paths.serve_config()
        cfg = LMConfig.from_dict(section["lm"]) if "lm" in section else LMConfig.full()
        model = LMModel.load(paths.lm, cfg, device=device, dtype=dtype, dep_steps=AGENT_CODEBOOKS)
        if weights_fp8:
            log.info("temporal weights to fp8: %.2f GB saved", model.quantize_weights_fp8_() / 1e9)
        return cls(model, TextTokenizer.load(paths.tokenizer), slots, paths=paths, context=context, kv_fp8=kv_fp8,
                   kv_bits=kv_bits, cuda_graph=cuda_graph, alignment=alignment, step_ahead=step_ahead,
                   catch_up_buckets=catch_up_buckets)

    # ---- sessions ------------------------------------------------------------------------------

    def begin(self, slot: int, voice: str | None, persona: str | None, sampling: SamplingParams) -> PrefillJob:
        """Validate, then reset `slot` completely and return its prompt prefill job.

        voice: a bundled basename ("NATF2.pt") or None. persona: the system text; with voice=None and
        persona=None there is no prompt at all (a bare start, as moshi's LMGen). Errors
        (InvalidVoice, InvalidPersona, InvalidSampling) leave the slot and everything else untouched."""
        self._check_slot(slot)
        if not isinstance(sampling, SamplingParams):
            raise InvalidSampling(f"sampling must be SamplingParams, got {type(sampling).__name__}")
        sampling.validate(self.text_card, self.card)
        if self.graph_top_k is not None and not sampling.greedy:
            for name, k, bound in (("text_top_k", sampling.text_top_k, self.graph_top_k[0]),
                                   ("audio_top_k", sampling.audio_top_k, self.graph_top_k[1])):
                if k <= 0 or k > bound:
                    raise InvalidSampling(f"{name} must be in [1, {bound}] on this server (its step is a "
                                          f"CUDA graph captured for that top-k width), got {k}")
        prefix = self._voice_prefix(voice) if voice is not None else None
        tokens = None
        if persona is not None or voice is not None:
            tokens = self._persona_tokens("" if persona is None else persona)
        cols = prompt.build(prefix.voice if prefix else None, tokens, self._delays_host, self._initial_host)
        if cols.frames > self.context:
            raise InvalidPersona(
                f"the prompt is {cols.frames} frames (voice, silence, {len(tokens or [])} persona tokens), "
                f"longer than the model's attention window of {self.context} frames; shorten the persona")
        # Everything is valid: from here on the slot belongs to the new session.
        self._reset_slot(slot)
        self._set_sampling(slot, sampling)
        job = PrefillJob(self, slot, cols, prefix)
        self._jobs[slot] = job
        if job.total_frames == 0:
            job.run(0)
        return job

    def release(self, slot: int) -> None:
        """Forget the session in `slot`: it is no longer steppable, a pending prefill job is cancelled."""
        self._check_slot(slot)
        if self._jobs[slot] is not None:
            self._jobs[slot].cancelled = True
            self._jobs[slot] = None
        self._live[slot] = False

    def first_output_frame(self, prompt_frames: int) -> int:
        """The first frame a live step returns after a prompt of F frames: F-1 (the prompt's last) with
        the personaplex lag, F with moshi's; never frame 0 (the start frame's initial tokens)."""
        return max(1, prompt_frames - self._lag)

    def is_live(self, slot: int) -> bool:
        return self._live[slot]

    def text_piece(self, token: int) -> str:
        return self.tokenizer.piece(int(token))

    # ---- the frame step ------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, user_codes: torch.Tensor, active: torch.Tensor, forced: TextForcing | None = None) -> StepResult:
        """Advance exactly the active slots by one frame; inactive slots are left untouched. `forced`:
        text tokens forced per slot (module doc; host tensors [S]); None forces nothing."""
        S, dev = self.num_slots, self.device
        if not isinstance(active, torch.Tensor) or active.dtype != torch.bool or tuple(active.shape) != (S,):
            raise ValueError(f"active must be a BoolTensor[{S}], got {getattr(active, 'shape', active)!r}")
        self._check_user_codes(user_codes, active, range(S))
        forced = TextForcing.none(S) if forced is None else forced
        self._check_forced(forced, S)
        self._replayed = False
        if not bool(active.any()):  # nothing to advance: skip the model entirely
            none = torch.full((S, 2 + AGENT_CODEBOOKS), -1, dtype=torch.long, device=dev)
            return StepResult(none[:, 0], none[:, 1:-1], torch.zeros(S, dtype=torch.bool, device=dev), none[:, -1])
        if self.cuda_graph:
            return self._replay(user_codes, active, forced)
        return self._advance(user_codes.to(dev, non_blocking=True), active.to(dev, non_blocking=True),
                             forced.to(dev))

    @torch.no_grad()
    def step_rows(self, slots: list[int], user_codes: torch.Tensor, rows: int,
                  forced: TextForcing | None = None) -> StepResult:
        """Advance exactly `slots` by one frame (user_codes[i] and forced[i] for slots[i]) as a step of
        `rows` rows, one of row_buckets: a compact step whose other rows are idle slots (module doc), or
        step() itself for rows == num_slots. The tokens and state step() gives those slots; results are
        indexed by slot, as step()'s."""
        S = self.num_slots
        if rows not in self.row_buckets:
            raise ValueError(f"rows must be one of {self.row_buckets}, got {rows!r}")
        if (not isinstance(slots, list) or not 1 <= len(slots) <= rows or len(set(slots)) != len(slots)
                or any(isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < S for s in slots)):
            raise ValueError(f"slots must be 1 to {rows} distinct ints in [0, {S}), got {slots!r}")
        n = len(slots)
        self._check_user_codes(user_codes, torch.ones(n, dtype=torch.bool), slots)
        forced = TextForcing.none(n) if forced is None else forced
        self._check_forced(forced, n)
        if rows == S:
            codes, active = torch.zeros(S, AGENT_CODEBOOKS, dtype=torch.long), torch.zeros(S, dtype=torch.bool)
            codes[slots], active[slots] = user_codes, True
            full = TextForcing.none(S)
            full.tokens[slots], full.gated[slots] = forced.tokens, forced.gated
            return self.step(codes, active, full)
        self._replayed = False
        taken = set(slots)
        padding = [s for s in range(S) if s not in taken][: rows - n]  # distinct idle rows: left as they are
        codes = torch.cat([user_codes, torch.zeros(rows - n, AGENT_CODEBOOKS, dtype=torch.long)])
        active = torch.arange(rows) < n
        idle = TextForcing.none(rows - n)
        padded = TextForcing(torch.cat([forced.tokens, idle.tokens]), torch.cat([forced.gated, idle.gated]))
        return self._compact[rows].run(self, torch.tensor(slots + padding), codes, active, padded)

    def _check_forced(self, forced: TextForcing, rows: int) -> None:
        """A TextForcing of `rows` host rows: tokens NO_FORCE or text ids the model emits."""
        if (not isinstance(forced, TextForcing) or not isinstance(forced.tokens, torch.Tensor)
                or forced.tokens.dtype != torch.long or tuple(forced.tokens.shape) != (rows,)
                or not isinstance(forced.gated, torch.Tensor) or forced.gated.dtype != torch.bool
                or tuple(forced.gated.shape) != (rows,)):
            raise ValueError(f"forced must be a TextForcing of a LongTensor[{rows}] and a BoolTensor[{rows}]")
        bad = (forced.tokens != NO_FORCE) & ((forced.tokens < 0) | (forced.tokens >= self.text_card))
        if bool(bad.any()):
            raise ValueError(f"forced text tokens must be {NO_FORCE} or in [0, {self.text_card}), got "
                             f"{forced.tokens[bad].tolist()[:8]}")

    def _check_user_codes(self, user_codes: torch.Tensor, active: torch.Tensor, slots) -> None:
        """user_codes [B, 8] in range where active [B] holds, and slots[i] live for every active row i.
        Checked where the caller's tensors live (the host, normally): no device sync per step."""
        B = active.shape[0]
        if (not isinstance(user_codes, torch.Tensor) or user_codes.dtype != torch.long
                or tuple(user_codes.shape) != (B, AGENT_CODEBOOKS)):
            raise ValueError(f"user_codes must be a LongTensor[{B}, {AGENT_CODEBOOKS}], got "
                             f"{getattr(user_codes, 'shape', user_codes)!r} {getattr(user_codes, 'dtype', '')}")
        stepped = [slots[i] for i, a in enumerate(active.tolist()) if a]
        not_live = [s for s in stepped if not self._live[s]]
        if not_live:
            raise ValueError(f"slots {not_live} are not live (no begin(), prefill not done, or released)")
        bad = ((user_codes < 0) | (user_codes >= self.card)) & active[:, None]
        if self.step_ahead:
            bad &= ~(user_codes == NO_FRAME).all(1, keepdim=True)  # a step-0 row: no user frame
        if bool(bad.any()):
            rows = bad.any(1).nonzero().flatten().tolist()
            raise ValueError(f"user codes must be in [0, {self.card}), slots {[slots[i] for i in rows]} are not")

    def last_step_device_s(self) -> float | None:
        """GPU time of the last graphed step, in seconds (None without a graph). Call it once the
        step's outputs are on the host: it waits for the step otherwise."""
        if self._replay_events is None or not self._replayed:
            return None
        start, end = self._replay_events
        return start.elapsed_time(end) / 1e3

    def _timed_replay(self, graph: torch.cuda.CUDAGraph) -> None:
        start, end = self._replay_events
        start.record()
        graph.replay()
        end.record()
        self._replayed = True

    def _replay(self, user_codes: torch.Tensor, active: torch.Tensor, forced: TextForcing) -> StepResult:
        """step() through a captured graph. Capture and its warm-up run with every slot inactive,
        which leaves all state as it was (that is what `_advance` guarantees for inactive rows)."""
        key = self.graph_top_k
        if key not in self._graphs:
            codes = torch.zeros(self.num_slots, AGENT_CODEBOOKS, dtype=torch.long, device=self.device)
            act = torch.zeros(self.num_slots, dtype=torch.bool, device=self.device)
            force = TextForcing.none(self.num_slots, self.device)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._advance(codes, act, force)  # warm-up: lazy inits and autotuning happen outside the capture
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = self._advance(codes, act, force)
            self._graphs[key] = (graph, codes, act, force, out)
            log.info("captured the step as a CUDA graph for top-k bounds %s (%d graphs)", key, len(self._graphs))
        graph, codes, act, force, out = self._graphs[key]
        codes.copy_(user_codes, non_blocking=True)
        act.copy_(active, non_blocking=True)
        force.tokens.copy_(forced.tokens, non_blocking=True)
        force.gated.copy_(forced.gated, non_blocking=True)
        self._timed_replay(graph)
        return _copy(out)

    def _advance(self, codes: torch.Tensor, act: torch.Tensor, forced: TextForcing, rows: torch.Tensor | None = None,
                 dep_kv=None) -> StepResult:
        """The device part of a step over B rows: every slot (rows None: row s is slot s), or the
        distinct slots `rows` (a compact step: their state is gathered into the rows and written
        back, with depformer cache `dep_kv` of batch B). Fixed shapes, no host syncs, state updated
        in place (so it can later be captured in a CUDA graph with `codes`/`act`/`forced`/`rows` as
        static inputs)."""
        B, max_delay = act.shape[0], self.cfg.max_delay
        of = (lambda t: t) if rows is None else (lambda t: t[rows])  # a row's per-slot state (a copy for rows)
        hist = of(self.hist)  # written in place: the engine's own for every slot, else written back below
        o = of(self.offset).clone()
        user = slice(1 + AGENT_CODEBOOKS, None)  # streams 9..16
        gen = slice(0, 1 + AGENT_CODEBOOKS)  # text + agent streams 0..8
        # 1. user codes of this frame into the history (column o + lag + delay); the lag is a constant
        #    of the engine, so a captured graph holds one alignment
        write = act & (codes[:, 0] != NO_FRAME) if self.step_ahead else act
        self._write(hist, user, (o[:, None] + self._write_lag + self.delays[user][None]) % RING, codes, write[:, None])
        # 2. the transformer on column o
        col = (o % RING)[:, None, None].expand(B, self.cfg.num_streams, 1)
        tokens = hist.gather(2, col)[..., 0]
        tokens = torch.where(o[:, None] <= self.delays[None, :], self.initial[None, :], tokens)
        # (no id range check: user codes were checked in step()/step_rows(), the rest of the history is ours)
        h = self._temporal_step(self.model.embed(tokens[:, None], check=False), act, rows)[:, 0]
        # 3. sample text, then the depformer's 8 agent codebooks
        text_params = self._params(self._text, self._text_k, self.text_card, of)
        audio_params = self._params(self._audio, self._audio_k, self.card, of)
        key = noise_key(of(self.seed), o)  # the session's randomness for this frame: (seed, frame index)
        text = self._force_text(sample(self.model.text_logits(h), text_params, key, codebook=0), forced)
        audio = self.model.depformer(h, text, lambda cb, logits: sample(logits, audio_params, key, 1 + cb),
                                     steps=AGENT_CODEBOOKS, dep_kv=self.dep_kv if dep_kv is None else dep_kv)
        new = torch.cat([text[:, None], audio], dim=1)  # [B, 9]: column o+1
        frame_of = (o + 1)[:, None] - self.delays[gen][None]
        keep_forced = frame_of < of(self.start)[:, None]  # prompt frames stay teacher-forced
        self._write(hist, gen, ((o + 1) % RING)[:, None].expand(B, 1 + AGENT_CODEBOOKS), new,
                    act[:, None] & ~keep_forced)
        # 4. the frame that is now complete
        out_frame = o + 1 - max_delay
        idx = (out_frame[:, None] + self.delays[gen][None]) % RING
        out = hist[:, gen].gather(2, idx[..., None])[..., 0]
        has_output = act & (out_frame >= of(self.first_output))
        out = torch.where(has_output[:, None], out, torch.full_like(out, -1))
        if rows is None:
            self.offset.add_(act.long())
        else:
            self.hist[rows] = hist
            self.offset[rows] = o + act.long()
        return StepResult(text_tokens=out[:, 0], agent_codes=out[:, 1:], has_output=has_output,
                          next_text=torch.where(act, text, torch.full_like(text, -1)))

    def _force_text(self, sampled: torch.Tensor, forced: TextForcing) -> torch.Tensor:
        """The text token each row writes (module doc): the sampled one where nothing is forced; the
        forced one where it does not wait; where it waits, the model's EPAD, the forced token in place
        of a word-starting piece, else PAD. The same ops whatever is forced: a graph holds every case."""
        tokens, gated = forced
        waiting = torch.where(sampled == EPAD_ID, sampled,
                              torch.where(self.word_start[sampled], tokens, torch.full_like(tokens, PAD_ID)))
        return torch.where(tokens == NO_FORCE, sampled, torch.where(gated, waiting, tokens))

    def _by_slot(self, r: StepResult, rows: torch.Tensor) -> StepResult:
        """A compact step's results (row i is slot rows[i]) indexed by slot, as step()'s."""
        S = self.num_slots
        packed = torch.full((S, 2 + AGENT_CODEBOOKS), -1, dtype=torch.long, device=self.device)
        packed[rows] = torch.cat([r.text_tokens[:, None], r.agent_codes, r.next_text[:, None]], dim=1)
        has_output = torch.zeros(S, dtype=torch.bool, device=self.device)
        has_output[rows] = r.has_output
        return StepResult(packed[:, 0], packed[:, 1:-1], has_output, packed[:, -1])

    @staticmethod
    def _write(hist: torch.Tensor, streams: slice, cols: torch.Tensor, values: torch.Tensor,
               mask: torch.Tensor) -> None:
        """hist[b, streams, cols[b, j]] = values[b, j] where mask (broadcast) holds."""
        view = hist[:, streams]
        old = view.gather(2, cols[..., None])[..., 0]
        view.scatter_(2, cols[..., None], torch.where(mask, values, old)[..., None])

    def _temporal_step(self, x: torch.Tensor, act: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """One temporal frame for B rows (static shape): every slot (rows None) or slots `rows`. The
        LM advances every row, so the ring entry each inactive row had overwritten is put back and
        its length restored."""
        kv = self.kv
        length = kv.length if rows is None else kv.length[rows]
        idx = length % kv.context  # [B]: the ring index each row writes
        saved = kv.save_entries(idx, rows)
        kv.live_rows = act  # idle rows attend over one entry: their output is thrown away below
        try:
            # all_slots: the LM's sync-free path for every slot; `rows` is a trusted static buffer
            h = self.model.temporal(x, kv, kv.all_slots if rows is None else rows)
        finally:
            kv.live_rows = None
        kv.restore_entries(idx, saved, keep=~act, rows=rows)
        if rows is None:
            kv.length -= (~act).long()
        else:
            kv.length[rows] = length + act.long()
        return h

    @staticmethod
    def _max_k(host_k: list[int], vocab: int) -> int:
        return max(vocab if k <= 0 else min(k, vocab) for k in host_k)

    def _params(self, p: RowParams, host_k: list[int], vocab: int, of=lambda t: t) -> RowParams:
        """The rows' sampling parameters (`of` picks a compact step's rows). The top-k bound is every
        slot's, in any step: the candidates a row draws from do not depend on which step runs it."""
        top_k = of(torch.where(p.top_k <= 0, vocab, p.top_k.clamp(max=vocab)))
        greedy, temperature = of(p.greedy), of(p.temperature)
        if self.graph_top_k is not None:  # the bound the graph is captured with (see __init__)
            return RowParams(greedy, temperature, top_k, self.graph_top_k[0 if vocab == self.text_card else 1])
        return RowParams(greedy, temperature, top_k, self._max_k(host_k, vocab))

    def _prefill_chunk(self, slot: int, slot_t: torch.Tensor, rows: torch.Tensor, start: int,
                       embedded: bool = False) -> None:
        """Run prompt columns `rows` (host LongTensor [n, 17]; with `embedded`, a voice's embeddings
        [n, dim]) into `slot` at positions start..start+n-1: a replay of the captured prefill graph
        when it applies, else eagerly. No host sync either way, so it queues behind a step still
        running on the GPU."""
        n = rows.shape[0]
        g = self.prefill_graph_for(n, start, embedded)
        if g is not None:
            g.run(self, slot, slot_t, rows, start)
            return
        x = to_device(rows[None], self.device)
        if not embedded:
            x = self.model.embed(x, check=False)  # ids are ours: no range check
        # The slot has written `start` positions; while they fit the ring they sit at indices 0..start-1.
        self.model.temporal(x, self.kv, slot_t, start if start <= self.context else None, prompt=True)

    def prefill_graph_for(self, n: int, start: int, embedded: bool = False) -> "_PrefillGraph | None":
        """The captured prefill chunk that runs n frames (of tokens, or of embeddings) at `start` (the
        one reading the fewest ring entries), or None: the chunk runs eagerly."""
        return next((g for g in self._prefill_graphs if g.embedded == embedded and g.fits(n, start, self.context)),
                    None)

    def warmup(self, voices: tuple[str, ...] = ()) -> None:
        """Run what a first session would, before any session: one short prompt prefill in slot 0
        (released again), the KV prefix of each voice in `voices` (so no session waits for it; by a
        prompt of that voice in slot 0, released again), with cuda_graph the captures of the step, of
        each compact step (with every slot inactive: no state changes) and of the prefill chunks of
        prompt tokens and of voice embeddings, and a timed step of each row count, idle (`warm_step_s`).
        On CUDA the allocator's cache is then handed back: what the warm-up used transiently is free
        for the other processes on the GPU. Call it on the thread that will run the engine."""
        if self._live[0] or self._jobs[0] is not None:
            raise RuntimeError("warmup() is for a fresh engine: slot 0 is in use")
        for voice in (None, *voices):  # 12 silence frames, no voice; then each voice's prompt (its KV prefix)
            job = self.begin(0, voice, "", SamplingParams(greedy=True))  # InvalidVoice for a name the checkpoint lacks
            while not job.run(self.context):
                pass
            self.release(0)
        if self.cuda_graph and self.graph_top_k not in self._graphs:
            S = self.num_slots
            self._replay(torch.zeros(S, AGENT_CODEBOOKS, dtype=torch.long), torch.zeros(S, dtype=torch.bool),
                         TextForcing.none(S))
        if self.cuda_graph:
            pool = self._graphs[self.graph_top_k][0].pool()
            for c in self._compact.values():
                if c.graph is None:
                    c.capture(self, pool)
        self.warm_step_s = {rows: self._idle_step_s(rows) for rows in self.row_buckets}
        log.info("idle step of each row count (what an unmeasured catch-up is predicted from): %s",
                 ", ".join(f"{rows} rows {t * 1e3:.1f} ms" for rows, t in sorted(self.warm_step_s.items())))
        if self.cuda_graph and not self._prefill_graphs:
            frames = min(self.prefill_graph_frames, self.context)
            pool = None
            # Prompt chunks, then voice chunks (a new voice's KV prefix: _VoicePrefix), at the same windows.
            for embedded in (False, True):
                for window in (*sorted(w for w in set(self.prefill_graph_windows) if 0 < w < self.context), None):
                    self._prefill_graphs.append(_PrefillGraph.capture(self, frames, window, pool, embedded))
                    pool = self._prefill_graphs[0].graph.pool()
                    self.kv.reset(0)  # the capture's warm-up run wrote slot 0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    @torch.no_grad()
    def _idle_step_s(self, rows: int, runs: int = 3) -> float:
        """Seconds of a step of `rows` rows with every row idle (no state changes), the fastest of
        `runs` after one untimed run (which compiles its shapes under fused.enable)."""
        S, dev = self.num_slots, self.device
        if rows == S and self.cuda_graph:
            graph, _, act, _, _ = self._graphs[self.graph_top_k]
            act.zero_()
            run = graph.replay
        elif rows == S:
            codes = torch.zeros(S, AGENT_CODEBOOKS, dtype=torch.long, device=dev)
            act = torch.zeros(S, dtype=torch.bool, device=dev)
            none = TextForcing.none(S, dev)
            run = lambda: self._advance(codes, act, none)  # noqa: E731
        else:
            c = self._compact[rows]
            c.active.zero_()
            run = c.graph.replay if c.graph is not None else lambda: c.forward(self)
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda *a: None)
        best = float("inf")
        for i in range(runs + 1):
            sync(dev)
            t0 = time.perf_counter()
            run()
            sync(dev)
            if i:
                best = min(best, time.perf_counter() - t0)
        return best

    # ---- slot state ----------------------------------------------------------------------------

    def _check_slot(self, slot) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot!r} is out of range for an engine of {self.num_slots} slots")

    def _reset_slot(self, slot: int) -> None:
        if self._jobs[slot] is not None:
            self._jobs[slot].cancelled = True
            self._jobs[slot] = None
        self._live[slot] = False
        self.kv.reset(slot)
        # fill_, not `t[slot] = value`: assigning a Python number to a CUDA tensor element copies it
        # from pageable host memory, which waits for the GPU, here for the step a piece rides.
        self.hist[slot].fill_(prompt.UNKNOWN)
        self.offset[slot].fill_(0)
        self.start[slot].fill_(1)
        self.first_output[slot].fill_(1)

    def _set_sampling(self, slot: int, s: SamplingParams) -> None:
        self.seed[slot].fill_(s.seed)  # fill_: no wait for the GPU (_reset_slot)
        self._text.greedy[slot].fill_(s.greedy)
        self._text.temperature[slot].fill_(float(s.text_temperature))
        self._text.top_k[slot].fill_(s.text_top_k)
        self._audio.temperature[slot].fill_(float(s.audio_temperature))
        self._audio.top_k[slot].fill_(s.audio_top_k)
        self._text_k[slot], self._audio_k[slot] = s.text_top_k, s.audio_top_k

    def _go_live(self, slot: int, cols: prompt.PromptColumns) -> None:
        """Prefill finished: the token history after the prompt; the first live step reads column F-1."""
        self.hist[slot] = to_device(cols.ring, self.device)
        self.offset[slot].fill_(cols.frames - 1)  # fill_: no wait for the GPU (_reset_slot)
        self.start[slot].fill_(cols.frames)
        self.first_output[slot].fill_(self.first_output_frame(cols.frames))
        if self.bench_full_context:
            # The same ring indices (positions move by a whole ring), but every index is now valid.
            self.kv.length[slot].add_(self.context)
        self._live[slot] = True
        self._jobs[slot] = None

    # ---- voices and persona --------------------------------------------------------------------

    def _voice_prefix(self, name: str) -> _VoicePrefix:
        if not isinstance(name, str):
            raise InvalidVoice(f"voice must be a bundled basename string, got {type(name).__name__}")
        if name not in self._voice_files:
            if voice_names.is_bundled(name) and voice_names.is_audio(name):
                raise InvalidVoice(f"voice {name[:80]!r} is not recorded on this talker (audio voices are recorded "
                                   f"by its VoiceRecorder before a session begins)")
            if self.paths is None:
                raise InvalidVoice(f"voice {name!r} is not available (no checkpoint directory)")
            path = self.paths.resolve_voice(name)  # InvalidVoice for anything but a bundled basename
            self._voice_files[name] = load_voice(path, self.cfg.dim, self.cfg.delays, self.text_card, self.card)
            log.info("voice %s loaded: %d frames (its KV is computed once, on first use)", name,
                     self._voice_files[name].frames)
        if name not in self._voice_kv:
            self._voice_kv[name] = _VoicePrefix(self, name, self._voice_files[name])
        return self._voice_kv[name]

    @torch.no_grad()
    def embed_voice(self, cols: torch.Tensor) -> VoiceLookup:
        """The embeddings of a recorded voice's columns (host LongTensor [N-1, 17], prompt.voice_columns) as
        the published format holds them, bf16 on the host: LMModel.embed, as prompt.make_voice runs it. Call
        on the engine's thread: it checks the ids on the host, launches the lookup and queues its copy to
        the host behind the GPU's work, and waits for nothing (VoiceLookup.wait does, off this thread)."""
        self.model.check_ids(cols)
        emb = self.model.embed(to_device(cols[None], self.device), check=False)[0].to(torch.bfloat16)
        if self.device.type != "cuda":
            return VoiceLookup(emb, None)
        host = torch.empty(emb.shape, dtype=emb.dtype, pin_memory=True)
        host.copy_(emb, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return VoiceLookup(host, done)

    def add_voice(self, key: str, voice: VoicePrompt) -> None:
        """Make a voice recorded from audio available to begin() as `key` (call on the engine's thread),
        until forget_voice(key). The caller bounds how many it adds (voice_recorder.py)."""
        self._voice_files[key] = voice
        self._voice_kv.pop(key, None)  # a new recording under an old key: its KV is computed afresh

    def forget_voice(self, key: str) -> None:
        """Drop a voice added by add_voice, and its KV prefix (call on the engine's thread). A prefill
        already running with it keeps its own reference, so its session does not notice."""
        self._voice_files.pop(key, None)
        self._voice_kv.pop(key, None)

    def has_voice(self, key: str) -> bool:
        """Whether begin() can use `key` without reading a file (added, preloaded or loaded already)."""
        return key in self._voice_files

    def _copy_voice_kv(self, slot: int, prefix: _VoicePrefix) -> None:
        self.kv.copy_slot(prefix.kv, 0, slot, src_length=prefix.done)

    def _persona_tokens(self, persona: str) -> list[int]:
        if not isinstance(persona, str):
            raise InvalidPersona(f"persona must be a str, got {type(persona).__name__}")
        try:
            return self.tokenizer.encode_persona(persona)
        except InvalidText as e:
            raise InvalidPersona(f"persona cannot be tokenized: {e}") from None
