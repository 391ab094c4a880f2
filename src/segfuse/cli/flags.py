"""Command-line options shared by several commands.

Fusion options come from ``FusionOptions``' own fields, so the command line can
never drift from the options the engine accepts: each field becomes ``--name``
(underscores as dashes) with its type, description and default; a boolean
becomes ``--name/--no-name``, a choice lists its values, a tuple repeats, a number
that may be None also takes the word ``none`` (``--gate none``), and a field that may
be None but is not by default also gets ``--no-name`` (``--no-gate``).
"""

from __future__ import annotations

import enum
import functools
import inspect
import types
import typing
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal

import typer
from pydantic.fields import FieldInfo

from ..member_options import flag_fields
from ..options import FusionOptions
from ..profiles import load_profile, load_profile_members

PANEL = "Fusion options"
PREFIX = "fusion__"  # parameter names of generated options; never clash with a command's own
NONE_PREFIX = "fusion_none__"
PROFILE = "fusion_profile"
MEMBER_PANEL = "Member options"
MEMBER_PREFIX = "member__"
NONE_WORD = "none"  # `--gate none`, `--accept-margin none`: the None of a nullable number
GIVEN_NONE = object()  # what such a flag parses to, told apart from a flag not given (None)

ModelOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--model",
        "-m",
        help="Member (repeat; default: the embedded three): a known model name, a .gguf "
        "path, a model of yours (ollama:NAME[:TAG], hf:ORG/REPO[:QUANT], lmstudio:PUBLISHER/REPO, "
        "llamacache:ORG/REPO; `segfuse models` lists them), transformers:PATH_OR_DIR\\[#name,key=value,...] "
        "or remote:URL\\[#name,key=value,...].",
    ),
]
CacheOpt = Annotated[str | None, typer.Option("--cache-dir", help="Where assembled models live.")]
ThreadsOpt = Annotated[int | None, typer.Option(help="llama.cpp threads per member (default: all cores, max 8).")]
CtxOpt = Annotated[int, typer.Option("--n-ctx", help="Context window per member, in tokens.")]


def hedge_persist_option(help: str) -> Any:
    """--hedge-persist (``Annotated[bool, ...]``), its help in the words of the command: what starts from
    the weights the last one ended with (a chat's turn, an evaluation's item)."""
    return typer.Option("--hedge-persist", help=help)


