"""Structured output: what an answer must be (a JSON object, a JSON schema, a grammar), and checking it.

A :class:`Constraint` is built once per request and validated up front (a bad schema is the
caller's error, said before any member runs). Grammar work is llguidance's: it compiles JSON
schemas and Lark grammars and computes, for any tokenizer, which tokens may come next.

Two matchers follow an answer under a constraint:

- :class:`TextMatcher` (the engine's): over bytes, so that it judges any member's candidate
  segment the same way whatever that member's tokenizer: a candidate that would leave the answer
  no longer a prefix of a valid document cannot win, and "stop here" only when it is complete;
- :class:`TokenMatcher` (a member session's): over that member's own tokens, to mask its logits
  while it drafts, following the shared answer in the member's tokens wherever it came from.

After a prefill (a final assistant message the answer continues) the constraint is on the whole
message: both matchers read the prefill first (:meth:`Constraint.check_prefill` refuses one the
constraint does not allow), and the engine checks the prefill and the answer together.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal

import numpy as np

from .errors import InvalidRequestError

# JSON on one line, separators as Python's json.dumps writes them: with free whitespace small models
# wander into endless blank lines.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as exc:  # pragma: no cover - llguidance is a core dependency
        raise InvalidRequestError("structured output needs the llguidance package", "pip install llguidance") from exc
    return llguidance


@dataclass(frozen=True)
class Constraint:
    """What the answer must be: ``kind`` json (any JSON object), json_schema, or lark (a grammar)."""

    kind: Literal["json", "json_schema", "lark"]
    grammar: str = field(repr=False)  # llguidance's compiled form
    schema: dict[str, Any] | None = None  # json_schema: checked again on the finished answer
    name: str | None = None  # the schema's name (response_format.json_schema.name)

    @classmethod
    def json_object(cls) -> Constraint:
        return cls._build("json", {"type": "object"}, None, where="response_format")

    @classmethod
    def json_schema(cls, schema: Any, name: str | None = None, where: str = "json_schema.schema") -> Constraint:
        if not isinstance(schema, dict):
            raise InvalidRequestError(
                f"{where} must be a JSON object (a JSON schema), not {type(schema).__name__}",
                'e.g. {"type": "object", "properties": {"name": {"type": "string"}}}',
            )
        _check_schema(schema, where)
        return cls._build("json_schema", schema, name, where=where)

    @classmethod
    def lark(cls, grammar: str) -> Constraint:
        ll = _llguidance()
        compiled = ll.LLMatcher.grammar_from_lark(grammar)
        _check_grammar(compiled, "grammar")
        return cls("lark", compiled)

    @classmethod
    def _build(cls, kind: Any, schema: dict[str, Any], name: str | None, where: str) -> Constraint:
        ll = _llguidance()
        try:
            compiled = ll.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as exc:
            raise InvalidRequestError(f"{where}: {exc}", "give a valid JSON schema") from None
        _check_grammar(compiled, where)
        return cls(kind, compiled, schema, name)

    def check_prefill(self, prefill: str) -> None:
        """InvalidRequestError unless `prefill` (the start of the answer's message) may begin a valid answer."""
        if prefill and not TextMatcher(self).allows("", prefill):
            raise InvalidRequestError(
                f"the final assistant message {prefill[:40]!r} cannot begin an answer in the requested format "
                f"({self.kind if self.kind != 'lark' else 'a tool call or text'})",
                "make the prefill the start of a valid answer, or drop it",
            )

    def check(self, text: str) -> str | None:
        """Why a finished answer does not satisfy the constraint (None: it does)."""
        if self.kind == "lark":
            matcher = TextMatcher(self)
            return None if matcher.allows("", text) and matcher.complete(text) else "it does not match the grammar"
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            return f"it is not JSON ({exc.msg} at character {exc.pos})"
        if self.schema is None:
            return None
        if _has_patterns(self.schema):
            # jsonschema would run Python's backtracking `re` on the client's patterns: "^(a+)+$" against 40
            # "a"s and a "!" takes hours, holding the GIL. llguidance enforced the same schema while the answer
            # was written, with regex automata that never backtrack: its verdict stands.
            return None if TextMatcher(self).complete(text) else "it does not match the schema"
        import jsonschema

        error = jsonschema.exceptions.best_match(
            jsonschema.validators.validator_for(self.schema)(self.schema).iter_errors(value)
        )
        return None if error is None else f"it does not validate: {error.message}"


def _has_patterns(schema: Any) -> bool:
    """Whether a schema holds a regular expression (``pattern``, ``patternProperties``) anywhere."""
    stack = [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if "patternProperties" in item or isinstance(item.get("pattern"), str):
                return True
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _check_schema(schema: dict[str, Any], where: str) -> None:
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.exceptions.SchemaError as exc:
        path = "/".join(str(p) for p in exc.absolute_path)
        raise InvalidRequestError(
            f"{where} is not a valid JSON schema{' at ' + path if path else ''}: {exc.message}",
            "see https://json-schema.org",
        ) from None


def _check_grammar(compiled: str, where: str) -> None:
    """llguidance's verdict: a schema feature it cannot express is the caller's error too."""
    is_error, messages = _llguidance().LLMatcher.validate_grammar_with_warnings(compiled, None)
    if is_error:
        raise InvalidRequestError(
            f"{where} cannot be enforced: {messages[0] if messages else 'invalid'}",
            "simplify the schema (see docs/server.md, Structured output)",
        )


# --- matchers -----------------------------------------------------------------------------------


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads: every token's bytes, the end token, a tokenize call."""

    def __init__(self, tokens: list[bytes], eos: int, tokenize: Callable[[bytes], list[int]]) -> None:
        self.tokens, self.eos_token_id, self.bos_token_id = tokens, eos, None
        self.special_token_ids: list[int] = []
        self._tokenize = tokenize

    def __call__(self, data: bytes) -> list[int]:
        return self._tokenize(data)


def tokenizer_for(pieces: Sequence[bytes], end_ids: Sequence[int], tokenize: Callable[[str], list[int]]) -> Any:
    """An llguidance tokenizer from a member's token pieces (control tokens empty), its
    end-of-generation ids and its plain tokenize call. Costs about a second for a large vocabulary:
    build it once per member."""
    ll = _llguidance()
    ends = set(end_ids)
    # Control tokens (empty pieces) are marked special, so that no grammar ever allows them except as the end.
    tokens = [piece if piece and t not in ends else b"\xff<|special_%d|>" % t for t, piece in enumerate(pieces)]
    vocab = _Vocabulary(tokens, min(ends), lambda data: tokenize(data.decode("utf-8", "replace")))
    return ll.LLTokenizer(ll.TokenizerWrapper(vocab), eos_token=sorted(ends))


@lru_cache(maxsize=1)
def _byte_tokenizer() -> Any:
    return tokenizer_for([bytes([b]) for b in range(256)] + [b""], [256], lambda text: list(text.encode("utf-8")))


class TextMatcher:
    """The constraint over the shared answer's bytes: which candidates keep it valid, and when it is done."""

    def __init__(self, constraint: Constraint) -> None:
        self._matcher = _llguidance().LLMatcher(_byte_tokenizer(), constraint.grammar, log_level=0)
        self._consumed = b""

    def _follow(self, answer: bytes) -> bool:
        if answer.startswith(self._consumed):
            new = answer[len(self._consumed) :]
        else:
            self._matcher.reset()
            self._consumed, new = b"", answer
        if new and not self._matcher.consume_tokens(list(new)):
            self._matcher.reset()
            self._consumed = b""
            return False
        self._consumed = answer
        return True

    def allows(self, answer: str, candidate: str) -> bool:
        """Whether ``answer + candidate`` is still a prefix of a valid document."""
        if not self._follow(answer.encode("utf-8")):
            return False
        data = list(candidate.encode("utf-8"))
        return bool(self._matcher.validate_tokens(data) == len(data))

    def complete(self, answer: str) -> bool:
        """Whether the answer may end here."""
        return self._follow(answer.encode("utf-8")) and self._matcher.is_accepting()

    def finished(self, answer: str) -> bool:
        """Whether nothing can follow: the document is complete and admits no more bytes."""
        return self.complete(answer) and self._matcher.is_stopped()


class TokenMatcher:
    """The constraint over one member's answer tokens: a mask of the tokens that may come next."""

    def __init__(self, tokenizer: Any, constraint: Constraint, n_vocab: int, prefill: str = "") -> None:
        """`prefill`: text the answer continues, read first and never rolled back (in tokens that spell
        it; the grammar follows bytes, so which tokens does not matter)."""
        ll = _llguidance()
        self._matcher = ll.LLMatcher(tokenizer, constraint.grammar, log_level=0)
        if prefill and not self._matcher.consume_tokens(tokenizer.greedy_tokenize(prefill)):
            raise InvalidRequestError(
                f"the prefill left the constraint: {self._matcher.get_error()}",
                "make the prefill the start of a valid answer, or drop it",
            )
        self._consumed: list[int] = []
        self._n_vocab = n_vocab
        self._bitmask = np.full(((tokenizer.vocab_size + 31) // 32,), -1, dtype=np.int32)

    def follow(self, answer_tokens: Sequence[int]) -> None:
        """Make the matcher stand after `answer_tokens` (rolling back what it consumed beyond their common prefix)."""
        k = 0
        for a, b in zip(self._consumed, answer_tokens):
            if a != b:
                break
            k += 1
        if k < len(self._consumed):
            self._matcher.rollback(len(self._consumed) - k)
            del self._consumed[k:]
        for token in answer_tokens[k:]:
            self.push(token)

    def push(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise InvalidRequestError(
                f"the answer left the constraint: {self._matcher.get_error()}", "report this with the request"
            )
        self._consumed.append(token)

    def pop(self, n: int) -> None:
        if n:
            self._matcher.rollback(n)
            del self._consumed[-n:]

    def allowed(self) -> np.ndarray:
        """A boolean mask over the member's vocabulary: the tokens that keep the answer valid."""
        self._matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
        mask = np.zeros(self._n_vocab, dtype=bool)
        n = min(self._n_vocab, len(bits))
        mask[:n] = bits[:n].astype(bool)
        return mask


__all__ = ["Constraint", "TextMatcher", "TokenMatcher", "tokenizer_for"]
