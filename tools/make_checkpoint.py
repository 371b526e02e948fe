"""Random PersonaPlex checkpoints in the published layout (tests, `make run`, benchmarks).

    python -m tools.make_checkpoint --preset tiny|full --seed N [--out DIR] [--device cpu|cuda]

writes, under DIR (default: the cache directory `ensure_checkpoint` uses):
    model.safetensors                              LM, published key names, all 16 depformer steps
    tokenizer-e351c8d8-checkpoint125.safetensors   Mimi
    tokenizer_spm_32k_3.model                      SentencePiece trained on tools/tokenizer_corpus.txt
    voices/{NATF2,NATM1,VARF0}.pt                  voice prompts in the published format
    config.json                                    {"personaplex_serve": {preset, seed, lm, mimi}}

The same (preset, seed) gives byte-identical files. The voices are recorded from random
agent codes through this LM's own embedding, so they are consistent with its weights.

In code:
    ensure_checkpoint("tiny", seed=0) -> Path     cached, built once (atomic, race-safe)
    build_random_checkpoint("full", 0, "cuda")    models in memory, nothing written
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import logging
import os
import shutil
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import sentencepiece as spm
import torch
from safetensors.torch import save_file

from services.common.checkpoint import CONFIG_FILE, CONFIG_SECTION, LM_FILE, MIMI_FILE, TOKENIZER_FILE, VOICES_DIR
from services.codec.mimi import MimiConfig, MimiModel
from services.talker.text import SYSTEM_TAG
from services.talker import prompt
from services.talker.model import LMConfig, LMModel
from services.talker.voices import VoicePrompt, save_voice

log = logging.getLogger("make_checkpoint")

REPO_ROOT = Path(__file__).resolve().parents[1]
CORPUS = Path(__file__).resolve().with_name("tokenizer_corpus.txt")
VOICE_NAMES = ("NATF2", "NATM1", "VARF0")
# Voice length in frames (real voices are seconds long). Tiny voices stay short so that tests
# can run a voice + persona prompt inside small attention windows.
VOICE_FRAMES = {"tiny": 4, "full": 64}
PRESETS = ("tiny", "full")


@dataclass
class RandomCheckpoint:
    preset: str
    seed: int
    lm_cfg: LMConfig
    mimi_cfg: MimiConfig
    lm: LMModel  # all 16 depformer steps (the published tensor set)
    mimi: MimiModel
    tokenizer: bytes  # the serialized SentencePiece model
    voices: dict[str, VoicePrompt]


def _configs(preset: str) -> tuple[LMConfig, MimiConfig]:
    if preset == "tiny":
        return LMConfig.tiny(), MimiConfig.tiny()
    if preset == "full":
        return LMConfig.full(), MimiConfig.full()
    raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")


def train_tokenizer(vocab_size: int) -> bytes:
    """SentencePiece (unigram) on the shipped corpus, deterministic: one thread, no sampling, no shuffle.
    Ids 0..3 are unk(end-pad)/BOS/EOS/PAD as in the published tokenizer; `<system>` is one piece."""
    lines = [ln.strip() for ln in CORPUS.read_text(encoding="utf-8").splitlines() if ln.strip()]
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=out, vocab_size=vocab_size, model_type="unigram",
        unk_id=0, bos_id=1, eos_id=2, pad_id=3, user_defined_symbols=[SYSTEM_TAG],
        num_threads=1, input_sentence_size=0, shuffle_input_sentence=False, character_coverage=1.0,
        # The full preset's 32000 pieces cannot come from a small corpus: take what it has.
        hard_vocab_limit=vocab_size <= 512, minloglevel=2,
    )
    return out.getvalue()


def _voice_codes(seed: int, name: str, frames: int, card: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 7919 + zlib.crc32(name.encode()))
    return torch.randint(0, card, (frames, 8), generator=g)


@torch.no_grad()
def build_random_checkpoint(preset: str = "tiny", seed: int = 0,
                            device: str | torch.device = "cpu") -> RandomCheckpoint:
    """All parts of a random checkpoint, in memory (on `device`; the full LM in bf16)."""
    lm_cfg, mimi_cfg = _configs(preset)
    dtype = torch.float32 if preset == "tiny" else torch.bfloat16
    lm = LMModel(lm_cfg, dep_steps=lm_cfg.dep_q, device=device, dtype=dtype).init_random_(seed).eval()
    # Mimi's codebooks are fitted (k-means) on the CPU, whose float sums depend on torch's thread
    # count: fit single-threaded so the same seed gives the same bytes in any process.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        mimi = MimiModel(mimi_cfg).init_random_(seed).to(device).eval()
    finally:
        torch.set_num_threads(threads)
    delays = torch.tensor(lm_cfg.delays, dtype=torch.long)
    initial = prompt.initial_tokens(lm_cfg.text_card, lm_cfg.card)
    voices = {}
    for name in VOICE_NAMES:
        codes = _voice_codes(seed, name, VOICE_FRAMES[preset], lm_cfg.card)
        v = prompt.make_voice(lm.embed, codes, delays, initial, device=device)
        voices[name] = VoicePrompt(embeddings=v.embeddings.to(torch.bfloat16).cpu(), cache=v.cache.cpu())
    return RandomCheckpoint(preset, seed, lm_cfg, mimi_cfg, lm, mimi, train_tokenizer(lm_cfg.text_card), voices)


def _cpu_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous() for k, v in module.state_dict().items()}


def write_checkpoint(ckpt: RandomCheckpoint, out: str | Path) -> Path:
    """Write `ckpt` into directory `out` (created) in the published layout."""
    out = Path(out)
    (out / VOICES_DIR).mkdir(parents=True, exist_ok=True)
    save_file(_cpu_state(ckpt.lm), str(out / LM_FILE))
    save_file(_cpu_state(ckpt.mimi), str(out / MIMI_FILE))
    (out / TOKENIZER_FILE).write_bytes(ckpt.tokenizer)
    for name, voice in ckpt.voices.items():
        save_voice(out / VOICES_DIR / f"{name}.pt", voice)
    section = {"preset": ckpt.preset, "seed": ckpt.seed, "lm": ckpt.lm_cfg.to_dict(), "mimi": ckpt.mimi_cfg.to_dict()}
    (out / CONFIG_FILE).write_text(json.dumps({CONFIG_SECTION: section}, indent=2, sort_keys=True) + "\n")
    return out


# The sources whose code decides the generated bytes: a change to any of them is a new cache entry,
# so a cached checkpoint is never stale after someone edits the model, codec or generator.
_GENERATOR_SOURCES = ("tools/make_checkpoint.py", "tools/tokenizer_corpus.txt", "services/talker/model.py",
                      "services/talker/layers.py", "services/talker/prompt.py", "services/talker/voices.py",
                      "services/talker/text.py", "services/codec/mimi/*.py")


def generator_fingerprint() -> str:
    h = hashlib.sha256(f"torch {torch.__version__} spm {spm.__version__}".encode())
    for pattern in _GENERATOR_SOURCES:
        for f in sorted(REPO_ROOT.glob(pattern)):
            h.update(f.relative_to(REPO_ROOT).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def cache_dir(preset: str, seed: int, root: str | Path | None = None) -> Path:
    """`.cache/checkpoints/{preset}-seed{seed}-{fingerprint of the generating code}` under the repo root."""
    return Path(root or REPO_ROOT / ".cache" / "checkpoints") / f"{preset}-seed{seed}-{generator_fingerprint()}"


def ensure_checkpoint(preset: str = "tiny", seed: int = 0, root: str | Path | None = None) -> Path:
    """The cached checkpoint directory for (preset, seed) and the current generator code, generated on first use.

    Built in a temporary sibling directory and renamed into place, so a reader never sees a
    partial checkpoint; when two processes race, the first rename wins and the other's copy is
    discarded (both are byte-identical anyway)."""
    final = cache_dir(preset, seed, root)
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        t0 = time.perf_counter()
        write_checkpoint(build_random_checkpoint(preset, seed, "cpu"), tmp)
        try:
            os.rename(tmp, final)
            log.info("generated %s checkpoint in %s (%.1f s)", preset, final, time.perf_counter() - t0)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tools.make_checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=PRESETS, default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="directory to write (default: the cache used by `make run` and tests)")
    p.add_argument("--device", default="cpu", help="where to build the models (cuda for the full preset)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.out is None and args.device == "cpu":
        print(ensure_checkpoint(args.preset, args.seed))
        return
    out = Path(args.out) if args.out else cache_dir(args.preset, args.seed)
    if out.exists() and any(out.iterdir()):
        p.error(f"{out} exists and is not empty")
    t0 = time.perf_counter()
    write_checkpoint(build_random_checkpoint(args.preset, args.seed, args.device), out)
    log.info("wrote %s checkpoint to %s (%.1f s)", args.preset, out, time.perf_counter() - t0)
    print(out)


if __name__ == "__main__":
    main()
