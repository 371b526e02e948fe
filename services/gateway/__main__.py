"""`python -m services.gateway --cells enc:port,talk:port,dec:port --port 8000 [--workers N|auto]`"""

from __future__ import annotations

import asyncio
import logging
import sys

from services.gateway.config import GatewayConfig
from services.gateway.server import Gateway, serve_until_signalled
from services.gateway.workers import supervise

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("websockets").setLevel(logging.WARNING)  # one line per HTTP probe is noise
    config = GatewayConfig.from_args()
    if config.workers == 1:
        asyncio.run(serve_until_signalled(Gateway(config)))  # this process serves: no supervisor, no worker
    else:
        sys.exit(supervise(config))
