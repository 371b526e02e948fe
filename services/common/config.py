"""One way from a config dataclass to flags and environment variables, for every service and tool.

    @dataclass(frozen=True)
    class EncoderConfig:
        port: int = option(50051, help="gRPC port (0 picks a free one)")
        slots: int = 2

    cfg = load_config(EncoderConfig, "ENCODER_", prog="python -m services.encoder")

Every field is a flag and an environment variable: `metrics_port` is --metrics-port and ENCODER_METRICS_PORT.
Precedence: the field's default < the environment < the command line. A value converts by the field's type
(str, int, float, bool, Path, and X | None, where an empty value means None); any other type takes a `parse`
hook in option(). A bool flag also stands alone (--cuda-graph) or negated (--no-cuda-graph).

A bad value, an unknown ENCODER_* variable, or a value the dataclass's __post_init__ refuses (validation stays
there) is a ConfigError: exit status 2, as argparse's own errors, with a message naming the flag or variable.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TypeVar

T = TypeVar("T")
SHOWN_CHARS = 60  # an echoed value is cut to this many characters
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class ConfigError(SystemExit):
    """A bad option: exit status 2 (as argparse's), and str() is the message, not the status."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def option(default: Any = dataclasses.MISSING, *, help: str = "", parse: Callable[[str], Any] | None = None,
           aliases: Sequence[str] = (), hidden: bool = False, settable: bool = True,
           default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with what the loader needs beyond its name and type.

    help: the --help line. parse: text -> value, for types the loader does not convert itself (raise
    ValueError with a reason). aliases: more flag names (each also read as PREFIX + its name from the
    environment), e.g. a flag's older name. hidden: left out of --help. settable=False: neither a flag nor a
    variable; the owner fills it (`derive` of load_config), e.g. a secret that must not sit on a command line."""
    meta = {"help": help, "parse": parse, "aliases": tuple(aliases), "hidden": hidden, "settable": settable}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=meta)


def load_config(cls: type[T], env_prefix: str, argv: Sequence[str] | None = None,
                env: Mapping[str, str] | None = None, *, prog: str | None = None, description: str | None = None,
                derive: Callable[[dict[str, Any]], None] | None = None,
                presets: Mapping[str, Mapping[str, Any]] | None = None) -> T:
    """`cls` from its defaults, then `env` (os.environ by default), then `argv` (sys.argv[1:] by default).

    presets {"smoke": {...}}: when the bool field `smoke` ends up true, its values replace those fields'
    defaults (the environment and flags still win). derive(values) may fill or adjust fields from others
    before the dataclass is built (a ValueError it raises is a ConfigError too)."""
    env = os.environ if env is None else env
    # No abbreviations: --slot is a typo, not --slots (and adding a field must not break a command line).
    parser = _Parser(prog=prog, description=description if description is not None else cls.__doc__,
                     allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter)
    options = _options(cls, env_prefix)
    defaults = {o.name: o.default() for o in options if o.has_default}
    try:
        given = _from_env(options, env_prefix, env)
    except ValueError as e:
        parser.error(str(e))
    for o in options:
        if o.settable:
            o.add_to(parser, given.get(o.name, defaults.get(o.name, dataclasses.MISSING)))
    given.update(vars(parser.parse_args(list(argv) if argv is not None else sys.argv[1:])))
    values = {**defaults, **given}
    for switch, preset in (presets or {}).items():
        if values[switch]:
            values = {**values, **preset, **given}
    try:
        if derive is not None:
            derive(values)
        return cls(**values)
    except ValueError as e:
        parser.error(str(e))


def env_names(cls: type, env_prefix: str) -> dict[str, str]:
    """Every environment variable `cls` reads -> the field it sets."""
    return {var: o.name for o in _options(cls, env_prefix) if o.settable for var in o.env_vars}


def flag_names(cls: type) -> dict[str, str]:
    """Every flag `cls` takes (bools also as --no-NAME) -> the field it sets."""
    return {flag: o.name for o in _options(cls, "") if o.settable for flag in o.all_flags}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        print(f"{self.prog}: error: {message} (--help lists the options)", file=sys.stderr)
        raise ConfigError(message)


def _cut(text: str) -> str:
    return repr(text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "...")


def _parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise ValueError(f"expected one of {'/'.join(_TRUE + _FALSE)}, got {_cut(text)}")


def _parse_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"expected an integer, got {_cut(text)}") from None


def _parse_float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"expected a number, got {_cut(text)}") from None


_CONVERTERS: dict[Any, Callable[[str], Any]] = {str: str, int: _parse_int, float: _parse_float, bool: _parse_bool,
                                                Path: Path}
_METAVARS = {str: "TEXT", _parse_int: "N", _parse_float: "X", Path: "PATH"}


@dataclasses.dataclass
class _Option:
    field: dataclasses.Field
    env_prefix: str
    convert: Callable[[str], Any]
    is_bool: bool
    metavar: str

    @property
    def name(self) -> str:
        return self.field.name

    @property
    def settable(self) -> bool:
        return self.field.metadata.get("settable", True)

    @property
    def has_default(self) -> bool:
        return self.field.default is not dataclasses.MISSING or self.field.default_factory is not dataclasses.MISSING

    def default(self) -> Any:
        f = self.field
        return f.default if f.default is not dataclasses.MISSING else f.default_factory()

    @property
    def flags(self) -> list[str]:
        return ["--" + self.name.replace("_", "-"), *self.field.metadata.get("aliases", ())]

    @property
    def all_flags(self) -> list[str]:
        return self.flags + (["--no-" + f[2:] for f in self.flags] if self.is_bool else [])

    @property
    def env_vars(self) -> list[str]:
        return [self.env_prefix + f[2:].replace("-", "_").upper() for f in self.flags]

    def add_to(self, parser: argparse.ArgumentParser, current: Any) -> None:
        meta = self.field.metadata
        text = meta.get("help", "").replace("%", "%%")
        shown = "" if current is dataclasses.MISSING or not _scalar(current) else f"; default {_show(current)}"
        env = " or ".join(self.env_vars)
        negated = [f for f in self.all_flags if f not in self.flags]
        if negated:
            shown += f"; {negated[0]} for false"
        text = argparse.SUPPRESS if meta.get("hidden") else f"{text} (env {env}{shown})".lstrip()
        kw = dict(dest=self.name, default=argparse.SUPPRESS, required=current is dataclasses.MISSING)
        if self.is_bool:  # --NAME, --NAME VALUE (true/false/1/0/...), or --no-NAME
            parser.add_argument(*self.flags, nargs="?", const=True, type=self._argparse_type, metavar="BOOL",
                                help=text, **kw)
            parser.add_argument(*negated, action="store_const", const=False, help=argparse.SUPPRESS, **kw)
        else:
            parser.add_argument(*self.flags, type=self._argparse_type, metavar=self.metavar, help=text, **kw)

    def _argparse_type(self, text: str) -> Any:
        try:
            return self.convert(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None


def _show(value: Any) -> str:
    return str(value) if isinstance(value, Path) else repr(value)


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool, Path))


def _options(cls: type, env_prefix: str) -> list[_Option]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        tp, optional = _unwrap_optional(hints[f.name])
        convert = f.metadata.get("parse") or _CONVERTERS.get(tp)
        if convert is None and f.metadata.get("settable", True):
            raise TypeError(f"{cls.__name__}.{f.name}: a field of type {tp} needs option(parse=...)")
        metavar = _METAVARS.get(convert, "VALUE")
        if optional and convert is not None:
            convert = _none_when_empty(convert)
        out.append(_Option(f, env_prefix, convert, tp is bool and not f.metadata.get("parse"), metavar))
    return out


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """X | None -> (X, True); anything else -> (tp, False)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _none_when_empty(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    return lambda text: None if text.strip() == "" else convert(text)


def _from_env(options: list[_Option], env_prefix: str, env: Mapping[str, str]) -> dict[str, Any]:
    """The fields the environment sets; an unknown PREFIX_* variable or a bad value is a ValueError."""
    known = {var: o for o in options if o.settable for var in o.env_vars}
    values: dict[str, Any] = {}
    for var in sorted(v for v in env if env_prefix and v.startswith(env_prefix)):
        o = known.get(var)
        if o is None:
            near = difflib.get_close_matches(var, known, n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise ValueError(f"environment variable {var[:SHOWN_CHARS]} is not an option{hint}")
        if o.name in values:
            raise ValueError(f"environment variables {' and '.join(o.env_vars)} set the same option; keep one")
        try:
            values[o.name] = o.convert(env[var])
        except ValueError as e:
            raise ValueError(f"environment variable {var}: {e}") from None
    return values
