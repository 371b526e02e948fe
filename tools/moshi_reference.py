"""moshi 0.2.13 as a numerical reference, for tests and benchmarks only (never runtime code).

The package is installed `--no-deps` by `make test` (it pins an older torch); on a GPU machine it
travels as a wheel. This builds its `LMModel` with PersonaPlex's settings (as its own
`moshi.models.loaders` does) at the sizes of one of our `LMConfig`s, and loads our weights into it
through the published (fused) key names.
"""

from __future__ import annotations

import os

import torch

from services.talker.model import LMConfig

os.environ.setdefault("NO_TORCH_COMPILE", "1")  # moshi would torch.compile some kernels


def moshi_lm_model(cfg: LMConfig, state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu"):
    """moshi's LMModel with `state` (published key names, all 16 depformer steps) loaded strictly."""
    from moshi.models.lm import LMModel as MoshiLM

    ff, dep_ff = 3 * cfg.hidden // 2, 3 * cfg.dep_hidden // 2  # moshi's gating hidden is 2/3 of these
    assert 2 * ff // 3 == cfg.hidden and 2 * dep_ff // 3 == cfg.dep_hidden
    ref = MoshiLM(
        delays=list(cfg.delays), n_q=cfg.n_q, dep_q=cfg.dep_q, card=cfg.card, text_card=cfg.text_card,
        existing_text_padding_id=3, dim=cfg.dim, num_heads=cfg.num_heads, num_layers=cfg.num_layers,
        hidden_scale=ff / cfg.dim, causal=True, layer_scale=None, context=cfg.context,
        max_period=cfg.max_period, gating="silu", norm="rms_norm_f32", positional_embedding="rope",
        depformer_dim=cfg.dep_dim, depformer_dim_feedforward=dep_ff, depformer_num_heads=cfg.dep_heads,
        depformer_num_layers=cfg.dep_layers, depformer_layer_scale=None, depformer_multi_linear=True,
        depformer_context=cfg.dep_q, depformer_max_period=cfg.max_period, depformer_gating="silu",
        depformer_pos_emb="none", depformer_weights_per_step=True, device=device, dtype=dtype,
    )
    ref.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)  # fused names, via moshi's hook
    return ref.eval()
