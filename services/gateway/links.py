"""The gateway's transport to a cell: one long-lived Link stream per stage (common.proto), shared by
every session this process holds on the cell.

A link message holds the entries of many sessions (a tick's outputs, an encoder batch's codes), so
the stages' event loops and this one pay per message, not per frame: at 160 sessions the
per-session streams cost each stage about 4000 gRPC messages a second.

- `StageLink`: one stage's stream. Entries out wait in an Outbox (common/outbox.py: the same
  message bounds as the stage's end) and leave as one message per loop turn, or after the stage's
  `flush_s` (stages.py); entries in go to `on_entry`; the stream's end or failure goes to `on_lost`
  once.
- `CellLink`: the three stage links of one cell and the sessions on them. It sees a session only
  through `LinkSession` (its stream id, an entry for it, a lost stage, the stall watch, its own
  handler's failure: one session's bug never ends the link of the others), so the
  transport knows nothing of a session's state machine (relay.py).

A link that breaks fails only the sessions on it; the next open builds a new one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Protocol

import grpc

from services.common.outbox import OUTBOX_BYTES, Outbox
from services.common.stage_gate import link_metadata
from services.gateway.cells import STAGES, Cell
from services.gateway.stages import CHAIN

log = logging.getLogger("gateway.links")

# Unsent entries past which a stage that does not read its link is given up (its sessions fail
# typed): the relays into the talker and decoder links cannot wait for room, so this bounds them.
# Below it, past OUTBOX_BYTES, a client's send_frame waits for room.
OUTBOX_LIMIT_BYTES = 2 * OUTBOX_BYTES
WATCH_PERIOD_S = 0.25


class LinkSession(Protocol):
    """What a CellLink needs of a session on it (relay.Relay is one)."""

    @property
    def stream_id(self) -> str: ...

    def link_entry(self, stage: str, entry) -> None:
        """One entry of the stage's link for this session (an answer or its stream's status)."""

    def link_lost(self, stage: str, why: str) -> None:
        """The stage's link broke: the session's stream there is gone."""

    def link_watch(self, now: float) -> None:
        """The watchdog's turn (every WATCH_PERIOD_S): the session checks its own progress."""

    def link_error(self, why: str) -> None:
        """One of the handlers above raised for this session: it fails, typed, and alone."""


