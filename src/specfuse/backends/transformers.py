"""Hugging Face transformers members: a local checkpoint directory or a GGUF file.

Spec: ``transformers:PATH`` (a model directory, a ``.gguf`` file, or an
embedded model name), options as keyword arguments of ``load``: ``device``
(``cpu``, ``cuda``, ``cuda:1``, ``auto`` = spread over GPUs with accelerate),
``dtype`` (``auto``, ``bf16``, ``fp16``, ``fp32``), ``trust_remote_code``
(off unless asked). Nothing is downloaded: ``local_files_only`` always.

A GGUF file is dequantized by transformers (through the ``gguf`` package) on
first use and saved as a regular checkpoint under the cache directory, so
later loads skip the conversion.

Per session (NOTES §2), mirroring the llama.cpp backend:
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
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from ..errors import MemberLoadError, ModelFileError, PromptTooLongError
from ..models import CHAT, QUESTION_ANSWER, PromptFormat
from ..models import cache_dir as default_cache_dir
from ..prompting import render_plain
from ..segments import tokens_spelling
from ..types import DraftTokens, Message, Sampling, TokenScores
from .hf_tokens import piece_function

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}
_CONVERT_LOCK = threading.Lock()


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


def _is_gguf(path: Path) -> bool:
    if not path.is_file():
        return False
    with path.open("rb") as handle:
        return handle.read(4) == b"GGUF"


def converted_dir(gguf: Path, dtype: torch.dtype, cache: str | os.PathLike[str] | None) -> Path:
    """Where a GGUF file's dequantized checkpoint is kept (keyed by file identity and dtype)."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{dtype}".encode()).hexdigest()[:16]
    return default_cache_dir(cache) / "transformers" / f"{gguf.stem}-{key}"


def convert_gguf(gguf: Path, dtype: torch.dtype, cache: str | os.PathLike[str] | None) -> Path | None:
    """Dequantize a GGUF file once into a checkpoint directory; return the directory.

    None when transformers keeps this file's weights in GGUF blocks instead of
    dequantizing them: then there is nothing to cache and the file is loaded as is.

    Written to a temporary directory and renamed into place, so a crash never
    leaves a half-written checkpoint behind.
    """
    target = converted_dir(gguf, dtype, cache)
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


# --- sampling ----------------------------------------------------------------------------------


