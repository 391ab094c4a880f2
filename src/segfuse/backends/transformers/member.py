"""Hugging Face transformers members: a local checkpoint directory or a GGUF file.

Spec: ``transformers:PATH`` (a model directory, a ``.gguf`` file, or an
embedded model name), options as keyword arguments of ``load``: ``device``
(``cpu``, ``cuda``, ``cuda:1``, ``auto`` = spread over GPUs with accelerate),
``dtype`` (``auto``, ``bf16``, ``fp16``, ``fp32``), ``trust_remote_code``
(off unless asked). Nothing is downloaded: ``local_files_only`` always.

A GGUF file is dequantized by transformers (through the ``gguf`` package) on
first use and saved as a regular checkpoint under the cache directory, so
later loads skip the conversion (``load.py``).

Per session (docs/design.md#prefix-caching), mirroring the llama.cpp backend:
- one ``DynamicCache`` holds the context; drafted tokens are appended to it
  and stay pending until ``accept``, which crops back what was not kept;
- ``score`` decodes all candidates in one forward pass on the cached prefix:
  candidates are concatenated after it with restarted position ids and a
  4-D additive mask (prefix visible, the pending draft hidden, each
  candidate causal within its own block; sliding-window layers get the same
  mask limited to their window). The candidates' keys/values are then cut
  out of the cache and kept, so the winning candidate is appended without
  recomputation;
- ``score("")`` is the probability of any end-of-generation token.

``echo`` (a whole text's tokens with their log-probabilities, ``Member.echo``) runs the text from
its start on a cache of its own, in chunks of bounded logits (``echo.py``).

Between requests (``prefix_cache_cells``, default one context window; 0 off), a
closed session's keys and values (prompt plus accepted answer) are copied into
a small prefix cache (``prefixes.py``); a new session starts from the longest
cached prefix of its prompt and runs only the rest, as llama.cpp members do.

The member puts together one part per module and implements the protocol with
them: ``load.py`` loads the tokenizer and weights, ``weights.py`` runs them
(:class:`Weights`: the forward pass and the candidates' mask), ``tokens.py``
tokenizes (:class:`Vocabulary`), ``prefixes.py`` keeps prefixes between requests
(:class:`StoredPrefixes`); ``session.py`` is one request's context and ``echo.py``
reads a whole text. Sessions and echo are given the parts they use, never the member.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...errors import MemberLoadError, ModelFileError
from ...models import PromptFormat
from ...types import DraftTokens, PromptToken
from ..base import Capabilities, Occupancy
from ..cached import LocalMember
from ..compute import on_compute
from ..spec import split_target
from . import batch
from .echo import echo_tokens
from .load import compute_thread, cudnn_attention_off, load_checkpoint, match_threads, pick_device, pick_dtype
from .prefixes import StoredPrefixes
from .session import TransformersSession
from .tokens import Vocabulary
from .weights import Weights

if TYPE_CHECKING:
    from ...member_options import MemberOptions


class TransformersMember(LocalMember):
    """A causal LM loaded once; each session owns its own KV cache. Its calls run on its device's compute
    thread (``backends/compute.py``), one at a time: concurrent forwards on one device only contend (not
    parallel_safe); several sessions' drafts share one forward pass per token (``draft_many``)."""

    capabilities = Capabilities(constrained=True, echo=True, batched=True, speculates=True)
    vocab: Vocabulary

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        name: str | None = None,
        prompt: PromptFormat | None = None,
        device: str | None = None,
        dtype: str = "auto",
        trust_remote_code: bool = False,
        n_ctx: int | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        attn_implementation: str = "sdpa",
        prefix_cache_cells: int | None = None,
    ) -> None:
        """`prefix_cache_cells`: tokens whose keys and values are kept between requests (None: one
        context window; 0: off)."""
        source = Path(path).expanduser()
        if not source.exists():
            raise ModelFileError(f"model not found: {source}", "give a model directory or a .gguf file")
        device = pick_device(device)
        self.placement = str(device).upper() if str(device) == "cpu" else str(device)
        torch_dtype = pick_dtype(dtype, device)
        if attn_implementation not in ("sdpa", "eager"):
            # Candidates are verified with a custom 4-D mask, which flash-attention kernels do not take.
            raise MemberLoadError(f"attention {attn_implementation!r} is not supported", "use sdpa or eager")
        self.name = name or (source.stem if source.is_file() else source.name)
        tokenizer, model = load_checkpoint(
            source,
            device=device,
            dtype=torch_dtype,
            trust_remote_code=trust_remote_code,
            cache_dir=cache_dir,
            attn_implementation=attn_implementation,
        )
        if str(device) != "cpu":
            cudnn_attention_off()
        self.thread = compute_thread(device)
        self.compute = self.thread.run
        self.compute(match_threads, torch.get_num_threads())
        self.weights = Weights(model, name=self.name, dtype=torch_dtype, n_ctx=n_ctx, compute=self.compute)
        self.n_params, self.n_ctx, self.nbytes = self.weights.n_params, self.weights.n_ctx, self.weights.nbytes
        if prefix_cache_cells is not None and prefix_cache_cells < 0:
            raise ValueError("prefix_cache_cells must be 0 (off) or more")
        self.prefixes = StoredPrefixes(self.n_ctx if prefix_cache_cells is None else prefix_cache_cells)
        self.prefix_cache = self.prefixes.cache
        generation = getattr(model, "generation_config", None)
        self.vocab = Vocabulary(
            tokenizer,
            name=self.name,
            prompt=prompt,
            vocab_size=self.weights.vocab_size,
            generation_eos=getattr(generation, "eos_token_id", None),
        )
        self.prompt = self.vocab.prompt

    @on_compute
    def echo(self, prompt: str | Sequence[int], top_k: int = 0) -> list[PromptToken]:
        ids = self.vocab.tokenize_plain(prompt) if isinstance(prompt, str) else prompt
        return echo_tokens(ids, top_k, vocab=self.vocab, weights=self.weights)

    @on_compute
    def open_session(
        self, prompt: list[int], seed: int | None, cache_salt: str | None = None, deterministic: bool = False
    ) -> TransformersSession:
        """A session that starts from the longest prefix of `prompt` cached under `cache_salt` (at least
        its last token is left to run: its logits row starts the answer); a `deterministic` one reads the
        whole prompt itself (its sessions never share a forward pass, so that is all it takes)."""
        session = TransformersSession(prompt, seed, vocab=self.vocab, weights=self.weights, prefixes=self.prefixes)
        session.cache_salt = cache_salt
        session.deterministic = deterministic
        if not deterministic:
            session.n_cached = session.stats.reused = self.prefixes.restore(session.cache, prompt, cache_salt)
        return session

    @on_compute
    def draft_many(  # type: ignore[override]  # it batches only its own sessions
        self, sessions: Sequence[TransformersSession], requests: Sequence[tuple[Any, ...]]
    ) -> list[DraftTokens | Exception]:
        """``draft`` for several sessions, one forward pass per token step for all of them (``batch.py``)."""
        return batch.draft_many(sessions, requests, self.weights)

    def occupancy(self) -> Occupancy:
        return Occupancy(slots=self.slots, prefix=self.prefix_cache.stats())

    def close(self) -> None:
        self.prefix_cache.clear()
        self.weights.close()


