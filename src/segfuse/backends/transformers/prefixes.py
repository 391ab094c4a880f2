"""The keys and values a transformers member keeps between requests (``prefix_cache_cells``).

A closed session's keys and values (prompt plus accepted answer) are copied into a small prefix cache
(``prefix_cache.py``, at most :data:`PREFIX_ENTRIES` entries within the bound); a new session starts from
the longest cached prefix of its prompt and runs only the rest, as llama.cpp members do.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import CacheLayerMixin

from ..prefix_cache import PrefixCache

PREFIX_ENTRIES = 8  # cached prefixes at most (each a copy of its keys and values, within the bound)


def attention_layers(cache: DynamicCache) -> list[CacheLayerMixin]:
    """The cache's layers, each of which keeps keys and values (a layer of linear attention keeps none)."""
    layers = [layer for layer in cache.layers if isinstance(layer, CacheLayerMixin)]
    if len(layers) != len(cache.layers):
        raise TypeError("a model with layers of linear attention is not supported by the transformers member")
    return layers


def keys_values(layer: CacheLayerMixin) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's keys and values (a layer the model has run)."""
    if layer.keys is None or layer.values is None:
        raise ValueError("a cache layer the model has not run")
    return layer.keys, layer.values


class StoredPrefixes:
    """Prefixes of `cells` tokens at most in all, each entry every layer's keys and values."""

    def __init__(self, cells: int) -> None:
        self._stored: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # per entry: each layer's K, V
        self.cache: PrefixCache[int] = PrefixCache(cells, range(PREFIX_ENTRIES), self._drop)

    def _drop(self, handle: int) -> None:
        self._stored.pop(handle, None)

    def restore(self, cache: DynamicCache, prompt: list[int], salt: str | None = None) -> int:
        """Put the longest prefix of `prompt` cached under `salt` into the empty `cache`; how many tokens
        it covers. At least the prompt's last token is left to run: its logits row starts the answer."""
        with self.cache.lock:
            found = self.cache.lookup(prompt, len(prompt) - 1, salt)
            if found is None:
                return 0
            handle, length = found
            for layer, (keys, values) in enumerate(self._stored[handle]):
                # views, not copies: a cache only ever replaces its tensors (cat, crop), never writes them
                cache.update(keys[..., :length, :], values[..., :length, :], layer)
            return length

    def keep(self, cache: DynamicCache, tokens: list[int], salt: str | None = None) -> None:
        """Keep the keys and values of `tokens`, the first positions of `cache`, in the prefix cache
        (under `salt`)."""

        def copy(handle: int, n: int) -> None:
            self._stored[handle] = [
                (keys[..., :n, :].clone(), values[..., :n, :].clone())
                for keys, values in map(keys_values, attention_layers(cache))
            ]

        self.cache.store(tokens, copy, salt)
