"""The package's sizes, read from its source: no function over 60 lines, no class over 250 (docs/design.md's
"small readable modules"), but for the few named below while they are being split; each of those must still
exist and still be over its limit, so that the list cannot go stale. (The engine's and the server's signatures
are held to six parameters by tests/test_engine_contract.py.)"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "segfuse"
MOST_LINES = {"function": 60, "class": 250}
# "path qualified.name" -> why it may be over its limit for now. Only what is being split elsewhere.
ALLOWED: dict[str, str] = {}  # name -> why it may stay long (none may today)


def sizes(path: Path, root: Path = SRC) -> dict[str, tuple[str, int]]:
    """Every function and class of `path` ("path qualified.name", nested ones under their parents' names)
    with its kind and its lines, from its `def` or `class` line to its last (decorators not counted)."""
    found: dict[str, tuple[str, int]] = {}
    where = path.relative_to(root).as_posix()

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                kind = "class" if isinstance(child, ast.ClassDef) else "function"
                found[f"{where} {name}"] = (kind, (child.end_lineno or child.lineno) - child.lineno + 1)
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(encoding="utf-8")), "")
    return found


def every_size(root: Path = SRC) -> dict[str, tuple[str, int]]:
    found: dict[str, tuple[str, int]] = {}
    for path in sorted(root.rglob("*.py")):
        found.update(sizes(path, root))
    assert len(found) > 500, f"the package's functions are not under {root}"
    return found


def too_long(found: dict[str, tuple[str, int]]) -> dict[str, str]:
    return {
        name: f"{kind} of {lines} lines (at most {MOST_LINES[kind]})"
        for name, (kind, lines) in found.items()
        if lines > MOST_LINES[kind]
    }


def test_no_function_over_60_lines_and_no_class_over_250():
    over = {name: why for name, why in too_long(every_size()).items() if name not in ALLOWED}
    assert not over, "split these along their steps:\n" + "\n".join(f"{n}: {w}" for n, w in sorted(over.items()))


def test_every_allowed_one_is_still_there_and_still_too_long():
    found = every_size()
    gone = [name for name in ALLOWED if name not in found]
    assert not gone, f"no longer in src/segfuse (take them off ALLOWED): {gone}"
    within = [name for name in ALLOWED if name not in too_long(found)]
    assert not within, f"within the limit now (take them off ALLOWED): {within}"


def test_the_measure_sees_what_it_looks_for(tmp_path):
    """Lines from `def` to the end; nested functions and methods under their parents' names."""
    body = "\n".join(f"    x{i} = {i}" for i in range(59))
    methods = "\n".join(f"    def m{i}(self):\n        return {i}\n" for i in range(84))
    sample = tmp_path / "sample.py"
    sample.write_text(
        f"@decorated\ndef long():\n{body}\n    return 1\n\n"
        f"def short():\n    def inner():\n        return 2\n    return inner\n\n"
        f"class Big:\n{methods}",
        encoding="utf-8",
    )
    found = sizes(sample, tmp_path)
    assert found["sample.py long"] == ("function", 61)
    assert found["sample.py short"] == ("function", 4) and found["sample.py short.inner"] == ("function", 2)
    assert found["sample.py Big"] == ("class", 252) and found["sample.py Big.m0"] == ("function", 2)
    assert set(too_long(found)) == {"sample.py long", "sample.py Big"}
