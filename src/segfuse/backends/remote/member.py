"""Members served by OpenAI-compatible completion servers (vLLM, SGLang, llama-cpp-python).

Spec: ``remote:URL[#NAME][,KEY=VALUE...]``, URL being the server's ``/v1``
base, e.g. ``remote:http://10.0.0.7:8000/v1#qwen72b,template=/models/qwen72b``.
The keys are RemoteOptions' fields.

How the protocol maps onto the API:
- the context is text: the member's chat template rendered here (the server
  only ever sees ``/v1/completions`` prompts) plus the accepted answer;
- ``draft``: one completion with ``max_tokens`` = window, the sampling
  options, ``logprobs`` (token texts, offsets, log-probs) and the finish
  reason ("stop" = end of generation, as no stop strings are sent);
- ``score``: prompt log-probabilities of context + candidate through
  ``echo`` + ``logprobs`` with ``max_tokens=1``; the candidate's tokens are the
  trailing prompt tokens covering its characters. All candidates go in one
  request where the server takes a list of prompts (vLLM, SGLang);
- ``score("")``: the log-probability of the model's end-of-generation text
  (e.g. ``<|im_end|>``) after the context.
- ``echo`` (a whole text's tokens, ``Member.echo``): the server's echo of the
  text alone, offered only where a load-time probe shows it echoes a plain text
  right (``echo.py``); ``tokenize_text``/``detokenize`` stay None.
Servers expose log-probabilities, not raw logits, so TokenScores.logits holds
the log-probabilities too (``mean_logit`` then ranks like ``mean_logprob``).
Caching is left to the server (vLLM's prefix caching, llama-cpp-python's
prompt reuse). Members hold no per-request state, so sessions are independent
and safe to run concurrently (``parallel_safe``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from ...errors import InvalidRequestError, MemberLoadError
from ...prompting import raw_prompt
from ...types import DraftTokens, Message, PromptToken, Sampling, TokenScores
from ..base import Capabilities, Member, MemberSession, OnText
from ..cached import check_prompt_fits
from ..spec import split_target
from .echo import echo_probe, echo_remote, raw_echo_agrees, refuse_ids, same_logprobs, shifted
from .http import CompletionClient, RemoteServerError, RetryPolicy
from .logprobs import Entry, choices_of, entries_of, logsumexp, pieces_of, scores_of, tail
from .prompt_source import PromptSource, load_prompt_source

if TYPE_CHECKING:
    from ...member_options import MemberOptions

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


@dataclass(frozen=True)
class RemoteOptions:
    """Options of a remote member (fragment keys of the spec, or keyword arguments)."""

    name: str | None = None
    model: str | None = None  # the server's model name; default: the only/first one it lists
    template: str | None = None  # GGUF file, embedded model name, HF directory or .jinja file
    format: Literal["auto", "chat", "plain"] = "auto"
    eos: str | None = None  # end-of-generation text, when the template source lacks it
    server: ServerName = "auto"
    batch: bool | None = None  # None: as the server kind allows
    timeout: float = 120.0
    retries: int = 2
    backoff: float = 0.25
    n_ctx: int | None = None
    api_key: str | None = None  # default: $SEGFUSE_REMOTE_API_KEY
    check_echo: bool = True  # probe that echoed log-probs agree with generated ones (chat and plain text)


# --- member and session -----------------------------------------------------------------


class RemoteMember(Member):
    """One model behind an OpenAI-compatible server."""

    capabilities = Capabilities(parallel_safe=True)  # HTTP requests; sessions share only the pooled client

    def __init__(self, url: str, options: RemoteOptions, *, fallback_n_ctx: int | None = None) -> None:
        self.url = url.rstrip("/")
        self.options = options
        self.placement = f"remote {self.url}"
        self.client = CompletionClient(
            self.url,
            api_key=options.api_key or os.environ.get("SEGFUSE_REMOTE_API_KEY"),
            timeout_s=options.timeout,
            retry=RetryPolicy(retries=options.retries, backoff_s=options.backoff),
        )
        try:
            listed = self._models()
            self.model = options.model or str(listed[0]["id"])
            reported = next((m for m in listed if m.get("id") == self.model), listed[0])
            self.kind = KINDS[_detect(options.server, reported)]
            self.batch = self.kind.batch if options.batch is None else options.batch
            self.n_ctx = options.n_ctx or _int(reported.get("max_model_len")) or fallback_n_ctx or 4096
            self.source = self._prompt_source(reported)
            base = os.path.basename(self.model.rstrip("/"))
            self.name = options.name or (base[: -len(".gguf")] if base.endswith(".gguf") else base) or self.url
            if not self.kind.echo:
                raise MemberLoadError(
                    f"{self.url} is a {self.kind.name} server, which returns no prompt log-probabilities",
                    "members must verify other members' candidates: serve it with vLLM, SGLang or "
                    "llama-cpp-python instead",
                )
            if options.check_echo:
                self._check_echo()
            # Echo (Member.echo) only where the server echoes a plain text right; unprobed: trusted.
            self.capabilities = Capabilities(parallel_safe=True,
                                             echo=not options.check_echo or raw_echo_agrees(self))
        except BaseException:
            self.client.close()
            raise

    # --- setup ---------------------------------------------------------------------------
    def _models(self) -> list[dict[str, Any]]:
        data = self.client.get("/models")
        listed = data.get("data") if isinstance(data, dict) else None
        if not listed:
            raise RemoteServerError(f"{self.url}/models lists no model", "is this an OpenAI-compatible /v1 URL?")
        return listed

    def _prompt_source(self, listed: dict[str, Any]) -> PromptSource:
        """The template from the options, else from the served model's id or root when it is a local path."""
        plain = {"plain": True, "chat": False}.get(self.options.format)
        source = self.options.template
        root = str(listed.get("root") or "")  # vLLM: the model folder it serves, whatever name it serves it as
        if source is None and (os.path.exists(os.path.expanduser(self.model)) or _is_catalogued(self.model)):
            source = self.model  # e.g. llama-cpp-python lists the GGUF path it serves
        elif source is None and root and os.path.exists(os.path.expanduser(root)):
            source = root
        if source is None:
            raise MemberLoadError(
                f"no prompt format known for remote member {self.model!r}",
                "add template=PATH (its GGUF file, Hugging Face directory or a .jinja file) to the member spec",
            )
        found = load_prompt_source(source, plain=plain, eos=self.options.eos)
        if not found.end_texts:
            raise MemberLoadError(f"no end-of-generation token known for {self.model!r} ({found.origin})",
                                  "add eos=TEXT to the member spec")
        return found

    def _check_echo(self) -> None:
        """Generated and echoed log-probs of the same tokens must agree.

        llama-cpp-python shifts echoed log-probs by one token when the prompt
        does not start with BOS (abetlen/llama-cpp-python#1983); scores would
        then be silently wrong, so such a server is refused.
        """
        found = echo_probe(self, self.source.render([Message("user", "Say hello.")]))
        if found is None:
            return  # nothing to compare, or re-tokenized differently: inconclusive
        got, want = found
        if not same_logprobs(got, want):
            raise MemberLoadError(
                f"{self.url}: echoed prompt log-probabilities disagree with generated ones "
                f"({[round(x, 3) for x in got]} vs {[round(x, 3) for x in want]})",
                "llama-cpp-python's server shifts them by one token when the prompt does not start with BOS "
                "(abetlen/llama-cpp-python#1983); serve this model with vLLM, or with a llama-cpp-python "
                "that has the fix (check_echo=false skips this probe: only for servers known to be right)",
            )

    # --- requests -------------------------------------------------------------------------
    def _complete(self, prompt: str, *, max_tokens: int, temperature: float, top_p: float,
                  seed: int | None, ignore_eos: bool = False) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
            "top_p": top_p, "logprobs": 1, "stream": False, **self.kind.extras,
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
        ban = {"logit_bias": {str(i): -100.0 for i in self.source.end_ids}} if self.source.end_ids else {}
        if self.kind.name in ("vllm", "sglang"):
            return {"ignore_eos": True, **ban}
        if not ban:
            raise InvalidRequestError(f"{self.name}: cannot ban end-of-generation tokens on this server",
                                      "their ids are unknown: give template=PATH with the model's tokenizer")
        return ban

    def _echo(self, prompts: Sequence[str]) -> list["_Echo"]:
        """Prompt log-probs of each prompt, batched where the server allows."""
        groups = [list(prompts)] if self.batch else [[p] for p in prompts]
        out: list[_Echo] = []
        for group in groups:
            body: dict[str, Any] = {
                "model": self.model, "prompt": group if len(group) > 1 else group[0],
                "max_tokens": self.kind.echo_max_tokens, "temperature": 0.0, "logprobs": 1, "echo": True,
                "stream": False,
            }
            data = self.client.post("/completions", body)
            usage = data.get("usage") or {}
            for choice in choices_of(data, len(group)):
                # The generated tokens follow the echoed prompt: max_tokens of them per prompt, except
                # where the server reports fewer (llama-cpp-python lists no end-of-generation token).
                n_gen = _int(usage.get("completion_tokens")) if len(group) == 1 else None
                n_gen = self.kind.echo_max_tokens if n_gen is None else min(n_gen, self.kind.echo_max_tokens)
                out.append(_Echo(entries_of(choice.get("logprobs")), n_gen))
        return out

    def echo(self, prompt: str | Sequence[int], top_k: int = 0) -> list[PromptToken]:
        """The server's echo of a text (echo.py); token ids are refused (the server's tokenizer
        is not known here)."""
        if not isinstance(prompt, str):
            raise refuse_ids(self)
        if not self.capabilities.echo:
            raise shifted(self, "echo a text")
        return echo_remote(self, prompt, top_k)

    def start(self, messages: Sequence[Message], *, seed: int | None, reserve: int, cache_salt: str | None = None,
              deterministic: bool = False) -> "RemoteSession":
        # The server's own cache and batches: no salt to give, and its determinism is its own (docs/server.md).
        if raw_prompt(messages) is not None and not self.capabilities.echo:
            # Its verification reads echoed log-probabilities of the text: shifted by one, they would be wrong.
            raise shifted(self, "score a text completion (chat completions work)")
        prompt = self.source.render(messages)
        n_bytes = len(prompt.encode("utf-8"))
        # A token spells at least one byte (2 spare: a BOS and a leading space the tokenizer may add), so a
        # prompt of fewer bytes than the window holds fits; a longer one is counted by the server if it can.
        exact = self._count_tokens(prompt) if n_bytes + 2 + reserve > self.n_ctx else None
        check_prompt_fits(self.name, n_bytes // 4 if exact is None else exact, reserve, self.n_ctx,
                          approximate=exact is None)
        session = RemoteSession(self, prompt, seed)
        if exact is not None:
            session.n_tokens = exact
        session.raw = raw_prompt(messages) is not None
        return session

    def _count_tokens(self, prompt: str) -> int | None:
        """The server's count of `prompt`'s tokens; None where it cannot say (the estimate then stands)."""
        if not self.kind.tokenize or not self.url.endswith("/v1"):
            return None
        try:
            data = self.client.post(f"{self.url[: -len('/v1')]}/tokenize", {"model": self.model, "prompt": prompt})
        except RemoteServerError:
            return None
        return _int(data.get("count")) if isinstance(data, dict) else None

    def close(self) -> None:
        self.client.close()


