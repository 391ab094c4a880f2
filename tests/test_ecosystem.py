"""The tools people already use, unchanged, against segfuse: lm-eval's API models, LiteLLM and `llm`.

One `segfuse serve` (the embedded members, no prefix cache, one generation at a time: the way an
evaluation compares greedy answers with the in-process adapter) serves the module. lm-eval and llm
run as their real command-line programs, LiteLLM through its Python API.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from openai import OpenAI

from helpers import checked_server

pytestmark = [pytest.mark.models, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TASKS = ROOT / "src" / "segfuse" / "eval" / "lm_eval_tasks"
OFFLINE = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with checked_server(tmp_path_factory.mktemp("ecosystem"), max_concurrent=1, prefix_cache_cells=0) as running:
        yield running


def run(args: list[str], env: dict[str, str] | None = None, timeout: float = 600) -> str:
    done = subprocess.run(args, cwd=ROOT, env=env or OFFLINE, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def samples(folder: Path) -> list[dict]:
    [path] = folder.rglob("samples_segfuse_gsm8k_*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


# --------------------------------------------------------------------------- lm-evaluation-harness


# Two GSM8K items, their samples logged into the folder that follows.
GSM8K_TWO = [
    "--tasks",
    "segfuse_gsm8k",
    "--limit",
    "2",
    "--gen_kwargs",
    "max_gen_toks=48",
    "--log_samples",
    "--output_path",
]


def lm_eval(server, tmp: Path, model: str, endpoint: str, *extra: str, more_args: str = "") -> list[dict]:
    args = (
        f"base_url={server.api}/{endpoint},model=segfuse,tokenizer_backend=None,num_concurrent=1,"
        f"max_retries=1{more_args}"
    )
    run(
        [
            str(BIN / "lm_eval"),
            "--model",
            model,
            "--model_args",
            args,
            "--include_path",
            str(TASKS),
            *GSM8K_TWO,
            str(tmp),
            *extra,
        ],
        env={**OFFLINE, "OPENAI_API_KEY": server.api_key},
    )
    return samples(tmp)


def test_lm_eval_chat_completions_scores_like_our_adapter(server, tmp_path):
    served = lm_eval(server, tmp_path / "served", "local-chat-completions", "chat/completions", "--apply_chat_template")
    run(
        [
            str(BIN / "segfuse-lm-eval"),
            "--model",
            "segfuse",
            "--model_args",
            "system=default,threads=1,prefix_cache_cells=0",
            *GSM8K_TWO,
            str(tmp_path / "adapter"),
        ]
    )
    adapter = samples(tmp_path / "adapter")
    assert [s["doc_id"] for s in served] == [s["doc_id"] for s in adapter] == [0, 1]
    assert [s["resps"] for s in served] == [s["resps"] for s in adapter]  # greedy: the same answers
    assert [s["exact_match"] for s in served] == [s["exact_match"] for s in adapter]


def test_lm_eval_local_completions_sends_the_raw_prompt(server, tmp_path):
    served = lm_eval(server, tmp_path, "local-completions", "completions", more_args=",tokenized_requests=False")
    client = OpenAI(base_url=server.api, api_key=server.api_key, max_retries=0, timeout=300)
    for sample in served[:1]:
        prompt = sample["arguments"]["gen_args_0"]["arg_0"]
        direct = client.completions.create(model="segfuse", prompt=prompt, max_tokens=48, temperature=0)
        assert sample["resps"][0][0] == direct.choices[0].text and direct.choices[0].text.strip()


# --------------------------------------------------------------------------- LiteLLM


def test_litellm_chat_streamed_and_not(server):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the price list
    litellm = pytest.importorskip("litellm", reason="the test extra installs litellm")
    ask = {
        "model": "openai/segfuse",
        "api_base": server.api,
        "api_key": server.api_key,
        "temperature": 0,
        "max_tokens": 12,
        "messages": [{"role": "user", "content": "Say hi in French."}],
    }
    whole = litellm.completion(**ask)
    text = whole.choices[0].message.content
    assert text and whole.usage.completion_tokens > 0
    assert "".join(c.choices[0].delta.content or "" for c in litellm.completion(**ask, stream=True)) == text
    raw = litellm.text_completion(
        model="text-completion-openai/segfuse",
        api_base=server.api,
        api_key=server.api_key,
        prompt="1, 2, 3, 4,",
        max_tokens=6,
        temperature=0,
    )
    assert raw.choices[0].text.startswith(" 5")


# --------------------------------------------------------------------------- llm


@pytest.fixture()
def llm_home(tmp_path, server):
    """An `llm` user directory: the server as an extra OpenAI model, its key, and a segfuse.toml."""
    (tmp_path / "extra-openai-models.yaml").write_text(
        f'- model_id: segfuse-remote\n  model_name: segfuse\n  api_base: "{server.api}"\n  api_key_name: segfuse\n'
    )
    (tmp_path / "keys.json").write_text(json.dumps({"segfuse": server.api_key}))
    (tmp_path / "segfuse.toml").write_text("[members]\nthreads = 1\n\n[defaults]\nmax_tokens = 24\n")
    return {**OFFLINE, "LLM_USER_PATH": str(tmp_path)}


def test_llm_lists_and_runs_segfuse_in_process(llm_home):
    llm = str(BIN / "llm")
    listed = run([llm, "models"], env=llm_home)
    assert "Segfuse: segfuse" in listed and "segfuse-remote" in listed
    answer = run(
        [llm, "-m", "segfuse", "Name three primary colors.", "-o", "gate", "0.5", "-o", "accept_margin", "2"],
        env=llm_home,
    )
    assert "red" in answer.lower()
    extracted = run(
        [llm, "-m", "segfuse", "--schema", "name, age int", "Extract: Maria Lopez is 34.", "-o", "max_tokens", "48"],
        env=llm_home,
    )
    assert json.loads(extracted) == {"name": "Maria Lopez", "age": 34}
    with pytest.raises(AssertionError, match="gate"):  # a bad option is llm's own clear error
        run([llm, "-m", "segfuse", "hi", "-o", "gate", "7"], env=llm_home)


def test_llm_reaches_a_running_server(llm_home):
    answer = run(
        [str(BIN / "llm"), "-m", "segfuse-remote", "Say hi in French.", "-o", "max_tokens", "12"], env=llm_home
    )
    assert "bonjour" in answer.lower()
