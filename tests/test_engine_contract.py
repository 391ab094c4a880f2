"""The engine's shape, read from its source: it imports nothing above it, and no function of it takes
more than six parameters (what is constant for a generation travels as one GenerationContext). The
server's functions keep to six too (what is constant for a response travels as its answer object,
``server/answer.py``)."""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[1] / "src" / "segfuse" / "engine"
SERVER = ENGINE.parent / "server"
# What lies above the engine: the ensemble (the public surface) and every interface built on it.
ABOVE = ("ensemble", "echo", "likelihood", "likelihood_weights", "server", "cli", "eval", "bench", "llm_plugin")
MOST_PARAMETERS = 6


def modules(root: Path = ENGINE) -> list[Path]:
    found = sorted(root.rglob("*.py"))  # subpackages too
    assert len(found) > 10, f"the modules are not in {root}"
    return found


def imported(path: Path) -> set[str]:
    """The segfuse modules `path` imports, as top-level names under segfuse (TYPE_CHECKING imports too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 2:  # from ..x import y: segfuse.x
                names.add(module.split(".")[0] if module else "")
                names.update(alias.name for alias in node.names if not module)
            elif node.level == 0 and module.startswith("segfuse."):
                names.add(module.split(".")[1])
        elif isinstance(node, ast.Import):
            names.update(a.name.split(".")[1] for a in node.names if a.name.startswith("segfuse."))
    return names


def test_the_engine_imports_nothing_above_it():
    wrong = {f"{path.name} imports segfuse.{name}" for path in modules() for name in imported(path) & set(ABOVE)}
    assert not wrong, sorted(wrong)


def parameters(path: Path) -> dict[str, int]:
    """Each function of `path` (name:line) and how many parameters it takes: `self` or `cls` not counted,
    keyword-only ones and ``*args`` / ``**kwargs`` counted."""
    counts = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
            counts[f"{node.name}:{node.lineno}"] = (
                len(names) - (names[:1] in (["self"], ["cls"])) + bool(a.vararg) + bool(a.kwarg)
            )
    return counts


def long_signatures(root: Path) -> list[str]:
    """Each function under `root` that takes more than six parameters, with where it is."""
    return [
        f"{path.relative_to(root)} {where} takes {n}"
        for path in modules(root)
        for where, n in parameters(path).items()
        if n > MOST_PARAMETERS
    ]


def test_no_engine_function_takes_more_than_six_parameters():
    long = long_signatures(ENGINE)
    assert not long, long


def test_no_server_function_takes_more_than_six_parameters():
    long = long_signatures(SERVER)
    assert not long, long


def test_the_checks_see_what_they_look_for(tmp_path):
    """The two readings above find an upward import and a long signature where there is one."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from ..server import app\nfrom ..types import Event\nimport segfuse.cli.flags\n"
        "def f(a, b, c, d, e, *, g, h): ...\n"
        "class C:\n    def m(self, a, b, c, d, e, **more): ...\n",
        encoding="utf-8",
    )
    assert imported(sample) & set(ABOVE) == {"server", "cli"}
    assert parameters(sample) == {"f:4": 7, "m:6": 6}
