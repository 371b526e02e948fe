"""The PersonaPlex language model: temporal transformer + depformer, in plain torch.

One frame (80 ms) of one session:
    tokens[17] --embed--> x[dim] --temporal (32 layers, KV ring)--> h --text_linear--> text token
    h, text token --depformer (per-step weights, steps 0..7)--> 8 agent audio codes

Numerically this is moshi 0.2.13's LMModel with the PersonaPlex config (see
`tests/test_lm_model.py`, which checks parity against it); the module tree is laid out so
that `state_dict()` (with all 16 depformer steps resident) has exactly the published keys.
Streams: 0 text, 1..8 agent codebooks, 9..16 user codebooks.
"""

from __future__ import annotations

import zlib
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from services.common.checkpoint import LM_FILE, CheckpointError
from services.talker.fp8_weights import linear, quantize_temporal_weights
from services.talker.kv_cache import DepformerCache, KVCache, kv_cache_type
from services.talker.layers import Gating, RMSNorm, Weight, apply_rope, embed_or_zero

_FULL_DELAYS = (0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1)


@dataclass(frozen=True)
class LMConfig:
    dim: int
    num_layers: int
    num_heads: int
    hidden: int  # SiLU-gated FF hidden size (linear_in has 2 * hidden rows)
    context: int  # temporal attention window and KV ring length, in frames
    text_card: int
    card: int
    n_q: int  # audio streams (agent + user)
    dep_q: int  # depformer steps in the checkpoint
    dep_dim: int
    dep_layers: int
    dep_heads: int
    dep_hidden: int
    delays: tuple[int, ...]  # one per stream: text, then the n_q audio streams
    max_period: float = 10_000.0
    norm_eps: float = 1e-8

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "delays", tuple(int(d) for d in self.delays))
        except (TypeError, ValueError):
            raise ValueError(f"LMConfig.delays must be a sequence of ints, got {self.delays!r}") from None
        for name in ("max_period", "norm_eps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"LMConfig.{name} must be a positive number, got {value!r}")
        for name in ("dim", "num_layers", "num_heads", "hidden", "context", "text_card", "card",
                     "n_q", "dep_q", "dep_dim", "dep_layers", "dep_heads", "dep_hidden"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LMConfig.{name} must be a positive int, got {value!r}")
        if self.dim % self.num_heads or (self.dim // self.num_heads) % 2:
            raise ValueError(f"dim {self.dim} must split into {self.num_heads} heads of even size (RoPE)")
        if self.dep_dim % self.dep_heads:
            raise ValueError(f"dep_dim {self.dep_dim} must split into {self.dep_heads} heads")
        if self.dep_q > self.n_q:
            raise ValueError(f"dep_q {self.dep_q} cannot exceed n_q {self.n_q}")
        if len(self.delays) != self.n_q + 1 or min(self.delays) < 0:
            raise ValueError(f"delays must be {self.n_q + 1} non-negative ints, got {self.delays}")

    @classmethod
    def full(cls) -> "LMConfig":
        """The published PersonaPlex-7B shapes."""
        return cls(dim=4096, num_layers=32, num_heads=32, hidden=11264, context=3000, text_card=32000,
                   card=2048, n_q=16, dep_q=16, dep_dim=1024, dep_layers=6, dep_heads=16, dep_hidden=2816,
                   delays=_FULL_DELAYS)

    @classmethod
    def tiny(cls) -> "LMConfig":
        """Same structure, tiny widths: a CPU step for 8 slots takes milliseconds. The context
        (256 frames, ~20 s) leaves room for a voice prompt and a persona of a couple of hundred
        tokens; tests that exercise the ring wrap pass a smaller one.
        hidden sizes are what moshi derives from hidden_scale 4.125 (2/3 of int(4.125 * dim))."""
        return cls(dim=64, num_layers=2, num_heads=4, hidden=176, context=256, text_card=512,
                   card=2048, n_q=16, dep_q=16, dep_dim=32, dep_layers=2, dep_heads=2, dep_hidden=88,
                   delays=_FULL_DELAYS)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["delays"] = list(self.delays)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "LMConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown LMConfig field(s): {', '.join(unknown)}")
        try:
            return cls(**d)
        except TypeError as e:  # a missing field
            raise ValueError(f"incomplete LMConfig: {e}") from None

    def replace(self, **changes) -> "LMConfig":
        return replace(self, **changes)

    @property
    def max_delay(self) -> int:
        return max(self.delays)

    @property
    def num_streams(self) -> int:
        return self.n_q + 1

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads


# --------------------------------------------------------------------------- temporal transformer


class TemporalAttention(nn.Module):
    def __init__(self, cfg: LMConfig, device=None, dtype=None):
        super().__init__()
        self.heads, self.max_period = cfg.num_heads, cfg.max_period
        self.in_proj_weight = nn.Parameter(torch.empty(3 * cfg.dim, cfg.dim, device=device, dtype=dtype))
        self.out_proj = nn.Linear(cfg.dim, cfg.dim, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, kv: KVCache, layer: int, slots: torch.Tensor,
                positions: torch.Tensor, window: int | None = None, prompt: bool = False) -> torch.Tensor:
        # rows of in_proj are q|k|v, each (heads, head_dim): [3, B, H, T, Dh]
        q, k, v = linear(x, self.in_proj_weight).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, k, positions, self.max_period)
        out = kv.attend(layer, q, k, v, slots, positions, window, prompt)  # stores k/v in the slot's ring
        return self.out_proj(out.transpose(1, 2).flatten(2))


class TemporalLayer(nn.Module):
    def __init__(self, cfg: LMConfig, device=None, dtype=None):
        super().__init__()
        self.norm1 = RMSNorm(cfg.dim, cfg.norm_eps, device=device, dtype=dtype)
        self.self_attn = TemporalAttention(cfg, device=device, dtype=dtype)
        self.norm2 = RMSNorm(cfg.dim, cfg.norm_eps, device=device, dtype=dtype)
        self.gating = Gating(cfg.dim, cfg.hidden, device=device, dtype=dtype)

    def forward(self, x, kv, layer, slots, positions, window=None, prompt=False):
        x = x + self.self_attn(self.norm1(x), kv, layer, slots, positions, window, prompt)
        return x + self.gating(self.norm2(x))


class Stack(nn.Module):
    """Holds `layers` so keys read `transformer.layers.{i}...` / `depformer.layers.{i}...`."""

    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)


