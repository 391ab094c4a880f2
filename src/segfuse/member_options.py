"""Members' load options: one typed object, validated once, whichever way they are given.

Every entry point reads the same fields: CLI flags (generated from them), the server's
``[members]`` table, a profile's ``[members]`` table, the ``llm`` plugin's ``-o`` options,
lm-eval's ``model_args`` and, per member, a spec's ``#key=value``. Adding an option is one field
here (every member may be given it) or in a backend's subclass (only its members' specs take
it); a backend uses the shared fields that apply to it and ignores the rest (a remote member
has no threads), so one ensemble can mix backends under one set of options.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import InvalidRequestError

# Booleans read the same everywhere (flags, TOML strings, a spec's #key=value): 1/true/yes/on, 0/false/no/off.
TRUE = frozenset({"1", "true", "yes", "on"})
FALSE = frozenset({"0", "false", "no", "off"})

SPLIT_MODES = ("layer", "row", "none")
# llama.cpp's KV-cache types (as llama-server's --cache-type-k takes them); past the first three, quantized.
CacheType = Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"]
UNQUANTIZED = ("f32", "f16", "bf16")


def parse_flag(key: str, value: str) -> bool:
    """`value` spelled as a boolean (TRUE / FALSE), else a clear error naming `key`."""
    lowered = value.strip().lower()
    if lowered not in TRUE | FALSE:
        raise InvalidRequestError(f"{key} must be true or false, not {value!r}", "write true or false")
    return lowered in TRUE


MAX_CONCURRENT = 32  # sessions a member without slots (remote, transformers) is asked to hold


class MemberOptions(BaseModel):
    """Options any member may be loaded with (None: the backend's default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    n_ctx: int | None = Field(None, ge=256, description="context window per member, in tokens (default 4096)")
    threads: int | None = Field(
        None,
        ge=1,
        description="llama.cpp threads per member (default: all cores up to 8, or 2 for a member wholly on a GPU)",
    )
    cache_dir: str | None = Field(None, description="where assembled models live")
    prefix_cache_cells: int | None = Field(
        None,
        ge=0,
        description="KV-cache cells a llama.cpp member keeps between requests (default n_ctx x slots; 0: off)",
    )
    prefix_cache_dir: str | None = Field(
        None,
        min_length=1,
        description="a directory where llama.cpp members keep their cached prefixes across restarts: written "
        "on close (and by the server every few minutes), read back when a prompt matches ('auto': the user's "
        "cache directory; default: none, the cache lives in memory only)",
    )
    prefix_cache_dir_max_bytes: int | None = Field(
        None,
        ge=1 << 20,
        description="the most bytes prefix_cache_dir may hold; the least recently used files go first (default 2 GiB)",
    )
    gpu_layers: int | None = Field(
        None,
        ge=-1,
        description="layers llama.cpp offloads to the GPU (default: all "
        "when the installed llama.cpp can offload, else 0; -1: all)",
    )
    main_gpu: int | None = Field(
        None,
        ge=0,
        description="the GPU a llama.cpp member runs on (split none), or holds its small tensors (default 0)",
    )
    split: Literal["layer", "row", "none"] | None = Field(
        None,
        description="how a llama.cpp member spreads over several GPUs: by layer (default), by row, or "
        "none (main_gpu only)",
    )
    tensor_split: tuple[float, ...] | None = Field(
        None, description="each GPU's share of a split member, e.g. 3/1 (default: by free memory)"
    )
    side_by_side: Literal["auto", "on", "off"] | None = Field(
        None,
        description="run a llama.cpp member's calls in a thread of their own, beside the other members' "
        "(default auto: on when every layer is on a GPU; on/true, off/false)",
    )
    type_k: CacheType | None = Field(
        None, description="a llama.cpp member's KV-cache type for keys: f16 (default), q8_0, q4_0, ... (less memory)"
    )
    type_v: CacheType | None = Field(
        None,
        description="a llama.cpp member's KV-cache type for values: f16 (default), q8_0, q4_0, ... (a quantized "
        "one needs flash_attn on or auto)",
    )
    flash_attn: Literal["auto", "on", "off"] | None = Field(
        None, description="a llama.cpp member's flash attention (default auto: where the device has it; on/off)"
    )
    slots: int | None = Field(
        None, ge=1, description="sessions a member holds at once", json_schema_extra={"flag": False}
    )
    reencode: bool | None = Field(
        None, description="re-encode the whole context every call (benchmarks only)", json_schema_extra={"flag": False}
    )

    @field_validator("tensor_split", mode="before")
    @classmethod
    def _shares(cls, value: object) -> object:
        """``3/1`` or ``3,1`` (a spec's items are comma-separated: write ``/`` there)."""
        if isinstance(value, str):
            return tuple(part for part in value.replace(",", "/").split("/") if part.strip())
        return value

    @field_validator("type_k", "type_v", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.strip().lower() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _quantized_values_need_flash_attention(self) -> MemberOptions:
        """llama.cpp refuses a quantized V cache without flash attention: said here, with the way out."""
        if self.type_v not in (None, *UNQUANTIZED) and self.flash_attn == "off":
            raise ValueError(f"type_v {self.type_v} needs flash_attn on or auto (llama.cpp quantizes V only then)")
        return self

    @field_validator("side_by_side", "flash_attn", mode="before")
    @classmethod
    def _on_off(cls, value: object) -> object:
        """true/false (TOML, JSON, a spec's yes/no/1/0) read as on/off."""
        if isinstance(value, bool):
            return "on" if value else "off"
        if isinstance(value, str):
            lowered = value.strip().lower()
            return "on" if lowered in TRUE else "off" if lowered in FALSE else lowered
        return value

    @classmethod
    def build(cls, given: Mapping[str, Any] | None = None, *, where: str = "member options") -> MemberOptions:
        """Validated options from `given` (None values are "not given"); an unknown key or bad value is an
        InvalidRequestError naming `where` and the keys this class takes."""
        values = {k: v for k, v in (given or {}).items() if v is not None}
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            raise _refusal(cls, exc, where) from None

    def given(self) -> dict[str, Any]:
        """The options set (not None), as keyword arguments."""
        return {k: v for k, v in self.model_dump().items() if v is not None}

    def merged(self, kind: type[MemberOptions], spec: Mapping[str, Any], *, where: str) -> Any:
        """This ensemble-wide object under a member spec's own `spec` options, as the backend's `kind`."""
        shared = {k: v for k, v in self.given().items() if k in kind.model_fields}
        return kind.build({**shared, **spec}, where=where)


def keys_of(kind: type[BaseModel]) -> list[str]:
    return list(kind.model_fields)


def flag_fields() -> dict[str, Any]:
    """The fields the command line gives a flag of their own."""
    return {
        name: f
        for name, f in MemberOptions.model_fields.items()
        if not (isinstance(f.json_schema_extra, dict) and f.json_schema_extra.get("flag") is False)
    }


def _refusal(kind: type[BaseModel], exc: ValidationError, where: str) -> InvalidRequestError:
    problems = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "(options)"
        problems.append(f"unknown option {key!r}" if err["type"] == "extra_forbidden" else f"{key}: {err['msg']}")
    return InvalidRequestError(f"{where}: " + "; ".join(problems), f"options: {', '.join(keys_of(kind))}")


__all__ = ["SPLIT_MODES", "UNQUANTIZED", "CacheType", "MemberOptions", "flag_fields", "keys_of"]
