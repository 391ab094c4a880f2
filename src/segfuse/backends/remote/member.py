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

The member puts together its parts and implements the protocol with them:
``server.py`` is the model on its server (its kind, the requests sent, over
``http.py``'s pooled client), ``prompt_source.py`` its prompt format;
``session.py`` is one request's context, ``logprobs.py`` reads the servers'
log-probabilities, and ``echo.py`` reads a whole text.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ...errors import InvalidRequestError, MemberLoadError
from ...prompting import raw_prompt
from ...types import Message, PromptToken
from ..base import Capabilities, Member, SessionOptions
from ..cached import check_prompt_fits
from ..spec import split_target
from .echo import echo_probe, echo_remote, raw_echo_agrees, refuse_ids, same_logprobs, shifted
from .http import CompletionClient, RetryPolicy
from .prompt_source import PromptSource, load_prompt_source
from .server import Server, ServerName, as_int, detect, list_models
from .session import RemoteSession

if TYPE_CHECKING:
    from ...member_options import MemberOptions


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


class RemoteMember(Member):
    """One model behind an OpenAI-compatible server."""

    capabilities = Capabilities(parallel_safe=True)  # HTTP requests; sessions share only the pooled client

    def __init__(self, url: str, options: RemoteOptions, *, fallback_n_ctx: int | None = None) -> None:
        self.url = url.rstrip("/")
        self.options = options
        self.placement = f"remote {self.url}"
        client = CompletionClient(
            self.url,
            api_key=options.api_key or os.environ.get("SEGFUSE_REMOTE_API_KEY"),
            timeout_s=options.timeout,
            retry=RetryPolicy(retries=options.retries, backoff_s=options.backoff),
        )
        try:
            listed = list_models(client)
            model = options.model or str(listed[0]["id"])
            reported = next((m for m in listed if m.get("id") == model), listed[0])
            kind = detect(options.server, reported)
            self.n_ctx = options.n_ctx or as_int(reported.get("max_model_len")) or fallback_n_ctx or 4096
            self.source = self._prompt_source(model, reported)
            base = os.path.basename(model.rstrip("/"))
            self.name = options.name or (base[: -len(".gguf")] if base.endswith(".gguf") else base) or self.url
            self.server = Server(
                client,
                model=model,
                kind=kind,
                batch=kind.batch if options.batch is None else options.batch,
                name=self.name,
                n_ctx=self.n_ctx,
                end_ids=self.source.end_ids,
            )
            if not kind.echo:
                raise MemberLoadError(
                    f"{self.url} is a {kind.name} server, which returns no prompt log-probabilities",
                    "members must verify other members' candidates: serve it with vLLM, SGLang or "
                    "llama-cpp-python instead",
                )
            if options.check_echo:
                self._check_echo()
            # Echo (Member.echo) only where the server echoes a plain text right; unprobed: trusted.
            self.capabilities = Capabilities(
                parallel_safe=True, echo=not options.check_echo or raw_echo_agrees(self.server)
            )
        except BaseException:
            client.close()
            raise

    # --- setup ---------------------------------------------------------------------------
    def _prompt_source(self, model: str, listed: dict[str, Any]) -> PromptSource:
        """The template from the options, else from the served model's id or root when it is a local path."""
        plain = {"plain": True, "chat": False}.get(self.options.format)
        source = self.options.template
        root = str(listed.get("root") or "")  # vLLM: the model folder it serves, whatever name it serves it as
        if source is None and (os.path.exists(os.path.expanduser(model)) or _is_catalogued(model)):
            source = model  # e.g. llama-cpp-python lists the GGUF path it serves
        elif source is None and root and os.path.exists(os.path.expanduser(root)):
            source = root
        if source is None:
            raise MemberLoadError(
                f"no prompt format known for remote member {model!r}",
                "add template=PATH (its GGUF file, Hugging Face directory or a .jinja file) to the member spec",
            )
        found = load_prompt_source(source, plain=plain, eos=self.options.eos)
        if not found.end_texts:
            raise MemberLoadError(
                f"no end-of-generation token known for {model!r} ({found.origin})", "add eos=TEXT to the member spec"
            )
        return found

    def _check_echo(self) -> None:
        """Generated and echoed log-probs of the same tokens must agree.

        llama-cpp-python shifts echoed log-probs by one token when the prompt
        does not start with BOS (abetlen/llama-cpp-python#1983); scores would
        then be silently wrong, so such a server is refused.
        """
        found = echo_probe(self.server, self.source.render([Message("user", "Say hello.")]))
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

    # --- the protocol ------------------------------------------------------------------------
    def echo(self, prompt: str | Sequence[int], top_k: int = 0) -> list[PromptToken]:
        """The server's echo of a text (echo.py); token ids are refused (the server's tokenizer
        is not known here)."""
        if not isinstance(prompt, str):
            raise refuse_ids(self.name)
        if not self.capabilities.echo:
            raise shifted(self.server, "echo a text")
        return echo_remote(self.server, prompt, top_k, self.source.bos_text)

    def new_session(self, messages: Sequence[Message], options: SessionOptions) -> RemoteSession:
        # The server's own cache and batches: no salt to give, and its determinism is its own (docs/server.md).
        if raw_prompt(messages) is not None and not self.capabilities.echo:
            # Its verification reads echoed log-probabilities of the text: shifted by one, they would be wrong.
            raise shifted(self.server, "score a text completion (chat completions work)")
        prompt = self.source.render(messages)
        n_bytes = len(prompt.encode("utf-8"))
        # A token spells at least one byte (2 spare: a BOS and a leading space the tokenizer may add), so a
        # prompt of fewer bytes than the window holds fits; a longer one is counted by the server if it can.
        exact = self.server.count_tokens(prompt) if n_bytes + 2 + options.reserve > self.n_ctx else None
        check_prompt_fits(
            self.name, n_bytes // 4 if exact is None else exact, options.reserve, self.n_ctx, approximate=exact is None
        )
        session = RemoteSession(self.server, self.source, prompt, options.seed)
        if exact is not None:
            session.n_tokens = exact
        session.raw = raw_prompt(messages) is not None
        return session

    def close(self) -> None:
        self.server.close()


def _is_catalogued(model: str) -> bool:
    from ...models import CATALOGUE

    return model in CATALOGUE


# --- registry entry -----------------------------------------------------------------------

TARGET_KEYS = {
    "model": str,
    "template": str,
    "format": str,
    "eos": str,
    "server": str,
    "batch": bool,
    "timeout": float,
    "retries": int,
    "backoff": float,
    "n_ctx": int,
    "api_key": str,
    "check_echo": bool,
}


def parse_target(target: str) -> tuple[str, dict[str, Any]]:
    """``URL#NAME,KEY=VALUE,...`` -> (URL, options typed as RemoteOptions' fields)."""
    url, options = split_target(target, TARGET_KEYS, "remote")
    if not url.startswith(("http://", "https://")):
        raise InvalidRequestError(
            f"remote member URL must start with http:// or https://: {url!r}",
            "e.g. remote:http://127.0.0.1:8000/v1#name",
        )
    return url, options


def load(target: str, shared: MemberOptions | None = None) -> RemoteMember:
    """Registry entry. Of the ensemble's `shared` options only n_ctx applies: a fallback when neither
    the spec nor the server says the context size (the server keeps its own threads, cache and GPUs)."""
    url, from_spec = parse_target(target)
    try:
        opts = RemoteOptions(**from_spec)
    except TypeError as exc:
        raise InvalidRequestError(f"bad remote member option: {exc}", "see RemoteOptions") from None
    return RemoteMember(url, opts, fallback_n_ctx=shared.n_ctx if shared else None)
