"""The wire types every API shares (pydantic only, no behaviour), and those of the server's own routes.

Requests are parsed strictly ("16" is not an int) so a client bug shows up as a
422 instead of a silently coerced value. A request field segfuse does not
implement is refused (400 ``unsupported_parameter``) rather than ignored, unless
it cannot change the answer: ``TOLERATED_PARAMETERS`` below on every API, and
each API's own table of neutral values (``chat.protocol``, ``completions.protocol``,
...). ``segfuse`` is our extension, in requests (fusion knobs) and in responses
(who wrote what): ``FusionInfo``. Each API's own shapes are in its folder's
``protocol.py``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

HealthStatus = Literal["ok", "loading", "failed", "stalled"]  # GET /health's; stalled: a worker step hangs

# --------------------------------------------------------------------------- requests

MAX_CACHE_SALT_CHARS = 256


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False


KEEP_ALIVE = (
    "how long the model's members stay loaded after this answer, as Ollama's keep_alive: a duration "
    '("5m"), seconds, 0 (free them now, if nothing else uses them) or -1 (keep them)'
)


class GenerationRequest(BaseModel):
    """What chat and text completions share: the model, the answer's budget and sampling, streaming."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int | None = None
    cache_salt: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_CACHE_SALT_CHARS,
        description="requests share prefix-cache entries only with requests of the same salt (docs/server.md)",
    )
    segfuse: dict[str, Any] | None = Field(
        None, description="segfuse options (window, score, self_score, hedge, exit, ...): FusionOptions fields"
    )
    keep_alive: str | int | float | None = Field(None, description=KEEP_ALIVE)

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise ValueError("segfuse returns exactly one choice; n must be 1")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def answer_budget(self) -> int | None:
        return self.max_tokens


# Accepted with any value and ignored on every API: bookkeeping that cannot change the answer. What else a
# request may hold is each API's own (its protocol module); anything more gets 400 unsupported_parameter
# (parsing.unsupported).
TOLERATED_PARAMETERS: frozenset[str] = frozenset(
    {
        "metadata",
        "store",
        "service_tier",
        "parallel_tool_calls",
        "prompt_cache_key",
        "safety_identifier",
    }
)


# --------------------------------------------------------------------------- segfuse extension


class CandidateInfo(BaseModel):
    model: str
    text: str
    finished: bool
    n_tokens: int


class RoundInfo(BaseModel):
    """One round's record: every candidate and every verifier's scores.

    Extra fields the engine adds later (weights, exited members) pass through.
    """

    model_config = ConfigDict(extra="allow")

    index: int
    winner: str
    winner_index: int
    candidates: list[CandidateInfo]
    scores: dict[str, list[float]] = Field(description="normalised score of each candidate, per verifier")
    raw_scores: dict[str, list[float | None]] = Field(description="raw score of each candidate, per verifier")
    aggregate: list[float]
    active: list[str] = []
    total_s: float = 0.0


class SegmentInfo(BaseModel):
    text: str
    model: str
    round: int


class FusionStats(BaseModel):
    model_config = ConfigDict(extra="allow")

    rounds: int
    model_calls: int
    tokens: int
    wins: dict[str, int]
    time_to_first_segment_s: float | None
    total_s: float
    tokens_per_s: float
    finish_reason: str
    queue_s: float = Field(0.0, description="time the request waited for the worker")


class FusionInfo(BaseModel):
    """The ``segfuse`` field of a response or stream chunk; absent parts are omitted."""

    members: list[str] | None = None
    segment: SegmentInfo | None = None
    round: RoundInfo | None = None
    segments: list[SegmentInfo] | None = None
    rounds: list[RoundInfo] | None = None
    stats: FusionStats | None = None
    prompt_tokens: dict[str, int] | None = Field(None, description="templated prompt length per member")
    weights: dict[str, float] | None = Field(None, description="voting weights at the end (Hedge)")
    departures: list[dict[str, Any]] | None = Field(None, description="members that left the query, and why")

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


# --------------------------------------------------------------------------- responses


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# --------------------------------------------------------------------------- the server's own routes


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "segfuse"
    parent: str | None = Field(None, description="for a member: the (first) ensemble it belongs to")
    members: list[str] | None = Field(None, description="for an ensemble: its members, in order")
    ensembles: list[str] | None = Field(None, description="for a member: every ensemble it belongs to")
    loaded: bool = Field(True, description="loaded now (else a request for it loads it first)")
    context_length: int | None = Field(
        None,
        description="tokens of prompt and answer it takes (the ensemble: "
        "its smallest member's window); null where a member cannot tell",
    )
    max_model_len: int | None = Field(None, description="the same, by the name vLLM gives it")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class QueueState(BaseModel):
    waiting: int = Field(description="requests queued for a free slot")
    running: int = Field(description="generations in flight")
    capacity: int = Field(description="how many may wait (queue_size)")
    max_concurrent: int = Field(1, description="generations run together")


