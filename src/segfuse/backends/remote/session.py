"""One request's context on a remote member (the mapping onto the server's API is in ``member.py``'s
docstring): plain text, no server-side state, so sessions are independent and may run concurrently.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...types import DraftTokens, Sampling, TokenScores
from ..base import MemberSession, OnText
from .http import RemoteServerError
from .logprobs import candidate_logprobs, entries_of, logsumexp, pieces_of, scores_of, tail
from .prompt_source import PromptSource
from .server import Server, as_int


class RemoteSession(MemberSession):
    """One request's context on a remote member: plain text, no server-side state. It sends its requests
    to `server` and reads the prompt format's stop strings and end texts from `source`."""

    def __init__(self, server: Server, source: PromptSource, prompt: str, seed: int | None) -> None:
        self.server = server
        self.source = source
        self.context = prompt
        self.seed = seed
        self.n_tokens = len(prompt.encode("utf-8")) // 4  # exact after each draft (usage.prompt_tokens)
        self._round = 0
        self._draft_tokens: dict[str, int] = {}
        self.stats = {"requests": 0, "draft": 0, "verify": 0}
        self.raw = False  # a text completion: the prompt format's stop strings do not apply

    @property
    def stops(self) -> tuple[str, ...]:
        return () if self.raw else self.source.prompt.stops

    @property
    def room(self) -> int:
        return self.server.n_ctx - self.n_tokens

    def counters(self) -> dict[str, int]:
        return dict(self.stats)

    def draft(self, max_tokens: int, sampling: Sampling, on_text: OnText | None = None) -> DraftTokens:
        # One completion request per draft: `on_text` is never called (the segment streams whole).
        self._round += 1
        # Within a signed 32-bit range, which every OpenAI-style server takes (llama.cpp's reads uint32).
        seed = None if self.seed is None else (self.seed * 1009 + self._round) % 2**31
        choice = self.server.complete(
            self.context,
            max_tokens=max_tokens,
            temperature=0.0 if sampling.greedy else sampling.temperature,
            top_p=1.0 if sampling.greedy else sampling.top_p,
            seed=seed,
            ignore_eos=sampling.ignore_eos,
        )
        self.stats["requests"] += 1
        prompt_tokens = as_int(choice["_usage"].get("prompt_tokens"))
        if prompt_tokens:
            self.n_tokens = prompt_tokens
        text = choice.get("text") or ""
        raw = choice.get("logprobs")
        entries = entries_of(raw) if text or (raw and raw.get("tokens")) else []
        finished = choice.get("finish_reason") == "stop"  # no stop strings are sent: "stop" is EOS
        pieces = pieces_of(text, entries, generated=True)
        logprobs = [e.logprob if e.logprob is not None else 0.0 for e in entries]
        listed_end = bool(entries) and pieces[-1] == "" and entries[-1].token in ("", *self.source.end_texts)
        if finished and not listed_end:
            # The server did not list the end-of-generation token (llama-cpp-python): ask for its probability.
            pieces.append("")
            logprobs.append(self._end_logprob(self.context + text))
        if len(pieces) > max_tokens + 1:
            raise RemoteServerError(f"{self.server.name}: asked for {max_tokens} tokens, got {len(pieces)}", "")
        self.stats["draft"] += len(pieces)
        self._draft_tokens = {text: len(entries)}
        data = tuple(p.encode("utf-8") for p in pieces)
        return DraftTokens(data, tuple(logprobs), tuple(logprobs), finished)

    def _end_logprob(self, context: str) -> float:
        ends = self.source.end_texts
        echoes = self.server.echo([context + end for end in ends])
        self.stats["requests"] += 1 if self.server.batch else len(ends)
        ends_found = [tail(e.entries, e.n_generated, 0, last=1)[0] for e in echoes]
        return logsumexp(candidate_logprobs(ends_found))

    def score(self, texts: Sequence[str]) -> list[TokenScores]:
        unique = [t for t in dict.fromkeys(texts) if t]
        results: dict[str, TokenScores] = {}
        if "" in texts:
            lp = self._end_logprob(self.context)
            results[""] = TokenScores((lp,), (lp,))
        if unique:
            echoes = self.server.echo([self.context + t for t in unique])
            self.stats["requests"] += 1 if self.server.batch else len(unique)
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
