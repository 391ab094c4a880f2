"""Profiles: fusion settings in a TOML file, written by `segfuse calibrate`, loaded with ``--profile``.

A profile's ``[fusion]`` table holds FusionOptions fields (a field set to None is
written ``"none"``, as TOML has no null); its ``[calibration]`` table records
what the choice was made on (members, task, items, figures). An optional
``[members]`` table holds member options (MemberOptions fields: n_ctx, threads,
gpu_layers, ...). Flags given on the command line go over the profile.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tomli_w

from .errors import InvalidRequestError
from .member_options import MemberOptions
from .options import NULLABLE, FusionOptions

NONE = "none"
HEADER = "# written by `segfuse calibrate`; generate, chat, serve and eval load it with --profile\n"


def write_profile(path: str | Path, options: Mapping[str, Any], calibration: Mapping[str, Any]) -> Path:
    """Write `options` (validated FusionOptions fields) and the figures behind them."""
    FusionOptions.build(**options)
    document = {
        "fusion": {k: NONE if v is None else v for k, v in options.items()},
        "calibration": {k: v for k, v in calibration.items() if v is not None},
    }
    target = Path(path)
    target.write_text(HEADER + tomli_w.dumps(document), encoding="utf-8")
    return target


def _read(file: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InvalidRequestError(f"profile not found: {file}", "write one with `segfuse calibrate`") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise InvalidRequestError(f"cannot read the profile {file}: {exc}", "it must be a TOML file") from None


def load_profile_members(path: str | Path) -> dict[str, Any]:
    """The [members] table of a profile (none: {}), validated as MemberOptions fields."""
    file = Path(path)
    table = _read(file).get("members", {})
    if not isinstance(table, dict):
        raise InvalidRequestError(f"{file}: [members] is not a table", "write member options as key = value")
    return MemberOptions.build(table, where=f"{file} [members]").given()


def load_profile(path: str | Path) -> dict[str, Any]:
    """The [fusion] table of a profile, validated as FusionOptions fields."""
    file = Path(path)
    document = _read(file)
    fusion = document.get("fusion")
    if not isinstance(fusion, dict):
        raise InvalidRequestError(f"{file} has no [fusion] table", "write one with `segfuse calibrate`")
    fusion = {k: None if v == NONE and k in NULLABLE else v for k, v in fusion.items()}
    try:
        FusionOptions.build(**fusion)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"{file}: {exc.message}", "fix the profile's [fusion] table") from None
    return fusion
