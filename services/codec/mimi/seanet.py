"""SEANet encoder and decoder (causal, ELU), laid out like moshi's so keys match:
`encoder.model.{i}...` / `decoder.model.{i}...` with ELU modules taking their own indices."""

from __future__ import annotations

from torch import Tensor, nn

from .config import MimiConfig
from .conv import StreamingConv1d, StreamingConvTranspose1d


def run_sequential(layers: nn.Sequential, x: Tensor, state: list | None, active: Tensor | None) -> Tensor:
    """Apply `layers` in order; streaming layers get their own entry of `state` (see init_sequential_state)."""
    k = 0
    for layer in layers:
        if hasattr(layer, "init_state"):
            x = layer(x, None if state is None else state[k], active)
            k += 1
        else:
            x = layer(x)
    return x


def init_sequential_state(layers: nn.Sequential, batch: int, device, dtype) -> list:
    return [layer.init_state(batch, device, dtype) for layer in layers if hasattr(layer, "init_state")]


class SEANetResnetBlock(nn.Module):
    """x + conv1x1(elu(conv_k(elu(x)))) with the hidden width dim // compress (true skip)."""

    def __init__(self, dim: int, kernel_size: int, dilation: int, compress: int):
        super().__init__()
        hidden = dim // compress
        self.block = nn.Sequential(
            nn.ELU(),
            StreamingConv1d(dim, hidden, kernel_size, dilation=dilation),
            nn.ELU(),
            StreamingConv1d(hidden, dim, 1),
        )

    def init_state(self, batch: int, device, dtype) -> list:
        return init_sequential_state(self.block, batch, device, dtype)

    def forward(self, x: Tensor, state: list | None = None, active: Tensor | None = None) -> Tensor:
        return x + run_sequential(self.block, x, state, active)


def _residuals(cfg: MimiConfig, dim: int) -> list[nn.Module]:
    return [
        SEANetResnetBlock(dim, cfg.residual_kernel_size, cfg.dilation_base**j, cfg.compress)
        for j in range(cfg.n_residual_layers)
    ]


class SEANetEncoder(nn.Module):
    """[B, 1, T] audio -> [B, dimension, T / hop] latents (hop 960 for 24 kHz)."""

    def __init__(self, cfg: MimiConfig):
        super().__init__()
        nf = cfg.n_filters
        layers: list[nn.Module] = [StreamingConv1d(1, nf, cfg.kernel_size)]
        mult = 1
        for ratio in reversed(cfg.ratios):
            layers += _residuals(cfg, mult * nf)
            layers += [nn.ELU(), StreamingConv1d(mult * nf, 2 * mult * nf, 2 * ratio, stride=ratio)]
            mult *= 2
        layers += [nn.ELU(), StreamingConv1d(mult * nf, cfg.dimension, cfg.last_kernel_size)]
        self.model = nn.Sequential(*layers)

    def init_state(self, batch: int, device, dtype) -> list:
        return init_sequential_state(self.model, batch, device, dtype)

    def forward(self, x: Tensor, state: list | None = None, active: Tensor | None = None) -> Tensor:
        return run_sequential(self.model, x, state, active)


class SEANetDecoder(nn.Module):
    """[B, dimension, F] latents -> [B, 1, F * hop] audio."""

    def __init__(self, cfg: MimiConfig):
        super().__init__()
        nf = cfg.n_filters
        mult = 2 ** len(cfg.ratios)
        layers: list[nn.Module] = [StreamingConv1d(cfg.dimension, mult * nf, cfg.kernel_size)]
        for ratio in cfg.ratios:
            layers += [nn.ELU(), StreamingConvTranspose1d(mult * nf, mult * nf // 2, 2 * ratio, stride=ratio)]
            layers += _residuals(cfg, mult * nf // 2)
            mult //= 2
        layers += [nn.ELU(), StreamingConv1d(nf, 1, cfg.last_kernel_size)]
        self.model = nn.Sequential(*layers)

    def init_state(self, batch: int, device, dtype) -> list:
        return init_sequential_state(self.model, batch, device, dtype)

    def forward(self, x: Tensor, state: list | None = None, active: Tensor | None = None) -> Tensor:
        return run_sequential(self.model, x, state, active)
