"""SpecFuse: fuse several LLMs at inference time, one verified segment at a time."""

from .ensemble import Ensemble
from .errors import SpecFuseError
from .options import FusionOptions
from .types import DoneEvent, Message, Result, RoundEvent, SegmentEvent

__all__ = [
    "DoneEvent",
    "Ensemble",
    "FusionOptions",
    "Message",
    "Result",
    "RoundEvent",
    "SegmentEvent",
    "SpecFuseError",
]
__version__ = "0.1.0"
