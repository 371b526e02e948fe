"""Dropping the half of Mimi a service does not run (see MimiModel.keep_only)."""

from __future__ import annotations


class DroppedHalfError(RuntimeError):
    """A part of Mimi that `keep_only` dropped was used (e.g. decode on an encoder-only model)."""


class Prunable:
    """Mixin for an nn.Module whose submodules may be dropped: reading a dropped one raises
    DroppedHalfError with the reason, not an AttributeError (nor a call on None)."""

    def drop_part(self, name: str, why: str) -> None:
        delattr(self, name)  # nn.Module.__delattr__: out of _modules; its tensors are freed with it
        self.__dict__.setdefault("_dropped_parts", {})[name] = why

    def __getattr__(self, name: str):
        dropped = self.__dict__.get("_dropped_parts")
        if dropped and name in dropped:
            raise DroppedHalfError(f"{dropped[name]} ({type(self).__name__}.{name} is gone)")
        return super().__getattr__(name)
