"""Prefix affinity: which copy read a conversation's prefix last, so that a prompt starting with it goes there.

A copy keeps the prefixes its sessions read in its prefix cache (llama.cpp members), so a
conversation's next turn, or another prompt with the same long system prompt, costs least on the
copy that read that prefix. The caller cannot see a copy's cache, nor tokenize; it keys prompts
by their messages instead: a hash of the messages up to the end of each message, and up to every
:data:`BLOCK` characters inside one (a long shared start of one message counts too). A small map
from those keys to the copy that read them last, least recently used keys dropped first, is all
it keeps.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from ...types import Message

BLOCK = 256  # characters between keys inside one message
MAX_KEYS = 4096


def prefix_keys(messages: Sequence[Message]) -> list[bytes]:
    """The keys of every prefix of `messages` a later prompt may share, shortest first."""
    h = hashlib.blake2b(digest_size=16)
    keys = []
    for message in messages:
        h.update(message.role.encode() + b"\x1f")
        text = message.content
        for at in range(0, len(text), BLOCK):
            h.update(text[at : at + BLOCK].encode("utf-8", "surrogatepass"))
            keys.append(h.copy().digest())
        h.update(b"\x1e")
        keys.append(h.copy().digest())
    return keys


class Affinity:
    """Prefix keys -> the index of the copy that read that prefix last."""

    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        self.max_keys = max_keys
        self._copy: OrderedDict[bytes, int] = OrderedDict()

    def find(self, keys: Sequence[bytes]) -> int | None:
        """The copy of the longest prefix known among `keys` (shortest first); None when none is."""
        for key in reversed(keys):
            if key in self._copy:
                self._copy.move_to_end(key)
                return self._copy[key]
        return None

    def remember(self, keys: Sequence[bytes], copy: int) -> None:
        for key in keys:
            self._copy[key] = copy
            self._copy.move_to_end(key)
        while len(self._copy) > self.max_keys:
            self._copy.popitem(last=False)

    def __len__(self) -> int:
        return len(self._copy)
