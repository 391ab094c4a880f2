"""``/v1/completions`` wire types (pydantic only, no behaviour): the legacy text-completions shapes."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator
from pydantic_core import PydanticCustomError

from .protocol import FusionInfo, GenerationRequest, Usage


class CompletionRequest(GenerationRequest):
    """The body of ``POST /v1/completions``: a text every member continues as it is (no chat template)."""

    prompt: str | list[str] = Field(description="the text to continue; a list answers each (not streamed)")
    echo: bool = Field(False, description="the prompt before the answer, in text (not in logprobs)")
    logprobs: int | None = Field(None, ge=0, le=5, description="each answer token's log-probability under its "
                                 "author, with this many of its most likely tokens (up to 5)")

    @field_validator("prompt", mode="before")
    @classmethod
    def _text_not_tokens(cls, value: object) -> object:
        # OpenAI also takes token ids (a list of ints, or of lists): the members share no vocabulary.
        items = value if isinstance(value, list) else [value]
        if any(isinstance(item, (int, list)) and not isinstance(item, bool) for item in items):
            raise PydanticCustomError("token_array", "token-array prompts are not supported (the members share no "
                                      "vocabulary): send the prompt as text")
        return value

    @field_validator("prompt")
    @classmethod
    def _some_prompt(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and not value:  # how many at most: [limits] max_prompts
            raise ValueError("give at least one prompt")
        return value

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)


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
    specfuse: FusionInfo | None = None
