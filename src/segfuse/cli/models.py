"""`segfuse models`: list the known models and prepare them."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich import box
from rich.table import Table

from .. import models as catalogue
from .app import err, models_app, out
from .flags import CacheOpt


def _size(size: int | None) -> str:
    if size is None:
        return ""
    if size >= 1e9:
        return f"{size / 1e9:.1f} GB"
    return f"{size / 1e6:.0f} MB" if size >= 1e6 else f"{size / 1e3:.0f} kB"


@models_app.callback()
def models_list(
    ctx: typer.Context,
    cache_dir: CacheOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON list, for scripts.")] = False,
    paths: Annotated[bool, typer.Option("--paths", help="Only `name<TAB>file` lines.")] = False,
) -> None:
    """List the embedded models and the models of Ollama, the Hugging Face cache, LM Studio and
    llama.cpp's cache on this machine: the name to pass to -m, size, quantisation, architecture, prompt."""
    if ctx.invoked_subcommand:
        return
    from ..listing import list_models

    rows = list_models(cache_dir)
    if as_json:
        sys.stdout.write(json.dumps([r.to_dict() for r in rows], indent=2) + "\n")
        return
    if paths:
        for row in rows:
            sys.stdout.write(f"{row.name}\t{row.path or '-'}\n")
        return
    # Names are what `-m` takes: they never wrap or shorten; the long file paths get their own lines.
    table = Table(
        "source",
        "name",
        "status",
        "size",
        "quant",
        "arch",
        "prompt",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        collapse_padding=True,
    )
    for column, key in zip(table.columns[:3], ("source", "name", "status"), strict=True):
        # never shortened: which model, how to name it, whether it can be used
        column.no_wrap, column.min_width = True, max(len(getattr(r, key)) for r in rows)
    for column in table.columns[3:]:
        column.no_wrap = True  # on a narrow terminal these are cut short, with an ellipsis
    for row in rows:
        prompt = "" if row.chat_template is None else "chat" if row.chat_template else "base"
        table.add_row(
            row.source, row.name, row.status, _size(row.size), row.quantisation or "", row.architecture or "", prompt
        )
    out.print(table)
    out.print()
    for row in rows:
        where = row.path if row.status != "not installed" else row.install
        out.print(f"{row.name}: {where}" + (f" — {row.detail}" if row.detail else ""), soft_wrap=True)
    out.print("default members (no -m): " + ", ".join(r.name for r in rows if r.default), soft_wrap=True)
    out.print(f"llama.cpp members run on: {runs_on()}", soft_wrap=True)
    if any(r.chat_template is False for r in rows):
        out.print(
            "base: no chat template in the model (a base model); it gets a Question/Answer prompt", soft_wrap=True
        )
    if any(r.status == "not prepared" for r in rows):
        out.print("prepare them with: segfuse models prepare", soft_wrap=True)


def runs_on() -> str:
    """Where a llama.cpp member runs by default with the installed llama-cpp-python."""
    from ..backends.llama_cpp.runtime import can_offload  # imports llama.cpp: only for the table

    if can_offload():
        return "the GPU, every layer (--gpu-layers N keeps the rest on the CPU; 0: all on the CPU)"
    return "the CPU (this llama-cpp-python has no GPU backend; docs/deploy.md says how to build one)"


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
    names: Annotated[list[str] | None, typer.Argument(help="Models to prepare (default: the embedded three).")] = None,
    cache_dir: CacheOpt = None,
) -> None:
    """Assemble and verify model files from the installed packages (offline)."""
    prepare_models(names or list(catalogue.DEFAULT_MODELS), cache_dir)
    err.print("all requested models are ready")