@dataclass
class _Echo:
    entries: list[Entry]
    n_generated: int


class RemoteSession(MemberSession):
    """One request's context on a remote member: plain text, no server-side state."""

    def __init__(self, member: RemoteMember, prompt: str, seed: int | None) -> None:
        self.m = member
        self.context = prompt
        self.seed = seed
        self.n_tokens = len(prompt.encode("utf-8")) // 4  # exact after each draft (usage.prompt_tokens)
        self._round = 0
        self._draft_tokens: dict[str, int] = {}
        self.stats = {"requests": 0, "draft": 0, "verify": 0}
        self.raw = False  # a text completion: the prompt format's stop strings do not apply

    @property
    def stops(self) -> tuple[str, ...]:
        return () if self.raw else self.m.source.prompt.stops

    @property
    def room(self) -> int:
        return self.m.n_ctx - self.n_tokens

    def counters(self) -> dict[str, int]:
        return dict(self.stats)

    def draft(self, max_tokens: int, sampling: Sampling, on_text: OnText | None = None) -> DraftTokens:
        # One completion request per draft: `on_text` is never called (the segment streams whole).
        self._round += 1
        # Within a signed 32-bit range, which every OpenAI-style server takes (llama.cpp's reads uint32).
        seed = None if self.seed is None else (self.seed * 1009 + self._round) % 2**31
        choice = self.m._complete(
            self.context,
            max_tokens=max_tokens,
            temperature=0.0 if sampling.greedy else sampling.temperature,
            top_p=1.0 if sampling.greedy else sampling.top_p,
            seed=seed,
            ignore_eos=sampling.ignore_eos,
        )
        self.stats["requests"] += 1
        prompt_tokens = _int(choice["_usage"].get("prompt_tokens"))
        if prompt_tokens:
            self.n_tokens = prompt_tokens
        text = choice.get("text") or ""
        raw = choice.get("logprobs")
        entries = entries_of(raw) if text or (raw and raw.get("tokens")) else []
        finished = choice.get("finish_reason") == "stop"  # no stop strings are sent: "stop" is EOS
        pieces = pieces_of(text, entries, generated=True)
        logprobs = [e.logprob if e.logprob is not None else 0.0 for e in entries]
        listed_end = bool(entries) and pieces[-1] == "" and entries[-1].token in ("", *self.m.source.end_texts)
        if finished and not listed_end:
            # The server did not list the end-of-generation token (llama-cpp-python): ask for its probability.
            pieces.append("")
            logprobs.append(self._end_logprob(self.context + text))
        if len(pieces) > max_tokens + 1:
            raise RemoteServerError(f"{self.m.name}: asked for {max_tokens} tokens, got {len(pieces)}", "")
        self.stats["draft"] += len(pieces)
        self._draft_tokens = {text: len(entries)}
        data = tuple(p.encode("utf-8") for p in pieces)
        return DraftTokens(data, tuple(logprobs), tuple(logprobs), finished)

    def _end_logprob(self, context: str) -> float:
        ends = self.m.source.end_texts
        echoes = self.m._echo([context + end for end in ends])
        self.stats["requests"] += 1 if self.m.batch else len(ends)
        ends_found = [tail(e.entries, e.n_generated, 0, last=1)[0] for e in echoes]
        return logsumexp([float(e.logprob) for e in ends_found])  # type: ignore[arg-type]

    def score(self, texts: Sequence[str]) -> list[TokenScores]:
        unique = [t for t in dict.fromkeys(texts) if t]
        results: dict[str, TokenScores] = {}
        if "" in texts:
            lp = self._end_logprob(self.context)
            results[""] = TokenScores((lp,), (lp,))
        if unique:
            echoes = self.m._echo([self.context + t for t in unique])
            self.stats["requests"] += 1 if self.m.batch else len(unique)
            for text, echo in zip(unique, echoes):
                scores = scores_of(tail(echo.entries, echo.n_generated, len(text)))
                self.stats["verify"] += len(scores.logprobs)
                self._draft_tokens.setdefault(text, len(scores.logprobs))
                results[text] = scores
        return [results[t] for t in texts]

    def accept(self, text: str) -> None:
        self.context += text
        self.n_tokens += self._draft_tokens.get(text, len(text.encode("utf-8")) // 2 + 1 if text else 0)
        self._draft_tokens = {}

    def close(self) -> None:
        pass


def _detect(requested: str, listed: dict[str, Any]) -> str:
    if requested != "auto":
        if requested not in KINDS:
            raise InvalidRequestError(f"unknown server kind {requested!r}", f"choose one of {', '.join(KINDS)}")
        return requested
    return _OWNED_BY.get(str(listed.get("owned_by", "")).lower(), "openai")


def _is_catalogued(model: str) -> bool:
    from ...models import CATALOGUE

    return model in CATALOGUE


def _int(value: Any) -> int | None:
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


# --- registry entry -----------------------------------------------------------------------

TARGET_KEYS = {"model": str, "template": str, "format": str, "eos": str, "server": str, "batch": bool,
               "timeout": float, "retries": int, "backoff": float, "n_ctx": int, "api_key": str, "check_echo": bool}


def parse_target(target: str) -> tuple[str, dict[str, Any]]:
    """``URL#NAME,KEY=VALUE,...`` -> (URL, options typed as RemoteOptions' fields)."""
    url, options = split_target(target, TARGET_KEYS, "remote")
    if not url.startswith(("http://", "https://")):
        raise InvalidRequestError(f"remote member URL must start with http:// or https://: {url!r}",
                                  "e.g. remote:http://127.0.0.1:8000/v1#name")
    return url, options


def load(target: str, shared: "MemberOptions | None" = None) -> RemoteMember:
    """Registry entry. Of the ensemble's `shared` options only n_ctx applies: a fallback when neither
    the spec nor the server says the context size (the server keeps its own threads, cache and GPUs)."""
    url, from_spec = parse_target(target)
    try:
        opts = RemoteOptions(**from_spec)
    except TypeError as exc:
        raise InvalidRequestError(f"bad remote member option: {exc}", "see RemoteOptions") from None
    return RemoteMember(url, opts, fallback_n_ctx=shared.n_ctx if shared else None)
