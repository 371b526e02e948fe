"""Record a voice prompt `.pt` from an audio file, offline, as NVIDIA's reference server does with
`save_voice_prompt_embeddings` (services/talker/voice_recorder.py says how):

    python -m tools.make_voice alice.wav --checkpoint DIR [--out alice.pt] [--dtype bfloat16]

Reads any format sphn reads, resamples to 24 kHz, takes the first channel, normalises to -24 LUFS,
Mimi-encodes it (the encoder half, on the CPU) and records it with the LM's input embeddings, which
are all of the LM it loads (the transformer is never run: a voice's embeddings do not depend on it).
The result goes into the checkpoint's voices/ folder to be served by name, or anywhere else.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from services.common import voice_audio
from services.common.checkpoint import CheckpointError, CheckpointPaths, InvalidVoice
from services.codec.mimi import MimiConfig, MimiModel
from services.talker import prompt
from services.talker.model import LMConfig, LMModel
from services.talker.voice_recorder import record
from services.talker.voices import VoicePrompt, save_voice

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def load_embedder(paths: CheckpointPaths, dtype: torch.dtype = torch.bfloat16) -> LMModel:
    """The LM with only its input embeddings loaded (everything else stays on the meta device):
    `.embed(tokens)` works, nothing else does."""
    from safetensors import safe_open

    section = paths.serve_config()
    cfg = LMConfig.from_dict(section["lm"]) if "lm" in section else LMConfig.full()
    model = LMModel(cfg, dep_steps=1, device="meta")
    with safe_open(str(paths.lm), framework="pt", device="cpu") as f:
        for name, module in [*((f"emb.{k}", m) for k, m in enumerate(model.emb)), ("text_emb", model.text_emb)]:
            weight = f.get_tensor(f"{name}.weight").to(dtype)
            if tuple(weight.shape) != tuple(module.weight.shape):
                raise CheckpointError(f"{paths.lm.name}: {name}.weight has shape {tuple(weight.shape)}, "
                                      f"expected {tuple(module.weight.shape)}")
            module.weight = torch.nn.Parameter(weight, requires_grad=False)
    return model


def make_voice(audio: str | Path, checkpoint: str | Path, dtype: torch.dtype = torch.bfloat16) -> VoicePrompt:
    paths = CheckpointPaths.open(checkpoint, require=("lm", "mimi"))
    section = paths.serve_config().get("mimi")
    mimi = MimiModel.load(paths.mimi, MimiConfig.from_dict(section) if section else MimiConfig.full(), keep="encode")
    lm = load_embedder(paths, dtype)
    delays = torch.tensor(lm.cfg.delays)
    initial = prompt.initial_tokens(lm.cfg.text_card, lm.cfg.card, lm.cfg.num_streams)
    return record(voice_audio.read_audio(audio), mimi, lm.embed, delays, initial)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.make_voice", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("audio", help="the voice's audio file (wav, flac, mp3, ogg)")
    ap.add_argument("--checkpoint", required=True, help="checkpoint directory in the published layout")
    ap.add_argument("--out", help="the .pt to write (default: the audio's name with .pt)")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES),
                    help="embedding dtype (bfloat16: as the reference server, serving in bf16, records)")
    a = ap.parse_args(argv)
    out = Path(a.out) if a.out else Path(a.audio).with_suffix(".pt")
    if out.suffix != ".pt":
        ap.error(f"--out must end in .pt, got {out}")
    try:
        voice = make_voice(a.audio, a.checkpoint, DTYPES[a.dtype])
    except (InvalidVoice, CheckpointError) as e:
        print(f"make_voice: {e}", file=sys.stderr)
        return 1
    save_voice(out, voice)
    print(f"{out}: {voice.frames} frames ({(voice.frames) * 0.08:.2f} s of voice prompt)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
