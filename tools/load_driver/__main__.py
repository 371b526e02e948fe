"""Command line: `python -m tools.load_driver --url ws://HOST:PORT/v1/realtime?duplex=1 [options]`.

Exit status: 0 every check passed; 1 a check or session failed; 2 bad options or an existing
result file; 130 interrupted (Ctrl-C; transports are closed first).
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
from .load import run_load
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

_HELP = {
    "url": "Realtime duplex endpoint, e.g. ws://127.0.0.1:8000/v1/realtime?duplex=1",
    "model": "model name for the URL and session.update (omitted when not given)",
    "input_wav": "input speech (integer PCM WAV; resampled to 24 kHz mono); default: a synthetic speech-like signal",
    "sessions": "load mode with N sessions; omit for the lifecycle (admission/slot reuse) scenario",
    "load_frames": "load mode: at most this many 80 ms input frames per session (the WAV is never looped)",
    "lifecycle_frames": "lifecycle mode: frames streamed in each of its two streaming phases",
    "capacity": "lifecycle mode: the server's session limit; session capacity+1 must be refused",
    "drain_s": "fixed observation window after the last input frame",
    "cleanup_timeout_s": "bound on session.close + session.closed, and separately on the WebSocket close",
    "max_client_rtf": "optional acceptance ceiling on client_stream_rtf (diagnostic by default)",
    "output_dir": "directory for load-result.json / lifecycle-result.json (never overwritten) and the plot",
    "server_revision": "operator-reported server commit (recorded, not verified)",
    "server_hardware": "operator-reported server hardware (recorded, not verified)",
    "plot": "also write load-timeline.png (needs matplotlib and --output-dir)",
    "progress": "live progress line on stderr",
}


# Fields whose default is None: the type of a given value.
_OPTIONAL_TYPES = {"sessions": int, "max_client_rtf": float, "input_wav": Path, "output_dir": Path,
                   "model": str, "server_revision": str, "server_hardware": str}


def parse_args(argv: Sequence[str] | None = None) -> DriverConfig:
    parser = argparse.ArgumentParser(prog="python -m tools.load_driver", description=__doc__.splitlines()[0])
    defaults = DriverConfig()
    for f in fields(DriverConfig):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=_HELP.get(f.name))
            continue
        kind = _OPTIONAL_TYPES.get(f.name, type(default))
        parser.add_argument(flag, type=kind, default=default, help=_HELP.get(f.name))
    config = DriverConfig(**vars(parser.parse_args(argv)))
    try:
        config.validate()
    except ConfigError as exc:
        parser.error(str(exc))
    return config


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
    return load_result(config, identity, await run_load(config, pcm, progress))


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
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
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
