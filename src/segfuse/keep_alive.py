"""How long a loaded member stays loaded after its last answer, written as Ollama writes ``keep_alive``.

A duration (``"5m"``, ``"1h30m"``, ``"90s"``, ``"250ms"``) or a number of seconds; ``0`` frees it
right after the answer; a negative value (``-1``, ``"-1m"``) keeps it until the server stops. A number
of more than ``MAX_SECONDS`` either way (about 317 years, or one too large for a float) is no duration.
"""

from __future__ import annotations

import math
import re

from .errors import InvalidRequestError

FOREVER = math.inf
_PART = re.compile(r"(\d+(?:\.\d+)?)(h|ms|m|s)")
_SECONDS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
# Past this, a number is a client's mistake (and an integer may not even fit a float): refused, not kept.
MAX_SECONDS = 10**10
HINT = 'write a duration ("5m", "1h30m", "90s"), a number of seconds, 0 (free at once) or -1 (keep)'


def keep_alive_seconds(value: str | int | float, where: str = "keep_alive") -> float:
    """Seconds to keep a member after its last answer: 0 frees it at once, ``FOREVER`` keeps it."""
    if isinstance(value, bool):
        raise InvalidRequestError(f"{where}: {value!r} is not a duration", HINT, field=where)
    if isinstance(value, int) and abs(value) > MAX_SECONDS:  # before float(), which overflows past 1e308
        raise _out_of_range(where)
    if isinstance(value, int | float):
        return _of_number(float(value), where)
    text = value.strip().lower().replace(" ", "")
    negative = text.startswith("-")
    body = text[1:] if negative else text
    try:
        seconds = float(body)
    except ValueError:
        parts = _PART.findall(body)
        if not parts or "".join(n + u for n, u in parts) != body:
            raise InvalidRequestError(f"{where}: {value!r} is not a duration", HINT, field=where) from None
        seconds = sum(float(n) * _SECONDS[u] for n, u in parts)
    return _of_number(-seconds if negative else seconds, where)


def _of_number(seconds: float, where: str) -> float:
    if math.isnan(seconds):
        raise InvalidRequestError(f"{where}: NaN is not a duration", HINT, field=where)
    if abs(seconds) > MAX_SECONDS:
        raise _out_of_range(where)
    return FOREVER if seconds < 0 else seconds


def _out_of_range(where: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"{where}: more than {MAX_SECONDS:,} seconds either way is no duration", HINT, field=where
    )


def describe_keep_alive(seconds: float) -> str:
    """Seconds as the operator reads them back: ``forever``, ``0s``, ``5m``, ``1h30m``, ``2.5s``."""
    if seconds == FOREVER:
        return "forever"
    if seconds < 60 and seconds != int(seconds):
        return f"{seconds:g}s"
    hours, rest = divmod(round(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    return "".join(f"{v}{u}" for v, u in ((hours, "h"), (minutes, "m"), (secs, "s")) if v) or "0s"


__all__ = ["FOREVER", "MAX_SECONDS", "describe_keep_alive", "keep_alive_seconds"]