TARGET_KEYS = {"device": str, "dtype": str, "attn_implementation": str, "n_ctx": int, "trust_remote_code": bool}


def parse_target(target: str) -> tuple[str, dict[str, Any]]:
    """``PATH#NAME,device=cuda:0,dtype=bf16,...`` -> (PATH, options)."""
    return split_target(target, TARGET_KEYS, "transformers")


def load(target: str, shared: MemberOptions | None = None) -> TransformersMember:
    """Registry entry: an embedded model name (its GGUF), a GGUF path or a model directory,
    optionally followed by ``#NAME,KEY=VALUE,...`` (see parse_target).

    Of the ensemble's `shared` options it takes cache_dir, n_ctx (the spec's goes first),
    prefix_cache_cells and threads (torch's CPU threads, process-wide); every session keeps its
    own cache, so slots do not apply, nor do llama.cpp's GPU options (see `device`).
    """
    from ...member_options import MemberOptions
    from ...models import CATALOGUE, resolve
    from ...sources import is_sourced

    shared = shared or MemberOptions()
    target, options = parse_target(target)
    cache_dir = shared.cache_dir
    options.setdefault("n_ctx", shared.n_ctx)
    options["prefix_cache_cells"] = shared.prefix_cache_cells
    if shared.threads:
        torch.set_num_threads(shared.threads)
    if target in CATALOGUE or is_sourced(target):  # hf:ORG/REPO may be a checkpoint folder
        name, path, prompt = resolve(target, cache_dir, checkpoint=True)
        options.setdefault("name", name)
        options.setdefault("prompt", prompt)
        target = str(path)
    return TransformersMember(target, cache_dir=cache_dir, **options)
