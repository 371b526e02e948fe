"""Fixtures shared by the whole suite."""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")  # before any grpc import: services/__init__.py says why
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")  # before torch runs: services/__init__.py says why

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# Two cores are shared by the suite and the services it starts.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_checkpoint() -> Path:
    """The embedded tiny random checkpoint in the published layout (generated once, cached)."""
    from tools.make_checkpoint import ensure_checkpoint

    return ensure_checkpoint("tiny", seed=0)
