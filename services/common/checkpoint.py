"""The published PersonaPlex checkpoint layout, and strict loading of it.

A checkpoint directory holds (names as published):
    model.safetensors                              the language model (Talker)
    tokenizer-e351c8d8-checkpoint125.safetensors   the Mimi codec
    tokenizer_spm_32k_3.model                      the SentencePiece text tokenizer
    voices/*.pt                                    precomputed voice prompts
    voices/*.wav (.flac, .mp3, .ogg)               voice audio, recorded by the talker on first use
    config.json                                    minimal in the release

The published config.json says nothing about shapes (the reference loader
hard-codes them), so a directory without our "personaplex_serve" section is
read as the full published model. Random checkpoints made by
`tools.make_checkpoint` record their preset's shapes there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from services.common import voice_names

LM_FILE = "model.safetensors"
MIMI_FILE = "tokenizer-e351c8d8-checkpoint125.safetensors"
TOKENIZER_FILE = "tokenizer_spm_32k_3.model"
VOICES_DIR = "voices"
CONFIG_FILE = "config.json"
CONFIG_SECTION = "personaplex_serve"



class CheckpointError(Exception):
    """A checkpoint file is missing, or a tensor in it is missing, unexpected or mis-shaped."""


class InvalidVoice(ValueError):
    """A voice that cannot be used: not a bundled basename (path, '..', unknown), or a bad voice file."""


@dataclass(frozen=True)
class CheckpointPaths:
    root: Path

    @property
    def lm(self) -> Path:
        return self.root / LM_FILE

    @property
    def mimi(self) -> Path:
        return self.root / MIMI_FILE

    @property
    def tokenizer(self) -> Path:
        return self.root / TOKENIZER_FILE

    @property
    def voices_dir(self) -> Path:
        return self.root / VOICES_DIR

    @property
    def config_file(self) -> Path:
        return self.root / CONFIG_FILE

    @classmethod
    def open(cls, root: str | Path, require: tuple[str, ...] = ("lm", "mimi", "tokenizer")) -> "CheckpointPaths":
        """Check that the directory has the files a service needs (`require`: "lm", "mimi", "tokenizer")."""
        paths = cls(Path(root).expanduser().resolve())
        if not paths.root.is_dir():
            raise CheckpointError(f"checkpoint directory {paths.root} does not exist")
        for f in (getattr(paths, name) for name in require):
            if not f.is_file():
                raise CheckpointError(f"checkpoint {paths.root} has no {f.name}")
        return paths

    def serve_config(self) -> dict:
        """Our own section of config.json ({} for the published release: full shapes)."""
        if not self.config_file.is_file():
            return {}
        with open(self.config_file) as f:
            return json.load(f).get(CONFIG_SECTION, {})

    def voice_names(self) -> list[str]:
        if not self.voices_dir.is_dir():
            return []
        return sorted(p.name for p in self.voices_dir.iterdir() if p.is_file() and voice_names.is_bundled(p.name))

    def resolve_voice(self, name: str) -> Path:
        """A client's voice name -> the bundled file. Only basenames are ever accepted."""
        if not voice_names.is_bundled(name):
            raise InvalidVoice(f"voice {str(name)[:80]!r} is not a bundled voice basename "
                               "(letters, digits, '_' or '-', "
                               f"ending in .pt or an audio suffix: {', '.join(voice_names.AUDIO_SUFFIXES)})")
        path = self.voices_dir / name
        if not path.is_file():
            raise InvalidVoice(f"voice {name!r} is not bundled; available: {', '.join(self.voice_names()) or 'none'}")
        return path


def load_state_dict_strict(module: nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    """Copy `state` into `module`, refusing anything but an exact match of names and shapes.

    A missing, unexpected or mis-shaped key is a CheckpointError naming the key:
    a partial load would serve a broken model without saying so.
    """
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing:
        raise CheckpointError(f"{what}: missing key {missing[0]!r}"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    if unexpected:
        raise CheckpointError(
            f"{what}: unexpected key {unexpected[0]!r}"
            + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
        )
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise CheckpointError(
                f"{what}: key {name!r} has shape {tuple(tensor.shape)}, expected {tuple(own[name].shape)}"
            )
    module.load_state_dict(state, strict=True)
