"""Cells: discovery, fresh capacity, and the admission order for a new session.

A cell is one (encoder, talker, decoder) triple, usually one GPU. The pool keeps
one gRPC channel per stage address, polls every stage's GetCapacity about every
0.5 s, and answers `candidates()`: the serving, non-draining cells with a free
slot, least loaded first. The relay tries them in that order; a session's
three streams always go to one cell.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from dataclasses import dataclass, field

import grpc

from duplex.v1 import common_pb2, decoder_pb2_grpc, encoder_pb2_grpc, talker_pb2_grpc
from services.gateway.config import CellAddress, GatewayConfig

log = logging.getLogger("gateway.cells")

STAGES = ("encoder", "talker", "decoder")
_STUBS = {
    "encoder": encoder_pb2_grpc.EncoderStub,
    "talker": talker_pb2_grpc.TalkerStub,
    "decoder": decoder_pb2_grpc.DecoderStub,
}
# Detect a dead peer quickly even when no stream is active.
_CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 2_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]


@dataclass
class Cell:
    address: CellAddress
    channels: dict[str, grpc.aio.Channel]
    stubs: dict
    capacity: dict[str, common_pb2.Capacity | None] = field(default_factory=lambda: {s: None for s in STAGES})
    # Sessions admitted here since the last poll: keeps two quick admissions from both
    # picking a cell whose polled free count is one.
    admitted_since_poll: int = 0
    # Sessions this gateway holds on the cell now (exact for this gateway; other gateways show
    # only in the polled free counts).
    live_sessions: int = 0
    last_poll_ok: float = 0.0
    last_error: dict = field(default_factory=dict)  # stage -> why its last poll failed (logged on change)
    link: object = None  # this process's links.CellLink to the cell, made on the first session

    @property
    def name(self) -> str:
        return self.address.name

    @property
    def serving(self) -> bool:
        return all(c is not None for c in self.capacity.values())

    @property
    def draining(self) -> bool:
        return any(c is not None and c.draining for c in self.capacity.values())

    @property
    def total_slots(self) -> int:
        """Sessions this cell can hold: the smallest stage's slot count."""
        if not self.serving:
            return 0
        return min(c.total_slots for c in self.capacity.values())

    @property
    def free_slots(self) -> int:
        if not self.serving or self.draining:
            return 0
        return max(0, min(c.free_slots for c in self.capacity.values()) - self.admitted_since_poll)

    def describe(self) -> dict:
        return {
            "cell": self.name,
            "serving": self.serving,
            "draining": self.draining,
            "total_slots": self.total_slots,
            "free_slots": self.free_slots,
        }

    async def close(self) -> None:
        if self.link is not None:
            await self.link.close()
        for ch in self.channels.values():
            await ch.close()


def _make_cell(address: CellAddress) -> Cell:
    channels = {s: grpc.aio.insecure_channel(getattr(address, s), options=_CHANNEL_OPTIONS) for s in STAGES}
    return Cell(address=address, channels=channels, stubs={s: _STUBS[s](channels[s]) for s in STAGES})