class PrefixCacheState(BaseModel):
    """A member's prefix cache: what it holds now (within ``bound``) and what it has done."""

    bound: int = Field(description="cells it may hold (0: off)")
    entries: int = Field(description="cached prefixes")
    cells: int = Field(description="tokens held, summed over entries (at most bound)")
    hits: int = Field(description="sessions that started from a cached prefix")
    misses: int = Field(description="sessions that found none")
    reused_tokens: int = Field(description="prompt tokens not decoded thanks to a hit")
    evictions: int = Field(description="entries dropped to make room")
    restored: int = Field(0, description="entries read back from the prefix-cache directory")
    saved: int = Field(0, description="entries written to the prefix-cache directory")


class MemberOccupancy(BaseModel):
    """What one member held after the worker's last step; null where the member cannot tell."""

    slots: int | None = Field(None, description="sessions it can hold at once")
    free_slots: int | None = Field(None, description="slots no open session takes")
    cache_cells: int | None = Field(
        None, description="KV-cache positions open sessions hold, summed over their sequences (0 when idle)"
    )
    stray_cells: int | None = Field(
        None, description="positions held by no session and no prefix-cache entry: a leak (always 0)"
    )
    prefix: PrefixCacheState | None = Field(None, description="the prefix cache kept between requests")


class CopyState(BaseModel):
    """One copy of a member that runs in copies (a Ray member): where it runs and what it holds."""

    index: int = Field(description="the copy's index within its member")
    node_ip: str = Field(description="the address of the node it runs on")
    node_id: str = Field(description="the Ray node's id")
    pid: int | None = Field(None, description="its process")
    placement: str | None = Field(None, description="what the member says of where it runs (CPU, GPU layers)")
    up: bool = Field(description="it answered when last asked")
    sessions: int = Field(description="sessions it holds")
    slots: int | None = Field(None, description="sessions it can hold at once")
    free_slots: int | None = Field(None, description="slots no session takes")
    waiting: int | None = Field(None, description="calls queued for its member's thread")
    prefix_hits: int | None = Field(None, description="sessions that started from its prefix cache")


class MemberLoad(BaseModel):
    """Where one member stands in the server's memory (``ollama ps``, for a member)."""

    state: Literal["unloaded", "loading", "loaded", "unloading", "failed"]
    ensembles: list[str] = Field(description="the ensembles it belongs to")
    in_use: int = Field(description="requests and generations holding it (never freed while any do)")
    bytes: int | None = Field(
        None, description="its bytes where it runs (weights; llama.cpp: and its KV cache and buffers), once loaded"
    )
    estimated_bytes: int | None = Field(
        None,
        description="its bytes as its file says, before it loads (with max_loaded_bytes; the budget counts it "
        "until it has loaded)",
    )
    pinned: bool = Field(False, description="an ensemble pins it (keep_alive -1): never freed by expiry or for room")
    loading_s: float | None = Field(None, description="while it loads: for how long so far")
    expires_in_s: float | None = Field(
        None, description="when idle: seconds until it is freed (null: in use, kept, or not loaded)"
    )
    error: str | None = Field(None, description="why its last load failed (the next request tries again)")
    loads: int = Field(0, description="times it was loaded since the server started")


ModelMemory = Literal["unloaded", "loading", "loaded", "idle", "partly loaded", "unloading", "failed"]


class ModelState(BaseModel):
    """Where one model stands in memory (``POST /v1/models/{id}/load`` and ``/unload`` answer it)."""

    id: str
    state: ModelMemory = Field(
        description="loaded (answering), idle (loaded, nothing answering), loading, unloading, unloaded, partly "
        "loaded (some members: another model's), failed (a member's last load)"
    )
    in_use: int = Field(description="requests and generations holding its most held member")
    pinned: bool = Field(description="every member is pinned (keep_alive -1)")
    expires_in_s: float | None = Field(None, description="idle: when its first member will be freed")
    members: dict[str, MemberLoad]


class Health(BaseModel):
    """``GET /health``: readiness plus the work counters tests and operators read."""

    status: HealthStatus
    model: str
    members: list[str]
    error: str | None = None
    queue: QueueState
    counters: dict[str, int]
    occupancy: dict[str, MemberOccupancy] = Field(
        default_factory=dict, description="per member: slots free, cache cells held"
    )
    placement: dict[str, str] = Field(
        default_factory=dict, description="per member: where it runs (CPU, GPU: n/N layers, a device, a remote server)"
    )
    copies: dict[str, list[CopyState]] = Field(
        default_factory=dict, description="per member that runs in copies (a Ray member): each copy"
    )
    degraded: list[str] = Field(
        default_factory=list,
        description="what is down and coming back: a copy, a node, a front-end replica (empty when all is well)",
    )
    replica: str | None = Field(None, description="the front-end replica that answered (a Ray Serve replica)")
    ensembles: dict[str, list[str]] = Field(default_factory=dict, description="each model served: its members")
    memory: dict[str, MemberLoad] = Field(
        default_factory=dict, description="per member: loaded or not, in use, its bytes, when it will be freed"
    )
