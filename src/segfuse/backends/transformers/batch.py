"""Several transformers sessions' drafts in shared forward passes (``TransformersMember.draft_many``).

Each session keeps its own ``DynamicCache``. To draft together, their caches are laid side by side in one
batched cache, each row left-padded to the longest (an attention mask hides the padding; each row keeps
its own positions), and every token step is one forward pass for all of them. At the end each session gets
back the keys and values of the tokens it fed, appended to its own cache: the batch is copied once per
draft, not per token. A session that finished early rides along until the others are done (its extra
positions are never copied back).

A deterministic session never shares a pass (its numbers must not depend on its neighbours): it drafts
alone, as does a batch of one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import DynamicCache

from ...types import DraftTokens
from .prefixes import attention_layers, keys_values
from .session import Drafting, TransformersSession
from .weights import Weights


def draft_many(
    sessions: Sequence[TransformersSession], requests: Sequence[tuple[Any, ...]], weights: Weights
) -> list[DraftTokens | Exception]:
    """``draft`` for each session (a request is draft's positional arguments: (n, sampling) or (n, sampling,
    on_text)); one result or exception per session, in order."""
    out: list[DraftTokens | Exception | None] = [None] * len(sessions)
    together: list[int] = []
    for i, session in enumerate(sessions):
        try:
            session.prepare_draft()
        except Exception as exc:  # that session's failure only
            out[i] = exc
            continue
        together.append(i)
    shared = [i for i in together if not sessions[i].deterministic]
    alone = [i for i in together if sessions[i].deterministic] + (shared if len(shared) == 1 else [])
    shared = [i for i in shared if i not in alone]
    for i in alone:
        out[i] = _outcome(sessions[i].draft, *requests[i])
    if shared:
        try:
            drafts: Sequence[DraftTokens | Exception] = draft_batch(
                [sessions[i] for i in shared], [requests[i] for i in shared], weights
            )
        except Exception as exc:  # the forward pass failed for all of them
            drafts = [exc] * len(shared)
        for i, draft in zip(shared, drafts):
            out[i] = draft
    return [o if o is not None else RuntimeError("no draft") for o in out]


def draft_batch(
    sessions: Sequence[TransformersSession], requests: Sequence[tuple[Any, ...]], weights: Weights
) -> list[DraftTokens]:
    """Drafts for prepared sessions, one forward pass per token step for all of those still drafting."""
    drafting = [Drafting(s, n, sampling, *hook) for s, (n, sampling, *hook) in zip(sessions, requests)]
    feeding = [d for d in drafting if d.step()]
    if feeding:
        batch = Batch([d.session.cache for d in feeding])
        fed = [0] * len(feeding)
        going = [True] * len(feeding)
        while any(going):
            ids = [d.ids[-1] for d in feeding]  # a finished row feeds its last token again: never copied back
            rows = weights.decode_rows(batch.cache, ids, [d.pos for d in feeding], batch.step())
            for j, d in enumerate(feeding):
                if going[j]:
                    d.fed(rows[j])
                    fed[j] += 1
                    going[j] = d.step()
        batch.hand_back([d.session.cache for d in feeding], fed)
    return [d.finish() for d in drafting]


class Batch:
    """Sessions' caches side by side, left-padded to one length, and the mask of what each row sees."""

    def __init__(self, caches: Sequence[DynamicCache]) -> None:
        lengths = [c.get_seq_length() for c in caches]
        self.width = max(lengths)
        per_cache = [[keys_values(layer) for layer in attention_layers(c)] for c in caches]
        self.cache = DynamicCache()
        for layer, kv in enumerate(zip(*per_cache)):
            keys = _left_padded([k for k, _ in kv], self.width)
            values = _left_padded([v for _, v in kv], self.width)
            self.cache.update(keys, values, layer)
        device = per_cache[0][0][0].device
        self.seen = torch.zeros((len(caches), self.width), dtype=torch.long, device=device)
        for row, n in enumerate(lengths):
            self.seen[row, self.width - n :] = 1

    def step(self) -> torch.Tensor:
        """The attention mask of the next step: what each row saw so far, and its new token."""
        self.seen = torch.cat([self.seen, self.seen.new_ones((self.seen.shape[0], 1))], dim=1)
        return self.seen

    def hand_back(self, caches: Sequence[DynamicCache], fed: Sequence[int]) -> None:
        """Append to each session's cache the keys and values of the `fed` tokens its row decoded."""
        for row, (cache, n) in enumerate(zip(caches, fed)):
            if n == 0:
                continue
            span = slice(self.width, self.width + n)
            for own, batched in zip(attention_layers(cache), attention_layers(self.cache)):
                (keys, values), (all_keys, all_values) = keys_values(own), keys_values(batched)
                own.keys = torch.cat([keys, all_keys[row : row + 1, :, span, :]], dim=-2)
                own.values = torch.cat([values, all_values[row : row + 1, :, span, :]], dim=-2)


def _left_padded(tensors: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """One (1, heads, length, dim) tensor per session -> (sessions, heads, width, dim), each right-aligned."""
    first = tensors[0]
    out = first.new_zeros((len(tensors), first.shape[1], width, first.shape[3]))
    for row, t in enumerate(tensors):
        out[row, :, width - t.shape[2] :, :] = t[0]
    return out


def _outcome(fn: Callable[..., DraftTokens], *args: Any) -> DraftTokens | Exception:
    try:
        return fn(*args)
    except Exception as exc:  # one session's failure is that session's result
        return exc
