"""Member targets with options: ``PATH_OR_URL#NAME,KEY=VALUE,...``, parsed once for every backend.

A backend names its keys and their types (``int``, ``float``, ``bool``, ``str``);
an item without ``=`` is the member's display name. Booleans read the same
everywhere: 1/true/yes/on and 0/false/no/off.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import InvalidRequestError
from ..member_options import parse_flag


def split_target(target: str, keys: Mapping[str, Any], backend: str) -> tuple[str, dict[str, Any]]:
    """``TARGET#NAME,KEY=VALUE,...`` -> (TARGET, options typed by `keys`; a key mapped to anything but a type,
    such as a pydantic field, keeps its text for the backend's options class to type)."""
    head, _, fragment = target.partition("#")
    options: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in fragment.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            options["name"] = item
            continue
        key = key.strip().replace("-", "_")
        if key not in keys:
            raise InvalidRequestError(
                f"unknown {backend} member option {key!r} in {target!r}",
                f"known: NAME, {', '.join(k for k in keys if k != 'name')}",
            )
        options[key] = _typed(key, value.strip(), keys[key])
    return head, options


def _typed(key: str, value: str, kind: type) -> Any:
    if kind is bool:
        return parse_flag(key, value)
    if kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            raise InvalidRequestError(f"{key} must be a number, not {value!r}", "") from None
    return value
