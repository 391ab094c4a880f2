"""Every command of the CLI, registered on import (one module per group of commands)."""

from . import answer, bench, calibrate, evaluate, models, score, serve  # noqa: F401  # imported to register their commands
