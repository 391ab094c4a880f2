"""The engine: one fused generation as a coroutine of member calls, and what drives it.

``loop.py`` is the generation (rounds until the answer stops); each round runs the steps of
``phases.py``; ``lineup.py`` and ``seats.py`` keep the members' places, ``transcript.py`` the answer so
far, ``records.py`` what rounds decided. Member calls are data (``calls.py``), run one generation at
a time (``loop.drive``) or many together (``scheduler.py``); ``live.py`` hands the leader's text out
as it decodes it. ``scoring.py`` and ``selection.py`` are the pure rules a round applies.
The engine imports nothing above it: not the ensemble, the server, the CLI, eval or bench.
"""

from .loop import SEED_SPACE, Steps, Stop, drive, fuse, fusion_steps, member_seed

__all__ = ["SEED_SPACE", "Steps", "Stop", "drive", "fuse", "fusion_steps", "member_seed"]
