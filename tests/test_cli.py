"""The command line as a newcomer meets it: piped prompts, the model list, missing extras."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from segfuse import models as catalogue

SEGFUSE = [sys.executable, "-m", "segfuse.cli"]
QWEN = ["-m", "qwen2.5-coder-0.5b", "--threads", "1", "--temperature", "0", "--json"]


def segfuse(*args: str, stdin: str | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*SEGFUSE, *args],
        input=stdin if stdin is not None else "",
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.models
def test_the_prompt_can_be_piped_in():
    done = segfuse("generate", "--max-tokens", "6", *QWEN, stdin="What is 2+2? Answer with the number only.")
    assert done.returncode == 0, done.stderr
    assert "4" in json.loads(done.stdout)["text"]


@pytest.mark.models
def test_a_piped_document_and_a_prompt_make_one_message():
    done = segfuse(
        "generate",
        "What is the secret word? Answer with the word only.",
        "--max-tokens",
        "8",
        *QWEN,
        stdin="The secret word is PINEAPPLE.",
    )
    assert done.returncode == 0, done.stderr
    assert "pineapple" in json.loads(done.stdout)["text"].lower()


@pytest.mark.models
def test_the_demo_answers_with_the_default_ensemble_and_says_how_to_consult_the_others():
    done = segfuse("demo", "--threads", "1", "--max-tokens", "24")
    assert done.returncode == 0, done.stderr
    assert "question:" in done.stderr and "smollm2-135m" in done.stderr and "gemma3-270m" in done.stderr
    assert len(done.stdout.split()) >= 3  # the streamed answer
    assert "rounds won alone by leader qwen2.5-coder-0.5b" in done.stderr  # the default: the largest member leads
    assert "--accept-margin 2" in done.stderr


@pytest.mark.slow
def test_dash_with_nothing_piped_is_a_clear_error():
    done = segfuse("generate", "-")
    assert done.returncode == 2
    assert "standard input" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
def test_no_prompt_at_all_is_a_clear_error():
    done = segfuse("generate")
    assert done.returncode == 2
    assert "no prompt given" in done.stderr


@pytest.mark.slow
def test_cli_user_errors_are_one_line_without_traceback():
    for args, needle in (
        (["generate", "-m", "nope", "hi"], "unknown model"),
        (["generate", "--window", "0", "hi"], "window"),
        (["generate", "--max-tokens", "0", "hi"], "max_tokens"),
        (["generate", "   "], "empty"),
    ):
        proc = segfuse(*args)
        assert proc.returncode == 2, args
        assert needle in proc.stderr
        assert "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def only_embedded(home) -> dict[str, str]:
    """An environment whose tools (Ollama, Hugging Face, LM Studio, llama.cpp) hold no models."""
    return {
        "HOME": str(home),
        "SEGFUSE_CACHE_DIR": str(catalogue.cache_dir()),
        "OLLAMA_MODELS": str(home / "none"),
        "HF_HUB_CACHE": str(home / "none"),
        "LLAMA_CACHE": str(home / "none"),
    }


@pytest.mark.slow
def test_the_model_list_never_cuts_a_name_at_80_columns(tmp_path):
    done = segfuse("models", env={"COLUMNS": "80", **only_embedded(tmp_path)})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    table = lines[: lines.index("")]  # the table, a blank line, then one line per file
    assert max(len(line) for line in table) <= 80  # the table fits the terminal
    for name in catalogue.CATALOGUE:
        assert any(name in line for line in table), name
        assert any(line.startswith(f"{name}: ") for line in lines)  # its file (or install line) on its own line


@pytest.mark.slow
def test_the_model_list_as_json_and_paths(tmp_path):
    rows = json.loads(segfuse("models", "--json", env=only_embedded(tmp_path)).stdout)
    assert [r["name"] for r in rows] == list(catalogue.CATALOGUE)
    assert {
        "name",
        "ready",
        "path",
        "install",
        "default",
        "source",
        "size",
        "quantisation",
        "architecture",
        "chat_template",
    } <= set(rows[0])
    paths = segfuse("models", "--paths", env=only_embedded(tmp_path)).stdout.splitlines()
    assert [line.split("\t")[0] for line in paths] == list(catalogue.CATALOGUE)


BLOCKED = """
import sys

class Missing:
    '''Pretend these modules are not installed, as in a core-only environment.'''
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, Missing())
sys.argv = ["segfuse", *{args!r}]
from segfuse.cli import main
main()
"""


@pytest.mark.parametrize(
    "args, blocked, extra",
    [
        (["serve"], {"fastapi"}, "server"),
        (["eval", "gsm8k", "--limit", "1"], {"lm_eval"}, "eval"),
        (["bench"], {"matplotlib"}, "bench"),
        (["generate", "hi", "-m", "transformers:/nowhere"], {"transformers"}, "hf"),
    ],
)
@pytest.mark.slow
def test_a_missing_extra_says_which_pip_line_fixes_it(args, blocked, extra):
    done = subprocess.run(
        [sys.executable, "-c", BLOCKED.format(blocked=blocked, args=args)],
        input="",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    message = done.stderr.strip()
    assert len(message.splitlines()) == 1 and "Traceback" not in message
    assert f"pip install 'segfuse[{extra}]'" in message
