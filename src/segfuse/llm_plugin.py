"""A plugin for simonw's ``llm``: ``llm -m segfuse "..."`` fuses the members in process.

Installed with the ``llm`` extra (``pip install 'segfuse[llm]'``), which
registers this module under llm's ``llm`` entry point. Members and fusion
defaults come from ``segfuse.toml`` in llm's user directory (``llm logs path``'s
folder; the same format as ``segfuse serve --config``: ``[members] models``
and member options such as ``threads``, ``n_ctx``, ``gpu_layers``; ``[defaults]``
fusion options), then from ``-o`` options (``-o members qwen2.5-coder-0.5b,gemma3-270m
-o gate 0.5 -o accept_margin 2 -o gpu_layers 0``; every member option is one;
``-o gate none`` / ``-o accept_margin none`` for None). The
answer streams segment by segment; ``--schema`` asks for
structured output. For a running ``segfuse serve``, use llm's own OpenAI
client instead (``extra-openai-models.yaml``, see docs/server.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, Literal

import llm
from pydantic import Field, create_model, field_validator

from .config import build_config
from .ensemble import Ensemble, request_of
from .member_options import MemberOptions, flag_fields
from .types import DoneEvent, Message, SegmentEvent, is_role

CONFIG_NAME = "segfuse.toml"
_loaded: dict[tuple[Any, ...], Ensemble] = {}  # one ensemble per members and options, for the life of the process


class _FusionOptions(llm.Options):
    members: str | None = Field(
        None, description="members, comma-separated (default: segfuse.toml, else the embedded three)"
    )
    max_tokens: int | None = Field(None, ge=1, description="answer budget in tokens")
    temperature: float | None = Field(None, ge=0, le=2, description="0 = greedy")
    seed: int | None = Field(None, description="sampling seed")
    # llm's -o values are text, and None here means "not given": the word none stands for None.
    gate: Annotated[float, Field(ge=0, le=1)] | Literal["none"] | None = Field(
        None, description="leader confidence gate (none = every round is a full vote)"
    )
    accept_margin: Annotated[float, Field(ge=0)] | Literal["none"] | None = Field(
        None,
        description="nats the leader's acceptance allows (0 = the leader alone; none = every proposal "
        "goes to the vote)",
    )
    window: int | None = Field(None, ge=1, description="tokens per drafted segment")

    @field_validator("gate", "accept_margin", mode="before")
    @classmethod
    def _none_word(cls, value: object) -> object:
        return "none" if isinstance(value, str) and value.strip().lower() == "none" else value


MEMBER_KEYS = tuple(flag_fields())
# Fields MemberOptions reads leniently before checking them (true/false as on/off, 3/1 as a split): taken
# as given here, so that its own reading applies.
_LENIENT = {
    name
    for d in MemberOptions.__pydantic_decorators__.field_validators.values()
    if d.info.mode == "before"
    for name in d.info.fields
}
# The member options are MemberOptions' own fields (checked again, whole, by MemberOptions.build).
_Options = create_model(
    "Options",
    __base__=_FusionOptions,
    **{
        name: (Any if name in _LENIENT else f.annotation, Field(None, description=f.description))
        for name, f in flag_fields().items()
    },
)  # type: ignore[call-overload]  # its overloads take no computed **fields


class Segfuse(llm.Model):
    model_id = "segfuse"
    can_stream = True
    supports_schema = True

    Options = _Options  # type: ignore[assignment]  # llm types it as its nested class; ours is made at import

    def execute(
        self, prompt: llm.Prompt, stream: bool, response: llm.Response, conversation: llm.Conversation | None
    ) -> Iterator[str]:
        path = llm.user_dir() / CONFIG_NAME  # type: ignore[no-untyped-call]  # llm.user_dir has no annotations
        config = build_config(path if path.exists() else None)
        options = prompt.options
        assert isinstance(options, _FusionOptions)  # llm made it of Segfuse.Options
        members = [m.strip() for m in options.members.split(",") if m.strip()] if options.members else None
        asked_members = {k: getattr(options, k) for k in MEMBER_KEYS if getattr(options, k) is not None}
        load = MemberOptions.build({**config.members.load_options().given(), **asked_members}, where="-o")
        ensemble = _ensemble(members or config.members.models or None, load)
        asked = {
            "max_tokens": options.max_tokens,
            "temperature": options.temperature,
            "seed": options.seed,
            "gate": options.gate,
            "accept_margin": options.accept_margin,
            "window": options.window,
        }
        fusion = {**config.fusion_defaults().model_dump(), **{k: v for k, v in asked.items() if v is not None}}
        schema = prompt.schema if isinstance(prompt.schema, dict) else None
        request = request_of(_messages(prompt), json_schema=schema, **fusion)
        for event in ensemble.stream(request):
            if isinstance(event, SegmentEvent):
                yield event.segment.text
            elif isinstance(event, DoneEvent):
                result = event.result
                response.response_json = {
                    "members": result.models,
                    "stats": result.stats.to_dict(),
                    "segments": [{"text": s.text, "model": s.model} for s in result.segments],
                }
                response.set_usage(output=result.stats.tokens)


def _messages(prompt: llm.Prompt) -> list[Message]:
    """The conversation so far (llm passes the whole chain), as segfuse messages."""
    out = []
    for message in prompt.messages:
        if message.role != "raw" and is_role(message.role):  # raw is segfuse's own role, never llm's
            text = "".join(getattr(part, "text", "") or "" for part in message.parts)
            out.append(Message(message.role, text))
    return out


def _ensemble(members: list[str] | None, options: MemberOptions) -> Ensemble:
    key = (tuple(members or ()), tuple(sorted(options.given().items())))
    if key not in _loaded:
        _loaded[key] = Ensemble(members, **options.given())
    return _loaded[key]


@llm.hookimpl
def register_models(register: Any) -> None:
    register(Segfuse())
