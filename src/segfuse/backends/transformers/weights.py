"""A transformers member's weights: one forward pass over a session's ``DynamicCache``, and the 4-D mask that
verifies several candidates in one pass (the layout is in ``member.py``'s docstring).

Nothing here knows about sessions or tokens; the member, its sessions and its echo run the weights
through it. Each session owns its cache and shares only the weights, so no lock is needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache

from ...errors import MemberLoadError
from ..compute import Compute, compute_here


class Weights:
    """A causal LM loaded on its device (`dtype`), with the attention layout its masks need.

    `n_ctx`: the context window asked for (None: the model's own, else 4096), at most the model's."""

    def __init__(
        self, model: Any, *, name: str, dtype: torch.dtype, n_ctx: int | None, compute: Compute = compute_here
    ) -> None:
        self.model = model
        self.compute = compute  # where its forward passes run: its device's compute thread (``compute.py``)
        self.name = name
        self.dtype = dtype
        self.n_params = int(model.num_parameters())  # the gate's default leader is the largest member
        self.nbytes = int(model.get_memory_footprint())
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])  # rows of its logits
        self.input_device = model.get_input_embeddings().weight.device
        self._read_attention(n_ctx)

    def _read_attention(self, n_ctx: int | None) -> None:
        """Layer kinds, sliding window and context length, as the batched verification masks need them."""
        config = self.model.config.get_text_config()
        self.layer_types: list[str] | None = getattr(config, "layer_types", None)
        unsupported = set(self.layer_types or ()) - {"full_attention", "sliding_attention"}
        if unsupported:
            raise MemberLoadError(
                f"{self.name}: layers of type {sorted(unsupported)} are not supported",
                "batched verification needs full or sliding-window attention layers",
            )
        self.sliding_window: int | None = getattr(config, "sliding_window", None)
        if getattr(config, "use_sliding_window", True) is False:
            self.sliding_window = None  # declared but switched off (Qwen2)
        limit = getattr(config, "max_position_embeddings", None) or 4096
        self.n_ctx = min(n_ctx, limit) if n_ctx else limit

    @torch.inference_mode()
    def forward(
        self,
        cache: DynamicCache,
        ids: Sequence[int],
        positions: Sequence[int],
        mask: Any = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Run `ids` on the cache; return float32 logits rows (all, or the last one)."""
        dev = self.input_device
        out = self.model(
            input_ids=torch.tensor([list(ids)], device=dev),
            position_ids=torch.tensor([list(positions)], device=dev),
            attention_mask=mask,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
        )
        logits: torch.Tensor = out.logits[0].float()
        return logits

    @torch.inference_mode()
    def decode_rows(
        self, cache: DynamicCache, ids: Sequence[int], positions: Sequence[int], attention: torch.Tensor
    ) -> torch.Tensor:
        """One token for each row of a batched `cache` (row i's token `ids[i]` at `positions[i]`); the float32
        logits row after each. `attention`: which of the cache's columns, and the new one, each row sees
        (rows are left-padded to one length: ``batch.py``)."""
        dev = self.input_device
        out = self.model(
            input_ids=torch.tensor([[t] for t in ids], device=dev),
            position_ids=torch.tensor([[p] for p in positions], device=dev),
            attention_mask=attention,
            past_key_values=cache,
            use_cache=True,
        )
        logits: torch.Tensor = out.logits[:, -1].float()
        return logits

    def block_mask(self, n_prefix: int, n_hidden: int, lengths: Sequence[int]) -> Any:
        """Additive 4-D mask for candidates after a prefix (and a hidden pending draft).

        Query rows are the candidates' tokens; key columns are the cache
        (prefix, hidden draft) followed by the candidates' tokens.
        """
        dev, total = self.input_device, sum(lengths)
        n_keys = n_prefix + n_hidden + total
        block = torch.repeat_interleave(torch.arange(len(lengths), device=dev), torch.tensor(lengths, device=dev))
        local = torch.cat([torch.arange(n, device=dev) for n in lengths])
        q_pos = n_prefix + local  # restarted positions: every candidate starts right after the prefix
        k_pos = torch.cat([torch.arange(n_prefix + n_hidden, device=dev), q_pos])
        # Key owners: -1 prefix (visible to all), -2 pending draft (hidden), else the candidate's index.
        k_block = torch.cat([torch.full((n_prefix,), -1, device=dev), torch.full((n_hidden,), -2, device=dev), block])
        same_block = k_block[None, :] == block[:, None]
        visible = (k_block[None, :] == -1) | (same_block & (k_pos[None, :] <= q_pos[:, None]))

        def additive(allowed: torch.Tensor) -> torch.Tensor:
            neg = torch.finfo(self.dtype).min
            out = torch.zeros((1, 1, total, n_keys), dtype=self.dtype, device=dev)
            return out.masked_fill(~allowed[None, None], neg)

        windowed = visible
        if self.sliding_window:
            windowed = visible & (k_pos[None, :] > q_pos[:, None] - self.sliding_window)
        if not self.layer_types:  # one kind of layer: windowed when the model says so (Mistral)
            return additive(windowed)
        masks = {"full_attention": additive(visible)}
        if "sliding_attention" in self.layer_types:
            masks["sliding_attention"] = additive(windowed)
        return masks

    def close(self) -> None:
        """Let the weights go (and the GPU memory they held)."""
        self.model = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
