"""Batched streaming over a fixed number of slots, one 80 ms frame per step.

Each slot is one independent stream (one session). All state lives in tensors preallocated at
construction (fixed shapes, slot first, reset value zero), so a step is a fixed sequence of kernels:
on CUDA, `cuda_graph=True` captures it once and replays it (one launch instead of a few hundred; the
captured step reads the weights and codebook centroids as they were at capture, so load weights
before the first step). A step runs every slot; `active` selects the slots whose state advances, the
others keep their state bit for bit. So a step with every slot inactive changes no state: the codec
services run one before serving (CodecBatcher.warmup) to capture the graph up front.

A streamer needs its half of the model: StreamingEncoder the encode half, StreamingDecoder the
decode half (MimiModel.keep_only may have dropped the other).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .model import InvalidFrame, MimiModel


def _flatten(state) -> list[Tensor]:
    if isinstance(state, Tensor):
        return [state]
    return [t for s in state for t in _flatten(s)]


class _Streamer:
    HALF = ""  # the half of MimiModel a subclass runs

    def __init__(self, model: MimiModel, slots: int, cuda_graph: bool = False):
        model.require(self.HALF, type(self).__name__)
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be a positive int, got {slots!r}")
        if cuda_graph and model.device.type != "cuda":
            raise ValueError(f"cuda_graph needs the model on a CUDA device, it is on {model.device}")
        self.model = model
        self.cfg = model.cfg
        self.slots = slots
        self.device = model.device
        self.state = self._init_state(model.device, model.dtype)
        self._tensors = _flatten(self.state)
        self.cuda_graph = cuda_graph
        self._graph = None

    def _init_state(self, device, dtype) -> list:
        raise NotImplementedError

    def _compute(self, x: Tensor, active: Tensor) -> Tensor:
        """The step itself on validated device tensors: a fixed kernel sequence, no host syncs."""
        raise NotImplementedError

    def reset(self, slot: int) -> None:
        """Start a new stream in `slot` (as if freshly constructed)."""
        if not isinstance(slot, int) or not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot!r} is not in [0, {self.slots})")
        for t in self._tensors:
            t[slot].zero_()

    def reset_all(self) -> None:
        for t in self._tensors:
            t.zero_()

    def _check_active(self, active: Tensor) -> Tensor:
        if not isinstance(active, Tensor) or active.dtype != torch.bool or tuple(active.shape) != (self.slots,):
            raise InvalidFrame(f"active must be a bool tensor of shape ({self.slots},), got {_describe(active)}")
        return active

    def _run(self, x: Tensor, active: Tensor) -> Tensor:
        if not self.cuda_graph:
            return self._compute(x, active)
        if self._graph is None:
            self._capture(x, active)
        self._static_in[0].copy_(x)
        self._static_in[1].copy_(active)
        self._graph.replay()
        return self._static_out.clone()

    def _capture(self, x: Tensor, active: Tensor) -> None:
        self._static_in = (x.clone(), active.clone())
        saved = [t.clone() for t in self._tensors]  # warm-up steps run for real: undo them after
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # lazy initialisations (cuBLAS handles, cached centroids) happen here
                self._compute(*self._static_in)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._static_out = self._compute(*self._static_in)
        for t, v in zip(self._tensors, saved):
            t.copy_(v)
        self._graph = graph


class StreamingEncoder(_Streamer):
    """pcm [slots, 1920] -> codes [slots, num_codebooks] per step."""

    HALF = "encode"

    def _init_state(self, device, dtype) -> list:
        m, n = self.model, self.slots
        return [
            m.encoder.init_state(n, device, dtype),
            m.encoder_transformer.init_state(n, device, dtype),
            m.downsample.conv.init_state(n, device, dtype),
        ]

    @torch.no_grad()
    def step(self, pcm: Tensor, active: Tensor) -> Tensor:
        """Advance the active slots by one frame. Rows of inactive slots in the result are meaningless.

        Raises InvalidFrame (with .slots) before touching any state if the input is malformed or an
        active slot's audio is not finite."""
        active = self._check_active(active)
        F = self.cfg.frame_size
        if not isinstance(pcm, Tensor) or tuple(pcm.shape) != (self.slots, F) or not pcm.is_floating_point():
            raise InvalidFrame(f"pcm must be a float tensor of shape ({self.slots}, {F}), got {_describe(pcm)}")
        bad = active.to(pcm.device) & ~torch.isfinite(pcm).all(dim=1)
        if bad.any():
            slots = bad.nonzero().flatten().tolist()
            raise InvalidFrame(f"non-finite audio in slots {slots}", slots)
        x = pcm.to(device=self.device, dtype=self.model.dtype)
        return self._run(x, active.to(self.device))

    def _compute(self, x: Tensor, active: Tensor) -> Tensor:
        m = self.model
        seanet_state, transformer_state, downsample_state = self.state
        latent = m.encoder(x.view(self.slots, 1, -1), seanet_state, active)
        latent = m.encoder_transformer(latent, transformer_state, active)
        latent = m.downsample.conv(latent, downsample_state, active)
        return m.quantizer.encode(latent, self.cfg.num_codebooks)[:, :, 0]


class StreamingDecoder(_Streamer):
    """codes [slots, num_codebooks] -> float32 pcm [slots, 1920] per step."""

    HALF = "decode"

    def _init_state(self, device, dtype) -> list:
        m, n = self.model, self.slots
        return [
            m.upsample.convtr.init_state(n, device, dtype),
            m.decoder_transformer.init_state(n, device, dtype),
            m.decoder.init_state(n, device, dtype),
        ]

    @torch.no_grad()
    def step(self, codes: Tensor, active: Tensor) -> Tensor:
        """Advance the active slots by one frame. Rows of inactive slots in the result are meaningless.

        Raises InvalidFrame (with .slots) before touching any state if the input is malformed or an
        active slot has a code outside [0, bins)."""
        active = self._check_active(active)
        K = self.cfg.num_codebooks
        if not isinstance(codes, Tensor) or tuple(codes.shape) != (self.slots, K) or codes.is_floating_point() \
                or codes.dtype == torch.bool:
            raise InvalidFrame(f"codes must be an integer tensor of shape ({self.slots}, {K}), got {_describe(codes)}")
        bad = active.to(codes.device) & ((codes < 0) | (codes >= self.cfg.bins)).any(dim=1)
        if bad.any():
            slots = bad.nonzero().flatten().tolist()
            raise InvalidFrame(f"codes outside [0, {self.cfg.bins}) in slots {slots}", slots)
        return self._run(codes.to(self.device, torch.long), active.to(self.device))

    def _compute(self, codes: Tensor, active: Tensor) -> Tensor:
        m = self.model
        # Inactive rows may hold anything; give the embedding lookup a valid index there.
        codes = torch.where(active[:, None], codes, 0)
        upsample_state, transformer_state, seanet_state = self.state
        latent = m.quantizer.decode(codes[:, :, None], m.dtype)
        latent = m.upsample.convtr(latent, upsample_state, active)
        latent = m.decoder_transformer(latent, transformer_state, active)
        return m.decoder(latent, seanet_state, active)[:, 0].float()


def _describe(x) -> str:
    if isinstance(x, Tensor):
        return f"{x.dtype} tensor of shape {tuple(x.shape)} on {x.device}"
    return type(x).__name__
