"""The engines' own answers, the references the drafting benchmark holds segfuse against: llama-cpp-python's
``Llama`` greedy alone and with prompt lookup decoding (``LlamaPromptLookupDecoding``), and Hugging Face
``model.generate`` greedy alone and with assisted generation (universal: the assistant may have another
vocabulary), on the very weights the segfuse transformers members hold."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ...backends.base import Member
from ...request import to_messages
from .speeds import on_compute

if TYPE_CHECKING:
    from ...backends.transformers import TransformersMember

PLD_TOKENS = 10  # num_pred_tokens of llama-cpp-python's prompt lookup decoding


@dataclass(frozen=True)
class Answer:
    """One answer of one system: its text, the tokens it wrote and the wall seconds it took."""

    text: str
    tokens: int
    seconds: float


class LlamaNative:
    """The leader's GGUF in llama-cpp-python, twice: plain and with prompt lookup decoding (each its own
    context, so neither reuses the other's cache)."""

    def __init__(self, path: Path, threads: int, n_ctx: int = 4096) -> None:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        common: dict[str, Any] = {"n_threads": threads, "n_ctx": n_ctx, "verbose": False, "seed": 0}
        self.alone = Llama(str(path), **common)
        self.lookup = Llama(str(path), draft_model=LlamaPromptLookupDecoding(num_pred_tokens=PLD_TOKENS), **common)

    def answer(self, system: str, prompt: str, max_tokens: int) -> Answer:
        llm = self.lookup if system == "llama_pld" else self.alone
        llm.reset()  # type: ignore[no-untyped-call]  # no prefix kept from the previous prompt: every answer pays its prefill
        t0 = time.perf_counter()
        out = cast(
            "dict[str, Any]",
            llm.create_chat_completion(
                messages=[{"role": "user", "content": prompt}],
                max_tokens=max_tokens,
                temperature=0.0,
                top_k=1,
            ),
        )
        seconds = time.perf_counter() - t0
        return Answer(out["choices"][0]["message"]["content"] or "", out["usage"]["completion_tokens"], seconds)

    def close(self) -> None:
        for llm in (self.alone, self.lookup):
            llm.close()


def hf_answer(leader: Member, assistant: Member | None, prompt: str, max_tokens: int) -> Answer:
    """``model.generate`` greedy on the leader's chat prompt, with `assistant` as its assistant model (None:
    alone), on the leader's compute thread."""
    import torch

    lead = cast("TransformersMember", leader)
    ids = torch.tensor([lead.prompt_tokens(to_messages(prompt)) or []], device=lead.weights.input_device)
    eos = lead.vocab.eog_ids
    kw: dict[str, Any] = {"max_new_tokens": max_tokens, "do_sample": False, "eos_token_id": eos, "pad_token_id": eos[0]}
    if assistant is not None:
        helper = cast("TransformersMember", assistant)
        kw["assistant_model"] = helper.weights.model
        if helper.vocab.tokenizer.get_vocab() != lead.vocab.tokenizer.get_vocab():  # universal assisted generation
            kw.update(tokenizer=lead.vocab.tokenizer, assistant_tokenizer=helper.vocab.tokenizer)

    def write() -> tuple[float, Any]:
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = lead.weights.model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
            return time.perf_counter() - t0, out

    seconds, out = on_compute(leader)(write)
    new = [int(t) for t in out[0, ids.shape[1] :] if int(t) not in eos]
    return Answer(lead.detokenize(new) or "", len(new), seconds)
