"""python -m services.talker --checkpoint DIR [--port 50052] [--metrics-port 9102] [--slots N]
                            [--device cpu|cuda] [--tick-ms 80] [--max-backlog-s 2.0]

Every option also reads from TALKER_<NAME> (e.g. TALKER_SLOTS=8); see services/talker/config.py.
SIGTERM drains: no new sessions, live ones run until they end or the drain deadline, then exit.
"""

from __future__ import annotations

import asyncio
import logging
import sys

from services.common.process import configure_process
from services.talker.config import TalkerConfig
from services.talker.server import TalkerService


async def main(cfg: TalkerConfig) -> None:
    service = await TalkerService(cfg).start()
    await service.serve_until_signal()


if __name__ == "__main__":
    cfg = TalkerConfig.load(sys.argv[1:])
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    configure_process(cfg.threads, cfg.gil_switch_ms)  # intra-op threads, GIL hand-offs
    asyncio.run(main(cfg))
