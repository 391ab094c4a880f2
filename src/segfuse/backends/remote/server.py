"""One model on an OpenAI-compatible completions server, as a remote member talks to it: what the server's
kind allows, and the requests the member sends (a completion with log-probabilities, the echo of prompts,
a prompt's token count).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ...errors import InvalidRequestError
from .http import CompletionClient, RemoteServerError
from .logprobs import Entry, choices_of, entries_of

ServerName = Literal["auto", "vllm", "sglang", "llama-cpp-python", "llama.cpp", "openai"]


@dataclass(frozen=True)
class ServerKind:
    """What a server kind allows. `extras` switch off samplers the server enables by default,
    so that temperature and top-p mean what they mean in the llama.cpp backend."""

    name: str
    batch: bool  # a list of prompts in one request
    echo: bool  # prompt log-probs through echo + logprobs
    extras: dict[str, Any] = field(default_factory=dict)
    echo_max_tokens: int = 1  # 0 where the server echoes without generating (vLLM)
    tokenize: bool = False  # POST /tokenize beside /v1 counts a prompt's tokens (vLLM)


KINDS: dict[str, ServerKind] = {
    "vllm": ServerKind("vllm", True, True, {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}, 0, True),
    "sglang": ServerKind("sglang", True, True, {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}),
    "llama-cpp-python": ServerKind("llama-cpp-python", False, True, {"top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0}),
    "llama.cpp": ServerKind("llama.cpp", False, False, {"top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0}),
    "openai": ServerKind("openai", True, True, {}),
}
_OWNED_BY = {"vllm": "vllm", "sglang": "sglang", "llamacpp": "llama.cpp", "me": "llama-cpp-python"}


def detect(requested: str, listed: dict[str, Any]) -> ServerKind:
    """The kind asked for, else the one the listed model's ``owned_by`` names (unknown: plain OpenAI)."""
    if requested != "auto":
        if requested not in KINDS:
            raise InvalidRequestError(f"unknown server kind {requested!r}", f"choose one of {', '.join(KINDS)}")
        return KINDS[requested]
    return KINDS[_OWNED_BY.get(str(listed.get("owned_by", "")).lower(), "openai")]


def list_models(client: CompletionClient) -> list[dict[str, Any]]:
    """The models a server lists at ``/models`` (at least one, else RemoteServerError)."""
    data = client.get("/models")
    listed = data.get("data") if isinstance(data, dict) else None
    if not listed or not isinstance(listed, list):
        raise RemoteServerError(f"{client.base_url}/models lists no model", "is this an OpenAI-compatible /v1 URL?")
    return listed


def as_int(value: Any) -> int | None:
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


@dataclass
class Echoed:
    """A prompt's echoed tokens, and how many generated ones follow them."""

    entries: list[Entry]
    n_generated: int


class Server:
    """`model` on the server behind `client`, as the member `name` sees it: its `kind`, whether it takes
    several prompts in one request (`batch`), its context window (`n_ctx`), and the ids of its
    end-of-generation tokens where known (`end_ids`, banned when a draft must not end)."""

    def __init__(
        self,
        client: CompletionClient,
        *,
        model: str,
        kind: ServerKind,
        batch: bool,
        name: str,
        n_ctx: int,
        end_ids: Sequence[int] = (),
    ) -> None:
        self.client = client
        self.url = client.base_url
        self.model, self.kind, self.batch = model, kind, batch
        self.name, self.n_ctx = name, n_ctx
        self.end_ids = tuple(end_ids)

    def complete(
        self,
        prompt: str,
        *,
        max_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | None,
        ignore_eos: bool = False,
    ) -> dict[str, Any]:
        """One completion with its tokens' log-probabilities: the choice, its request's usage under ``_usage``."""
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "logprobs": 1,
            "stream": False,
            **self.kind.extras,
        }
        if seed is not None:
            body["seed"] = seed
        if ignore_eos:
            body.update(self._no_end())
        data = self.client.post("/completions", body)
        choice = choices_of(data, 1)[0]
        choice["_usage"] = data.get("usage") or {}
        return choice

    def _no_end(self) -> dict[str, Any]:
        """Request fields that keep the server from ending the text (Sampling.ignore_eos): the end-of-generation
        tokens banned, as the llama.cpp backend bans them (vLLM's `ignore_eos` alone only goes on after one)."""
        ban = {"logit_bias": {str(i): -100.0 for i in self.end_ids}} if self.end_ids else {}
        if self.kind.name in ("vllm", "sglang"):
            return {"ignore_eos": True, **ban}
        if not ban:
            raise InvalidRequestError(
                f"{self.name}: cannot ban end-of-generation tokens on this server",
                "their ids are unknown: give template=PATH with the model's tokenizer",
            )
        return ban

    def echo(self, prompts: Sequence[str]) -> list[Echoed]:
        """Prompt log-probs of each prompt, batched where the server allows."""
        groups = [list(prompts)] if self.batch else [[p] for p in prompts]
        out: list[Echoed] = []
        for group in groups:
            body: dict[str, Any] = {
                "model": self.model,
                "prompt": group if len(group) > 1 else group[0],
                "max_tokens": self.kind.echo_max_tokens,
                "temperature": 0.0,
                "logprobs": 1,
                "echo": True,
                "stream": False,
            }
            data = self.client.post("/completions", body)
            usage = data.get("usage") or {}
            for choice in choices_of(data, len(group)):
                # The generated tokens follow the echoed prompt: max_tokens of them per prompt, except
                # where the server reports fewer (llama-cpp-python lists no end-of-generation token).
                n_gen = as_int(usage.get("completion_tokens")) if len(group) == 1 else None
                n_gen = self.kind.echo_max_tokens if n_gen is None else min(n_gen, self.kind.echo_max_tokens)
                out.append(Echoed(entries_of(choice.get("logprobs")), n_gen))
        return out

    def count_tokens(self, prompt: str) -> int | None:
        """The server's count of `prompt`'s tokens; None where it cannot say (the estimate then stands)."""
        if not self.kind.tokenize or not self.url.endswith("/v1"):
            return None
        try:
            data = self.client.post(f"{self.url[: -len('/v1')]}/tokenize", {"model": self.model, "prompt": prompt})
        except RemoteServerError:
            return None
        return as_int(data.get("count")) if isinstance(data, dict) else None

    def close(self) -> None:
        self.client.close()
