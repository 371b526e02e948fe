"""One typed place for a service's configuration: a dataclass, filled from
defaults, then environment variables, then command-line flags (last wins).

    @dataclass
    class EncoderConfig:
        port: int = 50051
        slots: int = 16

    cfg = load_config(EncoderConfig, env_prefix="ENCODER_", argv=sys.argv[1:])
    # ENCODER_SLOTS=32 or --slots 32; field `metrics_port` is --metrics-port / ENCODER_METRICS_PORT

Supported field types: str, int, float, bool. A bad value is a clear error naming the variable.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from typing import Mapping, Sequence, TypeVar

T = TypeVar("T")


def _parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _converter(tp):
    return {bool: _parse_bool, int: int, float: float, str: str}[tp]


def load_config(cls: type[T], env_prefix: str, argv: Sequence[str] | None = None,
                env: Mapping[str, str] | None = None, description: str = "") -> T:
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        var = env_prefix + f.name.upper()
        if var in env:
            try:
                values[f.name] = _converter(hints[f.name])(env[var])
            except ValueError as e:
                raise SystemExit(f"environment variable {var}={env[var]!r}: {e}") from None
    parser = argparse.ArgumentParser(description=description or cls.__doc__)
    for f in dataclasses.fields(cls):
        default = values.get(f.name, f.default)
        parser.add_argument(
            "--" + f.name.replace("_", "-"), dest=f.name, type=_converter(hints[f.name]), default=default,
            help=f"(env {env_prefix + f.name.upper()}; default {default!r})",
        )
    args = parser.parse_args(list(argv) if argv is not None else None)
    return cls(**vars(args))
