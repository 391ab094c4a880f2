"""Optional parts of segfuse and the one line that installs each.

The core (`pip install segfuse`) runs the engine on GGUF members: generate,
chat, demo, models. Other commands need an extra; asking for one that is not
installed is a user error with the fix, not an ImportError.
"""

from __future__ import annotations

import importlib

from .errors import SegfuseError

# extra -> modules it provides (checked by importing them: a broken install counts as missing)
EXTRAS: dict[str, tuple[str, ...]] = {
    "server": ("fastapi", "uvicorn"),
    "eval": ("matplotlib", "tqdm", "lm_eval", "nltk"),
    "hf": ("torch", "transformers", "gguf"),
    "remote": ("httpx",),
    "ray": ("ray",),
    "bench": ("matplotlib",),
}


class MissingExtraError(SegfuseError):
    """A command needs an optional extra that is not installed."""


def require(extra: str, what: str) -> None:
    """Raise MissingExtraError naming the `pip install` line when `extra` is not installed."""
    missing = []
    for module in EXTRAS[extra]:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise MissingExtraError(
            f"{what} needs the [{extra}] extra (missing: {', '.join(missing)})",
            f"pip install 'segfuse[{extra}]'",
        )
