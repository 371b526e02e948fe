"""Voice prompt files (`voices/*.pt`): read, validate, write.

The published format (written by the PersonaPlex reference when it records a voice):

    torch.load(path) == {"embeddings": Tensor[N-1, 1, 1, dim] (bf16), "cache": LongTensor[1, 17, 4]}

for a voice of N prompt frames. embeddings[i] is the summed 17-stream input embedding of
history column i (column 0 is the all-initial-token column), i.e. what the temporal
transformer reads while the voice plays; `cache` is the token-history ring (4 columns,
column c at index c % 4) after the voice: it holds columns N-3..N, of which the next
prompt frames read columns N-1 and N (column N only for the delay-1 streams).
See services/talker/prompt.py for the column layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from services.common.checkpoint import InvalidVoice

RING = 4  # token-history columns (max_delay + 3), as in the published files


@dataclass(frozen=True)
class VoicePrompt:
    embeddings: torch.Tensor  # [N-1, dim], as stored (bf16 in published files)
    cache: torch.Tensor  # LongTensor[17, RING]

    @property
    def frames(self) -> int:
        """N: voice frames, including the initial-token frame 0."""
        return self.embeddings.shape[0] + 1


def load_voice(path: str | Path, dim: int, delays: tuple[int, ...], text_card: int, card: int) -> VoicePrompt:
    """Read and check one voice file against the model's shapes. Anything off is InvalidVoice."""
    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise InvalidVoice(f"voice {path.name}: not a readable voice file ({type(e).__name__})") from None
    if not isinstance(state, dict) or set(state) != {"embeddings", "cache"}:
        keys = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise InvalidVoice(f"voice {path.name}: expected keys ['cache', 'embeddings'], got {keys}")
    emb, cache = state["embeddings"], state["cache"]
    streams = len(delays)
    if (not isinstance(emb, torch.Tensor) or emb.dim() != 4 or emb.shape[1:] != (1, 1, dim)
            or not emb.is_floating_point()):

        raise InvalidVoice(f"voice {path.name}: embeddings must be a float Tensor[N-1, 1, 1, {dim}], "
                           f"got {getattr(emb, 'shape', type(emb).__name__)}")
    if emb.shape[0] < 2:
        raise InvalidVoice(f"voice {path.name}: needs at least 3 frames, got {emb.shape[0] + 1}")
    if not bool(torch.isfinite(emb).all()):
        raise InvalidVoice(f"voice {path.name}: embeddings contain non-finite values")
    if not isinstance(cache, torch.Tensor) or cache.dtype != torch.long or tuple(cache.shape) != (1, streams, RING):
        raise InvalidVoice(f"voice {path.name}: cache must be a LongTensor[1, {streams}, {RING}], "
                           f"got {getattr(cache, 'shape', type(cache).__name__)} {getattr(cache, 'dtype', '')}")
    cache = cache[0]
    n = emb.shape[0] + 1
    # The columns the rest of the prompt reads must hold real token ids.
    needed = [(k, (n - 1) % RING) for k in range(streams)] + [(k, n % RING) for k in range(streams) if delays[k] > 0]
    for k, col in needed:
        v = int(cache[k, col])
        hi = text_card if k == 0 else card  # the initial token (text_card / card) is a valid input id
        if not 0 <= v <= hi:
            raise InvalidVoice(f"voice {path.name}: cache stream {k} holds {v}, expected a token id in [0, {hi}]")
    return VoicePrompt(embeddings=emb[:, 0, 0].contiguous(), cache=cache.contiguous())


def save_voice(path: str | Path, voice: VoicePrompt) -> None:
    """Write in the published format (bf16 embeddings, batch dims restored)."""
    torch.save(
        {"embeddings": voice.embeddings.to(torch.bfloat16)[:, None, None, :].contiguous(),
         "cache": voice.cache[None].to(torch.long).contiguous()},
        Path(path),
    )