# --------------------------------------------------------------------------- depformer


class DepformerAttention(nn.Module):
    """Causal attention over the steps of one frame, separate weights per step, no positions.
    Per-step matrices are packed along rows: in_proj_weight [steps*3*D, D], out_proj [steps*D, D]."""

    def __init__(self, cfg: LMConfig, steps: int, device=None, dtype=None):
        super().__init__()
        self.heads, self.steps = cfg.dep_heads, steps
        self.in_proj_weight = nn.Parameter(torch.empty(steps * 3 * cfg.dep_dim, cfg.dep_dim, device=device,
                                                       dtype=dtype))
        self.out_proj = Weight(steps * cfg.dep_dim, cfg.dep_dim, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, cb: int, cache: DepformerCache, layer: int) -> torch.Tensor:
        B, _, D = x.shape  # [B, 1, D]: step cb of this frame
        w_in = self.in_proj_weight.view(self.steps, 3 * D, D)[cb]
        q, k, v = F.linear(x, w_in).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        cache.k[layer, :, :, cb] = k[:, :, 0]
        cache.v[layer, :, :, cb] = v[:, :, 0]
        out = F.scaled_dot_product_attention(q, cache.k[layer, :, :, : cb + 1], cache.v[layer, :, :, : cb + 1])
        return F.linear(out.transpose(1, 2).flatten(2), self.out_proj.weight.view(self.steps, D, D)[cb])


class DepformerLayer(nn.Module):
    def __init__(self, cfg: LMConfig, steps: int, device=None, dtype=None):
        super().__init__()
        self.norm1 = RMSNorm(cfg.dep_dim, cfg.norm_eps, device=device, dtype=dtype)
        self.self_attn = DepformerAttention(cfg, steps, device=device, dtype=dtype)
        self.norm2 = RMSNorm(cfg.dep_dim, cfg.norm_eps, device=device, dtype=dtype)
        self.gating = nn.ModuleList(Gating(cfg.dep_dim, cfg.dep_hidden, device=device, dtype=dtype)
                                    for _ in range(steps))

    def forward(self, x, cb, cache, layer):
        x = x + self.self_attn(self.norm1(x), cb, cache, layer)
        return x + self.gating[cb](self.norm2(x))


