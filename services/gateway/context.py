"""What a client session sees of its gateway process: one typed object, built by server.Gateway."""

from __future__ import annotations

from dataclasses import dataclass

from services.gateway.admission import Releases
from services.gateway.cells import CellPool
from services.gateway.config import GatewayConfig
from services.gateway.metrics import GatewayMetrics
from services.gateway.resume import Resumes
from services.gateway.voices import Voices


@dataclass(frozen=True)
class GatewayContext:
    config: GatewayConfig
    pool: CellPool  # the cells and their capacity (admission picks from it)
    metrics: GatewayMetrics
    voices: Voices  # bundled and enrolled voices (a session's open reads its audio here)
    releases: Releases  # sessions being released now (admission waits for one when every cell is full)
    resumes: Resumes  # Realtime sessions a reconnect may resume, and their tokens (resume.py)
