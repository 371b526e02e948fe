"""One session's bug on a cell link fails that session alone (links.CellLink._guarded).

Every session of a gateway process on one cell shares its three stage links. An exception out of one
session's handler, raised into a link's read loop or the watchdog, would end the link and with it every
session on the cell. Here the CellLink's routing is driven directly with sessions that record what
reaches them, one of them raising."""

from __future__ import annotations

import logging

import pytest

from duplex.v1 import decoder_pb2
from services.gateway.links import CellLink


class Recorder:
    """A LinkSession that records its calls; `broken` names the handler that raises."""

    def __init__(self, stream_id: str, broken: str = "", error_raises: bool = False):
        self.stream_id, self.broken, self.error_raises = stream_id, broken, error_raises
        self.entries, self.lost, self.watched, self.errors = [], [], [], []

    def _maybe_raise(self, handler: str) -> None:
        if handler == self.broken:
            raise ValueError(f"a bug in {handler}")

    def link_entry(self, stage, entry):
        self._maybe_raise("link_entry")
        self.entries.append((stage, entry.stream_id))

    def link_lost(self, stage, why):
        self._maybe_raise("link_lost")
        self.lost.append(stage)

    def link_watch(self, now):
        self._maybe_raise("link_watch")
        self.watched.append(now)

    def link_error(self, why):
        if self.error_raises:
            raise RuntimeError("cannot even fail")
        self.errors.append(why)


class _Cell:
    name = "cell-0"
    link = None


def cell_link(*sessions: Recorder) -> CellLink:
    """The routing half of a CellLink (no stage streams: its links are never used here)."""
    link = CellLink.__new__(CellLink)
    link.cell, link.links, link.broken = _Cell(), {}, None
    link._sessions = {s.stream_id: s for s in sessions}
    return link


def entry(stream_id: str):
    return decoder_pb2.DecodeLinkResponse.Entry(stream_id=stream_id)


def test_an_entry_handler_that_raises_fails_only_its_session(caplog):
    bad, good = Recorder("a", broken="link_entry"), Recorder("b")
    link = cell_link(bad, good)
    with caplog.at_level(logging.ERROR, logger="gateway.links"):
        for sid in ("a", "b", "a", "b"):
            link._on_entry("decoder", entry(sid))
    assert good.entries == [("decoder", "b"), ("decoder", "b")] and good.errors == []
    assert len(bad.errors) == 2 and "decoder link entry" in bad.errors[0]
    assert link.broken is None and set(link._sessions) == {"a", "b"}  # the link lives; `a` ends itself (relay)
    assert "session a failed handling its decoder link" in caplog.text


def test_a_lost_link_reaches_every_session_though_one_raises():
    bad, good = Recorder("a", broken="link_lost"), Recorder("b")
    link = cell_link(bad, good)
    link._on_lost("talker", "ended the link")
    assert good.lost == ["talker"] and len(bad.errors) == 1


@pytest.mark.parametrize("error_raises", [False, True])
def test_a_watch_that_raises_fails_its_session_and_one_that_cannot_fail_is_dropped(error_raises):
    bad, good = Recorder("a", broken="link_watch", error_raises=error_raises), Recorder("b")
    link = cell_link(bad, good)
    for p in list(link._sessions.values()):
        link._guarded(p, "watch", p.link_watch, 1.0)
    assert good.watched == [1.0]
    assert set(link._sessions) == ({"b"} if error_raises else {"a", "b"})
    assert len(bad.errors) == (0 if error_raises else 1)
