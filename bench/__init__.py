"""GPU and CPU benchmarks; results in bench/results/, the journal in bench/RESULTS.md."""

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")  # before any grpc import: services/__init__.py says why