class StageLink:
    """One Link stream to one stage of a cell. Entries out are queued and leave as one message per
    loop turn; entries in go to `on_entry`; the stream's end or failure goes to `on_lost` once."""

    def __init__(self, cell: Cell, stage: str, on_entry: Callable, on_lost: Callable[[str, str], None]):
        self.cell, self.stage = cell, stage
        self._on_entry, self._on_lost = on_entry, on_lost
        self._spec = CHAIN[stage]
        self._call = getattr(cell.stubs[stage], self._spec.link_method)(metadata=link_metadata())  # stage_gate.py
        self._outbox = Outbox(OUTBOX_BYTES)
        self._urgent = asyncio.Event()  # an open or an end waits: no gathering (flush_s) for it
        self.lost: str | None = None
        self._tasks = [asyncio.create_task(self._read_loop(), name=f"link-{cell.name}-{stage}-read"),
                       asyncio.create_task(self._write_loop(), name=f"link-{cell.name}-{stage}-write")]

    def send(self, stream_id: str, **kind) -> None:
        """Queue one entry (request=... or end=...) for this stage. Never blocks; see `room`."""
        if self.lost is not None:
            return
        self._outbox.put(self._spec.link_request.Entry(stream_id=stream_id, **kind))
        if self._outbox.bytes > OUTBOX_LIMIT_BYTES:
            self._lose(f"the {self.stage} does not read its link: {self._outbox.bytes} bytes unsent")
            self._call.cancel()
            return
        if "end" in kind or kind["request"].WhichOneof("kind") != "frame":
            self._urgent.set()

    async def room(self) -> None:
        """Wait while this link's unsent entries are over their bound (the stage reads too slowly)."""
        await self._outbox.room()

    async def _write_loop(self) -> None:
        try:
            await self._write([])  # at once: a stage ends a link whose first message is late (stage_server.py)
            while True:
                await self._outbox.ready.wait()
                await self._gather()
                self._urgent.clear()
                for message in self._outbox.take():
                    await self._write(message)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._lose(f"writing failed: {_describe(e)}")

    async def _gather(self) -> None:
        """Let the other entries of this loop turn join, and on a link with a flush_s those of that long,
        unless an open or an end is waiting (a session's start and close are not held back)."""
        wait = self._spec.flush_s
        if wait <= 0 or self._urgent.is_set():
            await asyncio.sleep(0)
            return
        try:
            await asyncio.wait_for(self._urgent.wait(), wait)
        except asyncio.TimeoutError:
            pass

    async def _write(self, entries: list) -> None:
        await self._call.write(self._spec.link_request(entries=entries))

    async def _read_loop(self) -> None:
        try:
            while (msg := await self._call.read()) is not grpc.aio.EOF:
                for entry in msg.entries:
                    self._on_entry(self.stage, entry)
            self._lose(f"ended the link: {(await self._call.code()).name} {await self._call.details()}".strip())
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._lose(_describe(e))

    def _lose(self, why: str) -> None:
        if self.lost is None:
            self.lost = why
            self._outbox.drop()
            self._on_lost(self.stage, why)

    async def close(self) -> None:
        self._lose("link closed")
        self._call.cancel()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class CellLink:
    """This process's three stage links to one cell and the sessions on them."""

    def __init__(self, cell: Cell):
        self.cell = cell
        self._sessions: dict[str, LinkSession] = {}
        self.links = {s: StageLink(cell, s, self._on_entry, self._on_lost) for s in STAGES}
        self.broken: str | None = None
        self._watch = asyncio.create_task(self._watchdog(), name=f"link-{cell.name}-watch")

    @classmethod
    def of(cls, cell: Cell) -> "CellLink":
        """The cell's working link, made on first use and again after one broke."""
        link = cell.link
        if link is None or link.broken is not None:
            link = cell.link = cls(cell)
        return link

    def holds(self, stream_id: str) -> bool:
        return stream_id in self._sessions

    def add(self, session: LinkSession) -> None:
        """Route the entries of `session`'s stream id to it from now on."""
        self._sessions[session.stream_id] = session

    def forget(self, session: LinkSession) -> None:
        """The session is over here: its late entries are dropped; a broken link with none left closes."""
        if self._sessions.get(session.stream_id) is session:
            del self._sessions[session.stream_id]
        if self.broken is not None and not self._sessions:
            asyncio.ensure_future(self.close())

    def _on_entry(self, stage: str, entry) -> None:
        p = self._sessions.get(entry.stream_id)
        if p is not None:  # else: a session already over here (late answers are dropped)
            self._guarded(p, stage, p.link_entry, stage, entry)

    def _on_lost(self, stage: str, why: str) -> None:
        if self.broken is None:
            self.broken = f"{stage} link: {why}"
            log.warning("cell %s: %s link lost (%s); its %d session(s) fail", self.cell.name, stage, why,
                        len(self._sessions))
        for p in list(self._sessions.values()):
            self._guarded(p, stage, p.link_lost, stage, why)
        if not self._sessions:
            asyncio.ensure_future(self.close())

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(WATCH_PERIOD_S)
            now = time.monotonic()
            for p in list(self._sessions.values()):
                self._guarded(p, "watch", p.link_watch, now)

    def _guarded(self, p: LinkSession, stage: str, handler: Callable, *args) -> None:
        """Run one session's handler so that its bug fails that session alone: raised into the read loop
        or the watchdog, it would end the link and every session on it. The session fails typed
        (link_error); if that raises too, it is dropped from the link (its own deadlines end it)."""
        try:
            handler(*args)
        except Exception:
            log.exception("cell %s: session %s failed handling its %s link (%s); it alone ends", self.cell.name,
                          p.stream_id, stage, getattr(handler, "__name__", "handler"))
            try:
                p.link_error(f"the gateway failed handling its {stage} link entry (see the gateway's log)")
            except Exception:
                log.exception("cell %s: session %s could not be failed; dropped from the link", self.cell.name,
                              p.stream_id)
                self.forget(p)

    async def close(self) -> None:
        self._watch.cancel()
        await asyncio.gather(*(link.close() for link in self.links.values()), return_exceptions=True)
        if self.cell.link is self:
            self.cell.link = None


def _describe(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name} {e.details() or ''}".strip()
    return f"{type(e).__name__}: {e}"
