"""Paced multi-session load driver and lifecycle checker for Realtime duplex servers.

    python -m tools.load_driver --url ws://HOST:PORT/v1/realtime?duplex=1            # lifecycle
    python -m tools.load_driver --url ... --sessions 2 --load-frames 1000 --drain-s 2 \\
        --server-revision REV --server-hardware H200 --output-dir runs/n2 --plot       # load

Modules: config (options), input_audio (WAV / synthetic input, append events), session (one raw
WebSocket), validate (audio packets and session acceptance), metrics (definitions), load (paced
N-session mode), lifecycle (admission and slot reuse), report (progress, table, JSON, plot).
"""

from .config import DriverConfig
from .lifecycle import run_lifecycle
from .load import run_load

__all__ = ["DriverConfig", "run_load", "run_lifecycle"]
