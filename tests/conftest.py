"""Fixtures shared by the whole suite."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# Two cores are shared by the suite and the services it starts.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_checkpoint() -> Path:
    """The embedded tiny random checkpoint in the published layout (generated once, cached)."""
    from tools.make_checkpoint import ensure_checkpoint

    return ensure_checkpoint("tiny", seed=0)
