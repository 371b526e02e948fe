"""A stage stream's id: what every stage checks before it stores or uses one (common.proto's StreamOpen)."""

from __future__ import annotations

from services.common.errors import InvalidArgument

MAX_STREAM_ID = 128


def validate_stream_id(stream_id: str) -> None:
    """1..MAX_STREAM_ID printable ASCII characters (" " to "~"), else InvalidArgument (bad_stream_id).
    The length is checked first, and the characters by two C-level scans: a huge id costs no
    Python loop over its characters."""
    if not (1 <= len(stream_id) <= MAX_STREAM_ID and stream_id.isascii() and stream_id.isprintable()):
        raise InvalidArgument(f"stream id {stream_id[:40]!r} ({len(stream_id)} characters) must be "
                              f"1..{MAX_STREAM_ID} printable ASCII characters", kind="bad_stream_id")
