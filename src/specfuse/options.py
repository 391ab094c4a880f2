"""Generation options, validated once at the edge (CLI, Python API, server)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import InvalidRequestError
from .scoring import ScoreMode
from .types import Sampling


class FusionOptions(BaseModel):
    """Knobs of one fused generation. Unknown fields are rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    window: int = Field(10, ge=1, le=256, description="max tokens a member drafts per round")
    max_tokens: int = Field(256, ge=1, description="answer budget, in the winners' tokens")
    temperature: float = Field(0.6, ge=0.0, le=5.0, description="0 = greedy")
    top_p: float = Field(0.9, gt=0.0, le=1.0)
    seed: int | None = Field(None, description="same seed and members -> same answer")
    score: ScoreMode = Field("mean_prob", description="verifier score of a candidate")
    self_score: bool = Field(True, description="members also score their own draft")
    stop: tuple[str, ...] = Field((), description="stop strings; the answer ends before them")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_tuple(cls, value: object) -> object:
        if value is None:
            return ()
        if isinstance(value, str):
            return (value,)
        return value

    @property
    def sampling(self) -> Sampling:
        return Sampling(temperature=self.temperature, top_p=self.top_p, seed=self.seed)

    @classmethod
    def build(cls, **values: object) -> "FusionOptions":
        """Validate `values`, raising InvalidRequestError with a readable message."""
        values = {k: v for k, v in values.items() if v is not None or k == "seed"}
        try:
            return cls(**values)
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or "options"
            raise InvalidRequestError(
                f"invalid option {field}: {first['msg']}",
                "see `specfuse generate --help` for allowed values",
            ) from None
