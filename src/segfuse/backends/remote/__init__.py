"""The remote backend: a model behind an OpenAI-compatible completions server (``member.py``)."""

from .member import RemoteMember

__all__ = ["RemoteMember"]
