"""The session prompt, as token-history columns the temporal transformer reads.

Frames and columns. A *frame* f holds 17 aligned tokens: text, agent q0..q7, user q0..q7.
The model reads *columns*: column c, stream k holds frame (c - delay[k])'s token, so the
delay-1 streams lag by one. Frame 0 is the start frame: every column entry that would
come from frame <= 0 is the initial token (text_card for text, card for audio), exactly
as moshi's LMGen and the PersonaPlex reference do (the reference overwrites its first
prompt frame with initial tokens).

The prompt (reference order, teacher forced, one frame each):
    voice frames (from voices/*.pt: embeddings of columns 0..N-2 + the token ring after them)
    6 silence frames:   text PAD, agent SILENCE, user SINE
    persona frames:     text = one token of "<system> persona <system>", agent SILENCE, user SINE
                        (none for an empty persona: text.py's TextTokenizer.encode_persona)
    6 silence frames
Without a voice, the first silence frame is frame 0 (initial tokens), as in the reference.

For a prompt of F frames the transformer runs columns 0..F-2 in prefill; the first live
step reads column F-1 (see engine.py for why the first live frame shares it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.talker.voices import RING, VoicePrompt

SILENCE_TOKENS = [948, 243, 1178, 546, 1736, 1030, 1978, 2008]  # Mimi codes of zero audio
SINE_TOKENS = [430, 1268, 381, 1611, 1095, 1495, 56, 472]  # Mimi codes of a 440 Hz sine
SILENCE_FRAMES = 6  # int(0.5 s * 12.5 Hz), before and after the persona
PAD_ID = 3
UNKNOWN = -1  # a column entry not known yet (written by a live step before anyone reads it)


def initial_tokens(text_card: int, card: int, streams: int = 17) -> torch.Tensor:
    """The start-of-sequence input ids: LongTensor[streams]."""
    t = torch.full((streams,), card, dtype=torch.long)
    t[0] = text_card
    return t


def frame(text: int, agent: list[int], user: list[int]) -> list[int]:
    return [text, *agent, *user]


def text_frames(persona_tokens: list[int]) -> torch.Tensor:
    """silence x6, one frame per persona token, silence x6: LongTensor[M, 17]."""
    silence = frame(PAD_ID, SILENCE_TOKENS, SINE_TOKENS)
    rows = [silence] * SILENCE_FRAMES
    rows += [frame(t, SILENCE_TOKENS, SINE_TOKENS) for t in persona_tokens]
    rows += [silence] * SILENCE_FRAMES
    return torch.tensor(rows, dtype=torch.long)


def voice_frames(agent_codes: torch.Tensor) -> torch.Tensor:
    """A voice recording's frames: its agent codes [N, 8] with text PAD and user SINE: [N, 17]."""
    n = agent_codes.shape[0]
    text = torch.full((n, 1), PAD_ID, dtype=torch.long)
    user = torch.tensor(SINE_TOKENS, dtype=torch.long).expand(n, -1)
    return torch.cat([text, agent_codes.long(), user], dim=1)


def columns(frames: torch.Tensor, delays: torch.Tensor, initial: torch.Tensor) -> torch.Tensor:
    """Frames [F, 17] -> columns [F + max_delay, 17]: column c, stream k = frames[c - delay[k], k];
    the initial token where c - delay[k] <= 0 (frame 0 is the start frame), UNKNOWN past the last frame."""
    F, K = frames.shape
    C = F + int(delays.max())
    f = torch.arange(C)[:, None] - delays[None, :]  # [C, K] frame index of each entry
    vals = frames.gather(0, f.clamp(0, F - 1))
    vals = torch.where(f <= 0, initial[None, :].expand(C, K), vals)
    return torch.where(f >= F, torch.full_like(vals, UNKNOWN), vals)


