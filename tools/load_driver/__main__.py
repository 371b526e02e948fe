"""Command line: `python -m tools.load_driver --url ws://HOST:PORT/v1/realtime?duplex=1 [options]`.

Exit status: 0 PASS (every check passed); 1 FAIL (a check, session or server bound failed);
2 bad options or an existing result file; 3 INVALID (load mode: the client itself fell behind, so the
run says nothing about the server; see verdict.py); 130 interrupted (Ctrl-C; transports are closed first).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

from .config import ConfigError, DriverConfig
from .input_audio import input_signal
from .lifecycle import run_lifecycle
from .load import Shard, run_load
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
from .verdict import FAIL, INVALID, PASS

EXIT_CODES = {PASS: 0, FAIL: 1, INVALID: 3}

_HELP = {
    "url": "Realtime duplex endpoint, e.g. ws://127.0.0.1:8000/v1/realtime?duplex=1",
    "model": "model name for the URL and session.update (omitted when not given)",
    "input_wav": "input speech (integer PCM WAV; resampled to 24 kHz mono); default: a synthetic speech-like signal",
    "sessions": "load mode with N sessions; omit for the lifecycle (admission/slot reuse) scenario",
    "procs": "load mode: spread the sessions over K driver processes (merged into one result), or 'auto': "
             "one per 20 sessions, at most one per CPU",
    "load_frames": "load mode: at most this many 80 ms input frames per session (the WAV is never looped)",
    "lifecycle_frames": "lifecycle mode: frames streamed in each of its two streaming phases",
    "capacity": "lifecycle mode: the server's session limit; session capacity+1 must be refused",
    "drain_s": "fixed observation window after the last input frame",
    "cleanup_timeout_s": "bound on session.close + session.closed, and separately on the WebSocket close",
    "max_client_rtf": "optional acceptance ceiling on client_stream_rtf (diagnostic by default)",
    "max_underrun_s": "load verdict FAILs when any session's output starves longer than this",
    "max_frame_latency_p99_ms": "load verdict FAILs when the p99 over all frames of input frame i sent -> output "
                                "frame i received exceeds this (default: ITU-T G.114's 400 ms interactive limit)",
    "output_dir": "directory for load-result.json / lifecycle-result.json (never overwritten) and the plot",
    "server_revision": "operator-reported server commit (recorded, not verified)",
    "server_hardware": "operator-reported server hardware (recorded, not verified)",
    "plot": "also write load-timeline.png (needs matplotlib and --output-dir)",
    "progress": "live progress line on stderr",
}


def procs_arg(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count or auto, got {text[:20]!r}") from None


def shard_arg(text: str) -> Shard:
    index, _, count = text.partition("/")
    try:
        shard = Shard(int(index), int(count))
    except ValueError:
        raise argparse.ArgumentTypeError("expected INDEX/COUNT") from None
    if not 0 <= shard.index < shard.count:
        raise argparse.ArgumentTypeError("expected 0 <= INDEX < COUNT")
    return shard


# Fields whose default is None or of another type: the type of a given value.
_OPTIONAL_TYPES = {"sessions": int, "max_client_rtf": float, "input_wav": Path, "output_dir": Path,
                   "model": str, "server_revision": str, "server_hardware": str, "procs": procs_arg}


def parse_args(argv: Sequence[str] | None = None) -> DriverConfig:
    return parse_command(argv)[0]


def parse_command(argv: Sequence[str] | None = None) -> tuple[DriverConfig, Shard | None, Path | None]:
    """The options, plus the hidden ones procs.py gives a child driver process (its shard, its result file)."""
    parser = argparse.ArgumentParser(prog="python -m tools.load_driver", description=__doc__.splitlines()[0])
    parser.add_argument("--shard", type=shard_arg, help=argparse.SUPPRESS)
    parser.add_argument("--shard-result", type=Path, help=argparse.SUPPRESS)
    defaults = DriverConfig()
    for f in fields(DriverConfig):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=_HELP.get(f.name))
            continue
        kind = _OPTIONAL_TYPES.get(f.name, type(default))
        parser.add_argument(flag, type=kind, default=default, help=_HELP.get(f.name))
    options = vars(parser.parse_args(argv))
    shard, shard_result = options.pop("shard"), options.pop("shard_result")
    config = DriverConfig(**options)
    try:
        config.validate()
    except ConfigError as exc:
        parser.error(str(exc))
    if (shard is None) != (shard_result is None) or (shard is not None and config.sessions is None):
        parser.error("--shard and --shard-result go together, in load mode")
    return config, shard, shard_result


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
    frames = config.load_frames if config.sessions is not None else config.lifecycle_frames
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
    return load_result(config, identity, await run_load(config, pcm, progress))


def shard_main(config: DriverConfig, shard: Shard, result_path: Path) -> int:
    """A child driver process of `--procs` (see procs.py): its raw result goes to result_path."""
    pcm, _ = input_signal(config.input_wav, config.load_frames, config.input_seed)
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
