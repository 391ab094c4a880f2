"""The transformers backend: Hugging Face checkpoints, or GGUF files dequantized once (``member.py``)."""

from .member import TransformersMember

__all__ = ["TransformersMember"]
