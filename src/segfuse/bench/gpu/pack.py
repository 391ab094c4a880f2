"""The GPU check's pack: what a machine with a GPU, torch and transformers (and no network) needs to run it.

``python -m segfuse.bench.gpu.pack --out .cache/gpu-pack`` (``make gpu-pack``), run from a source checkout on
a machine where the embedded models are prepared, writes:

- ``wheels/``: segfuse's own wheel (``pip wheel --no-deps .``) and the wheels of the packages segfuse imports
  for an ensemble of transformers members that torch and transformers do not bring (:data:`DEPENDENCIES`),
  at the versions installed here, for the target Python (``--python-version``, default 3.12) on
  manylinux x86-64; ``--no-deps-download`` leaves them out (the check then uses its environment's);
- ``tokenizers/NAME.tar.gz``: the embedded models' tokenizers, exported from their GGUF files;
- ``check.py``: the stdlib-only script that installs the wheels and runs the check (``bootstrap.py``);
- ``pack.json``: segfuse's version, the git commit it was packed at, the files and the total size.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from ..common.machine import git
from .models import TOKENIZERS

ROOT = Path(__file__).resolve().parents[4]  # the source checkout (pyproject.toml) this module runs from
# What segfuse imports for an ensemble of transformers members and the GPU check, beyond the standard library,
# torch, transformers and what they require (numpy, jinja2, huggingface_hub, safetensors, tokenizers, PyYAML,
# tqdm, packaging, typing_extensions): the options' models (pydantic), the cache folder (platformdirs) and the
# [hf] extra's check (gguf), and typing_extensions at the version pydantic asks for (torch asks for an older
# one: the newer goes ahead of it, and adds only). Structured output's llguidance and jsonschema, profiles'
# tomli-w and the CLI's typer and rich are imported only where used, never by the check.
# tests/test_gpu_check.py runs the check with nothing else installed and checks that it imported each of these.
DEPENDENCIES = (
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "typing-extensions",
    "platformdirs",
    "gguf",
)
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")
MIB = 2**20
LEFT_OUT = (".git", ".venv", ".cache", "runs", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache")


def segfuse_wheel(wheels: Path) -> Path:
    """segfuse's wheel from the source checkout (no dependencies); its path."""
    if not (ROOT / "pyproject.toml").is_file():
        raise SystemExit(f"{ROOT} is not a segfuse source checkout: run the pack from one")
    with tempfile.TemporaryDirectory() as tmp:  # a clean copy: no stale build/ of the checkout's in the wheel
        source = Path(tmp) / "segfuse"
        shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*LEFT_OUT))
        command = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(wheels), str(source)]
        if _builds_here():  # this environment's setuptools builds it: nothing fetched for an isolated build
            command.insert(-3, "--no-build-isolation")
        subprocess.run(command, check=True)
    return next(wheels.glob("segfuse-*.whl"))


def _builds_here() -> bool:
    """Whether the installed setuptools meets pyproject.toml's build requirement (77: license expressions)."""
    try:
        return int(version("setuptools").split(".")[0]) >= 77
    except (PackageNotFoundError, ValueError):
        return False


def dependency_wheels(wheels: Path, python_version: str) -> list[str]:
    """Download :data:`DEPENDENCIES`' wheels, at the versions installed here, for the target Python."""
    pins = [f"{name}=={version(name)}" for name in DEPENDENCIES]
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    command += ["--python-version", python_version, "--implementation", "cp", *platforms, "-d", str(wheels), *pins]
    subprocess.run(command, check=True)
    return pins


def export_tokenizer(name: str, into: Path) -> Path:
    """The embedded model `name`'s tokenizer, read from its GGUF file by transformers and saved, as a .tar.gz."""
    from transformers import AutoTokenizer

    from ...models import resolve

    _, gguf, _ = resolve(name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    archive = into / f"{name}.tar.gz"
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        with tarfile.open(archive, "w:gz", compresslevel=9) as tar:
            for path in sorted(Path(tmp).iterdir()):
                tar.add(path, arcname=path.name)
    return archive


def pack(out: Path, python_version: str = "3.12", download: bool = True, log: Any = print) -> dict[str, Any]:
    """Write the pack into `out` (emptied first); its manifest."""
    if out.exists():
        shutil.rmtree(out)
    wheels, tokenizers = out / "wheels", out / "tokenizers"
    wheels.mkdir(parents=True)
    tokenizers.mkdir()
    wheel = segfuse_wheel(wheels)
    log(f"segfuse's wheel: {wheel.name}")
    pins = dependency_wheels(wheels, python_version) if download else []
    log(f"dependencies: {', '.join(pins) or 'none (the check takes its environment’s)'}")
    for name in TOKENIZERS:
        log(f"tokenizer: {export_tokenizer(name, tokenizers).name}")
    shutil.copyfile(Path(__file__).with_name("bootstrap.py"), out / "check.py")
    manifest: dict[str, Any] = {
        "segfuse_version": wheel.name.split("-")[1],
        "git": git(),
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "python_version": python_version,
        "platforms": list(PLATFORMS),
        "dependencies": "wheels" if download else "environment",
        "pins": pins,
        "files": sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()),
    }
    manifest["size_bytes"] = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    (out / "pack.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m segfuse.bench.gpu.pack", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".cache/gpu-pack"), help="the pack's folder (emptied)")
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python, for its wheels")
    parser.add_argument(
        "--no-deps-download",
        dest="download",
        action="store_false",
        help="no dependency wheels: the check uses its environment's packages for them",
    )
    args = parser.parse_args(argv)
    manifest = pack(args.out, args.python_version, args.download)
    print(f"wrote {args.out}: {len(manifest['files'])} files, {manifest['size_bytes'] / MIB:.1f} MiB")


if __name__ == "__main__":
    main()
