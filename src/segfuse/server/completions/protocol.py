"""``/v1/completions`` wire types (pydantic only, no behaviour): the legacy text-completions shapes, and the
tokenizer routes' requests."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..wire import FusionInfo, GenerationRequest, Usage

PATH = "/v1/completions"
MODEL_PATH = "/m/{model}/v1/completions"  # one model's own: its tokenizer routes beside it


class CompletionRequest(GenerationRequest):
    """The body of ``POST /v1/completions``: a text every member continues as it is (no chat template)."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="the text to continue (a list answers each, not streamed); or token ids of the model's "
        "tokenizer (``/tokenize``: for segfuse, its largest member's)"
    )
    echo: bool = Field(False, description="the prompt before the answer; with logprobs, its tokens' too")
    logprobs: int | None = Field(
        None,
        ge=0,
        le=5,
        description="each answer token's log-probability under its "
        "author, with this many of its most likely tokens (up to 5)",
    )
    max_tokens: int | None = Field(None, ge=0, description="0 (with echo): the prompt alone, no answer")

    @field_validator("prompt")
    @classmethod
    def _some_prompt(cls, value: object) -> object:
        if isinstance(value, list) and not value:  # how many at most: [limits] max_prompts
            raise ValueError("give at least one prompt")
        if isinstance(value, list) and isinstance(value[0], list):
            if not all(value):
                raise ValueError("a token-array prompt is empty")
            ids = [t for item in value for t in item]
        else:
            ids = [t for t in value if isinstance(t, int)] if isinstance(value, list) else []
        if any(t < 0 for t in ids):
            raise ValueError("token ids are 0 or more")
        return value

    @model_validator(mode="after")
    def _answer_or_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 asks for no answer: only with echo (the prompt's log-probabilities)")
        return self

    @property
    def answer_budget(self) -> int | None:
        return self.max_tokens or None  # 0: no answer at all (echo alone), so no budget to set

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt: a text, or token ids."""
        value = self.prompt
        if isinstance(value, str):
            return [value]
        ids = [t for t in value if isinstance(t, int)]
        if ids:  # one prompt of token ids
            return [ids]
        return [p for p in value if not isinstance(p, int)]


COMPLETION_PARAMETERS: tuple[str, ...] = tuple(CompletionRequest.model_fields)
# /v1/completions: OpenAI parameters accepted only at a value that asks for nothing.
COMPLETION_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "suffix": ("",),
    "best_of": (1,),
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "logit_bias": ({},),
}


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per answer token."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class TextCompletion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    segfuse: FusionInfo | None = None


# --------------------------------------------------------------------------- the tokenizer routes


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str
    model: str | None = None
    add_special_tokens: bool = Field(True, description="the BOS the model reads first, where it uses one")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    tokens: list[int]
    model: str | None = None
