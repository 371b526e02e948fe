"""`python -m services.gateway --cells enc:port,talk:port,dec:port --port 8000`"""

from __future__ import annotations

import asyncio
import logging
import signal

from services.gateway.config import GatewayConfig
from services.gateway.server import Gateway


async def main(config: GatewayConfig) -> None:
    gateway = Gateway(config)
    await gateway.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logging.getLogger("gateway").info("stopping: closing sessions")
    await gateway.stop()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("websockets").setLevel(logging.WARNING)  # one line per HTTP probe is noise
    asyncio.run(main(GatewayConfig.from_args()))
