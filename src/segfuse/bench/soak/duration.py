"""Durations as people write them on a command line: ``30m``, ``90s``, ``1h30m``, ``2.5m``, ``45``."""

from __future__ import annotations

import re

from ...errors import SegfuseError

_PART = re.compile(r"(\d+(?:\.\d+)?)([hms]?)")
_SECONDS = {"h": 3600.0, "m": 60.0, "s": 1.0, "": 1.0}


def parse_duration(text: str) -> float:
    """Seconds in `text`: numbers with a unit each (h, m, s, largest first), or a bare number of seconds."""
    compact = text.strip().lower().replace(" ", "")
    parts = _PART.findall(compact)
    units = [unit for _, unit in parts]
    well_formed = bool(parts) and "".join(n + u for n, u in parts) == compact
    bare = units == [""]
    ordered = units == sorted(units, key="hms".index) and len(set(units)) == len(units) and "" not in units
    if not well_formed or not (bare or ordered):
        raise SegfuseError(f"{text!r} is not a duration", "write e.g. 30m, 90s, 1h30m or 2.5m")
    seconds = sum(float(n) * _SECONDS[u] for n, u in parts)
    if seconds <= 0:
        raise SegfuseError(f"{text!r} is not a positive duration", "write e.g. 30m or 90s")
    return seconds


def format_duration(seconds: float) -> str:
    """Whole seconds written back the same way: ``1h5m3s``, ``30m``, ``45s``."""
    hours, rest = divmod(round(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    parts = [f"{v}{u}" for v, u in ((hours, "h"), (minutes, "m"), (secs, "s")) if v]
    return "".join(parts) or "0s"
