"""Generation options, validated once at the edge (CLI, Python API, server)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import InvalidRequestError
from .types import Sampling

NULLABLE = ("seed", "gate", "accept_margin")  # fields where None is a value of its own, not "not given"
# Seeds as clients send them: OpenAI's signed 64-bit range and unsigned 64-bit seeds; -1 means "random"
# (llama.cpp's server). The engine maps each into the range its samplers take (``engine.member_seed``).
SEED_MIN, SEED_LIMIT, RANDOM_SEED = -(2**63), 2**64, -1
# How a verifier scores a candidate (``engine/scoring.py``).
ScoreMode = Literal["mean_prob", "mean_logprob", "mean_logit"]
SCORE_MODES: tuple[str, ...] = ("mean_prob", "mean_logprob", "mean_logit")
# Who drafts for the leader (``engine/drafting.py``).
DraftMode = Literal["off", "members", "lookup", "auto"]
DRAFT_MODES: tuple[str, ...] = ("off", "members", "lookup", "auto")


class FusionOptions(BaseModel):
    """Knobs of one fused generation. Unknown fields are rejected."""

    # Every number finite (no inf or NaN from JSON's extensions) and bounded above: a request must not
    # make a step overflow or the weights of later rounds degenerate.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    window: int = Field(10, ge=1, le=256, description="max tokens a member drafts per round")
    max_tokens: int = Field(256, ge=1, le=1_000_000, description="answer budget, in the winners' tokens")
    temperature: float = Field(0.6, ge=0.0, le=5.0, description="0 = greedy")
    top_p: float = Field(0.9, gt=0.0, le=1.0)
    seed: int | None = Field(
        None,
        ge=SEED_MIN,
        lt=SEED_LIMIT,
        description="same seed and members -> same answer; -1 = random (as llama.cpp's server)",
    )
    score: ScoreMode = Field("mean_prob", description="verifier score of a candidate")
    self_score: bool = Field(True, description="members also score their own draft")
    stop: tuple[str, ...] = Field((), description="stop strings; the answer ends before them")
    ignore_eos: bool = Field(False, description="run to max_tokens: no end-of-generation, no member stops")
    # Online feedback (SpecEM): per-member voting weights updated every round. Off by default since the
    # 512-token study (docs/results-gate.md): with the confidence gate the votes are rare, and Hedge learned
    # from the same votes that let weak members hijack the answer.
    hedge: bool = Field(False, description="update voting weights with Hedge each round")
    hedge_eta: float = Field(1.0, gt=0.0, le=100.0, description="Hedge learning rate eta0")
    # Model Exit: members whose cumulative quality falls behind stop for the rest of the query.
    exit: bool = Field(False, description="let lagging members exit within a query")
    exit_warmup: int = Field(3, ge=1, le=100_000, description="rounds before any member may exit")
    exit_entropy: float = Field(0.9, gt=0.0, le=1.0, description="exit only below this normalised entropy")
    exit_temperature: float = Field(0.1, gt=0.0, le=100.0, description="softmax temperature over cumulative quality")
    exit_fraction: float = Field(0.5, gt=0.0, le=1.0, description="exit if share < fraction / K_active")
    exit_min_active: int = Field(1, ge=1, le=1000, description="never fewer active members than this")
    exit_votes: Literal["all", "others"] = Field(
        "all", description="Model Exit quality from all votes, or only the other members' (cross-votes)"
    )
    # Selection that weak members cannot hijack (docs/results-gate.md says which are on and why).
    # Off by default: on IFEval it broke near-loops of the leader that the checks needed (docs/results-gate.md).
    guard: bool = Field(False, description="a candidate that makes the answer loop may not win")
    guard_ngram: int = Field(6, ge=2, le=32, description="word n-gram length of the degeneration guard")
    guard_times: int = Field(2, ge=1, le=1000, description="an n-gram seen this often already is a loop")
    guard_share: float = Field(0.75, gt=0.0, le=1.0, description="share of looping n-grams that penalises")
    guard_patience: int = Field(
        3,
        ge=1,
        le=100_000,
        description="after this many votes in a row whose winner still continued a loop, the "
        "guard stops sending the leader's looping drafts to a vote for the rest of the answer",
    )
    prior: Literal["uniform", "prompt"] = Field(
        "uniform", description="starting voting weights: uniform, or from each member's bits per byte on the prompt"
    )
    prior_temperature: float = Field(
        0.1, gt=0.0, le=100.0, description="softmax temperature over negative bits per byte"
    )
    # The default engine: the largest member leads and its confident drafts win alone (docs/results-gate.md).
    gate: float | None = Field(
        0.5,
        ge=0.0,
        le=10.0,
        description="the leader's draft wins alone when its mean token probability reaches this; "
        "None = every round is a full vote",
    )
    leader: str = Field("auto", min_length=1, description="member that drafts first under the gate; auto = heaviest")
    # The leader verifies (docs/results.md): when it is unsure, the others' drafts are proposals it must accept.
    # Default 0, the leader alone: on the study items no margin gained at a cost within 1.15x of the leader's
    # (with the three embedded members); `segfuse calibrate` chooses one for other members.
    accept: Literal["worst", "mean"] = Field(
        "worst",
        description="the leader's acceptance test of another member's segment: worst = every token within "
        "accept_margin nats of the leader's own top choice there; mean = mean log-probability within accept_margin "
        "of the leader's own draft's",
    )
    followers: Literal["lazy", "eager"] = Field(
        "lazy",
        description="members the options never consult (the leader alone): lazy = they start only if "
        "the leader fails mid-answer, reading the prompt and the answer so far in one go; eager = they read the "
        "prompt and follow every segment, ready at once",
    )
    accept_margin: float | None = Field(
        0.0,
        ge=0.0,
        le=1000.0,
        description="nats the leader's acceptance test allows; 0 = the leader alone; "
        "none = every proposal goes to the vote",
    )
    # Drafting for the leader (docs/performance.md#drafting): the answer stays the leader's own, token for token;
    # drafts only let it write several tokens per pass.
    draft: DraftMode = Field(
        "off",
        description="drafts the leader reads in one pass and keeps where they are what it would write: off = "
        "none; members = the other members draft; lookup = text copied from the prompt and the answer; "
        "auto = whichever pays, measured as the answer grows",
    )
    draft_max: int = Field(16, ge=1, le=64, description="most tokens of one draft the leader reads per round")
    draft_users: int = Field(
        1,
        ge=1,
        le=64,
        description="the leader reads drafts only while at most this many answers are in flight together; with "
        "more, each answers alone and their tokens are decoded in one batch",
    )
    # Strict: a request's "yes" must not read as true. Off by default: it costs the prefix cache and batching.
    deterministic: bool = Field(
        False,
        strict=True,
        description="the same request gives the same text (greedy, or with the same seed) "
        "whatever the prefix cache holds and whatever else runs: no cached prefix, a KV cache and decodes of its own",
    )

    @field_validator(*NULLABLE, mode="before")
    @classmethod
    def _none_as_text(cls, value: object) -> object:
        # TOML, llm's -o options and the command line have no null: the word "none" is that value there.
        return None if isinstance(value, str) and value.strip().lower() == "none" else value

    @field_validator("seed")
    @classmethod
    def _random_seed(cls, value: int | None) -> int | None:
        return None if value == RANDOM_SEED else value

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
        return Sampling(temperature=self.temperature, top_p=self.top_p, seed=self.seed, ignore_eos=self.ignore_eos)

    @classmethod
    def build(cls, **values: object) -> FusionOptions:
        """Validate `values`, raising InvalidRequestError with a readable message."""
        # None means "not given" except where it is a value of its own (no seed, no gate).
        values = {k: v for k, v in values.items() if v is not None or k in NULLABLE}
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or "options"
            raise InvalidRequestError(
                f"invalid option {field}: {first['msg']}",
                "see `segfuse generate --help` for allowed values",
                field=field,
            ) from None
