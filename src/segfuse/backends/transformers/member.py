"""Hugging Face transformers members: a local checkpoint directory or a GGUF file.

Spec: ``transformers:PATH`` (a model directory, a ``.gguf`` file, or an
embedded model name), options as keyword arguments of ``load``: ``device``
(``cpu``, ``cuda``, ``cuda:1``, ``auto`` = spread over GPUs with accelerate),
``dtype`` (``auto``, ``bf16``, ``fp16``, ``fp32``), ``trust_remote_code``
(off unless asked). Nothing is downloaded: ``local_files_only`` always.

A GGUF file is dequantized by transformers (through the ``gguf`` package) on
first use and saved as a regular checkpoint under the cache directory, so
later loads skip the conversion.

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
a small prefix cache (``prefix_cache.py``, at most ``PREFIX_ENTRIES`` entries);
a new session starts from the longest cached prefix of its prompt and runs only
the rest, as llama.cpp members do.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from ...errors import MemberLoadError, ModelFileError
from ...models import PromptFormat, is_gguf
from ...models import cache_dir as default_cache_dir
from ...prompting import chat_prompt, choose_format, raw_prompt, render_plain
from ...types import Message, PromptToken
from ..base import Capabilities, Occupancy
from ..cached import LocalMember
from ..prefix_cache import PrefixCache
from ..spec import split_target
from ..special_text import Special, SpecialTexts, protected_pieces
from .echo import echo_tokens, text_frame
from .tokens import piece_function

if TYPE_CHECKING:
    from ...member_options import MemberOptions
from .session import TransformersSession

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}
_CONVERT_LOCK = threading.Lock()
PREFIX_ENTRIES = 8  # cached prefixes at most (each a copy of its keys and values, within the bound)


def pick_device(device: str | None) -> str:
    if device:
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def pick_dtype(dtype: str, device: str) -> torch.dtype:
    """`auto`: fp32 on CPU (bf16 matmuls are slow there), bf16 on GPUs that have it, else fp16."""
    if dtype != "auto":
        try:
            return DTYPES[dtype.lower()]
        except KeyError:
            raise MemberLoadError(f"unknown dtype {dtype!r}", f"choose auto, {', '.join(DTYPES)}") from None
    if device.startswith("cpu") or not torch.cuda.is_available():
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


# --- loading ---------------------------------------------------------------------------------


def converted_dir(gguf: Path, dtype: torch.dtype, cache: str | os.PathLike[str] | None) -> Path:
    """Where a GGUF file's dequantized checkpoint is kept (keyed by file identity and dtype)."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{dtype}".encode()).hexdigest()[:16]
    return default_cache_dir(cache) / "transformers" / f"{gguf.stem}-{key}"


def convert_gguf(gguf: Path, dtype: torch.dtype, cache: str | os.PathLike[str] | None,
                 target: Path | None = None) -> Path | None:
    """Dequantize a GGUF file once into a checkpoint directory (`target`, else one in the cache);
    return the directory.

    None when transformers keeps this file's weights in GGUF blocks instead of
    dequantizing them: then there is nothing to cache and the file is loaded as is.

    Written to a temporary directory and renamed into place, so a crash never
    leaves a half-written checkpoint behind.
    """
    target = target or converted_dir(gguf, dtype, cache)
    with _CONVERT_LOCK:
        if (target / "config.json").is_file():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            kwargs: dict[str, Any] = {"gguf_file": gguf.name, "local_files_only": True}
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs)
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=dtype, **kwargs)
            quantizer = getattr(model, "hf_quantizer", None)
            if quantizer is not None and getattr(quantizer, "packed_modules", None):
                return None  # weights stay in GGUF blocks (transformers' GGUF kernels): nothing to cache
            # The weights were dequantized into plain tensors: it is an ordinary checkpoint now.
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            os.replace(tmp, target)
        except Exception as exc:
            raise MemberLoadError(f"transformers could not convert {gguf}: {exc}",
                                  "this GGUF architecture or quantization may be unsupported by transformers; "
                                  "use the llama.cpp backend for it") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


# --- member ------------------------------------------------------------------------------------


