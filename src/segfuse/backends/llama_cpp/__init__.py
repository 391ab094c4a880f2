"""The llama.cpp backend: GGUF models through llama-cpp-python's low-level API (``member.py``)."""

from .member import LlamaCppMember

__all__ = ["LlamaCppMember"]