# --------------------------------------------------------------------------- the model


class LMModel(nn.Module):
    """The LM with `dep_steps` depformer steps resident (16 = all, as published; 8 in serving).

    The resident model is a prefix of the published one: every key either exists in full or
    holds the leading rows/modules of the published tensor, which is how `load` trims it.
    """

    def __init__(self, cfg: LMConfig, dep_steps: int = 16, device=None, dtype=None):
        super().__init__()
        if not 1 <= dep_steps <= cfg.dep_q:
            raise ValueError(f"dep_steps must be in [1, {cfg.dep_q}], got {dep_steps}")
        self.cfg, self.dep_steps = cfg, dep_steps
        kw = dict(device=device, dtype=dtype)
        self.emb = nn.ModuleList(nn.Embedding(cfg.card + 1, cfg.dim, **kw) for _ in range(cfg.n_q))
        self.text_emb = nn.Embedding(cfg.text_card + 1, cfg.dim, **kw)
        self.transformer = Stack([TemporalLayer(cfg, **kw) for _ in range(cfg.num_layers)])
        self.out_norm = RMSNorm(cfg.dim, cfg.norm_eps, **kw)
        self.text_linear = nn.Linear(cfg.dim, cfg.text_card, bias=False, **kw)
        self.depformer_in = nn.ModuleList(nn.Linear(cfg.dim, cfg.dep_dim, bias=False, **kw) for _ in range(dep_steps))
        # step cb > 0 reads the token of step cb - 1; the last step's token is never an input.
        self.depformer_emb = nn.ModuleList(nn.Embedding(cfg.card + 1, cfg.dep_dim, **kw) for _ in range(dep_steps - 1))
        self.depformer_text_emb = nn.Embedding(cfg.text_card + 1, cfg.dep_dim, **kw)
        # Registered as "depformer" for the published key names; `self.depformer` is the method
        # that runs it (class attributes win over submodules), the layers are `self.dep_layers`.
        self._modules["depformer"] = Stack([DepformerLayer(cfg, dep_steps, **kw) for _ in range(cfg.dep_layers)])
        self.linears = nn.ModuleList(nn.Linear(cfg.dep_dim, cfg.card, bias=False, **kw) for _ in range(dep_steps))
        self.requires_grad_(False)

    def quantize_weights_fp8_(self) -> int:
        """The temporal layers' matrices to fp8 with per-row scales, in place (services/talker/
        fp8_weights.py); returns the bytes saved. Loading a checkpoint afterwards is not supported."""
        saved = quantize_temporal_weights(self.transformer.layers)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the bf16 matrices' blocks back to the device, for the KV ring
        return saved

    @property
    def dep_layers(self) -> nn.ModuleList:
        return self._modules["depformer"].layers

    @property
    def device(self) -> torch.device:
        return self.text_emb.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.text_emb.weight.dtype

    # ---- weights

    @staticmethod
    def published_shapes(cfg: LMConfig) -> dict[str, tuple[int, ...]]:
        """Every key of the published model.safetensors for `cfg`, with its shape."""
        meta = LMModel(cfg, dep_steps=cfg.dep_q, device="meta")
        return {name: tuple(t.shape) for name, t in meta.state_dict().items()}

    def init_random_(self, seed: int) -> "LMModel":
        """Deterministic random weights. Each published tensor is drawn from its own generator
        (seeded by `seed` and the key name), so a model with fewer resident depformer steps gets
        exactly the leading part of the full model's weights."""
        own = self.state_dict()
        for name, shape in self.published_shapes(self.cfg).items():
            if name not in own:
                continue
            # On a GPU the draws come from the GPU's generator: seconds instead of the minutes 7B CPU
            # draws take. Same seed, same bytes on that kind of device (not the CPU's bytes).
            dev = own[name].device if own[name].device.type == "cuda" else torch.device("cpu")
            gen = torch.Generator(device=dev).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            if name.endswith("alpha"):
                full = 1.0 + 0.1 * torch.randn(shape, generator=gen, device=dev)
            else:
                # embeddings unit-scaled, matrices scaled by fan-in (like moshi's init)
                std = 1.0 if "emb" in name else shape[-1] ** -0.5
                full = torch.randn(shape, generator=gen, device=dev) * std
            own[name].copy_(full[: own[name].shape[0]])
        return self

    @classmethod
    def load(cls, path: str | Path, cfg: LMConfig, device="cpu", dtype: torch.dtype = torch.float32,
             dep_steps: int = 8) -> "LMModel":
        """Strictly load a published `model.safetensors` (or a checkpoint directory holding one).

        Every published key must be present with its shape; nothing else may be. Only the
        resident part (the first `dep_steps` depformer steps) is read from disk.
        """
        from safetensors import safe_open

        path = Path(path)
        if path.is_dir():
            path = path / LM_FILE
        if not path.is_file():
            raise CheckpointError(f"LM weights {path} do not exist")
        expected = cls.published_shapes(cfg)
        model = cls(cfg, dep_steps=dep_steps, device="meta")
        state: dict[str, torch.Tensor] = {}
        try:
            f = safe_open(str(path), framework="pt", device="cpu")
        except Exception as e:  # unreadable header: not a safetensors file
            raise CheckpointError(f"{path.name}: cannot read safetensors file: {e}") from None
        with f:
            keys = set(f.keys())
            missing, unexpected = sorted(set(expected) - keys), sorted(keys - set(expected))
            if missing:
                raise CheckpointError(f"{path.name}: missing key {missing[0]!r}" + _more(missing))
            if unexpected:
                raise CheckpointError(f"{path.name}: unexpected key {unexpected[0]!r}" + _more(unexpected))
            for name, shape in expected.items():
                got = tuple(f.get_slice(name).get_shape())
                if got != shape:
                    raise CheckpointError(f"{path.name}: key {name!r} has shape {got}, expected {shape}")
            for name, t in model.state_dict().items():
                rows = t.shape[0]
                tensor = f.get_tensor(name) if rows == expected[name][0] else f.get_slice(name)[:rows]
                state[name] = tensor.to(device=device, dtype=dtype)
        model.load_state_dict(state, strict=True, assign=True)
        return model.requires_grad_(False).eval()

    # ---- temporal transformer

    @torch.no_grad()
    def embed(self, tokens: torch.Tensor, check: bool = True) -> torch.Tensor:
        """tokens LongTensor[B, T, 17] (already delayed) -> the summed input embedding [B, T, dim].
        check=False skips the id range check (a host sync on the GPU) for callers that validated
        already (check_ids on their host copy)."""
        cfg = self.cfg
        if tokens.dim() != 3 or tokens.shape[-1] != cfg.num_streams or tokens.dtype != torch.long:
            raise ValueError(f"tokens must be a LongTensor[B, T, {cfg.num_streams}], got {tuple(tokens.shape)} "
                             f"{tokens.dtype}")
        if check:
            self.check_ids(tokens)
        text, audio = tokens[..., 0], tokens[..., 1:]
        x = embed_or_zero(self.emb[0], audio[..., 0])
        for k in range(1, cfg.n_q):  # audio first, then text: moshi's summation order
            x = x + embed_or_zero(self.emb[k], audio[..., k])
        return x + embed_or_zero(self.text_emb, text)

    def check_ids(self, tokens: torch.Tensor) -> None:
        """ValueError unless every id of tokens [..., 17] is -1, a text id (stream 0) or an audio id. An
        out-of-range id would be a device-side assert on the GPU, killing every session: refused here."""
        cfg = self.cfg
        if tokens.numel() and (int(tokens.min()) < -1 or int(tokens[..., 0].max()) > cfg.text_card
                               or int(tokens[..., 1:].max()) > cfg.card):
            raise ValueError(f"token ids must be -1, text 0..{cfg.text_card} or audio 0..{cfg.card}")

    def new_kv_cache(self, slots: int, device=None, dtype=None, context: int | None = None,
                     fp8: bool = False, bits: int | None = None) -> KVCache:
        """The temporal KV ring for `slots` sessions, storing `bits` per value (services/talker/kv_cache.py's
        kv_cache_type): None the compute dtype, 8 fp8 with per-vector scales, 4 int4. fp8=True is bits=8."""
        if fp8 and bits not in (None, 8):
            raise ValueError(f"fp8=True is bits=8, got bits={bits!r} too")
        cfg = self.cfg
        cache = kv_cache_type(8 if fp8 else bits)
        return cache(cfg.num_layers, slots, cfg.num_heads, cfg.context if context is None else context, cfg.head_dim,
                     device=device or self.device, dtype=dtype or self.dtype)

    @torch.no_grad()
    def temporal(self, x: torch.Tensor, kv: KVCache, slots: torch.Tensor, window: int | None = None,
                 prompt: bool = False) -> torch.Tensor:
        """Advance slot slots[b] by the T frames x[b] (T=1 live, T>1 prefill); returns out_norm(h).
        window (prefill): every slot has written at most this many positions, unwrapped (KVCache.attend).
        prompt: the frames are a prompt chunk even if T=1 (KVCache.attend says why it matters)."""
        if x.dim() != 3 or x.shape[-1] != self.cfg.dim or x.shape[1] < 1:
            raise ValueError(f"x must be [B, T>=1, {self.cfg.dim}], got {tuple(x.shape)}")
        if (kv.num_layers, kv.heads, kv.head_dim) != (self.cfg.num_layers, self.cfg.num_heads, self.cfg.head_dim):
            raise ValueError(f"KV cache of {kv.num_layers} layers x {kv.heads} heads x {kv.head_dim} was not made "
                             f"for this model")
        kv.check_slots(slots)
        if slots.numel() != x.shape[0]:
            raise ValueError(f"{x.shape[0]} rows but {slots.numel()} slots")
        B, T, _ = x.shape
        positions = kv.length[slots][:, None] + torch.arange(T, device=x.device)  # [B, T] absolute
        x = x.to(self.dtype)
        for i, layer in enumerate(self.transformer.layers):
            x = layer(x, kv, i, slots, positions, window, prompt)
        kv.length[slots] += T
        return self.out_norm(x)

    @torch.no_grad()
    def text_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.text_linear(h)

    # ---- depformer

    def new_depformer_cache(self, batch: int, steps: int | None = None) -> DepformerCache:
        cfg = self.cfg
        return DepformerCache(cfg.dep_layers, batch, cfg.dep_heads, steps or self.dep_steps,
                              cfg.dep_dim // cfg.dep_heads, device=self.device, dtype=self.dtype)

    @torch.no_grad()
    def depformer_step_logits(self, cb: int, h: torch.Tensor, prev_token: torch.Tensor,
                              dep_kv: DepformerCache) -> torch.Tensor:
        """Step cb of the depformer: h [B, dim] (temporal output), prev_token [B] (the text token
        for cb 0, else step cb-1's audio token) -> logits [B, card]. Steps must run 0, 1, .., cb."""
        if not 0 <= cb < min(self.dep_steps, dep_kv.steps):
            raise ValueError(f"depformer step {cb} is not resident (dep_steps={self.dep_steps}, cache {dep_kv.steps})")
        if h.dim() != 2 or prev_token.shape != (h.shape[0],) or dep_kv.batch != h.shape[0]:
            raise ValueError(f"h [B, dim], prev_token [B] and a cache of batch B expected, got "
                             f"{tuple(h.shape)}, {tuple(prev_token.shape)}, batch {dep_kv.batch}")
        token_emb = self.depformer_text_emb if cb == 0 else self.depformer_emb[cb - 1]
        x = (self.depformer_in[cb](h) + embed_or_zero(token_emb, prev_token))[:, None]
        for i, layer in enumerate(self.dep_layers):
            x = layer(x, cb, dep_kv, i)
        return self.linears[cb](x[:, 0])

    @torch.no_grad()
    def depformer(self, h: torch.Tensor, text_token: torch.Tensor,
                  sample: Callable[[int, torch.Tensor], torch.Tensor], steps: int | None = None,
                  dep_kv: DepformerCache | None = None) -> torch.Tensor:
        """One frame of the depformer: tokens [B, steps], each picked by sample(cb, logits)."""
        steps = self.dep_steps if steps is None else steps
        if not 1 <= steps <= self.dep_steps:
            raise ValueError(f"steps must be in [1, {self.dep_steps}], got {steps}")
        dep_kv = dep_kv or self.new_depformer_cache(h.shape[0], steps)
        prev, out = text_token, []
        for cb in range(steps):
            prev = sample(cb, self.depformer_step_logits(cb, h, prev, dep_kv))
            out.append(prev)
        return torch.stack(out, dim=1)


def _more(items: list) -> str:
    return f" (and {len(items) - 1} more)" if len(items) > 1 else ""