class TransformersMember(LocalMember):
    """A causal LM loaded once; each session owns its own KV cache (on one device, concurrent
    forwards only contend: not parallel_safe)."""

    capabilities = Capabilities(constrained=True, echo=True)

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
        self.device = pick_device(device)
        self.placement = str(self.device).upper() if str(self.device) == "cpu" else str(self.device)
        self.dtype = pick_dtype(dtype, self.device)
        if attn_implementation not in ("sdpa", "eager"):
            # Candidates are verified with a custom 4-D mask, which flash-attention kernels do not take.
            raise MemberLoadError(f"attention {attn_implementation!r} is not supported", "use sdpa or eager")
        self.name = name or (source.stem if source.is_file() else source.name)
        self._load(source, trust_remote_code, cache_dir, attn_implementation)
        self.n_params = int(self.model.num_parameters())
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])  # rows of its logits  # the gate's default leader is the largest member
        self.input_device = self.model.get_input_embeddings().weight.device
        self._read_attention(n_ctx)
        if prefix_cache_cells is not None and prefix_cache_cells < 0:
            raise ValueError("prefix_cache_cells must be 0 (off) or more")
        self._stored: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # per entry: each layer's K, V
        self.prefix_cache: PrefixCache[int] = PrefixCache(
            self.n_ctx if prefix_cache_cells is None else prefix_cache_cells, range(PREFIX_ENTRIES),
            lambda handle: self._stored.pop(handle, None))
        self.chat_template: str | None = getattr(self.tokenizer, "chat_template", None)
        self.prompt = choose_format(prompt, self.chat_template, self.name)
        self._piece = piece_function(self.tokenizer)
        self.n_vocab = len(self.tokenizer)  # ids with a text (logits rows past it are padding)
        self.text_prefix, self._text_suffix = text_frame(self.tokenizer)  # e.g. its BOS; EOS
        self._read_end_tokens()
        added = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        self.specials = SpecialTexts(Special(str(t.content), int(i), bool(getattr(t, "lstrip", False)),
                                             bool(getattr(t, "rstrip", False)))
                                     for i, t in added.items() if getattr(t, "special", False))

    def _load(self, source: Path, trust_remote_code: bool, cache_dir: str | os.PathLike[str] | None,
              attn_implementation: str) -> None:
        """Tokenizer and weights from a checkpoint directory, or a GGUF file (dequantized once, cached)."""
        kwargs: dict[str, Any] = {"local_files_only": True, "trust_remote_code": trust_remote_code}
        directory = source
        if is_gguf(source):
            converted = convert_gguf(source, self.dtype, cache_dir)
            directory = converted or source.parent
            if converted is None:
                kwargs["gguf_file"] = source.name
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(directory), **kwargs)
            placement = {"device_map": "auto"} if self.device == "auto" else {}
            self.model = AutoModelForCausalLM.from_pretrained(
                str(directory), dtype=self.dtype, attn_implementation=attn_implementation, **placement, **kwargs
            )
        except (OSError, ValueError) as exc:
            raise MemberLoadError(f"transformers could not load {directory}: {exc}",
                                  "is it a complete causal-LM checkpoint? (trust_remote_code is off)") from None
        if self.device != "auto":
            self.model.to(self.device)
        self.model.eval()

    def _read_attention(self, n_ctx: int | None) -> None:
        """Layer kinds, sliding window and context length, as the batched verification masks need them."""
        config = self.model.config.get_text_config()
        self.layer_types: list[str] | None = getattr(config, "layer_types", None)
        unsupported = set(self.layer_types or ()) - {"full_attention", "sliding_attention"}
        if unsupported:
            raise MemberLoadError(f"{self.name}: layers of type {sorted(unsupported)} are not supported",
                                  "batched verification needs full or sliding-window attention layers")
        self.sliding_window: int | None = getattr(config, "sliding_window", None)
        if getattr(config, "use_sliding_window", True) is False:
            self.sliding_window = None  # declared but switched off (Qwen2)
        limit = getattr(config, "max_position_embeddings", None) or 4096
        self.n_ctx = min(n_ctx, limit) if n_ctx else limit

    def _read_end_tokens(self) -> None:
        """Every end-of-generation id the model declares (generation config and tokenizer)."""
        eog: set[int] = set()
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        for ids in (gen_eos, self.tokenizer.eos_token_id):
            eog.update([ids] if isinstance(ids, int) else list(ids or []))
        if not eog:
            raise MemberLoadError(f"{self.name} declares no end-of-generation token", "fix its tokenizer config")
        self.eog_ids = sorted(eog)
        self._eog_set = frozenset(eog)
        self._eog = torch.tensor(self.eog_ids, device=self.input_device)

    # --- tokens ------------------------------------------------------------------------------
    def is_eog(self, token: int) -> bool:
        return token in self._eog_set

    def tokenize_plain(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def piece(self, token: int) -> bytes:
        return self._piece(token)

    def prompt_tokens(self, messages: Sequence[Message]) -> list[int]:
        tok = self.tokenizer
        if (raw := raw_prompt(messages)) is not None:  # a text completion: no template, specials parsed (as llama.cpp)
            return list(tok(raw, add_special_tokens=not (tok.bos_token and raw.startswith(tok.bos_token)))["input_ids"])
        if self.prompt.style == "plain":  # contents only: special token texts in them stay text
            return list(tok(render_plain(messages), add_special_tokens=True, split_special_tokens=True)["input_ids"])
        text = self._render(messages)
        has_bos = bool(tok.bos_token) and text.startswith(tok.bos_token)
        if not self.specials.spelled_in(m.content for m in messages):
            return list(tok(text, add_special_tokens=not has_bos)["input_ids"])
        return self.protected_tokens(messages, text, add_special=not has_bos)

    def _render(self, messages: Sequence[Message]) -> str:
        """`messages` through the tokenizer's chat template, ready for the answer (a prefill left open)."""
        return chat_prompt(lambda ms, gen: self.tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in ms], tokenize=False, add_generation_prompt=gen),
            messages, self.name)

    def protected_tokens(self, messages: Sequence[Message], text: str, *, add_special: bool) -> list[int]:
        """`text` (the templated `messages`) tokenized with the template's special tokens, and the
        messages' contents as plain text (``split_special_tokens``; see ``special_text.py``)."""
        tok = self.tokenizer
        ids: list[int] = []
        for piece in protected_pieces(self.name, self._render, messages, text, self.specials):
            ids += [piece] if isinstance(piece, int) else tok(piece, add_special_tokens=False,
                                                              split_special_tokens=True)["input_ids"]
        return self.text_prefix + ids + self._text_suffix if add_special else ids

    # --- echo (echo.py) ---------------------------------------------------------------------
    def lead_tokens(self) -> list[int]:
        return list(self.text_prefix)

    def echo(self, prompt: str | Sequence[int], top_k: int = 0) -> list[PromptToken]:
        return echo_tokens(self, self.tokenize_plain(prompt) if isinstance(prompt, str) else prompt, top_k)

    # --- forward -----------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, cache: DynamicCache, ids: Sequence[int], positions: Sequence[int],
                mask: Any = None, last_only: bool = False) -> torch.Tensor:
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
        return out.logits[0].float()

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
        k_block = torch.cat([torch.full((n_prefix,), -1, device=dev), torch.full((n_hidden,), -2, device=dev),
                             block])
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

    # --- sessions ----------------------------------------------------------------------------
    def open_session(self, prompt: list[int], seed: int | None, cache_salt: str | None = None,
                     deterministic: bool = False) -> "TransformersSession":
        """A session that starts from the longest prefix of `prompt` cached under `cache_salt` (at least
        its last token is left to run: its logits row starts the answer); a `deterministic` one reads the
        whole prompt itself (its sessions never share a forward pass, so that is all it takes)."""
        session = TransformersSession(self, prompt, seed)
        session.cache_salt = cache_salt
        if deterministic:
            return session
        with self.prefix_cache.lock:
            found = self.prefix_cache.lookup(prompt, len(prompt) - 1, cache_salt)
            if found is not None:
                handle, length = found
                for layer, (keys, values) in enumerate(self._stored[handle]):
                    # views, not copies: a cache only ever replaces its tensors (cat, crop), never writes them
                    session.cache.update(keys[..., :length, :], values[..., :length, :], layer)
                session.n_cached = session.stats.reused = length
        return session

    def keep_prefix(self, cache: DynamicCache, tokens: list[int], salt: str | None = None) -> None:
        """Keep the keys and values of `tokens`, the first positions of `cache`, in the prefix cache
        (under `salt`)."""
        def copy(handle: int, n: int) -> None:
            self._stored[handle] = [(layer.keys[..., :n, :].clone(), layer.values[..., :n, :].clone())
                                    for layer in cache.layers]

        self.prefix_cache.store(tokens, copy, salt)

    def occupancy(self) -> Occupancy:
        return Occupancy(slots=self.slots, prefix=self.prefix_cache.stats())

    def close(self) -> None:
        self.prefix_cache.clear()
        self.model = None  # type: ignore[assignment]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


TARGET_KEYS = {"device": str, "dtype": str, "attn_implementation": str, "n_ctx": int, "trust_remote_code": bool}


def parse_target(target: str) -> tuple[str, dict[str, Any]]:
    """``PATH#NAME,device=cuda:0,dtype=bf16,...`` -> (PATH, options)."""
    return split_target(target, TARGET_KEYS, "transformers")


def load(target: str, shared: "MemberOptions | None" = None) -> TransformersMember:
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
