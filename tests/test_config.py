"""The one loader from a config dataclass to flags and environment (services/common/config.py), and every
service's config through it: precedence, typed errors, help, and the shared stage base."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.common.config import ConfigError, env_names, flag_names, load_config, option
from services.common.stage_config import StageConfig
from services.decoder.config import DecoderConfig
from services.encoder.config import EncoderConfig
from services.gateway.config import GatewayConfig, usable_cpus
from services.talker.config import TalkerConfig
from tools.load_driver.__main__ import parse_args as driver_args
from tools.procs import REPO_ROOT


def _even(text: str) -> int:
    n = int(text)
    if n % 2:
        raise ValueError(f"expected an even number, got {n}")
    return n


@dataclass(frozen=True)
class Toy:
    """A toy service."""

    name: str = option("toy", help="what it is called")
    count: int = 1
    ratio: float = 0.5
    loud: bool = False
    quiet: bool = True
    where: Path | None = None
    limit: int | None = None
    pair: int = option(2, parse=_even, help="an even number")
    wait_s: float = option(1.0, aliases=("--wait",), help="seconds to wait")
    secret: str | None = option(None, settable=False)
    inner: str = option("x", hidden=True)

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError(f"count must be >= 0, got {self.count}")


def toy(argv=(), env=None, **kw) -> Toy:
    return load_config(Toy, "TOY_", list(argv), env or {}, **kw)


def test_default_then_environment_then_flag():
    assert toy() == Toy()
    env = {"TOY_COUNT": "5", "TOY_RATIO": "0.25", "TOY_NAME": "env"}
    assert (toy([], env).count, toy([], env).ratio, toy([], env).name) == (5, 0.25, "env")
    cfg = toy(["--count", "7", "--name", "flag"], env)
    assert (cfg.count, cfg.ratio, cfg.name) == (7, 0.25, "flag")  # the flag wins; the env still sets the rest


def test_bool_optional_path_hook_and_alias_forms():
    assert toy(["--loud"]).loud is True and toy(["--loud", "false"]).loud is False
    assert toy(["--no-quiet"]).quiet is False and toy([], {"TOY_QUIET": "off"}).quiet is False
    assert toy(["--quiet", "yes"], {"TOY_QUIET": "0"}).quiet is True
    assert toy(["--where", "/a/b"]).where == Path("/a/b") and toy([], {"TOY_WHERE": ""}).where is None
    assert toy(["--limit", "3"]).limit == 3 and toy(["--limit", ""]).limit is None
    assert toy(["--pair", "4"]).pair == 4 and toy([], {"TOY_PAIR": "6"}).pair == 6
    assert toy(["--wait", "3"]).wait_s == 3.0 and toy(["--wait-s", "4"]).wait_s == 4.0
    assert toy([], {"TOY_WAIT": "5"}).wait_s == 5.0 and toy([], {"TOY_WAIT_S": "6"}).wait_s == 6.0
    assert env_names(Toy, "TOY_")["TOY_WAIT"] == "wait_s" and "TOY_SECRET" not in env_names(Toy, "TOY_")
    assert "--no-loud" in flag_names(Toy) and "--secret" not in flag_names(Toy)


def test_derive_fills_fields_that_are_not_options():
    cfg = toy([], {}, derive=lambda values: values.update(secret="from-derive"))
    assert cfg.secret == "from-derive"
    with pytest.raises(ConfigError, match="unrecognized arguments: --secret"):
        toy(["--secret", "x"])


@pytest.mark.parametrize("argv,env,names", [
    ([], {"TOY_COUNT": "many"}, ["TOY_COUNT", "expected an integer", "'many'"]),
    (["--count", "many"], {}, ["--count", "expected an integer"]),
    (["--ratio", "half"], {}, ["--ratio", "expected a number"]),
    (["--loud", "maybe"], {}, ["--loud", "expected one of"]),
    ([], {"TOY_LOUD": "maybe"}, ["TOY_LOUD"]),
    (["--pair", "3"], {}, ["--pair", "expected an even number"]),
    ([], {"TOY_PAIR": "3"}, ["TOY_PAIR", "expected an even number"]),
    ([], {"TOY_CONUT": "3"}, ["TOY_CONUT is not an option", "did you mean TOY_COUNT"]),
    ([], {"TOY_WAIT": "1", "TOY_WAIT_S": "2"}, ["TOY_WAIT_S and TOY_WAIT"]),
    (["--count", "-1"], {}, ["count must be >= 0"]),  # the dataclass's own __post_init__
    (["--no-loud", "true"], {}, ["unrecognized arguments: true"]),  # --no-NAME takes no value
    (["--nope"], {}, ["unrecognized arguments: --nope"]),
    (["--coun", "3"], {}, ["unrecognized arguments: --coun"]),  # no abbreviations
])
def test_a_bad_value_is_a_usage_error_naming_the_flag_or_variable(capsys, argv, env, names):
    with pytest.raises(ConfigError) as e:
        toy(argv, env)
    assert e.value.code == 2  # argparse's status for a usage error
    for name in names:
        assert name in str(e.value)
    assert str(e.value) in capsys.readouterr().err


def test_an_echoed_value_is_cut_short():
    with pytest.raises(ConfigError) as e:
        toy([], {"TOY_COUNT": "9" * 500 + "x"})
    assert len(str(e.value)) < 150 and "9" * 100 not in str(e.value)


def test_help_comes_from_the_field(capsys):
    with pytest.raises(SystemExit) as e:
        toy(["--help"], {"TOY_COUNT": "4"}, prog="toy")
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "A toy service." in out and "what it is called (env TOY_NAME; default 'toy')" in out
    assert "(env TOY_COUNT; default 4)" in out  # the default shown is the one the environment set
    assert "seconds to wait (env TOY_WAIT_S or TOY_WAIT; default 1.0)" in out
    assert "--inner" not in out and "--secret" not in out


def test_a_preset_replaces_defaults_and_the_environment_and_flags_still_win():
    presets = {"loud": {"count": 9, "name": "preset"}}
    assert (toy([], {}, presets=presets).count, toy([], {}, presets=presets).name) == (1, "toy")  # switch off
    cfg = toy(["--loud", "--name", "flag"], {"TOY_RATIO": "0.1"}, presets=presets)
    assert (cfg.count, cfg.name, cfg.ratio) == (9, "flag", 0.1)
    assert toy([], {"TOY_LOUD": "1", "TOY_COUNT": "3"}, presets=presets).count == 3


def test_a_field_without_a_default_must_be_given():
    @dataclass
    class Need:
        url: str

    assert load_config(Need, "N_", ["--url", "x"], {}).url == "x"
    assert load_config(Need, "N_", [], {"N_URL": "y"}).url == "y"
    with pytest.raises(ConfigError, match="required: --url"):
        load_config(Need, "N_", [], {})


def test_a_type_the_loader_cannot_convert_needs_a_parse_hook():
    @dataclass
    class Bad:
        pairs: tuple[int, ...] = ()

    with pytest.raises(TypeError, match="Bad.pairs.*option\\(parse=...\\)"):
        load_config(Bad, "BAD_", [], {})


# ---- every service's config -----------------------------------------------------------------------------

CKPT = ["--checkpoint", "/ckpt"]
CELLS = ["--cells", "a:1,b:2,c:3"]


@pytest.mark.parametrize("cls,port,metrics_port", [(EncoderConfig, 50051, 9101), (TalkerConfig, 50052, 9102),
                                                   (DecoderConfig, 50053, 9103)])
def test_every_stage_loads_from_its_environment_and_flags(cls, port, metrics_port):
    prefix = cls.ENV_PREFIX
    cfg = cls.load(CKPT, env={})
    assert (cfg.port, cfg.metrics_port, cfg.slots, cfg.checkpoint) == (port, metrics_port, 2, "/ckpt")
    env = {f"{prefix}SLOTS": "8", f"{prefix}CHECKPOINT": "/env", f"{prefix}CUDA_GRAPH": "0",
           f"{prefix}DRAIN_DEADLINE_S": "300", f"{prefix}HOST": "10.0.0.7"}
    cfg = cls.load([], env=env)
    assert (cfg.slots, cfg.checkpoint, cfg.drain_deadline_s, cfg.host) == (8, "/env", 300.0, "10.0.0.7")
    assert cls.load(["--slots", "3"], env=env).slots == 3
    with pytest.raises(ConfigError, match=f"--checkpoint \\(or {prefix}CHECKPOINT\\) is required"):
        cls.load([], env={})
    with pytest.raises(ConfigError, match=f"{prefix}SLOTS"):
        cls.load(CKPT, env={f"{prefix}SLOTS": "many"})
    with pytest.raises(ConfigError, match="slots must be >= 1"):
        cls.load([*CKPT, "--slots", "0"], env={})
    with pytest.raises(ConfigError, match=f"{prefix}SLOT is not an option.*{prefix}SLOTS"):
        cls.load(CKPT, env={f"{prefix}SLOT": "4"})


def test_talker_and_codecs_share_one_stage_base():
    shared = {f.name for f in dataclasses.fields(StageConfig)}
    assert {"checkpoint", "host", "port", "metrics_port", "slots", "device", "threads", "cuda_graph",
            "drain_deadline_s", "stream_idle_timeout_s", "gil_switch_ms", "log_level"} <= shared
    for cls in (EncoderConfig, TalkerConfig, DecoderConfig):
        assert issubclass(cls, StageConfig)
        base, own = StageConfig(), cls()
        assert [getattr(own, n) for n in shared - {"port", "metrics_port"}] == \
               [getattr(base, n) for n in shared - {"port", "metrics_port"}]
    assert TalkerConfig.load([*CKPT, "--tick-ms", "40"], env={"TALKER_KV_FP8": "1"}).kv_fp8 is True
    assert EncoderConfig.load(CKPT, env={"ENCODER_BATCH_WAIT_MS": "20"}).batch_wait_ms == 20.0
    with pytest.raises(ConfigError, match="cuda_graph needs a CUDA device"):
        TalkerConfig.load([*CKPT, "--cuda-graph"], env={})
    with pytest.raises(ConfigError, match="log_level"):
        DecoderConfig.load([*CKPT, "--log-level", "chatty"], env={})


def test_gateway_loads_from_its_environment_and_flags(tmp_path):
    env = {"GATEWAY_WORKERS": "3", "GATEWAY_CELLS_DNS": "cells", "GATEWAY_OPEN_TIMEOUT": "12.5",
           "GATEWAY_IDLE_SESSION_TIMEOUT_S": "1.5", "GATEWAY_VOICE_ALIASES": "marin=VARF0.pt",
           "GATEWAY_DNS_PORTS": "1,2,3"}
    cfg = GatewayConfig.from_args([], env)
    assert (cfg.workers, cfg.cells_dns, cfg.open_timeout_s, cfg.idle_session_timeout_s) == (3, "cells", 12.5, 1.5)
    assert cfg.voice_aliases == (("marin", "VARF0.pt"),) and cfg.dns_ports == (1, 2, 3) and cfg.api_key is None
    assert GatewayConfig.from_args(["--workers", "2", "--open-timeout-s", "4"], env).workers == 2
    assert GatewayConfig.from_args(["--workers", "auto"], env).workers == usable_cpus()
    cells_file = tmp_path / "cells.json"
    cells_file.write_text('[{"encoder": "e:1", "talker": "t:2", "decoder": "d:3"}]')
    cfg = GatewayConfig.from_args([*CELLS, "--cells-file", str(cells_file)], {"K": "key", "GATEWAY_API_KEY_ENV": "K"})
    assert [c.talker for c in cfg.cells] == ["b:2", "t:2"] and cfg.api_key == "key"
    for argv, env, message in [
        ([], {}, "give --cells, --cells-file or --cells-dns"),
        (CELLS, {"GATEWAY_WORKERS": "lots"}, "GATEWAY_WORKERS: expected a positive integer or 'auto'"),
        ([*CELLS, "--workers", "0"], {}, "--workers: expected a positive integer"),
        ([*CELLS, "--dns-ports", "1,2"], {}, "--dns-ports: expected three ports"),
        ([*CELLS, "--cells-file", str(tmp_path / "none.json")], {}, "cells file"),
        ([*CELLS, "--voice-upload"], {}, "--voice-upload needs an API key: set PERSONAPLEX_GATEWAY_API_KEY"),
        ([*CELLS, "--stall-timeout", "0"], {}, "stall_timeout_s must be > 0"),
        (CELLS, {"GATEWAY_API_KEY": "k"}, "GATEWAY_API_KEY is not an option"),  # the key is never a GATEWAY_ option
    ]:
        with pytest.raises(ConfigError, match=message):
            GatewayConfig.from_args(argv, env)


def test_load_driver_loads_from_its_environment_and_flags():
    cfg = driver_args([], {"LOAD_DRIVER_SESSIONS": "4", "LOAD_DRIVER_PROCS": "auto", "LOAD_DRIVER_PROGRESS": "0"})
    assert (cfg.sessions, cfg.procs, cfg.progress) == (4, "auto", False)
    assert driver_args(["--procs", "2", "--progress"], {"LOAD_DRIVER_SESSIONS": "4"}).procs == 2
    assert driver_args([], {}).sessions is None  # lifecycle mode
    with pytest.raises(ConfigError, match="--sessions must be in"):
        driver_args([], {"LOAD_DRIVER_SESSIONS": "0"})
    with pytest.raises(ConfigError, match="LOAD_DRIVER_PROCS: expected a count or auto"):
        driver_args([], {"LOAD_DRIVER_PROCS": "many"})


def test_run_stack_and_the_cell_benchmark_load_from_their_environment_and_flags(monkeypatch):
    from bench.cell import parse_args as bench_args
    from tools.run_stack import ENV_PREFIX, StackOptions

    env = {"RUN_STACK_SESSIONS": "4", "RUN_STACK_CHECKPOINT": ""}
    opts = load_config(StackOptions, ENV_PREFIX, ["--cells", "2"], env)
    assert (opts.sessions, opts.cells, opts.checkpoint, opts.talker_tick_ms) == (4, 2, None, None)
    with pytest.raises(ConfigError, match="sessions and cells must be >= 1"):
        load_config(StackOptions, ENV_PREFIX, ["--sessions", "0"], {})
    monkeypatch.setenv("BENCH_SESSIONS", "3")  # over the --smoke preset's 2, under the flag
    assert bench_args(["--smoke"]).sessions == "3" and bench_args(["--smoke", "--sessions", "4"]).sessions == "4"
    assert bench_args(["--smoke"]).device == "cpu" and bench_args([]).device == "cuda"


def test_a_service_process_refuses_a_bad_variable_before_it_starts():
    """The real entry point, as a deployment runs it: status 2 and the variable's name on stderr."""
    run = subprocess.run([sys.executable, "-m", "services.gateway", *CELLS], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "GATEWAY_WORKERS": "lots"})
    assert run.returncode == 2, run.stderr
    assert "GATEWAY_WORKERS: expected a positive integer or 'auto', got 'lots'" in run.stderr
    assert "Traceback" not in run.stderr
