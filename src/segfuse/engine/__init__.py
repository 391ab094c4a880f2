"""The engine: one fused generation as a coroutine of member calls, and what drives it.

``loop.py`` is the generation (rounds until the answer stops); each round runs the steps of
``phases.py``; ``lineup.py`` and ``seats.py`` keep the members' places, ``transcript.py`` the answer so
far, ``records.py`` what rounds decided. Member calls are data (``calls.py``), run one generation at
a time (``loop.drive``) or many together (``scheduler.py``); ``live.py`` hands the leader's text out
as it decodes it. ``scoring.py`` and ``selection.py`` are the pure rules a round applies.
The engine imports nothing above it: not the ensemble, the server, the CLI, eval or bench; they import
it from here (``__all__``), never its modules (a contract in pyproject.toml says so).
"""

from .drafting import expected_tokens
from .loop import SEED_SPACE, Steps, Stop, drive, fuse, fusion_steps, member_seed
from .phases import Draft, cut_segment
from .scheduler import Flight, FlightCancelled, Scheduler, run_all
from .scoring import aggregate, normalise, pick_winner, raw_score
from .selection import loops

__all__ = [
    "SEED_SPACE",
    "Draft",
    "Flight",
    "FlightCancelled",
    "Scheduler",
    "Steps",
    "Stop",
    "aggregate",
    "cut_segment",
    "drive",
    "expected_tokens",
    "fuse",
    "fusion_steps",
    "loops",
    "member_seed",
    "normalise",
    "pick_winner",
    "raw_score",
    "run_all",
]
