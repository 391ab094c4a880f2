"""A member loaded for a test's span and closed at its end, for the module fixtures that load one."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from segfuse.backends.base import Member
from segfuse.backends.registry import load_member


@contextmanager
def loaded(spec: str, **options: Any) -> Iterator[Member]:
    """`load_member(spec, **options)`, closed on the way out (a failed test's too)."""
    member = load_member(spec, **options)
    try:
        yield member
    finally:
        member.close()
