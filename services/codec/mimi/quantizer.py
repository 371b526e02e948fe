"""Split residual vector quantizer: codebook 0 ("semantic") quantizes one projection of the
latent, codebooks 1.. ("acoustic") residual-quantize another projection of the same latent.

A codebook's centroids are `embedding_sum / cluster_usage.clamp(min=1e-5)` (EMA statistics as
published). Quantization always runs in fp32, whatever the model dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .halves import Prunable

_EPSILON = 1e-5


class EuclideanCodebook(nn.Module):
    def __init__(self, dim: int, bins: int):
        super().__init__()
        self.register_buffer("_initialized", torch.tensor([False], dtype=torch.float))
        self.register_buffer("cluster_usage", torch.ones(bins))
        self.register_buffer("embedding_sum", torch.zeros(bins, dim))
        self._cache: tuple | None = None

    def _key(self) -> tuple:
        # Any in-place write (load_state_dict, init) bumps a tensor's _version; .to() makes new tensors.
        return tuple((t.data_ptr(), t._version, t.device) for t in (self.embedding_sum, self.cluster_usage))

    def centroids_and_norms(self) -> tuple[Tensor, Tensor]:
        """(centroids [bins, dim], their squared norms [bins]) in fp32, recomputed only when the buffers change."""
        key = self._key()
        if self._cache is None or self._cache[0] != key:
            c = self.embedding_sum.float() / self.cluster_usage.float().clamp(min=_EPSILON)[:, None]
            self._cache = (key, c, (c * c).sum(-1))
        return self._cache[1], self._cache[2]

    def centroids(self) -> Tensor:
        return self.centroids_and_norms()[0]


class VectorQuantization(nn.Module):
    def __init__(self, dim: int, bins: int):
        super().__init__()
        self._codebook = EuclideanCodebook(dim, bins)


class _Layers(nn.Module):
    def __init__(self, dim: int, bins: int, n: int):
        super().__init__()
        self.layers = nn.ModuleList(VectorQuantization(dim, bins) for _ in range(n))


class ResidualVectorQuantizer(Prunable, nn.Module):
    """input_proj is the encode path's, output_proj the decode path's (MimiModel.keep_only drops one)."""

    def __init__(self, input_dim: int, dim: int, bins: int, n_q: int):
        super().__init__()
        self.input_proj = nn.Conv1d(input_dim, dim, 1, bias=False)
        self.output_proj = nn.Conv1d(dim, input_dim, 1, bias=False)
        self.vq = _Layers(dim, bins, n_q)

    def encode(self, x: Tensor, n: int) -> Tensor:
        """x [B, C, T] -> codes [B, n, T] from the first n codebooks."""
        residual = F.conv1d(x.float(), self.input_proj.weight.float()).transpose(1, 2)  # [B, T, D]
        codes = []
        for layer in self.vq.layers[:n]:
            centroids, norms = layer._codebook.centroids_and_norms()
            # argmin ||r - c||^2 = argmin (||c||^2 - 2 r.c): ||r||^2 is the same for every centroid.
            scores = norms - 2 * residual @ centroids.T
            idx = scores.argmin(dim=-1)
            residual = residual - F.embedding(idx, centroids)
            codes.append(idx)
        return torch.stack(codes, dim=1)

    def decode(self, codes: Tensor, dtype: torch.dtype) -> Tensor:
        """codes [B, n, T] -> [B, C, T]."""
        quantized = 0
        for k, layer in enumerate(self.vq.layers[: codes.shape[1]]):
            quantized = quantized + F.embedding(codes[:, k], layer._codebook.centroids())
        out = F.conv1d(quantized.transpose(1, 2), self.output_proj.weight.float())
        return out.to(dtype)


class SplitResidualVectorQuantizer(nn.Module):
    def __init__(self, input_dim: int, dim: int, bins: int, n_q: int, n_q_semantic: int):
        super().__init__()
        self.n_q_semantic = n_q_semantic
        self.rvq_first = ResidualVectorQuantizer(input_dim, dim, bins, n_q_semantic)
        self.rvq_rest = ResidualVectorQuantizer(input_dim, dim, bins, n_q - n_q_semantic)

    def encode(self, x: Tensor, num_codebooks: int) -> Tensor:
        """x [B, C, T] -> LongTensor [B, num_codebooks, T]."""
        first = self.rvq_first.encode(x, self.n_q_semantic)
        rest = self.rvq_rest.encode(x, num_codebooks - self.n_q_semantic)
        return torch.cat([first, rest], dim=1)

    def decode(self, codes: Tensor, dtype: torch.dtype) -> Tensor:
        s = self.n_q_semantic
        return self.rvq_first.decode(codes[:, :s], dtype) + self.rvq_rest.decode(codes[:, s:], dtype)
