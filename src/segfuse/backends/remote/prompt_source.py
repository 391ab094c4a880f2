"""Where a member that has no local weights gets its prompt format from.

A remote member's server only sees text, so segfuse renders the chat
template itself. The template, the BOS/EOS texts and the end-of-generation
tokens come from the model's own metadata (docs/design.md#templates), read from:

- a GGUF file, an embedded model name or a model of yours (``ollama:NAME``,
  ``hf:ORG/REPO``, ...): llama.cpp reads the vocabulary only (no weights, well
  under a second);
- a Hugging Face model directory, or ``hf:ORG/REPO`` of a cached one:
  ``tokenizer_config.json`` (or ``chat_template.jinja``), ``tokenizer.json`` and
  ``generation_config.json``;
- a Jinja file: the template alone; give ``eos`` explicitly.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ...errors import MemberLoadError, ModelFileError
from ...models import CATALOGUE, QUESTION_ANSWER, PromptFormat, is_gguf
from ...prompting import chat_prompt, raw_prompt, render_chat, render_plain
from ...sources import is_sourced
from ...types import Message


@dataclass(frozen=True)
class PromptSource:
    """A member's prompt format as text: what to send and which texts end an answer."""

    prompt: PromptFormat
    template: str | None = None
    bos_text: str = ""
    eos_text: str = ""
    end_texts: tuple[str, ...] = ()  # end-of-generation tokens as text (EOS, end of turn, ...)
    end_ids: tuple[int, ...] = ()  # their ids, where known (to ban them with a logit bias)
    add_bos: bool = False  # the server's tokenizer adds BOS by itself
    origin: str = ""

    def render(self, messages: Sequence[Message]) -> str:
        """The templated prompt, ready for the assistant's answer (a prefill left open; a raw prompt as it is)."""
        if (raw := raw_prompt(messages)) is not None:
            return raw
        if self.prompt.style == "plain":
            return render_plain(messages)  # the server adds BOS where the model wants one
        if not self.template:
            raise MemberLoadError(f"no chat template known ({self.origin})", "give template=PATH or format=plain")
        template = self.template
        text = chat_prompt(
            lambda ms, gen: render_chat(template, ms, self.bos_text, self.eos_text, gen), messages, self.origin
        )
        if self.add_bos and self.bos_text and text.startswith(self.bos_text):
            text = text[len(self.bos_text) :]  # the server adds it; twice would change the prompt
        return text


def load_prompt_source(source: str, *, plain: bool | None = None, eos: str | None = None) -> PromptSource:
    """Read a prompt format from an embedded model name, a GGUF file, an HF directory or a Jinja file."""
    prompt: PromptFormat | None = None
    if source in CATALOGUE or is_sourced(source):
        from ...models import resolve

        _, path, prompt = resolve(source, checkpoint=True)  # hf:ORG/REPO may be a tokenizer folder
    else:
        path = Path(source).expanduser()
    if not path.exists():
        raise ModelFileError(
            f"template source not found: {source}",
            "give an embedded model name, a .gguf file, a model directory, a .jinja file "
            "or a model of yours (ollama:NAME, hf:ORG/REPO, ...)",
        )
    if path.is_dir():
        found = _from_hf_dir(path)
    elif is_gguf(path):
        found = _from_gguf(path)
    else:
        found = PromptSource(PromptFormat("chat"), template=path.read_text(encoding="utf-8"), origin=str(path))
    if prompt is not None:
        found = replace(found, prompt=prompt)
    if eos is not None:
        found = replace(found, eos_text=eos, end_texts=(eos,), end_ids=())
    if plain is True:
        found = replace(found, prompt=QUESTION_ANSWER)
    elif found.prompt.style == "chat" and not found.template:
        found = replace(found, prompt=QUESTION_ANSWER)  # base models: Question/Answer
    return found


def _from_gguf(path: Path) -> PromptSource:
    import llama_cpp as lc

    from ..llama_cpp.runtime import init_backend  # also routes llama.cpp's log away from the terminal

    init_backend()
    params = lc.llama_model_default_params()
    params.vocab_only = True
    model = lc.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise ModelFileError(f"llama.cpp could not read the vocabulary of {path}", "is it a valid GGUF file?")
    try:
        vocab = lc.llama_model_get_vocab(model)
        raw = lc.llama_model_chat_template(model, None)
        template = raw.decode("utf-8") if raw else None

        def text(token: int) -> str:
            if token < 0:
                return ""
            buf = (ctypes.c_char * 256)()
            n = lc.llama_token_to_piece(vocab, token, buf, len(buf), 0, True)
            return buf.raw[: max(n, 0)].decode("utf-8", "replace")

        # Every end-of-generation token the vocabulary declares, as the llama.cpp backend sums them.
        eog = [t for t in range(lc.llama_vocab_n_tokens(vocab)) if lc.llama_vocab_is_eog(vocab, t)]
        ends = {text(t): t for t in eog if text(t)}
        return PromptSource(
            PromptFormat("chat"),
            template=template,
            bos_text=text(lc.llama_vocab_bos(vocab)),
            eos_text=text(lc.llama_vocab_eos(vocab)),
            end_texts=tuple(ends),
            end_ids=tuple(ends.values()),
            add_bos=bool(lc.llama_vocab_get_add_bos(vocab)),
            origin=str(path),
        )
    finally:
        lc.llama_model_free(model)


def _token_text(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"cannot read {path}: {exc}", "is the model directory complete?") from None


def _from_hf_dir(path: Path) -> PromptSource:
    config = _read_json(path / "tokenizer_config.json")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: use the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    jinja = path / "chat_template.jinja"
    if not template and jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
    # End-of-generation ids (generation_config) -> their texts (tokenizer.json's added tokens).
    added = {t["id"]: t["content"] for t in _read_json(path / "tokenizer.json").get("added_tokens", [])}
    ids = _read_json(path / "generation_config.json").get("eos_token_id")
    ids = [ids] if isinstance(ids, int) else (ids or [])
    by_text = {content: i for i, content in added.items()}
    ends = {added[i]: i for i in ids if i in added}
    if eos and eos not in ends:
        ends = {eos: by_text.get(eos, -1), **ends}
    return PromptSource(
        PromptFormat("chat"),
        template=template or None,
        bos_text=bos,
        eos_text=eos,
        end_texts=tuple(ends),
        end_ids=tuple(i for i in ends.values() if i >= 0),
        add_bos=bool(config.get("add_bos_token", False)),
        origin=str(path),
    )