class CellPool:
    def __init__(self, config: GatewayConfig, on_poll=None):
        self.config = config
        self.cells: dict[CellAddress, Cell] = {}
        self._tasks: list[asyncio.Task] = []
        self._on_poll = on_poll  # called after each poll round (metrics)
        self._polled = asyncio.Event()

    async def start(self) -> None:
        for addr in self.config.cells:
            self.cells[addr] = _make_cell(addr)
        if self.config.cells_dns:
            await self._refresh_dns()
            self._tasks.append(asyncio.create_task(self._dns_loop(), name="cells-dns"))
        self._tasks.append(asyncio.create_task(self._poll_loop(), name="cells-poll"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for cell in list(self.cells.values()):
            await cell.close()

    async def wait_first_poll(self, timeout: float = 5.0) -> None:
        try:
            await asyncio.wait_for(self._polled.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    # ---- admission view -------------------------------------------------

    def candidates(self) -> list[Cell]:
        """Serving, non-draining cells, most free slots first.

        Cells whose last poll showed no free slot stay in the list (last): a slot may have
        been freed since, and the stage's own RESOURCE_EXHAUSTED is the authoritative answer.
        """
        ok = [c for c in self.cells.values() if c.serving and not c.draining]
        return sorted(ok, key=lambda c: (c.free_slots == 0, c.live_sessions / max(1, c.total_slots), -c.free_slots,
                                         c.name))

    def healthy(self) -> bool:
        """True when every stage of at least one cell is serving."""
        return any(c.serving for c in self.cells.values())

    def admission_state(self) -> str:
        """"ready": some cell is serving and not draining (it admits, or will once a slot frees);
        "draining": every serving cell drains; "down": no cell is serving."""
        serving = [c for c in self.cells.values() if c.serving]
        if not serving:
            return "down"
        return "draining" if all(c.draining for c in serving) else "ready"

    def capacity_summary(self) -> dict:
        serving = [c for c in self.cells.values() if c.serving]
        return {
            "cells": len(self.cells),
            "serving_cells": len(serving),
            "total_slots": sum(c.total_slots for c in serving),
            "max_cell_slots": max((c.total_slots for c in serving), default=0),
            "free_slots": sum(c.free_slots for c in serving),
        }

    # ---- polling ----------------------------------------------------------

    async def _poll_cell(self, cell: Cell) -> None:
        async def one(stage: str):
            try:
                cap = await cell.stubs[stage].GetCapacity(common_pb2.CapacityRequest(),
                                                          timeout=self.config.poll_timeout_s)
            except (grpc.aio.AioRpcError, asyncio.TimeoutError) as e:
                why = f"{e.code().name} {e.details()}" if isinstance(e, grpc.aio.AioRpcError) else "timeout"
                if cell.capacity[stage] is not None or cell.last_error.get(stage) != why:
                    log.warning("cell %s: %s does not answer GetCapacity: %s", cell.name, stage, why)
                cell.capacity[stage] = None
                cell.last_error[stage] = why
                return
            cell.last_error.pop(stage, None)
            if cell.capacity[stage] is None:
                log.info("cell %s: %s serving (%d/%d free)", cell.name, stage, cap.free_slots, cap.total_slots)
            cell.capacity[stage] = cap

        await asyncio.gather(*(one(s) for s in STAGES))
        cell.admitted_since_poll = 0
        cell.last_poll_ok = time.monotonic() if cell.serving else cell.last_poll_ok

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll_cell(c) for c in list(self.cells.values())))
        self._polled.set()
        if self._on_poll:
            self._on_poll(self)

    async def _poll_loop(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception:  # keep polling whatever one round did
                log.exception("capacity poll failed")
            await asyncio.sleep(self.config.poll_interval_s)

    # ---- DNS discovery (Kubernetes headless Service) ----------------------

    async def _refresh_dns(self) -> None:
        name = self.config.cells_dns
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(name, None, type=socket.SOCK_STREAM)
        except OSError as e:
            log.warning("cells DNS %s did not resolve: %s", name, e)
            return
        ips = sorted({info[4][0] for info in infos})
        pe, pt, pd = self.config.dns_ports
        fmt = lambda ip, port: f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"  # noqa: E731
        wanted = {CellAddress(fmt(ip, pe), fmt(ip, pt), fmt(ip, pd)) for ip in ips}
        static = set(self.config.cells)
        for addr in wanted - set(self.cells):
            log.info("cells DNS %s: new cell %s", name, addr.name)
            self.cells[addr] = _make_cell(addr)
        for addr in set(self.cells) - wanted - static:
            log.info("cells DNS %s: cell %s gone", name, addr.name)
            # No new sessions go there; live sessions keep their own reference to the
            # cell, and its channels are released when the last one ends.
            self.cells.pop(addr)

    async def _dns_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.dns_refresh_s)
            await self._refresh_dns()
