"""segfuse: fuse several LLMs at inference time, one verified segment at a time.

The package implements the SpecFuse / SpecEM method (arXiv 2412.07380) under a name of its own:
``specfuse`` on the package index is an unrelated project.
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from .ensemble import Ensemble
from .errors import SegfuseError
from .options import FusionOptions
from .request import FusionRequest
from .types import DoneEvent, Message, Result, RoundEvent, SegmentEvent

try:  # the version lives in pyproject.toml alone; the installed metadata carries it here
    __version__ = _version("segfuse")
except PackageNotFoundError:  # a source tree on sys.path without an install
    __version__ = "0+unknown"

__all__ = [
    "DoneEvent",
    "Ensemble",
    "FusionOptions",
    "FusionRequest",
    "Message",
    "Result",
    "RoundEvent",
    "SegfuseError",
    "SegmentEvent",
    "__version__",
]