def sample(row: torch.Tensor, sampling: Sampling, generator: torch.Generator | None,
           banned: torch.Tensor | None = None) -> int:
    """Temperature + nucleus sampling on one logits row (float32); greedy at temperature 0.

    `banned` token ids are never picked (end-of-generation under Sampling.ignore_eos).
    """
    if banned is not None:
        row = row.index_fill(0, banned.to(row.device), float("-inf"))
    if sampling.greedy:
        return int(row.argmax())
    probs = torch.softmax(row / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = (sorted_probs.cumsum(0) - sorted_probs) < sampling.top_p  # always keeps the top token
        picked = torch.multinomial(sorted_probs * keep, 1, generator=generator)
        return int(order[picked])
    return int(torch.multinomial(probs, 1, generator=generator))


# --- member ------------------------------------------------------------------------------------


class TransformersMember:
    """A causal LM loaded once; each session owns its own KV cache."""

    parallel_safe = False  # on one device, concurrent forwards only contend

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
    ) -> None:
        source = Path(path).expanduser()
        if not source.exists():
            raise ModelFileError(f"model not found: {source}", "give a model directory or a .gguf file")
        self.device = pick_device(device)
        self.dtype = pick_dtype(dtype, self.device)
        if attn_implementation not in ("sdpa", "eager"):
            # Candidates are verified with a custom 4-D mask, which flash-attention kernels do not take.
            raise MemberLoadError(f"attention {attn_implementation!r} is not supported", "use sdpa or eager")
        self.name = name or (source.stem if source.is_file() else source.name)
        kwargs: dict[str, Any] = {"local_files_only": True, "trust_remote_code": trust_remote_code}
        directory = source
        if _is_gguf(source):
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
        self.n_params = int(self.model.num_parameters())  # the gate's default leader is the largest member
        self.input_device = self.model.get_input_embeddings().weight.device
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

        tok = self.tokenizer
        self.chat_template: str | None = getattr(tok, "chat_template", None)
        self.prompt = prompt or (CHAT if self.chat_template else QUESTION_ANSWER)
        if self.prompt.style == "chat" and not self.chat_template:
            raise MemberLoadError(f"{self.name} has no chat template", "use the plain Question/Answer format")
        self.piece = piece_function(tok)
        eog: set[int] = set()
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        for ids in (gen_eos, tok.eos_token_id):
            eog.update([ids] if isinstance(ids, int) else list(ids or []))
        if not eog:
            raise MemberLoadError(f"{self.name} declares no end-of-generation token", "fix its tokenizer config")
        self.eog_ids = sorted(eog)
        self._eog_set = frozenset(eog)
        self._eog = torch.tensor(self.eog_ids, device=self.input_device)

    # --- tokens ------------------------------------------------------------------------------
    def is_eog(self, token: int) -> bool:
        return token in self._eog_set

    def tokenize(self, text: str) -> list[int]:
        """Plain text -> ids, special-token markup taken literally (as llama.cpp's parse_special=False)."""
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def encode_continuation(self, text: str) -> list[int]:
        """Tokens that spell exactly `text` after a context (see the llama.cpp backend)."""
        target = text.encode("utf-8")
        ids = self.tokenize(text)
        if b"".join(self.piece(t) for t in ids) == target:
            return ids
        anchor, joined = self.tokenize("\n"), self.tokenize("\n" + text)
        if joined[: len(anchor)] == anchor and b"".join(self.piece(t) for t in joined[len(anchor) :]) == target:
            return joined[len(anchor) :]
        return ids

    def prompt_tokens(self, messages: Sequence[Message]) -> list[int]:
        tok = self.tokenizer
        if self.prompt.style == "plain":
            return list(tok(render_plain(messages), add_special_tokens=True)["input_ids"])
        text = tok.apply_chat_template([{"role": m.role, "content": m.content} for m in messages],
                                       tokenize=False, add_generation_prompt=True)
        has_bos = bool(tok.bos_token) and text.startswith(tok.bos_token)
        return list(tok(text, add_special_tokens=not has_bos)["input_ids"])

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
    def start(self, messages: Sequence[Message], *, seed: int | None, reserve: int) -> "TransformersSession":
        prompt = self.prompt_tokens(messages)
        if len(prompt) + reserve > self.n_ctx:
            raise PromptTooLongError(
                f"the prompt is {len(prompt)} tokens for {self.name}, whose context holds {self.n_ctx} "
                f"(with {reserve} tokens reserved for drafting)",
                "shorten the prompt or load the member with a larger n_ctx",
            )
        return TransformersSession(self, prompt, seed)

    def close(self) -> None:
        self.model = None  # type: ignore[assignment]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# --- session -----------------------------------------------------------------------------------


@dataclass
class _Draft:
    ids: list[int]
    pieces: list[bytes]
    rows: list[torch.Tensor]  # rows[j]: logits that sampled ids[j]

    @property
    def n_decoded(self) -> int:
        return len(self.ids) - 1  # the last sampled token is never fed back

    def kept_tokens(self, text: str) -> int | None:
        return tokens_spelling(self.pieces, text)


@dataclass
class _Verified:
    ids: list[int]
    scores: TokenScores
    keys: list[torch.Tensor]  # per layer: this candidate's cached keys/values
    values: list[torch.Tensor]
    last_row: torch.Tensor


def _crop(cache: DynamicCache, length: int) -> None:
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)  # negative = tokens to remove; accepted by old and new transformers


def _log_softmax_at(rows: torch.Tensor, targets: Sequence[int]) -> tuple[list[float], list[float]]:
    index = torch.tensor(list(targets), device=rows.device)[:, None]
    picked = rows.gather(1, index)[:, 0]
    logprobs = picked - torch.logsumexp(rows, dim=-1)
    return logprobs.tolist(), picked.tolist()


