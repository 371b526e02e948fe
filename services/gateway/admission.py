"""Opening and releasing a session's relay, for both wires (Realtime and /api/chat).

A client that closes and at once reconnects (LiveKit's plugins reconnect to change the persona)
races its own old session: the stages free the old slot only once its streams have ended. So when
every cell is full while this gateway is still releasing a session, admission waits a bounded
moment (`admission_wait_s`) for that release and tries again, instead of refusing.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Callable

from services.gateway.relay import OpenParams, Relay, RelayError, RelayListener, open_on_cells

if TYPE_CHECKING:
    from services.gateway.context import GatewayContext

log = logging.getLogger("gateway.admission")

# Refusals a client should retry later (close 1013), not give up on.
RETRY_LATER = ("resource_exhausted", "server_busy", "server_shutting_down")


def admission_error(pool) -> RelayError | None:
    """Why no session can be opened now, before trying any cell (None: some cell admits)."""
    state = pool.admission_state()
    if state == "down":
        return RelayError("runtime_open_failed", "no cell is serving (every cell has a stage down)")
    if state == "draining":
        return RelayError("server_shutting_down", "every cell is draining (shutting down): retry in a few seconds")
    return None


# A reconnect can reach admission a few loop turns before its old session has begun releasing
# (the old socket's close is still being handled): a full refusal first looks again after this.
CLOSE_GRACE_S = 0.1


class Releases:
    """Sessions of this gateway whose streams are being ended, and a signal when one is done."""

    def __init__(self) -> None:
        self.pending = 0
        self._done = asyncio.Event()

    async def wait(self, timeout: float) -> None:
        done = self._done
        try:
            await asyncio.wait_for(done.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def started(self) -> None:
        self.pending += 1

    def finished(self) -> None:
        self.pending -= 1
        self._done.set()
        self._done = asyncio.Event()


async def admit(ctx: GatewayContext, make_params: Callable[[], OpenParams], listener: RelayListener, prefer=None,
                wait: bool = True) -> Relay:
    """Open a relay on the least loaded cell (`prefer` first), telling `listener`. Raises RelayError.
    `wait=False`: a full pool is refused at once (the caller has a slot it can give up instead)."""
    cfg = ctx.config
    if (refusal := admission_error(ctx.pool)) is not None:
        raise refusal
    loop = asyncio.get_running_loop()
    deadline = loop.time() + cfg.admission_wait_s
    graced = False
    while True:
        cells = ctx.pool.candidates()
        if prefer is not None:
            cells = [prefer] + [c for c in cells if c is not prefer]
        try:
            return await open_on_cells(cells, make_params, listener, open_timeout_s=cfg.open_timeout_s,
                                       stall_timeout_s=cfg.stall_timeout_s, cleanup_timeout_s=cfg.cleanup_timeout_s)
        except RelayError as e:
            left = deadline - loop.time()
            if e.code != "resource_exhausted" or not wait or left <= 0:
                raise
            if ctx.releases.pending:
                log.info("every cell is full while %d session(s) are being released: waiting up to %.0f ms",
                         ctx.releases.pending, left * 1000)
                await ctx.releases.wait(left)
            elif not graced:
                graced = True
                await asyncio.sleep(min(CLOSE_GRACE_S, left))
            else:
                raise


async def release(ctx: GatewayContext, p: Relay, graceful: bool) -> bool:
    """End a relay's streams (graceful: its queued frames still come out). True when confirmed."""
    ctx.releases.started()
    try:
        confirmed = await (p.close() if graceful else p.abort())
    finally:
        ctx.releases.finished()
    if not confirmed:
        ctx.metrics.cleanup_unconfirmed.inc()
    return confirmed
