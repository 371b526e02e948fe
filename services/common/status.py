"""A status machine's one rule: a status moves only along its table's edges (status -> the statuses
it may become). The gateway's relay and client session keep their tables beside their enums."""

from __future__ import annotations

import enum
from typing import Mapping, TypeVar

E = TypeVar("E", bound=enum.Enum)


class IllegalTransition(RuntimeError):
    """A move its table does not allow: a bug in the caller, never a client's or a stage's doing."""


def transition(table: Mapping[E, frozenset[E]], status: E, to: E) -> E:
    """`to`, if `status` may become it in `table`; else IllegalTransition."""
    if to not in table[status]:
        raise IllegalTransition(f"{type(status).__name__} {status.value} cannot become {to.value}")
    return to
