"""MimiModel: the codec's modules, one-shot encode/decode, strict loading, random init.

Streaming (per-slot state, batched) is in streaming.py; both paths share these modules.

A codec service runs only one half of Mimi. `keep_only("encode")` (or `load(..., keep="encode")`,
which checks the whole file strictly first) deletes the other half's modules: the decode half
(quantizer output projections, upsample, decoder transformer, SEANet decoder) for an encoder, the
encode half (SEANet encoder, encoder transformer, downsample, quantizer input projections) for a
decoder, and in both cases the codebooks past `num_codebooks`, which neither half reads. Using a
dropped part raises DroppedHalfError.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from torch import Tensor, nn

from services.common.checkpoint import CheckpointError, load_state_dict_strict
from .config import MimiConfig
from .conv import StreamingConv1d, StreamingConvTranspose1d
from .halves import DroppedHalfError, Prunable
from .quantizer import SplitResidualVectorQuantizer
from .seanet import SEANetDecoder, SEANetEncoder
from .transformer import Attention, LayerScale, MimiTransformer

log = logging.getLogger(__name__)

# moshi >= 0.2 keeps attention projections per step in memory (`in_projs.0.weight`); published
# files use the fused names. A file saved from moshi's memory is accepted under those names too.
_MOSHI_MEMORY_NAMES = [
    (re.compile(r"\.self_attn\.in_projs\.0\.weight$"), ".self_attn.in_proj_weight"),
    (re.compile(r"\.self_attn\.out_projs\.0\.weight$"), ".self_attn.out_proj.weight"),
]


def published_names(state: dict[str, Tensor]) -> dict[str, Tensor]:
    out = {}
    for name, tensor in state.items():
        for pattern, repl in _MOSHI_MEMORY_NAMES:
            name = pattern.sub(repl, name)
        out[name] = tensor
    return out


class ConvDownsample(nn.Module):
    """Learnt stride-2 causal conv from the SEANet rate (25 Hz) to the code rate (12.5 Hz)."""

    def __init__(self, dim: int, stride: int):
        super().__init__()
        self.conv = StreamingConv1d(dim, dim, 2 * stride, stride=stride, bias=False, replicate=True)


class ConvTrUpsample(nn.Module):
    """Learnt channel-wise (groups=dim) transposed conv from 12.5 Hz back to 25 Hz."""

    def __init__(self, dim: int, stride: int):
        super().__init__()
        self.convtr = StreamingConvTranspose1d(dim, dim, 2 * stride, stride=stride, groups=dim, bias=False)


# The modules only one half reads (the quantizer is split inside, see keep_only).
HALVES = {
    "encode": ("encoder", "encoder_transformer", "downsample"),
    "decode": ("upsample", "decoder_transformer", "decoder"),
}


class InvalidFrame(ValueError):
    """An input frame is malformed (shape, dtype, non-finite audio, codes out of range).

    `slots` names the offending slots of a batched streaming step ([] for a one-shot call).
    Nothing has been changed when it is raised."""

    def __init__(self, message: str, slots: list[int] | None = None):
        super().__init__(message)
        self.slots = slots or []


class MimiModel(Prunable, nn.Module):
    def __init__(self, cfg: MimiConfig):
        super().__init__()
        self.cfg = cfg
        self.kept = "both"  # "encode" | "decode" once keep_only has dropped the other half
        self.encoder = SEANetEncoder(cfg)
        self.decoder = SEANetDecoder(cfg)
        self.encoder_transformer = MimiTransformer(cfg)
        self.decoder_transformer = MimiTransformer(cfg)
        self.quantizer = SplitResidualVectorQuantizer(
            cfg.dimension, cfg.quantizer_dimension, cfg.bins, cfg.n_q, cfg.n_q_semantic
        )
        self.downsample = ConvDownsample(cfg.dimension, cfg.downsample_stride)
        self.upsample = ConvTrUpsample(cfg.dimension, cfg.downsample_stride)

    def _probe(self) -> Tensor:
        seanet = self.decoder if self.kept == "decode" else self.encoder
        return seanet.model[0].conv.conv.weight

    @property
    def device(self) -> torch.device:
        return self._probe().device

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype of convolutions and transformers (the quantizer always runs in fp32)."""
        return self._probe().dtype

    # ---- halves ---------------------------------------------------------------------------
    def require(self, half: str, user: str = "") -> None:
        """Raise DroppedHalfError unless this model still has `half` ("encode" | "decode")."""
        if half not in HALVES:
            raise ValueError(f"half must be 'encode' or 'decode', got {half!r}")
        if self.kept not in ("both", half):
            raise DroppedHalfError(
                f"{user or half} needs Mimi's {half} half, which keep_only({self.kept!r}) dropped; "
                f"load the model without keep={self.kept!r} to {half}"
            )

    @torch.no_grad()
    def keep_only(self, half: str) -> "MimiModel":
        """Delete the modules only the other half uses (and the codebooks past num_codebooks).

        `half` is "encode" (pcm -> codes: SEANet encoder, encoder transformer, downsample, quantizer
        input projections and the used codebooks) or "decode" (codes -> pcm: the used codebooks,
        quantizer output projections, upsample, decoder transformer, SEANet decoder). Call it after
        loading the weights; on CUDA the freed memory is handed back to the driver
        (torch.cuda.empty_cache). Idempotent for the same half; afterwards the other half raises
        DroppedHalfError. The model's state_dict then no longer matches a published file."""
        if half not in HALVES:
            raise ValueError(f"keep_only takes 'encode' or 'decode', got {half!r}")
        if self.kept == half:
            return self
        self.require(half, f"keep_only({half!r})")
        other = "decode" if half == "encode" else "encode"
        device = self.device
        before = _tensor_bytes(self)
        why = f"Mimi's {other} half was dropped by keep_only({half!r})"
        for name in HALVES[other]:
            self.drop_part(name, why)
        used = {"rvq_first": self.cfg.n_q_semantic, "rvq_rest": self.cfg.num_codebooks - self.cfg.n_q_semantic}
        for rvq_name, n in used.items():
            rvq = getattr(self.quantizer, rvq_name)
            rvq.drop_part("output_proj" if half == "encode" else "input_proj", why)
            del rvq.vq.layers[n:]  # codebooks neither half reads with num_codebooks fixed
        self.kept = half
        after = _tensor_bytes(self)
        if device.type == "cuda":
            import gc

            gc.collect()
            torch.cuda.empty_cache()
        log.info("kept Mimi's %s half: weights %.1f MB -> %.1f MB (%s)", half, before / 2**20, after / 2**20, device)
        return self

    # ---- one-shot -------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, pcm: Tensor) -> Tensor:
        """pcm [B, 1, T] (T a positive multiple of 1920) -> codes LongTensor [B, num_codebooks, T // 1920]."""
        self.require("encode", "MimiModel.encode")
        if not isinstance(pcm, Tensor) or pcm.dim() != 3 or pcm.shape[1] != 1 or not pcm.is_floating_point():
            raise InvalidFrame(f"encode expects float audio [B, 1, T], got {_describe(pcm)}")
        if pcm.shape[-1] == 0 or pcm.shape[-1] % self.cfg.frame_size:
            raise InvalidFrame(f"encode expects a positive multiple of {self.cfg.frame_size} samples, got "
                               f"{pcm.shape[-1]}")
        if not torch.isfinite(pcm).all():
            raise InvalidFrame("encode got non-finite audio samples")
        x = pcm.to(device=self.device, dtype=self.dtype)
        latent = self.downsample.conv(self.encoder_transformer(self.encoder(x)))
        return self.quantizer.encode(latent, self.cfg.num_codebooks)

    @torch.no_grad()
    def decode(self, codes: Tensor) -> Tensor:
        """codes [B, num_codebooks, F] -> float32 audio [B, 1, F * 1920]."""
        self.require("decode", "MimiModel.decode")
        K = self.cfg.num_codebooks
        if not isinstance(codes, Tensor) or codes.dim() != 3 or codes.shape[1] != K or codes.is_floating_point():
            raise InvalidFrame(f"decode expects integer codes [B, {K}, F], got {_describe(codes)}")
        if codes.shape[-1] == 0:
            raise InvalidFrame("decode got zero frames")
        if ((codes < 0) | (codes >= self.cfg.bins)).any():
            raise InvalidFrame(f"decode got codes outside [0, {self.cfg.bins})")
        latent = self.quantizer.decode(codes.to(self.device, torch.long), self.dtype)
        return self.decoder(self.decoder_transformer(self.upsample.convtr(latent))).float()

    # ---- weights --------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path, cfg: MimiConfig, device: str | torch.device = "cpu",
             dtype: torch.dtype = torch.float32, keep: str | None = None) -> "MimiModel":
        """Load a published-layout Mimi safetensors file; any name/shape mismatch is a CheckpointError.

        keep="encode" | "decode": after the strict check of the whole file, `keep_only(keep)` on the
        host, so the dropped half never reaches `device`."""
        if keep is not None and keep not in HALVES:
            raise ValueError(f"keep must be None, 'encode' or 'decode', got {keep!r}")
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"Mimi weights {path} do not exist")
        try:
            state = load_file(str(path))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"Mimi weights {path} are not a readable safetensors file: {e}") from e
        model = cls(cfg)
        load_state_dict_strict(model, published_names(state), f"Mimi ({path.name})")
        del state
        if keep is not None:
            model.keep_only(keep)
        model.to(device=device, dtype=dtype)
        model.quantizer.float()  # codebooks stay fp32: nearest-centroid search is precision-sensitive
        model.eval()
        log.info("loaded Mimi from %s (%s, %s, %s)", path, device, dtype,
                 "both halves" if keep is None else f"{keep} half only")
        return model

    @classmethod
    def random(cls, cfg: MimiConfig, seed: int, device: str | torch.device = "cpu") -> "MimiModel":
        """Same weights as `MimiModel(cfg).init_random_(seed)`, without paying for torch's default init."""
        with torch.device("meta"):
            model = cls(cfg)
        return model.to_empty(device=device).init_random_(seed).eval()

    @torch.no_grad()
    def init_random_(self, seed: int) -> "MimiModel":
        """Deterministic random weights that keep activations O(1), with codebooks fitted to the
        latents of a fixed noise signal (as moshi's k-means init does) so codes vary with the input."""
        g = torch.Generator().manual_seed(seed)

        def normal(shape, std=1.0):
            return torch.randn(shape, generator=g) * std

        for module in self.modules():
            if isinstance(module, nn.Conv1d):
                w = module.weight
                module.weight.copy_(normal(w.shape, w[0].numel() ** -0.5))
            elif isinstance(module, nn.ConvTranspose1d):
                w = module.weight  # [in, out/groups, k]: each output sums in/groups * k/stride taps
                fan_in = w.shape[0] // module.groups * w.shape[2] / module.stride[0]
                module.weight.copy_(normal(w.shape, fan_in**-0.5))
            elif isinstance(module, nn.Linear):
                module.weight.copy_(normal(module.weight.shape, module.weight.shape[1] ** -0.5))
            elif isinstance(module, Attention):
                module.in_proj_weight.copy_(normal(module.in_proj_weight.shape, module.in_proj_weight.shape[1] ** -0.5))
            elif isinstance(module, nn.LayerNorm):
                module.weight.copy_(1 + normal(module.weight.shape, 0.1))
                module.bias.copy_(normal(module.bias.shape, 0.1))
            elif isinstance(module, LayerScale):
                module.scale.copy_(0.05 + 0.2 * torch.rand(module.scale.shape, generator=g))
            if isinstance(module, (nn.Conv1d, nn.ConvTranspose1d)) and module.bias is not None:
                module.bias.copy_(normal(module.bias.shape, 0.05))

        # Fit the codebooks to latents of a fixed noise signal, layer by layer of the residual.
        frames = 6
        pcm = normal((1, 1, frames * self.cfg.frame_size), 0.1).to(self.device, self.dtype)
        latent = self.downsample.conv(self.encoder_transformer(self.encoder(pcm))).float()
        for rvq in (self.quantizer.rvq_first, self.quantizer.rvq_rest):
            residual = torch.nn.functional.conv1d(latent, rvq.input_proj.weight.float()).transpose(1, 2)
            residual = residual.reshape(-1, residual.shape[-1])
            for layer in rvq.vq.layers:
                cb = layer._codebook
                bins, dim = cb.embedding_sum.shape
                # Random directions at ~1/4 of the residual's norm (about the best scale for a random
                # codebook in high dimension), so each layer shrinks the residual a little.
                norm = 0.25 * residual.norm(dim=-1).mean().cpu()
                directions = torch.nn.functional.normalize(normal((bins, dim)), dim=-1)
                centroids = directions * norm * (0.9 + 0.2 * torch.rand(bins, 1, generator=g))
                usage = 0.5 + 1.5 * torch.rand(bins, generator=g)
                cb.embedding_sum.copy_(centroids * usage[:, None])
                cb.cluster_usage.copy_(usage)
                cb._initialized.fill_(1.0)
                c = cb.centroids()
                idx = ((c * c).sum(-1) - 2 * residual @ c.T).argmin(-1)
                residual = residual - c[idx]

        # Scale the last decoder conv so decoded audio has a speech-like level (std ~0.1).
        codes = self.encode(pcm.float())
        out = self.decode(codes)
        last = self.decoder.model[-1].conv.conv
        scale = 0.1 / out.float().std().clamp(min=1e-6)
        last.weight.mul_(scale.to(last.weight))
        last.bias.mul_(scale.to(last.bias))
        return self


def _tensor_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def _describe(x) -> str:
    if isinstance(x, Tensor):
        return f"{x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__
