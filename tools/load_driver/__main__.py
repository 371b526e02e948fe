"""Command line: `python -m tools.load_driver --url ws://HOST:PORT/v1/realtime?duplex=1 [options]`.

Exit status: 0 PASS (every check passed); 1 FAIL (a check, session or server bound failed);
2 bad options or an existing result file; 3 INVALID (load mode: the client itself fell behind, so the
run says nothing about the server; see verdict.py); 130 interrupted (Ctrl-C; transports are closed first).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from services.common.config import load_config

from .config import ENV_PREFIX, DriverConfig
from .calls import run_traffic
from .input_audio import input_signal
from .lifecycle import run_lifecycle
from .load import Shard
from .procs import run_procs, run_shard
from .report import (
    LIFECYCLE_RESULT_NAME,
    PLOT_NAME,
    RESULT_NAME,
    Progress,
    ensure_writable,
    load_result,
    plot_timeline,
    public_url,
    summary_table,
    write_result,
)
from .traffic import input_frames
from .verdict import FAIL, INVALID, PASS

EXIT_CODES = {PASS: 0, FAIL: 1, INVALID: 3}


def shard_arg(text: str) -> Shard:
    index, _, count = text.partition("/")
    try:
        shard = Shard(int(index), int(count))
    except ValueError:
        raise argparse.ArgumentTypeError("expected INDEX/COUNT") from None
    if not 0 <= shard.index < shard.count:
        raise argparse.ArgumentTypeError("expected 0 <= INDEX < COUNT")
    return shard


def parse_args(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> DriverConfig:
    return parse_command(argv, env)[0]


def parse_command(argv: Sequence[str] | None = None,
                  env: Mapping[str, str] | None = None) -> tuple[DriverConfig, Shard | None, Path | None]:
    """The options (defaults < LOAD_DRIVER_* environment < flags), plus the hidden ones procs.py gives a child
    driver process (its shard, its result file)."""
    child = argparse.ArgumentParser(prog="python -m tools.load_driver", add_help=False, allow_abbrev=False)
    child.add_argument("--shard", type=shard_arg)
    child.add_argument("--shard-result", type=Path)
    hidden, rest = child.parse_known_args(argv)
    config = load_config(DriverConfig, ENV_PREFIX, rest, env, prog="python -m tools.load_driver",
                         description=__doc__.splitlines()[0])
    child_args = (hidden.shard, hidden.shard_result)
    if (None in child_args and child_args != (None, None)) or (hidden.shard is not None and config.sessions is None):
        child.error("--shard and --shard-result go together, in load mode")
    return config, hidden.shard, hidden.shard_result


def print_lifecycle(result: dict) -> None:
    verdict = "PASS" if result["ok"] else f"FAIL at {result['failed_check']}: {result['error']}"
    print(f"lifecycle: {verdict}")
    print(f"  passed checks: {', '.join(result['passed_checks']) or '-'}")
    for role, stats in result["sessions"].items():
        print(
            f"  {role:12s} session={stats.get('session_id')} in={stats.get('input_frames')} "
            f"out={stats.get('output_frames')} voiced={stats.get('voiced_frames')} rms={stats.get('audio_rms')} "
            f"text_deltas={stats.get('text_deltas')}"
        )


async def run(config: DriverConfig) -> dict:
    progress = Progress(enabled=config.progress)
    frames = input_frames(config) if config.sessions is not None else config.lifecycle_frames
    pcm, identity = input_signal(config.input_wav, frames, config.input_seed)
    progress.note(f"{config.mode} against {public_url(config.url)}; input {identity['source']}, "
                  f"{identity['frames']} frames")
    if config.sessions is None:
        result = await run_lifecycle(config, pcm, progress)
        result.update(url=public_url(config.url), model=config.model, input=identity,
                      reported_server={"revision": config.server_revision, "hardware": config.server_hardware})
        return result
    procs = config.resolved_procs()
    if procs > 1:
        progress.note(f"{config.sessions} sessions over {procs} driver processes")
        return load_result(config, identity, await run_procs(config, procs, pcm, progress))
    return load_result(config, identity, await run_traffic(config, pcm, progress))


def shard_main(config: DriverConfig, shard: Shard, result_path: Path) -> int:
    """A child driver process of `--procs` (see procs.py): its raw result goes to result_path."""
    pcm, _ = input_signal(config.input_wav, input_frames(config), config.input_seed)
    try:
        part = asyncio.run(run_shard(config, shard, pcm))
    except (KeyboardInterrupt, asyncio.CancelledError):
        return 130
    write_result(result_path, part)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    config, shard, shard_result = parse_command(argv)
    if shard is not None and shard_result is not None:
        return shard_main(config, shard, shard_result)
    try:
        path = ensure_writable(config, RESULT_NAME if config.sessions is not None else LIFECYCLE_RESULT_NAME)
    except FileExistsError as exc:
        print(f"load_driver: refusing to overwrite: {exc}", file=sys.stderr)
        return 2
    try:
        result = asyncio.run(run(config))
    except KeyboardInterrupt:
        print("load_driver: interrupted; connections closed", file=sys.stderr)
        return 130
    if path is not None:
        write_result(path, result)
    if result["mode"] == "lifecycle":
        print_lifecycle(result)
    else:
        print(summary_table(result))
        if config.plot and config.output_dir is not None:
            plot_timeline(result, config.output_dir / PLOT_NAME)
    if path is not None:
        print(f"result: {path}", file=sys.stderr)
    if result["mode"] == "lifecycle":
        return 0 if result["ok"] else 1
    return EXIT_CODES[result["verdict"]]


if __name__ == "__main__":
    sys.exit(main())