class TransformersSession:
    """One request's context on a TransformersMember. See the module docstring."""

    def __init__(self, member: TransformersMember, prompt: list[int], seed: int | None) -> None:
        self.m = member
        self.prompt_len = len(prompt)
        self.tokens = list(prompt)
        self.cache = DynamicCache()  # full layers: sliding windows are enforced by the masks, and cropping works
        self.n_cached = 0
        self.next_row: torch.Tensor | None = None
        self.generator: torch.Generator | None = None
        if seed is not None:
            gen_device = "cpu" if member.input_device.type == "cpu" else member.input_device
            self.generator = torch.Generator(device=gen_device).manual_seed(seed)
        self.stats = {"prompt": 0, "catch_up": 0, "draft": 0, "verify": 0, "forward_calls": 0}
        self._draft: _Draft | None = None
        self._verified: dict[str, _Verified] = {}

    @property
    def stops(self) -> tuple[str, ...]:
        return self.m.prompt.stops

    @property
    def room(self) -> int:
        return self.m.n_ctx - len(self.tokens)

    def counters(self) -> dict[str, int]:
        return dict(self.stats)

    def _sync(self) -> None:
        """Run accepted tokens that are not cached yet, so that next_row is known."""
        start = self.n_cached
        if start < len(self.tokens):
            rows = self.m.forward(self.cache, self.tokens[start:], range(start, len(self.tokens)), last_only=True)
            self.stats["forward_calls"] += 1
            self.n_cached = len(self.tokens)
            self.next_row = rows[-1]
            in_prompt = max(0, min(self.n_cached, self.prompt_len) - start)
            self.stats["prompt"] += in_prompt
            self.stats["catch_up"] += self.n_cached - start - in_prompt
        if self.next_row is None:
            raise RuntimeError("context is empty")

    def draft(self, max_tokens: int, sampling: Sampling) -> DraftTokens:
        if self._draft is not None:  # an earlier draft was never accepted: drop its tokens
            _crop(self.cache, len(self.tokens))
            self._draft, self._verified = None, {}
        self._sync()
        row = self.next_row
        assert row is not None
        ids: list[int] = []
        rows: list[torch.Tensor] = []
        logprobs: list[float] = []
        logits: list[float] = []
        finished = False
        pos = len(self.tokens)
        banned = self.m._eog if sampling.ignore_eos else None
        for step in range(max_tokens):
            rows.append(row)
            token = sample(row, sampling, self.generator, banned)
            ids.append(token)
            logit = float(row[token])
            logits.append(logit)
            logprobs.append(logit - float(torch.logsumexp(row, dim=-1)))
            if self.m.is_eog(token):
                finished = True
                break
            if step == max_tokens - 1:
                break
            row = self.m.forward(self.cache, [token], [pos])[-1]
            self.stats["draft"] += 1
            self.stats["forward_calls"] += 1
            pos += 1
        pieces = [self.m.piece(t) if not self.m.is_eog(t) else b"" for t in ids]
        self._draft = _Draft(ids, pieces, rows)
        return DraftTokens(tuple(pieces), tuple(logprobs), tuple(logits), finished)

    def score(self, texts: Sequence[str]) -> list[TokenScores]:
        self._sync()
        prefix_row = self.next_row
        assert prefix_row is not None
        results = {t: v.scores for t, v in self._verified.items()}
        if "" in texts:
            eog = prefix_row[self.m._eog.to(prefix_row.device)]
            lp = float(torch.logsumexp(eog, 0) - torch.logsumexp(prefix_row, 0))
            results[""] = TokenScores((lp,), (float(eog.max()),))
        pending = [t for t in dict.fromkeys(texts) if t not in results]
        if pending:
            self._verify(pending, prefix_row)
            results.update((t, self._verified[t].scores) for t in pending)
        return [results[t] for t in texts]

    def _verify(self, texts: list[str], prefix_row: torch.Tensor) -> None:
        """All candidates in one forward pass; their keys/values are kept aside for accept."""
        m, n_prefix = self.m, len(self.tokens)
        encoded = [m.encode_continuation(t) for t in texts]
        lengths = [len(ids) for ids in encoded]
        if n_prefix + sum(lengths) > m.n_ctx:
            raise PromptTooLongError(f"{m.name}: the candidates do not fit the context", "lower --window")
        n_cache = self.cache.get_seq_length()  # prefix + this round's pending draft tokens
        mask = m.block_mask(n_prefix, n_cache - n_prefix, lengths)
        positions = [n_prefix + i for n in lengths for i in range(n)]
        rows = m.forward(self.cache, [t for ids in encoded for t in ids], positions, mask=mask)
        self.stats["verify"] += sum(lengths)
        self.stats["forward_calls"] += 1
        layers = self.cache.layers
        keys = [layer.keys[..., n_cache:, :] for layer in layers]
        values = [layer.values[..., n_cache:, :] for layer in layers]
        _crop(self.cache, n_cache)
        at = 0
        for text, ids in zip(texts, encoded):
            block = rows[at : at + len(ids)]
            predictors = torch.cat([prefix_row[None, :], block[:-1]])
            lps, lgs = _log_softmax_at(predictors, ids)
            span = slice(at, at + len(ids))
            self._verified[text] = _Verified(ids, TokenScores(tuple(lps), tuple(lgs)),
                                             [k[..., span, :] for k in keys], [v[..., span, :] for v in values],
                                             block[-1])
            at += len(ids)

    def accept(self, text: str) -> None:
        n_prefix = len(self.tokens)
        draft = self._draft
        kept = draft.kept_tokens(text) if (draft and text) else None
        if kept is not None and draft is not None:
            # Our own draft won: its tokens are already cached.
            decoded = min(kept, draft.n_decoded)
            _crop(self.cache, n_prefix + decoded)
            self.tokens += draft.ids[:kept]
            self.n_cached = n_prefix + decoded
            self.next_row = draft.rows[kept] if decoded == kept else None
        elif text and text in self._verified:
            # Another member's candidate won: append the keys/values computed while verifying.
            cand = self._verified[text]
            _crop(self.cache, n_prefix)
            for layer, k, v in zip(self.cache.layers, cand.keys, cand.values):
                layer.keys = torch.cat([layer.keys, k], dim=-2)
                layer.values = torch.cat([layer.values, v], dim=-2)
            self.tokens += cand.ids
            self.n_cached = len(self.tokens)
            self.next_row = cand.last_row
        else:
            _crop(self.cache, n_prefix)
            if text:
                self.tokens += self.m.encode_continuation(text)
                self.n_cached = n_prefix
                self.next_row = None
        self._draft = None
        self._verified = {}

    def answer_tokens(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    def close(self) -> None:
        self.cache = DynamicCache()
        self._verified = {}


_FLAGS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def parse_target(target: str) -> tuple[str, dict[str, Any]]:
    """``PATH#NAME,device=cuda:0,dtype=bf16,...`` -> (PATH, options)."""
    path, _, fragment = target.partition("#")
    options: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in fragment.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            options["name"] = item
        elif key in ("device", "dtype", "attn_implementation"):
            options[key] = value
        elif key == "n_ctx":
            options[key] = int(value)
        elif key == "trust_remote_code" and value.lower() in _FLAGS:
            options[key] = _FLAGS[value.lower()]
        else:
            raise MemberLoadError(f"unknown or bad transformers member option {item!r}",
                                  "known: NAME, device=, dtype=, n_ctx=, trust_remote_code=, attn_implementation=")
    return path, options


def load(
    target: str, *, cache_dir: str | None = None, threads: int | None = None, slots: int | None = None,
    **options: Any
) -> TransformersMember:
    """Registry entry: an embedded model name (its GGUF), a GGUF path or a model directory,
    optionally followed by ``#NAME,KEY=VALUE,...`` (see parse_target).

    `threads` sets torch's CPU threads (process-wide) when given. `slots` is ignored:
    every session keeps its own cache, so any number can be open.
    """
    from ..models import CATALOGUE, resolve
    from ..sources import is_sourced

    target, from_spec = parse_target(target)
    options.update(from_spec)
    if threads:
        torch.set_num_threads(threads)
    if target in CATALOGUE or is_sourced(target):  # hf:ORG/REPO may be a checkpoint folder
        name, path, prompt = resolve(target, cache_dir, checkpoint=True)
        options.setdefault("name", name)
        options.setdefault("prompt", prompt)
        target = str(path)
    return TransformersMember(target, cache_dir=cache_dir, **options)
