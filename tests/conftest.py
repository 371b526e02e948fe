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


# The stack several modules share (one start for the session instead of one per module): one cell of
# 2 sessions whose codec stages have a spare slot (so the talker is the stage that refuses a third
# session), the gateway with generous stall and open bounds for this shared, slow machine. A test on it
# leaves it as it found it (its sessions closed); a test that kills or reconfigures a stage takes its own
# stack, and one that drains it for good is marked `drains_shared_stack` and runs last (below).
SHARED_GATEWAY_ARGS = ["--stall-timeout", "30", "--open-timeout", "120", "--cleanup-timeout", "20"]
SHARED_CODEC_ARGS = ["--slots", "3"]


@pytest.fixture(scope="session")
def shared_stack(tiny_checkpoint):
    from tools.run_stack import Stack

    with Stack(tiny_checkpoint, sessions=2, codec_args=SHARED_CODEC_ARGS, gateway_args=SHARED_GATEWAY_ARGS) as s:
        yield s


def pytest_configure(config):
    config.addinivalue_line("markers", "drains_shared_stack: drains the session's shared stack for good; runs last")


def pytest_collection_modifyitems(session, config, items):
    """Tests that drain the shared stack run after every other test (their order among themselves kept)."""
    last = [item for item in items if item.get_closest_marker("drains_shared_stack")]
    if last:
        items[:] = [item for item in items if item not in last] + last