def _optional_of(annotation: Any) -> tuple[Any, bool]:
    """(inner type, whether None is allowed) of ``X | None``."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return inner[0], True
    return annotation, False


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parameter(name: str, field: FieldInfo, default: Any, shown: str | None = None) -> inspect.Parameter:
    """One typer option for one FusionOptions field; None when the user does not give it.

    `shown` is the default the help prints, where the command decides it later (eval's top_p)."""
    kind, nullable = _optional_of(field.annotation)
    common: dict[str, Any] = {"help": field.description or "", "rich_help_panel": PANEL}
    if shown is not None:
        common["show_default"] = shown
    elif default != () and default is not None:
        common["show_default"] = str(default).lower() if isinstance(default, bool) else str(default)
    annotation: object  # the type typer reads the flag as
    if kind is bool:
        annotation, option = bool | None, typer.Option(None, f"{_flag(name)}/--no-{name.replace('_', '-')}", **common)
    elif typing.get_origin(kind) is Literal:  # typer lists an Enum's values as the choices
        choices = _choices(name, kind)
        annotation, option = choices | None, typer.Option(None, _flag(name), **common)
    elif typing.get_origin(kind) is tuple:
        annotation, option = (
            list[str] | None,
            typer.Option(None, _flag(name), **{**common, "help": common["help"] + " (repeatable)"}),
        )
    elif nullable and kind in (int, float):  # `--gate none`: a number, or the word none for None
        option = typer.Option(
            None, _flag(name), metavar=f"{kind.__name__.upper()}|none", callback=_number_or_none(kind), **common
        )
        annotation = str | None
    else:
        annotation, option = kind | None, typer.Option(None, _flag(name), **common)
    return inspect.Parameter(PREFIX + name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation)


def _choices(name: str, literal: object) -> type[enum.Enum]:
    """An Enum of a Literal's values: typer lists them as the flag's choices."""
    values = {str(c): str(c) for c in typing.get_args(literal)}
    # mypy takes the functional API for a class only where the name is a literal
    return enum.Enum(f"{name}_choice", values, type=str)  # type: ignore[return-value]  # a name made at run time


def _number_or_none(kind: type) -> Callable[[str | None], Any]:
    """Parse a nullable number's flag: `kind`, or GIVEN_NONE for the word none."""

    def parse(value: str | None) -> Any:
        if value is None:
            return None
        if value.strip().lower() == NONE_WORD:
            return GIVEN_NONE
        try:
            return kind(value)
        except ValueError:
            raise typer.BadParameter(f"{value!r} is not a {'whole ' if kind is int else ''}number or none") from None

    return parse


def _none_parameter(name: str) -> inspect.Parameter:
    option = typer.Option(False, f"--no-{name.replace('_', '-')}", help=f"Set {name} to none.", rich_help_panel=PANEL)
    return inspect.Parameter(NONE_PREFIX + name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=bool)


def _plain(value: Any) -> Any:
    """A parsed option as FusionOptions takes it: choices as their text, repeated options as a tuple,
    the word none as None."""
    if value is GIVEN_NONE:
        return None
    if isinstance(value, enum.Enum):
        return value.value
    return tuple(value) if isinstance(value, list) else value


def _member_parameter(name: str, field: FieldInfo) -> inspect.Parameter:
    """One typer option for one MemberOptions field; None when the user does not give it."""
    kind, _ = _optional_of(field.annotation)
    common: dict[str, Any] = {"help": field.description or "", "rich_help_panel": MEMBER_PANEL}
    annotation: object  # the type typer reads the flag as
    if kind is bool:
        annotation, option = bool | None, typer.Option(None, f"{_flag(name)}/--no-{name.replace('_', '-')}", **common)
    elif typing.get_origin(kind) is Literal:
        choices = _choices(name, kind)
        annotation, option = choices | None, typer.Option(None, _flag(name), **common)
    elif typing.get_origin(kind) is tuple:  # shares as one word, 3/1, as in a member spec
        annotation, option = str | None, typer.Option(None, _flag(name), metavar="A/B/...", **common)
    else:
        annotation, option = kind | None, typer.Option(None, _flag(name), **common)
    return inspect.Parameter(
        MEMBER_PREFIX + name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation
    )


def fusion_flags(
    defaults: Mapping[str, Any] | None = None, shown: Mapping[str, str] | None = None, *, members: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command one option per FusionOptions field.

    The command receives ``fusion``: the fields the user set, over a
    ``--profile`` (written by `segfuse calibrate`), over the command's own
    `defaults` (shown in the help, or as `shown` says where the command
    decides a default later); ``FusionOptions.build`` validates them.
    With `members`, also one option per MemberOptions field (--n-ctx, --threads, --gpu-layers, ...):
    the command receives ``member_options``, those given over the profile's [members] table.
    """
    defaults = dict(defaults or {})
    shown = dict(shown or {})

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        own = [p for p in inspect.signature(command).parameters.values() if p.name not in ("fusion", "member_options")]
        fields = FusionOptions.model_fields
        added = [_parameter(name, f, defaults.get(name, f.default), shown.get(name)) for name, f in fields.items()]
        nullable = [name for name, f in fields.items() if _optional_of(f.annotation)[1] and f.default is not None]
        added += [_none_parameter(name) for name in nullable]
        member_fields = flag_fields() if members else {}
        added += [_member_parameter(name, f) for name, f in member_fields.items()]
        added.append(
            inspect.Parameter(
                PROFILE,
                inspect.Parameter.KEYWORD_ONLY,
                annotation=str | None,
                default=typer.Option(
                    None,
                    "--profile",
                    rich_help_panel=PANEL,
                    help="TOML profile from `segfuse calibrate`: its settings, under the flags given here.",
                ),
            )
        )

        @functools.wraps(command)
        def run(**values: Any) -> Any:
            given = {name: values.pop(PREFIX + name) for name in fields}
            given = {k: _plain(v) for k, v in given.items() if v is not None}
            given.update({name: None for name in nullable if values.pop(NONE_PREFIX + name)})
            profile_path = values.pop(PROFILE)
            profile = load_profile(profile_path) if profile_path else {}
            if members:
                chosen = {name: _plain(values.pop(MEMBER_PREFIX + name)) for name in member_fields}
                on_file = load_profile_members(profile_path) if profile_path else {}
                values["member_options"] = {**on_file, **{k: v for k, v in chosen.items() if v is not None}}
            return command(**values, fusion={**defaults, **profile, **given})

        hints = typing.get_type_hints(command, include_extras=True)
        params = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in own] + added
        run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]  # what typer reads
        run.__annotations__ = {p.name: p.annotation for p in params}
        return run

    return decorate


def member_flags() -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command without fusion flags one option per MemberOptions field; it receives
    ``member_options``: those the user gave."""

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        own = [p for p in inspect.signature(command).parameters.values() if p.name != "member_options"]
        fields = flag_fields()

        @functools.wraps(command)
        def run(**values: Any) -> Any:
            chosen = {name: _plain(values.pop(MEMBER_PREFIX + name)) for name in fields}
            return command(**values, member_options={k: v for k, v in chosen.items() if v is not None})

        hints = typing.get_type_hints(command, include_extras=True)
        params = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in own]
        params += [_member_parameter(name, f) for name, f in fields.items()]
        run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]  # what typer reads
        run.__annotations__ = {p.name: p.annotation for p in params}
        return run

    return decorate
