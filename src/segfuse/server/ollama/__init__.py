"""Ollama's own API (``/api/chat``, ``/api/generate``, ``/api/tags``, ...): its wire types, planning, answers
and model cards."""
