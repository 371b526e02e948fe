"""The step's elementwise chains, each fused into one or two GPU kernels by torch.compile.

Why: at 160 sessions the graphed talker step launched about 6,000 kernels, most of them small
elementwise ones (an RMSNorm alone is eight: cast, square, mean, add, rsqrt, two products,
cast). Each costs a few microseconds even inside a CUDA graph, which added up to about a fifth
of the step (bench/RESULTS.md). Compiling the few functions that make those chains (RMSNorm, the
fp8 quantizations, RoPE, the SiLU gate) turns each into one kernel.

What: `@fused` marks a pure tensor function. It runs eagerly unless `enable()` was called and
its first argument is a CUDA tensor; then the torch.compile'd version runs. The CPU (tests,
local runs) never compiles. Compilation happens on first use of each shape, so the engine's
warm-up runs every shape the step and prefill use before a graph is captured (after two shapes
a function compiles a shape-generic version, so a later odd prefill length does not compile
again). Same arithmetic as eager up to the order of fp32 operations: bench/compile_check.py
measures the difference on the GPU.
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)

_enabled = False


def enable(on: bool = True) -> None:
    """Turn compiled kernels on (for CUDA tensors) in this process; the talker does this when
    configured with compile=True, before it loads the model."""
    global _enabled
    _enabled = bool(on)
    if on:
        # Each fused function sees a handful of shapes (the step, prefill chunks, the depformer).
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 32)


def enabled() -> bool:
    return _enabled


def fused(fn: F) -> F:
    compiled = torch.compile(fn, fullgraph=True)  # lazy: nothing compiles until a CUDA call

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if _enabled and args[0].is_cuda:
            return compiled(*args, **kwargs)
        return fn(*args, **kwargs)

    call.eager = fn  # type: ignore[attr-defined]
    return call  # type: ignore[return-value]