def ring_of(cols: torch.Tensor, upto: int, partial_last: torch.Tensor | None = None) -> torch.Tensor:
    """The token-history ring [17, RING] holding columns upto-RING+1..upto (column c at c % RING).
    Columns < 0 stay UNKNOWN. `partial_last` (bool [17]) limits which streams of column `upto` are written
    (the rest keep the older column at that index, as the reference ring does)."""
    K = cols.shape[1]
    ring = torch.full((K, RING), UNKNOWN, dtype=torch.long)
    for c in range(upto - RING, upto + 1):  # one extra column first: what `partial_last` leaves behind
        if c < 0:
            continue
        write = torch.ones(K, dtype=torch.bool) if (c < upto or partial_last is None) else partial_last
        ring[:, c % RING] = torch.where(write, cols[c], ring[:, c % RING])
    return ring


@dataclass(frozen=True)
class PromptColumns:
    """What prefill needs for one session, beyond the (cached) voice part."""

    voice: VoicePrompt | None
    first: int  # first column run from tokens (N-1 with a voice, else 0)
    inputs: torch.Tensor  # LongTensor[T, 17]: columns first..F-2, run through the transformer
    ring: torch.Tensor  # LongTensor[17, RING]: the token history after prefill (columns F-3..F)
    frames: int  # F: prompt frames including frame 0; the first live step reads column F-1

    @property
    def transformer_frames(self) -> int:
        """Temporal positions prefill writes: F - 1 (voice embeddings + token columns)."""
        return self.first + self.inputs.shape[0]


def build(voice: VoicePrompt | None, persona_tokens: list[int] | None, delays: torch.Tensor,
          initial: torch.Tensor) -> PromptColumns:
    """The prompt for (voice, persona). voice=None and persona_tokens=None: no prompt at all
    (a bare start, F = 1: just the start frame, like moshi's LMGen)."""
    if voice is None and persona_tokens is None:
        tail = torch.zeros(1, len(delays), dtype=torch.long)  # frame 0: its tokens are never read
    else:
        tail = text_frames(persona_tokens or [])
    if voice is None:
        cols = columns(tail, delays, initial)
        F = tail.shape[0]
        first = 0
    else:
        n = voice.frames
        F = n + tail.shape[0]
        placeholder = torch.full((n, len(delays)), UNKNOWN, dtype=torch.long)
        cols = columns(torch.cat([placeholder, tail]), delays, initial)
        # Columns N-1 and N still hold voice tokens (the delay-1 streams lag): take them from its ring.
        for c in (n - 1, n):
            from_voice = (c - delays) < n
            cols[c] = torch.where(from_voice, voice.cache[:, c % RING], cols[c])
        first = n - 1
    return PromptColumns(voice=voice, first=first, inputs=cols[first:F - 1], ring=ring_of(cols, F), frames=F)


def voice_columns(agent_codes: torch.Tensor, delays: torch.Tensor, initial: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """A voice's N frames of agent codes -> (its columns 0..N-2, LongTensor[N-1, 17], which the voice
    prompt holds embedded; the ring after the reference's last voice step: columns N-3..N, column N
    only for the delay-1 streams). On the CPU."""
    agent_codes, delays, initial = agent_codes.cpu(), delays.cpu(), initial.cpu()
    frames = voice_frames(agent_codes)
    n = frames.shape[0]
    if n < 3:
        raise ValueError(f"a voice needs at least 3 frames, got {n}")
    cols = columns(frames, delays, initial)
    return cols[: n - 1], ring_of(cols, n, partial_last=delays > 0)


@torch.no_grad()
def make_voice(embed, agent_codes: torch.Tensor, delays: torch.Tensor, initial: torch.Tensor,
               device: str | torch.device = "cpu") -> VoicePrompt:
    """Record a voice the way the reference does, from its N frames of agent codes:
    `embed` (LMModel.embed, on `device`) of its columns 0..N-2, and its ring (voice_columns). Tokens
    stay on the CPU."""
    cols, ring = voice_columns(agent_codes, delays, initial)
    return VoicePrompt(embeddings=embed(cols[None].to(device))[0], cache=ring)
